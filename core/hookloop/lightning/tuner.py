"""``Tuner``: the learning-rate finder and the batch-size finder, under Lightning's names,
working in one process and under data-parallel strategies (``--plugins ddp --devices 2``;
fsdp and DeepSpeed ZeRO 0-2 too; ZeRO-3 and ``ddp_spawn`` are refused).

``Tuner(trainer).lr_find(model, ...)`` runs ``num_training`` optimizer steps with the
learning rate rising from ``min_lr`` to ``max_lr`` (exponentially or linearly, Lightning's
``_ExponentialLR``/``_LinearLR`` schedule), records the smoothed loss (Lightning's
``beta=0.98`` running mean with its bias correction), stops when the smoothed loss passes
``early_stop_threshold`` times the best one, restores the weights and the trainer, and
suggests the learning rate at the steepest negative gradient of the loss.
``Tuner(trainer).scale_batch_size(model, ...)`` runs ``steps_per_trial`` steps per batch
size, doubling it (``"power"``) or refining by bisection (``"binsearch"``) until an
out-of-memory error or ``max_val``, and sets the last size that fitted.

Under several processes every rank takes the same decisions: the loss the finder records
is the all-reduced mean of the ranks' losses (so the smoothed losses, the early stop and
the suggestion are the same on every rank), and an out-of-memory error in one rank's
``training_step`` is caught there (that rank backs a zero loss so the gradient all-reduce
still completes), then an all-reduced MAX of the flag at the batch's end ends the trial on
every rank. An out-of-memory error outside ``training_step`` (in the backward, the
optimizer) under several processes is not caught: the other ranks would wait in a
collective for it.

Each search is a ``trainer.fit`` of its own with the run's strategy, precision and device
plugins but none of its observers (progress bar, loggers, checkpoints, callbacks), as
Lightning's finders replace the callbacks and the loggers; the trainer's position, state
and plugins are put back afterwards, and the run directory the search claimed is the one
the next ``fit`` uses.

Layer: beside :mod:`hookloop.trainer` (it drives a trainer it is given; it imports
neither the trainer nor a plugin).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from typing import Any

import torch

from hookloop.contract import registry as plugin_registry
from hookloop.engine.defaults import Defaults
from hookloop.contract.errors import ConfigurationError, MissingAttributeError, MissingDependencyError
from hookloop.contract.hookspecs import hookimpl
from hookloop.engine.state import LoopState
from hookloop.resume import checkpoint
from hookloop.distributed.ranks import rank_zero_info, rank_zero_warn

log = logging.getLogger(__name__)

__all__ = ["Tuner", "LRFinder", "lr_schedule", "is_oom_error"]


# ---------------------------------------------------------------------------------------
# The learning-rate schedule and the result (Lightning's _LRFinder)
# ---------------------------------------------------------------------------------------


def lr_schedule(mode: str, min_lr: float, max_lr: float, num_training: int) -> list[float]:
    """The learning rate of each of the finder's ``num_training`` steps, as Lightning's
    ``_ExponentialLR``/``_LinearLR`` give them: step 0 runs at ``min_lr``; step ``k >= 1``
    at ``min_lr * (max_lr/min_lr) ** ((k+1)/num_training)`` (exponential) or
    ``min_lr + (k+1)/num_training * (max_lr - min_lr)`` (linear)."""
    out = []
    for k in range(num_training):
        if k == 0:
            out.append(min_lr)
            continue
        r = (k + 1) / num_training
        out.append(min_lr * (max_lr / min_lr) ** r if mode == "exponential" else min_lr + r * (max_lr - min_lr))
    return out


class LRFinder:
    """What :meth:`Tuner.lr_find` found: ``results = {"lr": [...], "loss": [...]}`` (one
    entry per optimizer step; the loss is the smoothed, rank-averaged one),
    :meth:`suggestion` and :meth:`plot` (Lightning's ``_LRFinder``)."""

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int):
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: dict[str, list[float]] = {}
        self._optimal_idx: int | None = None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate at the steepest negative gradient of the loss over the
        learning rate (``torch.gradient``), skipping ``skip_begin`` first and ``skip_end``
        last points and the non-finite losses; ``None`` when fewer than 2 points are left."""
        losses = torch.tensor(self.results["loss"][skip_begin:-skip_end])
        lrs = torch.tensor(self.results["lr"][skip_begin:-skip_end])
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:  # torch.gradient needs 2; logged as Lightning logs it
            log.error(
                "Failed to compute suggestion for learning rate because there are not enough points. Increase "
                "the loop iteration limits or the size of your dataset/dataloader (lr_find: fewer than 2 finite "
                "losses after skipping the first and last; raise num_training or give more batches).")
            self._optimal_idx = None
            return None
        gradients = torch.gradient(losses, spacing=[lrs])[0]
        min_grad = torch.argmin(gradients).item()
        kept = torch.arange(len(self.results["loss"]))[skip_begin:-skip_end][finite]
        self._optimal_idx = int(kept[min_grad].item())
        return self.results["lr"][self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """The loss over the learning rate (log scale in exponential mode), the
        suggestion as a red point with ``suggest=True``; needs matplotlib."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise MissingDependencyError(
                "LRFinder.plot draws with matplotlib, which is not installed: pip install 'hookloop[plot]' "
                "(or pip install matplotlib)") from None
        lrs, losses = self.results["lr"], self.results["loss"]
        if ax is None:
            fig, ax = plt.subplots()
        else:
            fig = ax.figure
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None and self._optimal_idx is not None:
            ax.plot(lrs[self._optimal_idx], losses[self._optimal_idx], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig

    def table(self) -> str:
        """The results as text: step, learning rate, smoothed loss."""
        rows = [f"{'step':>5}  {'lr':>12}  {'loss':>12}"]
        rows += [f"{i:>5}  {lr:>12.4e}  {loss:>12.6g}"
                 for i, (lr, loss) in enumerate(zip(self.results.get("lr", []), self.results.get("loss", [])))]
        return "\n".join(rows)


class _LRFinderHooks:
    """Sets each step's learning rate and records the rank-averaged smoothed loss."""

    hookloop_name = "lr_finder"
    hookloop_role = "observer"

    def __init__(self, lrs: list[float], early_stop_threshold: float | None, beta: float = 0.98):
        self.schedule, self.early_stop_threshold, self.beta = lrs, early_stop_threshold, beta
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.avg_loss = 0.0
        self.best_loss = 0.0
        self.start_step = 0
        self.step_before = 0

    @hookimpl
    def on_train_start(self, trainer):
        if len(trainer.optimizers) != 1:
            raise ConfigurationError(
                f"`model.configure_optimizers()` returned {len(trainer.optimizers)}, but learning rate finder "
                f"only works with single optimizer: return one optimizer while you search")
        self.start_step = trainer.global_step

    @hookimpl
    def on_train_batch_start(self, trainer, batch, batch_idx):
        self.step_before = trainer.global_step
        k = trainer.global_step - self.start_step
        lr = self.schedule[min(k, len(self.schedule) - 1)]
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = lr
        self._lr = lr

    @hookimpl
    def on_train_batch_end(self, trainer, outputs, loss, batch, batch_idx):
        if trainer.global_step == self.step_before:  # inside an accumulation window
            return
        self.lrs.append(self._lr)
        if loss is None:
            self.losses.append(float("nan"))
            return
        # Lightning records the window's last micro-batch loss as backpropagated, divided by
        # accumulate_grad_batches (a scale: the suggestion and the stop rule are the same)
        value = loss.detach().float().reshape(()) / trainer.accumulate_grad_batches
        if trainer.world_size > 1:
            # every rank records (and decides on) the mean over the ranks
            value = trainer.reduce(value.clone(), "mean")
        current_loss = value.item()
        current_step = trainer.global_step - self.start_step
        self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * current_loss
        smoothed = self.avg_loss / (1 - self.beta ** (current_step + 1))
        if (self.early_stop_threshold is not None and current_step > 1
                and smoothed > self.early_stop_threshold * self.best_loss):
            trainer.should_stop = True  # the same value on every rank: the same decision
        if smoothed < self.best_loss or current_step == 1:
            self.best_loss = smoothed
        self.losses.append(smoothed)


# ---------------------------------------------------------------------------------------
# Out of memory, agreed by all ranks
# ---------------------------------------------------------------------------------------


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error: ``torch.OutOfMemoryError``, or a
    ``RuntimeError`` saying "out of memory", cuDNN's "not supported" for a too-large
    batch, or the CPU allocator's "can't allocate memory" (Lightning's test)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError) or len(exc.args) != 1:
        return False
    text = str(exc.args[0])
    return ("out of memory" in text or "CUDNN_STATUS_NOT_SUPPORTED" in text
            or "DefaultCPUAllocator: can't allocate memory" in text)


class _TrialOutOfMemory(RuntimeError):
    """Raised on every rank when any rank ran out of memory in a trial."""

    def __init__(self):
        super().__init__("out of memory (batch-size trial)")


class _OOMAgreement:
    """Catches an out-of-memory error in ``training_step`` (backing a zero loss that
    touches every parameter, so DDP's gradient all-reduce still completes) and ends the
    trial on every rank at the batch's end (all-reduced MAX of the flag)."""

    hookloop_name = "batch_size_finder"
    hookloop_role = "observer"

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.failed = False
        original = module.training_step

        def training_step(*args: Any, **kwargs: Any):
            try:
                return original(*args, **kwargs)
            except RuntimeError as exc:
                if not is_oom_error(exc):
                    raise
                self.failed = True
                params = [p for p in module.parameters() if p.requires_grad]
                return sum((p.sum() * 0.0 for p in params), torch.zeros((), device=params[0].device)
                           if params else torch.zeros(()))

        module.__dict__["training_step"] = training_step

    def remove(self) -> None:
        self.module.__dict__.pop("training_step", None)

    @hookimpl
    def on_train_batch_end(self, trainer, outputs, loss, batch, batch_idx):
        flag = torch.tensor(1.0 if self.failed else 0.0)
        if trainer.world_size > 1:
            flag = trainer.reduce(flag.to(trainer.root_device), "max")
        if float(flag) > 0:
            raise _TrialOutOfMemory()


# ---------------------------------------------------------------------------------------
# The Tuner
# ---------------------------------------------------------------------------------------

# What a search run changes on the trainer, put back after it.
_TRAINER_ATTRS = ("plugins", "plugin_manager", "hook", "_callback_hooks", "state", "global_step", "current_epoch",
                  "batch_idx", "should_stop", "module", "model", "datamodule", "optimizers",
                  "lr_scheduler_configs", "train_dataloader", "val_dataloaders", "test_dataloaders",
                  "predict_dataloaders", "num_training_batches", "device_mesh")
_CONFIG_ATTRS = ("max_steps", "limit_val_batches", "num_sanity_val_steps", "limit_train_batches")


class _SearchRun:
    """A ``trainer.fit`` of the finder's own: the run's non-observer plugins plus
    ``extra`` hooks, ``max_steps`` steps, no validation; everything restored after."""

    def __init__(self, trainer: Any, extra: list, max_steps: int):
        self.trainer, self.extra, self.max_steps = trainer, extra, max_steps

    def __enter__(self):
        t = self.trainer
        self.saved = {a: getattr(t, a) for a in _TRAINER_ATTRS if hasattr(t, a)}
        self.saved_config = {a: getattr(t.config, a) for a in _CONFIG_ATTRS}
        kept = [p for p in t.plugins if getattr(p, "hookloop_role", "extension") != "observer"]
        t.plugins = kept + list(self.extra)
        t.plugin_manager = plugin_registry.make_plugin_manager(t.plugins, Defaults())
        t.hook = t.plugin_manager.hook
        t._callback_hooks = None
        old_state = self.saved["state"]
        t.state = LoopState(t, old_state.run_index)
        t.state.log_dir = old_state.log_dir
        t.global_step, t.current_epoch, t.should_stop = 0, 0, False
        t.config.max_steps = self.max_steps
        t.__dict__["_hookloop_tuning"] = True  # its fit is the search's, not a `hookloop tune` request
        t.config.limit_val_batches = 0
        t.config.num_sanity_val_steps = 0
        return self

    def __exit__(self, *exc: Any) -> None:
        t = self.trainer
        search_state = t.state
        t.__dict__.pop("_hookloop_tuning", None)
        for a, v in self.saved.items():
            setattr(t, a, v)
        for a, v in self.saved_config.items():
            setattr(t.config, a, v)
        if t.state.log_dir is None:  # the next fit uses the directory this search claimed
            t.state.log_dir = search_state.log_dir


def _check_not_spawning(trainer: Any, finder: str) -> None:
    """A strategy that spawns its workers from this process (``ddp_spawn``) would run the
    search in them and lose what it found there: refused, with the alternative."""
    # a launcher's label: the name the user chose it by (``ddp_spawn`` for its ``spawn``)
    spawners = [getattr(impl.plugin, "label", impl.plugin_name)
                for impl in trainer.plugin_manager.hook.spawn.get_hookimpls()
                if impl.plugin_name != "hookloop.defaults"]
    if spawners:
        raise ConfigurationError(
            f"{finder} runs in the process that calls it, and {spawners[0]!r} spawns its workers from "
            f"there (the search's results would stay in them): use the 'ddp' strategy with `hookloop run` "
            f"(or `hookloop tune`), whose every worker runs the script and the finder")


def _restore_weights(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Put back the weights ``saved`` (``model.state_dict()`` before the search, plain
    tensors). A search run that ended in an exception (a batch-size trial out of memory)
    or a sharded strategy that does not gather at teardown (fsdp with
    ``state_dict_type="sharded"``) leaves a parameter as this rank's DTensor shard, which
    a plain ``load_state_dict`` cannot copy into: such a parameter is replaced by a plain
    one holding the saved whole tensor (every rank saved the same), as it was before."""
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or not (hasattr(param, "placements") and hasattr(param, "to_local")):
                continue
            key = f"{prefix}.{name}" if prefix else name
            if key not in saved or hasattr(saved[key], "placements"):
                continue  # a DTensor before the search too: load_state_dict copies into it
            module._parameters[name] = torch.nn.Parameter(saved[key].clone().to(param.to_local().device),
                                                          requires_grad=param.requires_grad)
    model.load_state_dict(saved)


def _zero3_strategy(trainer: Any) -> str | None:
    """The name of a DeepSpeed strategy plugin that partitions the parameters (ZeRO
    stage 3: its ``stage``, or the ``zero_optimization.stage`` of its custom config), or
    ``None``. Duck-typed: the core imports no plugin."""
    for plugin in trainer.plugins:
        name = getattr(plugin, "hookloop_name", "")
        if getattr(plugin, "hookloop_role", None) != "strategy" or not name.startswith("deepspeed"):
            continue
        stage = getattr(plugin, "stage", None)
        config = getattr(plugin, "config", None) or os.environ.get("HOOKLOOP_DEEPSPEED_CONFIG")
        if isinstance(config, (str, os.PathLike)):
            try:
                with open(config) as f:
                    config = json.load(f)
            except (OSError, ValueError):
                config = None  # the strategy reports a bad config itself
        if isinstance(config, dict):
            stage = (config.get("zero_optimization") or {}).get("stage", 0)
        if stage == 3:
            return name
    return None


def _check_strategy(trainer: Any, finder: str) -> None:
    """Refuse, before anything runs, a strategy under which a finder cannot work:
    ``ddp_spawn`` (the search would run in its workers) and DeepSpeed ZeRO-3 (a module
    that went through one ZeRO-3 engine cannot be wrapped by another in the same process,
    and a finder needs one per search plus the fit after it)."""
    _check_not_spawning(trainer, finder)
    zero3 = _zero3_strategy(trainer)
    if zero3 is not None:
        raise ConfigurationError(
            f"{finder} under {zero3!r} (DeepSpeed ZeRO stage 3) is not supported: each search is a fit of its "
            f"own, and a module that went through one ZeRO-3 engine cannot be wrapped by a second one in the "
            f"same process (DeepSpeed keeps the first engine's process group on its parameters: \"Group ... "
            f"is not registered\"), so the trials and the fit after the search would fail. Run the finder "
            f"under 'deepspeed_stage_2' (the same global batch, every parameter whole on every rank), fsdp or "
            f"ddp, then train with {zero3!r}")


def _fit(trainer: Any, model: Any, train_dataloaders: Any, datamodule: Any) -> None:
    if datamodule is not None:
        trainer.fit(model, datamodule=datamodule)
    else:
        trainer.fit(model, train_dataloaders)


def _getattr(obj: Any, name: str) -> tuple[bool, Any]:
    if obj is None:
        return False, None
    if name in getattr(obj, "__dict__", {}) or hasattr(type(obj), name):
        return True, getattr(obj, name)
    hparams = getattr(obj, "hparams", None)
    if isinstance(hparams, dict) and name in hparams:
        return True, hparams[name]
    return False, None


def _setattr(obj: Any, name: str, value: Any) -> None:
    if name in getattr(obj, "__dict__", {}) or hasattr(type(obj), name):
        setattr(obj, name, value)
    hparams = getattr(obj, "hparams", None)
    if isinstance(hparams, dict) and name in hparams:
        hparams[name] = value


class Tuner:
    """Lightning's ``Tuner``: ``Tuner(trainer).lr_find(model, ...)`` and
    ``Tuner(trainer).scale_batch_size(model, ...)``, on every rank of a multi-process run
    with the same result on each (see :mod:`hookloop.tuner`)."""

    def __init__(self, trainer: Any):
        self._trainer = trainer
        #: the batch-size finder's trials, in order: (batch size, whether it fitted)
        self.trials: list[tuple[int, bool]] = []

    def lr_find(self, model: torch.nn.Module, train_dataloaders: Any = None, val_dataloaders: Any = None,
                dataloaders: Any = None, datamodule: Any = None, method: str = "fit", min_lr: float = 1e-8,
                max_lr: float = 1, num_training: int = 100, mode: str = "exponential",
                early_stop_threshold: float | None = 4.0, update_attr: bool = True,
                attr_name: str = "") -> LRFinder | None:
        """Run the learning-rate range test (Lightning's arguments; ``val_dataloaders``
        and ``dataloaders`` are accepted and not used: the search does not validate).
        With ``update_attr``, the suggestion is set as ``model.lr``/``model.learning_rate``
        (or ``attr_name``; in ``model.hparams`` too)."""
        trainer = self._trainer
        if method != "fit":
            raise ConfigurationError(f"lr_find(method={method!r}): the learning rate finder runs 'fit' only")
        if mode not in ("exponential", "linear"):
            raise ConfigurationError(f"lr_find(mode={mode!r}) must be 'exponential' or 'linear'")
        if not (isinstance(num_training, int) and num_training >= 1):
            raise ConfigurationError(f"lr_find(num_training={num_training!r}) must be an int >= 1")
        # min_lr > max_lr sweeps downwards, as Lightning's schedule does
        if not all(isinstance(v, (int, float)) and 0 < v and math.isfinite(v) for v in (min_lr, max_lr)):
            raise ConfigurationError(
                f"lr_find needs finite min_lr > 0 and max_lr > 0, got min_lr={min_lr!r}, max_lr={max_lr!r}")
        if isinstance(train_dataloaders, torch.utils.data.DataLoader) is False and datamodule is None and \
                train_dataloaders is not None and callable(getattr(train_dataloaders, "train_dataloader", None)):
            datamodule, train_dataloaders = train_dataloaders, None
        if trainer.config.fast_dev_run:
            rank_zero_warn("Skipping learning rate finder since `fast_dev_run` is enabled.")
            return None
        _check_strategy(trainer, "lr_find")
        if update_attr:
            attr_name = _lr_attr_name(model, attr_name)
        saved = copy.deepcopy(model.state_dict())
        finder = LRFinder(mode, min_lr, max_lr, num_training)
        hooks = _LRFinderHooks(lr_schedule(mode, min_lr, max_lr, num_training), early_stop_threshold)
        # the random generators as they were (Lightning's isolate_rng): the search draws
        # nothing the run after it (or a second search) would have drawn
        rng = checkpoint.rng_state()
        try:
            with _SearchRun(trainer, [hooks], max_steps=num_training):
                _fit(trainer, model, train_dataloaders, datamodule)
        finally:
            _restore_weights(model, saved)
            checkpoint.set_rng_state(rng)
        if len(hooks.losses) < num_training:
            rank_zero_info(f"LR finder stopped early after {len(hooks.losses)} steps due to diverging loss.")
        finder.results = {"lr": hooks.lrs, "loss": hooks.losses}
        if update_attr:
            lr = finder.suggestion()
            if lr is not None:
                _setattr(model, attr_name, lr)
                rank_zero_info(f"Learning rate set to {lr}")
        return finder

    def scale_batch_size(self, model: torch.nn.Module, train_dataloaders: Any = None, val_dataloaders: Any = None,
                         dataloaders: Any = None, datamodule: Any = None, method: str = "fit",
                         mode: str = "power", steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                         batch_arg_name: str = "batch_size", margin: float = 0.05,
                         max_val: int = 8192) -> int | None:
        """Find the largest batch size that runs ``steps_per_trial`` training steps
        without running out of memory (Lightning's arguments and search). The batch size
        is read from and written to ``batch_arg_name`` of the datamodule (when given and
        it has one) or the model; the loaders must be built from it
        (``train_dataloader()``), so loaders passed in are refused. On the CPU, where
        nothing runs out of memory, ``max_val`` bounds the search."""
        trainer = self._trainer
        if method != "fit":
            raise ConfigurationError(f"scale_batch_size(method={method!r}): the batch-size finder runs 'fit' only")
        if mode not in ("power", "binsearch"):
            raise ConfigurationError(f"scale_batch_size(mode={mode!r}) must be 'power' or 'binsearch'")
        if train_dataloaders is not None and callable(getattr(train_dataloaders, "train_dataloader", None)):
            datamodule, train_dataloaders = train_dataloaders, None
        if train_dataloaders is not None:
            raise ConfigurationError(
                "scale_batch_size needs loaders it can rebuild: give a datamodule (or a model) whose "
                "train_dataloader() reads the batch size attribute, not train_dataloaders")
        if not 0.0 <= margin < 1.0:
            raise ConfigurationError(f"scale_batch_size(margin={margin!r}) must be in [0, 1)")
        if trainer.config.fast_dev_run:
            rank_zero_warn("Skipping batch size scaler since `fast_dev_run` is enabled.")
            return None
        _check_strategy(trainer, "scale_batch_size")
        # Lightning's lightning_setattr: every holder of the attribute gets the new value
        holders = [c for c in (datamodule, model) if _getattr(c, batch_arg_name)[0]]
        target = holders[0] if holders else None
        if target is None:
            raise ConfigurationError(
                f"scale_batch_size: neither the datamodule nor the model has the attribute {batch_arg_name!r} "
                f"(batch_arg_name) that train_dataloader() reads")
        saved = copy.deepcopy(model.state_dict())

        def set_size(value: int) -> None:
            for holder in holders:
                _setattr(holder, batch_arg_name, value)

        set_size(init_val)
        new_size = init_val

        seen = {"length": None}

        def adjust(value: int) -> tuple[int, bool]:
            current = _getattr(target, batch_arg_name)[1]
            length = seen["length"]
            if length is not None and current >= length:  # Lightning: the dataset is no larger
                rank_zero_info(f"The batch size {current} is greater or equal than the length of your dataset: {length}.")
                return current, False
            new = min(int(value), max_val)
            set_size(new)
            return new, new != current

        def trial() -> bool:
            """True: fitted; False: out of memory (on some rank: the same answer on all)."""
            agreement = _OOMAgreement(model)
            size = _getattr(target, batch_arg_name)[1]
            try:
                with _SearchRun(trainer, [agreement], max_steps=steps_per_trial):
                    _fit(trainer, model, None, datamodule)
                    dataset = getattr(trainer.train_dataloader, "dataset", None)
                    seen["length"] = len(dataset) if hasattr(dataset, "__len__") else None
                self.trials.append((size, True))
                return True
            except RuntimeError as exc:
                if is_oom_error(exc) or isinstance(exc, _TrialOutOfMemory):
                    self.trials.append((size, False))
                    return False
                raise
            finally:
                agreement.remove()

        try:
            if mode == "power":
                any_success = False
                for i in range(max_trials):
                    if new_size >= max_val:
                        rank_zero_info(f"Reached the maximum batch size limit of {max_val}. Stopping search.")
                        break
                    if trial():
                        last = new_size
                        if i + 1 >= max_trials:
                            new_size = last
                            break
                        new_size, changed = adjust(new_size * 2)
                        if not changed:
                            break
                        any_success = True
                    else:
                        new_size, _ = adjust(new_size // 2)
                        if any_success:
                            break
            else:
                low, high, count = 1, None, 0
                while True:
                    if new_size >= max_val:
                        rank_zero_info(f"Reached the maximum batch size limit of {max_val}. Stopping search.")
                        break
                    if trial():
                        last = new_size
                        count += 1
                        if count >= max_trials:
                            new_size = last
                            break
                        low = new_size
                        if high:
                            if high - low <= 1:
                                break
                            new_size, changed = adjust((high + low) // 2)
                        else:
                            new_size, changed = adjust(new_size * 2)
                        if not changed:
                            break
                    else:
                        high = new_size
                        new_size, _ = adjust((high + low) // 2)
                        if high - low <= 1:
                            break
                if margin > 0:
                    new_size = max(1, int(new_size * (1 - margin)))
        finally:
            _restore_weights(model, saved)
        set_size(new_size)
        rank_zero_info(f"Finished batch size finder, will continue with full run using batch size {new_size}")
        return new_size


#: set by ``hookloop tune``: ``{"finder": "lr"|"batch-size", "options": {...}}`` (JSON)
TUNE_ENV = "HOOKLOOP_TUNE"


def tune_from_environment(trainer: Any, model: Any, train_dataloaders: Any, datamodule: Any) -> None:
    """``hookloop tune``'s end of a script's first ``fit``: run the finder that
    ``HOOKLOOP_TUNE`` names on every rank, print the suggestion and the table on global
    rank 0, and end the process (status 0) instead of training."""
    request = json.loads(os.environ[TUNE_ENV])
    tuner = Tuner(trainer)
    options = request["options"]
    if request["finder"] == "lr":
        found = tuner.lr_find(model, train_dataloaders, datamodule=datamodule, update_attr=False, **options)
        if trainer.global_rank == 0 and found is not None:
            suggestion = found.suggestion()
            print(found.table())
            print(f"hookloop tune lr: suggested learning rate {suggestion!r} "
                  f"({len(found.results['loss'])} of {options['num_training']} steps)", flush=True)
    else:
        size = tuner.scale_batch_size(model, train_dataloaders, datamodule=datamodule, **options)
        if trainer.global_rank == 0:
            print(f"{'batch size':>10}  result")
            for value, fitted in tuner.trials:
                print(f"{value:>10}  {'fits' if fitted else 'out of memory'}")
            print(f"hookloop tune batch-size: batch size {size!r}", flush=True)
    raise SystemExit(0)


def _lr_attr_name(model: Any, attr_name: str) -> str:
    if attr_name:
        if not _getattr(model, attr_name)[0]:
            raise MissingAttributeError(
                f"The attribute name for the learning rate was set to {attr_name}, but could not find this as "
                f"a field in `model` or `model.hparams`.")
        return attr_name
    for name in ("lr", "learning_rate"):
        if _getattr(model, name)[0]:
            return name
    raise MissingAttributeError(
        "When using the learning rate finder, either `model` or `model.hparams` should have one of these "
        "fields: ('lr', 'learning_rate'). If your model has a different name for the learning rate, set it "
        "with `.lr_find(attr_name=...)`.")
