"""``model_summary`` (built in, ``enable_model_summary=False`` or ``no:model_summary``
turns it off): Lightning's ModelSummary callback.

At the start of ``fit``, global rank 0 prints the table Lightning prints: one row per
layer down to ``max_depth`` (name, type, parameter count, train/eval mode, FLOPs, and
the input/output sizes when the module has an ``example_input_array``), then the
trainable, non-trainable and total parameter counts, the estimated size of the
parameters in MB, the modules in train and eval mode, and the total FLOPs. The FLOPs and
sizes come from one forward pass of ``example_input_array`` (none without it: FLOPs are 0).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from hookloop.contract.errors import ConfigurationError
from hookloop.helpers import move_to_device
from hookloop.contract.hookspecs import hookimpl

UNKNOWN_SIZE = "?"
NOT_APPLICABLE = "n/a"
_UNITS = (" ", "K", "M", "B", "T")
#: bits per parameter for the size estimate (other precisions count 32, as Lightning)
_PRECISION_BITS = {"16-true": 16, "bf16-true": 16, "64": 64, "64-true": 64}


def human_readable_count(number: int | float) -> str:
    """Lightning's abbreviation: ``123  ``, ``1.2 K``, ``2.0 M``, ``400 T``, ``5,000 T``."""
    if number < 0:
        raise ValueError(f"a count must be >= 0, got {number}")
    digits = int(math.floor(math.log10(number)) + 1 if number > 0 else 1)
    groups = min(int(math.ceil(digits / 3)), len(_UNITS))
    number = number * 10 ** (-3 * (groups - 1))
    index = groups - 1
    if index < 1 or number >= 100:
        return f"{int(number):,d} {_UNITS[index]}"
    return f"{number:,.1f} {_UNITS[index]}"


def _shape(value: Any) -> Any:
    if hasattr(value, "shape"):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        return [_shape(v) for v in value]
    return UNKNOWN_SIZE


def _numel(parameters) -> int:
    from torch.nn.parameter import UninitializedParameter

    return sum(0 if isinstance(p, UninitializedParameter) else p.numel() for p in parameters)


class Summary:
    """The numbers of a model summary (Lightning's ``utilities.model_summary.ModelSummary``):
    ``layer_names``, ``layer_types``, ``param_nums``, ``training_modes``, ``in_sizes``,
    ``out_sizes``, ``flop_counts``; ``total_parameters``, ``trainable_parameters``,
    ``model_size`` (MB), ``total_training_modes``, ``total_flops``. ``str()`` is the table."""

    def __init__(self, model: nn.Module, max_depth: int = 1, precision: str = "32", trainer: Any = None):
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ConfigurationError(f"ModelSummary max_depth={max_depth!r} must be -1 (all), 0 (none) or > 0")
        self._model, self._max_depth = model, max_depth
        self._precision_megabytes = _PRECISION_BITS.get(str(precision), 32) / 8.0 * 1e-6
        if max_depth == 0:
            modules: list = []
        elif max_depth == 1:
            modules = list(model.named_children())
        else:
            modules = list(model.named_modules())[1:]  # not the root
        self._layers = {name: module for name, module in modules}
        self._sizes: dict[str, tuple] = {}
        self._flops: dict[str, dict] = {}
        self.total_flops = 0
        if getattr(model, "example_input_array", None) is not None:
            self._forward_example(trainer)
        if max_depth >= 1:
            self._layers = {k: v for k, v in self._layers.items() if k.count(".") < max_depth}

    def _forward_example(self, trainer: Any) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        model = self._model
        handles = []
        for name, module in self._layers.items():
            def hook(_module, args, kwargs, out, name=name):
                if name in self._sizes:
                    return
                inp = (*args, *kwargs.values()) if kwargs else args
                self._sizes[name] = (_shape(inp[0] if len(inp) == 1 else inp), _shape(out))

            if not isinstance(module, torch.jit.ScriptModule):
                handles.append(module.register_forward_hook(hook, with_kwargs=True))
        example = model.example_input_array
        contexts: list = []
        if trainer is not None:
            example = move_to_device(example, trainer.root_device)
            contexts = [c for c in trainer.hook.forward_context(trainer=trainer) if c is not None]
        counter = FlopCounterMode(display=False, depth=self._max_depth + 1)
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for context in contexts:
                    stack.enter_context(context)
                stack.enter_context(counter)
                if isinstance(example, (list, tuple)):
                    model(*example)
                elif isinstance(example, dict):
                    model(**example)
                else:
                    model(example)
        finally:
            for handle in handles:
                handle.remove()
            for module, mode in modes.items():
                module.training = mode
        counts = counter.get_flop_counts()
        self.total_flops = counter.get_total_flops()
        self._flops = {name: counts.get(f"{type(model).__name__}.{name}", {}) for name in self._layers}

    # -- per layer ----------------------------------------------------------------------------

    @property
    def layer_names(self) -> list[str]:
        return list(self._layers)

    @property
    def layer_types(self) -> list[str]:
        return [type(m).__name__ for m in self._layers.values()]

    @property
    def param_nums(self) -> list[int]:
        return [_numel(m.parameters()) for m in self._layers.values()]

    @property
    def training_modes(self) -> list[bool]:
        return [m.training for m in self._layers.values()]

    @property
    def in_sizes(self) -> list:
        return [self._sizes.get(name, (UNKNOWN_SIZE, UNKNOWN_SIZE))[0] or UNKNOWN_SIZE for name in self._layers]

    @property
    def out_sizes(self) -> list:
        return [self._sizes.get(name, (UNKNOWN_SIZE, UNKNOWN_SIZE))[1] or UNKNOWN_SIZE for name in self._layers]

    @property
    def flop_counts(self) -> dict[str, dict]:
        return {name: self._flops.get(name, {}) for name in self._layers}

    # -- totals -------------------------------------------------------------------------------

    @property
    def total_parameters(self) -> int:
        return _numel(self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return _numel(p for p in self._model.parameters() if p.requires_grad)

    @property
    def total_layer_params(self) -> int:
        return sum(self.param_nums)

    @property
    def model_size(self) -> float:
        return self.total_parameters * self._precision_megabytes

    @property
    def total_training_modes(self) -> dict[str, int]:
        modes = [m.training for m in self._model.modules()][1:]  # not the root
        return {"train": modes.count(True), "eval": modes.count(False)}

    # -- the table ------------------------------------------------------------------------------

    def columns(self) -> list[tuple[str, list[str]]]:
        """The table's columns, as (header, cells): Lightning's."""
        columns = [
            (" ", [str(i) for i in range(len(self._layers))]),
            ("Name", self.layer_names),
            ("Type", self.layer_types),
            ("Params", [human_readable_count(n) for n in self.param_nums]),
            ("Mode", ["train" if mode else "eval" for mode in self.training_modes]),
            ("FLOPs", [human_readable_count(sum(c.values())) for c in self.flop_counts.values()]),
        ]
        example = getattr(self._model, "example_input_array", None) is not None
        if example:
            columns.append(("In sizes", [str(x) for x in self.in_sizes]))
            columns.append(("Out sizes", [str(x) for x in self.out_sizes]))
        leftover = self.total_parameters - self.total_layer_params
        if leftover > 0:
            extra = {" ": " ", "Name": "other params", "Type": NOT_APPLICABLE, "Params": human_readable_count(leftover)}
            for header, cells in columns:
                cells.append(extra.get(header, NOT_APPLICABLE))
        return columns

    def __str__(self) -> str:
        columns = self.columns()
        rows = len(columns[0][1])
        widths = [max([len(header)] + [len(str(c)) for c in cells]) for header, cells in columns]
        rule = "-" * (sum(widths) + 3 * (1 + len(columns)))
        lines = [" | ".join(f"{header:<{w}}" for (header, _), w in zip(columns, widths)), rule]
        for i in range(rows):
            lines.append(" | ".join(f"{str(cells[i]):<{w}}" for (_, cells), w in zip(columns, widths)))
        lines.append(rule)
        trainable, total, modes = self.trainable_parameters, self.total_parameters, self.total_training_modes
        for value, label in (
            (human_readable_count(trainable), "Trainable params"),
            (human_readable_count(total - trainable), "Non-trainable params"),
            (human_readable_count(total), "Total params"),
            (f"{self.model_size:,.3f}", "Total estimated model params size (MB)"),
            (modes["train"], "Modules in train mode"),
            (modes["eval"], "Modules in eval mode"),
            (human_readable_count(self.total_flops), "Total Flops"),
        ):
            lines.append(f"{value!s:<10}{label}")
        return "\n".join(lines)

    __repr__ = __str__


def summarize(model: nn.Module, max_depth: int = 1) -> Summary:
    """The summary of ``model`` down to ``max_depth`` (Lightning's ``summarize``)."""
    trainer = model.__dict__.get("_hookloop_trainer")
    return Summary(model, max_depth, precision=trainer.precision if trainer is not None else "32", trainer=trainer)


class ModelSummary:
    """Print the model summary at the start of ``fit`` (global rank 0).

    max_depth: how deep nested modules are listed: 1 the module's children, -1 all, 0 no
        table
    """

    hookloop_name = "model_summary"
    hookloop_role = "observer"

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any):
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ConfigurationError(f"ModelSummary(max_depth={max_depth!r}) must be -1 (all), 0 (none) or > 0")
        self._max_depth = max_depth
        self._summarize_kwargs = summarize_kwargs
        #: the summary printed by the last fit (rank 0), for reading its numbers
        self.summary: Summary | None = None

    @hookimpl
    def on_fit_start(self, trainer):
        if not self._max_depth:
            return
        # Every rank runs the example's forward (a sharded model's forward is a collective).
        self.summary = Summary(trainer.module, self._max_depth, precision=trainer.precision, trainer=trainer)
        if trainer.is_global_zero:
            self.summarize(self.summary)

    def summarize(self, summary: Summary) -> None:
        """Print the table (override to send it elsewhere)."""
        print("\n" + str(summary), flush=True)
