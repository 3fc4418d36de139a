"""``pipe``: pipeline parallelism of ``sequential_module`` over devices of one process.

``fairscale.nn.Pipe`` (GPipe): the ``nn.Sequential`` the module exposes as
``sequential_module`` is split into partitions of ``balance`` layers, each on one
device; every batch is cut into ``chunks`` micro-batches that flow through the
partitions in a pipeline, and activations are recomputed in the backward pass as
``checkpoint`` says. One process drives every device (fairscale runs a worker thread
per device). On the CPU, ``devices=["cpu", "cpu"]`` runs the same partitioning,
micro-batching and checkpointing for real.

The module is not rewritten: ``sequential_module`` keeps its layers (so state-dict keys,
checkpoints and the optimizer's parameters are the user's), and only its ``forward``
is routed through the Pipe built around those same layers, for the run.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

import hookloop
from hookloop.distributed.launchers import InProcess

from ._backend import require_fairscale
from .balance import check_balance, check_balance_option, choose_balance, sequential_of

CHECKPOINT_MODES = ("always", "except_last", "never")


class PipeStrategy:
    """Pipeline parallelism with fairscale's Pipe (``plugins=["pipe"]``), in one process.

    Options (constructor arguments, or ``plugin_options={"pipe": {...}}``):

    ``balance``
        layers per partition, e.g. ``[2, 3]``; ``None``: chosen for the number of devices
        (by time with fairscale's ``balance_by_time`` when the module has an
        ``example_input_array``, else by parameter count) and printed.
    ``chunks``
        micro-batches each batch is cut into (default 8, as Lightning's sequential
        plugin); 1 runs the partitions one after the other.
    ``checkpoint``
        ``"except_last"`` (default: recompute the activations of every micro-batch but
        the last in the backward pass), ``"always"`` or ``"never"``.
    ``devices``
        one device per partition, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``;
        ``None``: ``len(balance)`` devices (else the Trainer's ``devices`` count) of the
        run's accelerator, the first GPUs or the CPU.
    """

    hookloop_name = "pipe"
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self, balance: list[int] | None = None, chunks: int = 8, checkpoint: str = "except_last",
                 devices: list[Any] | None = None):
        require_fairscale(self.hookloop_name)
        self.balance = balance
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.devices = devices
        self._devices: list[torch.device] = []
        self._sequential: nn.Sequential | None = None
        self.pipe: Any = None  # the fairscale Pipe of the current run

    def __setattr__(self, name: str, value: Any) -> None:
        # Checked whenever set, so plugin_options fail at Trainer(...), before any run.
        if name == "balance":
            check_balance_option(self.hookloop_name, value)
        elif name == "chunks":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise hookloop.ConfigurationError(f"pipe option chunks={value!r} must be an integer >= 1 (micro-batches per batch)")
        elif name == "checkpoint":
            if value not in CHECKPOINT_MODES:
                raise hookloop.ConfigurationError(
                    f"pipe option checkpoint={value!r} must be one of {', '.join(map(repr, CHECKPOINT_MODES))}")
        elif name == "devices" and value is not None:
            if not isinstance(value, (list, tuple)) or not value:
                raise hookloop.ConfigurationError(
                    f"pipe option devices={value!r} must be a list of devices, one per partition "
                    f"(e.g. ['cuda:0', 'cuda:1'] or ['cpu', 'cpu'])")
            try:
                [torch.device(d) for d in value]
            except (RuntimeError, TypeError) as exc:
                raise hookloop.ConfigurationError(f"pipe option devices={value!r}: {exc}") from None
        object.__setattr__(self, name, value)

    # -- launching: one process drives every device --------------------------------------

    @property
    def hookloop_launcher(self) -> InProcess:
        """The core's ``in_process`` launcher: ``devices`` are the pipeline's partitions,
        not processes; one machine."""
        return InProcess(check=self._check_one_node, label="pipe")

    def _check_one_node(self, config) -> None:
        if config.nodes > 1:
            raise hookloop.ConfigurationError(
                f"pipe drives its devices from one process on one machine, but nodes={config.nodes}: "
                f"use ddp_sequential for pipeline stages on several processes and machines")

    # -- environment ----------------------------------------------------------------------

    @hookloop.hookimpl
    def setup_environment(self, trainer):
        """A world of one process whose device is the first partition's."""
        launched = hookloop.env_int("WORLD_SIZE", default=1)
        if launched > 1:
            raise hookloop.ConfigurationError(
                f"pipe drives every device from one process, but the launcher started {launched}: "
                f"launch one (hookloop run --plugins pipe script.py), or use ddp_sequential for "
                f"one pipeline stage per process")
        self._devices = self._resolve_devices(trainer)
        trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank = 1, 0, 0, 0
        trainer.root_device = self._devices[0]
        return True

    def _resolve_devices(self, trainer) -> list[torch.device]:
        if self.devices is not None:
            devices = [torch.device(d) for d in self.devices]
            if any(d.type == "cuda" for d in devices) and not torch.cuda.is_available():
                raise hookloop.ConfigurationError(
                    f"pipe devices={list(self.devices)} names CUDA devices, and this machine has no "
                    f"CUDA GPU: use devices={['cpu'] * len(devices)} to run the pipeline on the CPU")
            if self.balance is not None and len(self.balance) != len(devices):
                raise hookloop.ConfigurationError(
                    f"pipe balance={self.balance} has {len(self.balance)} partitions and devices="
                    f"{list(self.devices)} {len(devices)}: give one device per partition")
            return devices
        count = len(self.balance) if self.balance is not None else trainer.config.num_processes()
        first = hookloop.local_rank_device(trainer, 0)
        if first.type == "cuda":
            if count > torch.cuda.device_count():
                raise hookloop.ConfigurationError(
                    f"pipe needs {count} GPUs (one per partition) and this machine has "
                    f"{torch.cuda.device_count()}: fewer partitions, or devices=['cuda:0', ...]")
            return [torch.device("cuda", i) for i in range(count)]
        return [torch.device("cpu")] * count

    @hookloop.hookimpl
    def teardown(self, trainer):
        """Give ``sequential_module`` its own forward back; the layers stay on their devices."""
        sequential, self._sequential = self._sequential, None
        if sequential is not None:
            sequential.__dict__.pop("forward", None)
        pipe, self.pipe = self.pipe, None
        if pipe is not None:
            release_pipe(pipe)

    # -- the model ------------------------------------------------------------------------

    @hookloop.hookimpl
    def wrap_model(self, trainer, model):
        """Split ``sequential_module`` into a Pipe and route its forward through it."""
        from fairscale.nn import Pipe

        module = model.module
        sequential = sequential_of(module, self.hookloop_name)
        root = trainer.root_device
        model.to(root)  # everything on the first device; Pipe moves each partition to its own
        balance = self.balance
        if balance is None:
            balance, how = choose_balance(self.hookloop_name, module, sequential, len(self._devices), root)
            print(f"hookloop-fairscale: pipe balance {balance} over {[str(d) for d in self._devices]}, "
                  f"chosen {how}; set balance=[...] to choose it yourself", flush=True)
        balance = check_balance(self.hookloop_name, balance, sequential)
        self.pipe = build_pipe(sequential, balance, self._devices[: len(balance)], self.chunks, self.checkpoint)
        sequential.forward = _ThroughPipe(self.pipe, root)  # an instance attribute: the layers stay where they are
        self._sequential = sequential
        return model


def build_pipe(sequential: nn.Sequential, balance: list[int], devices: list[torch.device], chunks: int,
               checkpoint: str):
    """``fairscale.nn.Pipe`` around ``sequential``'s own layers, whose partitions run under
    the caller's autocast (fairscale runs them in worker threads, where the caller's
    autocast state, which is per thread, does not reach)."""
    import warnings

    from fairscale.nn import Pipe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "upstreamed to PyTorch", since removed there
        pipe = Pipe(sequential, balance=balance, devices=devices, chunks=chunks, checkpoint=checkpoint)
    autocast = _AutocastState()
    for partition in pipe.partitions:
        partition.forward = _UnderAutocast(partition, autocast)
    pipe._hookloop_autocast = autocast
    return pipe


def release_pipe(pipe) -> None:
    """Drop what keeps ``pipe`` alive, so that it is freed (and fairscale joins its worker
    threads) now. A Pipe left to the end of the interpreter hangs the exit: its
    ``__del__`` waits for worker threads that the interpreter has already stopped."""
    for partition in pipe.partitions:
        partition.__dict__.pop("forward", None)


class _AutocastState:
    """The autocast state of the thread that called the pipe, for its worker threads."""

    def __init__(self):
        self.by_device: dict[str, tuple[bool, torch.dtype]] = {}

    def capture(self, device_types: set[str]) -> None:
        self.by_device = {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in device_types}


class _UnderAutocast:
    """A partition's forward, re-entering the caller's autocast in the worker thread (also
    when a checkpointed micro-batch is recomputed in the backward pass)."""

    def __init__(self, partition: nn.Sequential, state: _AutocastState):
        self.partition, self.state = partition, state

    def __call__(self, *inputs):
        device_type = next(self.partition.parameters(), torch.empty(0)).device.type
        enabled, dtype = self.state.by_device.get(device_type, (False, None))
        if not enabled:
            return nn.Sequential.forward(self.partition, *inputs)
        with torch.autocast(device_type=device_type, dtype=dtype):
            return nn.Sequential.forward(self.partition, *inputs)


class _ThroughPipe:
    """``sequential_module.forward`` for the run: the input goes to the first partition's
    device, through the Pipe, and the output comes back to the module's device."""

    def __init__(self, pipe, root: torch.device):
        self.pipe, self.root = pipe, root

    def __call__(self, input):
        pipe = self.pipe
        pipe._hookloop_autocast.capture({d.type for d in pipe.devices})
        first = pipe.devices[0]
        moved = hookloop.move_to_device(input, first) if _on_other_device(input, first) else input
        output = pipe(moved)
        return hookloop.move_to_device(output, self.root) if _on_other_device(output, self.root) else output


def _on_other_device(obj: Any, device: torch.device) -> bool:
    found = []
    hookloop.apply_to_tensors(obj, lambda t: found.append(t.device != device))
    return any(found)
