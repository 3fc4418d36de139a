"""Optimizers and LR schedulers: what ``configure_optimizers`` may return, when the loop
steps each scheduler, and the optimizers of manual optimization.

Public helpers for plugin authors: :func:`before_optimizer_step` (call it in your
``optimizer_step`` right before stepping), :class:`GradScaling` (backward and step
through a loss scaler), :func:`load_scheduler_states` and :func:`schedulers_of`.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from hookloop.contract.errors import AutomaticOptimizationError, CheckpointError, ConfigurationError
from hookloop.helpers import clip_gradients

_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name",
                   "reduce_on_plateau")
#: the lr_scheduler config keys manual optimization ignores (Lightning warns): the module steps
_MANUAL_IGNORED_KEYS = ("reduce_on_plateau", "monitor", "strict")


@dataclass
class SchedulerConfig:
    """One LR scheduler and when the loop steps it (Lightning's ``LRSchedulerConfig``,
    which is this class: configs compare equal field by field, as Lightning's).

    ``interval`` is ``"epoch"`` or ``"step"`` (optimizer steps); it steps every
    ``frequency`` intervals. ``ReduceLROnPlateau`` steps with the value of ``monitor``
    from ``trainer.callback_metrics``; when that metric was never logged it is an
    error (``strict``) or the step is skipped with a warning (``strict=False``).
    """

    scheduler: Any
    #: the config's name (the ``LearningRateMonitor`` key)
    name: str | None = None
    interval: str = "epoch"
    frequency: int = 1
    #: stepped with the monitored value (Lightning's key: also a custom scheduler);
    #: ``None``: whether it is a ``ReduceLROnPlateau``
    reduce_on_plateau: bool | None = None
    monitor: str | None = None
    strict: bool = True
    #: how the loop steps it: ``None`` calls ``scheduler.step()`` (``step(value)`` on a
    #: plateau); else ``step_with(scheduler, value or None)`` (the Lightning layer sets
    #: the module's ``lr_scheduler_step`` here)
    step_with: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.reduce_on_plateau is None:
            self.reduce_on_plateau = isinstance(self.scheduler,
                                                torch.optim.lr_scheduler.ReduceLROnPlateau)


class NoOptimizer(torch.optim.Optimizer):
    """What a fit runs with when ``configure_optimizers`` returns ``None`` (Lightning's
    ``_MockOptimizer``): its ``step`` and ``zero_grad`` do nothing, so the module trains
    (forward and backward) without its weights changing."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(1)], {})

    def step(self, closure: Any = None) -> Any:
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def parse_optimizers(result: Any, owner: str, automatic: bool,
                     custom_step: bool = False) -> tuple[list, list[SchedulerConfig]]:
    """What Lightning users return from ``configure_optimizers``, as (optimizers, schedulers).

    An optimizer; a list/tuple of optimizers; ``([optimizers], [schedulers or configs])``;
    ``{"optimizer": ..., "lr_scheduler": scheduler or config, "monitor": ...}``; a
    list/tuple of such dicts; or ``None`` (warned, as Lightning: the fit runs with a
    :class:`NoOptimizer`). Several optimizers need manual optimization, as in Lightning 2.
    ``custom_step``: the module steps the schedulers itself (Lightning's
    ``lr_scheduler_step``), so a scheduler needs no ``step()``.
    """
    optimizers: list = []
    configs: list[SchedulerConfig] = []
    if result is None:
        warnings.warn(f"`{owner}.configure_optimizers` returned `None`, this fit will run with "
                      "no optimizer", UserWarning, stacklevel=3)
        return [NoOptimizer()], []
    Optimizer = torch.optim.Optimizer
    pair = isinstance(result, (list, tuple)) and len(result) == 2
    if isinstance(result, Optimizer):
        optimizers = [result]
    elif isinstance(result, dict):
        optimizers, configs = _from_dict(result, owner, automatic, custom_step)
    elif isinstance(result, (list, tuple)) and result and all(isinstance(r, dict) for r in result):
        for item in result:
            opts, confs = _from_dict(item, owner, automatic, custom_step)
            optimizers += opts
            configs += confs
    elif pair and isinstance(result[0], (list, tuple)):
        optimizers = list(result[0])
        schedulers = result[1] if isinstance(result[1], (list, tuple)) else [result[1]]
        configs = [_scheduler_config(s, owner, automatic, custom_step)
                   for s in schedulers if s is not None]
    elif pair and isinstance(result[0], Optimizer) and not isinstance(result[1], Optimizer):
        # (optimizer, scheduler): hookloop accepted it before Lightning's forms; kept.
        optimizers = [result[0]]
        configs = ([_scheduler_config(result[1], owner, automatic, custom_step)]
                   if result[1] is not None else [])
    elif isinstance(result, (list, tuple)):
        optimizers = list(result)
    bad = [type(o).__name__ for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
    if not optimizers or bad:
        raise ConfigurationError(
            f"Unknown configuration for model optimizers: {owner}.configure_optimizers must "
            f"return an optimizer, a list of optimizers, ([optimizers], [schedulers]), "
            f"{{'optimizer': ..., 'lr_scheduler': ...}} or a list of such dicts; got "
            f"{type(result).__name__}{' holding ' + ', '.join(bad) if bad else ''}"
        )
    if automatic and len(optimizers) > 1:
        raise AutomaticOptimizationError(
            f"Training with multiple optimizers is only supported with manual optimization: "
            f"{owner}.configure_optimizers returned {len(optimizers)} optimizers. Set "
            f"self.automatic_optimization = False in __init__ and step them in training_step "
            f"(opt_g, opt_d = self.optimizers(); self.manual_backward(loss); opt_g.step() ...)."
        )
    for config in configs:
        driven = getattr(config.scheduler, "optimizer", None)
        if driven is not None and not any(driven is o for o in optimizers):
            raise ConfigurationError(
                f"Some schedulers are attached with an optimizer that wasn't returned from "
                f"`configure_optimizers`: {owner}.configure_optimizers returned the scheduler "
                f"{type(config.scheduler).__name__}, whose optimizer is not among the optimizers "
                f"it returned; return that optimizer too, or build the scheduler on one returned"
            )
    return optimizers, configs


def _from_dict(result: dict, owner: str, automatic: bool,
               custom_step: bool) -> tuple[list, list[SchedulerConfig]]:
    unknown = set(result) - {"optimizer", "lr_scheduler", "monitor", "frequency"}
    if unknown:  # Lightning warns and ignores them
        known = ("optimizer", "lr_scheduler", "monitor")
        warnings.warn(_unknown_keys(owner, unknown, known, what="the optimizer configuration")
                      + ": they are ignored", RuntimeWarning, stacklevel=4)
    if "frequency" in result:
        raise ConfigurationError(
            f"{owner}.configure_optimizers: an optimizer 'frequency' alternates optimizers under "
            f"automatic optimization (Lightning 1.x), which hookloop does not do: use manual "
            f"optimization and step each optimizer when you want to"
        )
    optimizer = result.get("optimizer")
    scheduler = result.get("lr_scheduler")
    configs = []
    if scheduler is not None:
        configs.append(_scheduler_config(scheduler, owner, automatic, custom_step,
                                         monitor=result.get("monitor")))
    return [optimizer], configs


def _scheduler_config(scheduler: Any, owner: str, automatic: bool, custom_step: bool,
                      monitor: str | None = None) -> SchedulerConfig:
    """``monitor``: the dict's top-level ``monitor``, used unless the config names one.

    As Lightning's: unknown keys of a config are warned about and ignored (automatic
    optimization; manual: refused); under manual optimization the module steps its
    schedulers, so ``reduce_on_plateau``, ``monitor`` and ``strict`` are ignored (warned)
    and a scheduler needs no ``step()`` and no metric to monitor."""
    if isinstance(scheduler, dict):
        what = "the lr scheduler dict"
        unknown = set(scheduler) - set(_SCHEDULER_KEYS)
        if unknown and not automatic:
            raise ConfigurationError(_unknown_keys(owner, unknown, _SCHEDULER_KEYS, what=what))
        if unknown:
            warnings.warn(_unknown_keys(owner, unknown, _SCHEDULER_KEYS, what=what)
                          + ": they are ignored", RuntimeWarning, stacklevel=4)
        ignored = [] if automatic else [k for k in _MANUAL_IGNORED_KEYS if k in scheduler]
        if ignored:
            warnings.warn(
                f"The lr scheduler dict contains the key(s) {ignored}, but the keys will be "
                f"ignored. You need to call `lr_scheduler.step()` manually in manual optimization "
                f"({owner}.configure_optimizers; under manual optimization training_step steps "
                "the schedulers)", RuntimeWarning, stacklevel=4)
        if "scheduler" not in scheduler:
            raise ConfigurationError(
                f'The lr scheduler dict must have the key "scheduler" with its item being an lr '
                f"scheduler: {owner}.configure_optimizers returned an lr_scheduler config without "
                "one ({'scheduler': scheduler, 'interval': 'epoch', ...})")
        given = {k: v for k, v in scheduler.items() if k in _SCHEDULER_KEYS and k not in ignored}
        config = SchedulerConfig(**given)
    else:
        config = SchedulerConfig(scheduler)
    if not automatic:  # Lightning's: the module steps it, with whatever it needs
        config.reduce_on_plateau = False
    if config.monitor is None and automatic:
        config.monitor = monitor
    return _checked(config, owner, automatic, custom_step)


def _checked(config: SchedulerConfig, owner: str, automatic: bool,
             custom_step: bool) -> SchedulerConfig:
    scheduler = config.scheduler
    if not (callable(getattr(scheduler, "state_dict", None))
            and callable(getattr(scheduler, "load_state_dict", None))):
        raise ConfigurationError(
            f"The provided lr scheduler `{type(scheduler).__name__}` is invalid. It should have "
            f"`state_dict` and `load_state_dict` methods defined ({owner}.configure_optimizers): "
            "checkpoints save and restore it with them; define both (as torch's LR schedulers do)")
    if not automatic:
        return config  # the module steps it (Lightning checks nothing more)
    torch_api = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if not custom_step and not isinstance(scheduler, torch_api):
        raise ConfigurationError(
            f"The provided lr scheduler `{type(scheduler).__name__}` doesn't follow PyTorch's "
            f"LRScheduler API (it is not a torch.optim.lr_scheduler.LRScheduler). "
            f"{owner}.configure_optimizers returned it under automatic optimization, where the "
            "loop steps it: override the `LightningModule.lr_scheduler_step` hook with your own "
            "logic to step it, or subclass LRScheduler")
    if config.interval not in ("epoch", "step"):
        raise ConfigurationError(
            f'The "interval" key in lr scheduler dict must be "step" or "epoch" but is '
            f'"{config.interval}" ({owner}.configure_optimizers)')
    frequency = config.frequency
    if not isinstance(frequency, int) or isinstance(frequency, bool) or frequency < 1:
        raise ConfigurationError(
            f"lr_scheduler frequency={config.frequency!r} must be an integer >= 1")
    if config.reduce_on_plateau and not config.monitor:
        raise ConfigurationError(
            f"`configure_optimizers` must include a monitor when a `ReduceLROnPlateau` scheduler "
            f"is used: {owner}.configure_optimizers returned one without the metric it "
            "monitors. Return {'optimizer': optimizer, 'lr_scheduler': scheduler, "
            "'monitor': 'val_loss'} (or 'monitor' inside the lr_scheduler config)"
        )
    if (isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR)
            and config.interval == "epoch"):
        warnings.warn(
            "A `OneCycleLR` scheduler is using 'interval': 'epoch'. Are you sure you didn't "
            f"mean 'interval': 'step'? ({owner}.configure_optimizers: OneCycleLR's schedule is "
            "usually counted in optimizer steps)", RuntimeWarning, stacklevel=5)
    return config


def _unknown_keys(owner: str, unknown: set, known: tuple, what: str) -> str:
    """Lightning's wording (``Found unsupported keys in WHAT: {...}``), with close matches."""
    keys = sorted(map(str, unknown))
    close = [f"{key!r} (did you mean {match[0]!r}?)" for key in keys
             if (match := difflib.get_close_matches(key, known, n=1))]
    hint = f": {', '.join(close)}" if close else ""
    return (f"Found unsupported keys in {what}: {{{', '.join(map(repr, keys))}}} "
            f"({owner}.configure_optimizers{hint}; known: {', '.join(known)})")


def step_schedulers(trainer: Any, interval: str, plateau: bool, count: int) -> None:
    """Step the ``interval`` schedulers (plateau ones or the others) due at ``count``
    (epochs completed, or optimizer steps taken)."""
    for config in trainer.lr_scheduler_configs:
        if (config.interval != interval or config.reduce_on_plateau != plateau
                or count % config.frequency):
            continue
        if not plateau:
            if config.step_with is None:
                config.scheduler.step()
            else:
                config.step_with(config.scheduler, None)
            continue
        value = trainer.callback_metrics.get(config.monitor)
        if value is None:
            if config.strict:
                raise ConfigurationError(
                    f"ReduceLROnPlateau conditioned on metric {config.monitor} which is not "
                    f"available. Available metrics are: {list(trainer.callback_metrics)}. "
                    f"Log it with self.log({config.monitor!r}, value), or monitor one of those "
                    "('monitor' in configure_optimizers), or set 'strict': False in the "
                    "lr_scheduler config to skip the step when it is missing."
                )
            if trainer.is_global_zero:  # as Lightning: a warning at every skipped step
                warnings.warn(
                    f"ReduceLROnPlateau conditioned on metric {config.monitor} which is not "
                    "available but strict is set to `False`. Skipping learning rate update.",
                    RuntimeWarning, stacklevel=2)
            continue
        if config.step_with is None:
            config.scheduler.step(value)
        else:
            config.step_with(config.scheduler, value)


def schedulers_of(trainer: Any, optimizer: Any) -> list:
    """The schedulers from ``configure_optimizers`` that drive ``optimizer``.

    For strategies that replace an optimizer (``wrap_optimizer``): re-point these at
    the replacement with :func:`hookloop.repoint_lr_scheduler`.
    """
    return [c.scheduler for c in trainer.lr_scheduler_configs
            if getattr(c.scheduler, "optimizer", None) is optimizer]


def before_optimizer_step(trainer: Any, optimizer: Any, clip: bool = True) -> None:
    """Call in ``optimizer_step`` after unscaling/synchronising and right before stepping.

    Fires :func:`hookloop.contract.hookspecs.on_before_optimizer_step` (when anyone listens) and
    clips the gradients: as ``gradient_clip_val`` says, or as the module asked for this
    optimizer with ``self.clip_gradients(...)`` under manual optimization. A strategy
    whose backend clips by itself (DeepSpeed) passes ``clip=False``.
    """
    event = trainer.state.on_before_optimizer_step
    if event is not None:
        event(trainer=trainer, optimizer=optimizer)
    if not clip:
        if custom_clipping(trainer.module):
            raise ConfigurationError(
                f"{type(trainer.module).__name__}.configure_gradient_clipping is not called: the "
                "strategy clips the gradients itself. Remove the override and set "
                "Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)")
        return
    requests = trainer.state.clip_requests
    request = requests.pop(id(optimizer), None) if requests else None
    if request is not None:
        clip_gradients(trainer, optimizer, *request)
    elif custom_clipping(trainer.module) and trainer.automatic_optimization:
        _configure_gradient_clipping(trainer, optimizer)
    else:
        clip_gradients(trainer, optimizer)


def custom_clipping(module: Any) -> bool:
    """Whether ``module`` overrides Lightning's ``configure_gradient_clipping`` (hookloop's
    ``Module`` has it as a placeholder that clips as the Trainer says)."""
    method = getattr(type(module), "configure_gradient_clipping", None)
    return callable(method) and not getattr(method, "hookloop_placeholder", False)


def _configure_gradient_clipping(trainer: Any, optimizer: Any) -> None:
    """Lightning's: the module's ``configure_gradient_clipping(optimizer, gradient_clip_val,
    gradient_clip_algorithm)`` decides, every optimizer step of automatic optimization;
    ``self.clip_gradients(...)`` inside it clips at once (through the ``clip_gradients`` hook)."""
    state = trainer.state
    state.clipping_optimizer = optimizer
    try:
        trainer.module.configure_gradient_clipping(optimizer, trainer.gradient_clip_val,
                                                   trainer.config.gradient_clip_algorithm)
    finally:
        state.clipping_optimizer = None


class GradScaling:
    """Loss scaling for ``precision="16-mixed"``: backward of the scaled loss, and the
    optimizer step through the scaler, with skipped-step detection in one place.

    ``scaler`` is what the ``configure_grad_scaler`` hook returned (``torch.amp.GradScaler``
    or a shard-aware subclass). A precision plugin (hookloop-amp) or a strategy that owns
    precision (fsdp) keeps one and calls :meth:`backward` from its ``backward`` hook and
    :meth:`step` from its ``optimizer_step`` hook. ``skipped_steps`` counts the steps
    skipped because a gradient held inf/nan, in this run (or restored with the scaler).
    """

    def __init__(self, scaler: Any):
        self.scaler = scaler
        self.skipped_steps = 0
        # The scale before the next step: a fresh scaler answers without a device sync.
        self._last_scale = scaler.get_scale()

    def backward(self, trainer: Any, loss: torch.Tensor) -> bool:
        """Backpropagate the scaled loss with ``trainer.backward_kwargs``; returns True."""
        self.scaler.scale(loss).backward(**trainer.backward_kwargs)
        return True

    def step(self, trainer: Any, optimizer: Any) -> bool:
        """Unscale the gradients (clipping thresholds are in true units), call
        :func:`before_optimizer_step` (the event, then clipping), step unless a gradient
        holds inf/nan, update the scale; returns whether the step was taken.

        The scale drops exactly when inf/nan was found; ``scaler.step`` already waited for
        the device to decide, so reading the scale costs no extra synchronisation.
        """
        scaler = self.scaler
        scaler.unscale_(optimizer)
        before_optimizer_step(trainer, optimizer)
        scaler.step(optimizer)  # skips optimizer.step() when a gradient is inf/nan
        scaler.update()
        scale = scaler.get_scale()
        took_step = scale >= self._last_scale
        self._last_scale = scale
        if not took_step:
            self.skipped_steps += 1
        return took_step

    def load_state_dict(self, scaler_state: dict, skipped_steps: int | None = None) -> None:
        """Restore the scaler's state (``scaler.state_dict()`` of a checkpoint) and, when
        given, the count of skipped steps."""
        self.scaler.load_state_dict(scaler_state)
        if skipped_steps is not None:
            self.skipped_steps = int(skipped_steps)
        self._last_scale = self.scaler.get_scale()


def load_scheduler_states(trainer: Any, scheduler_states: list) -> None:
    """Restore the LR schedulers of ``configure_optimizers`` from a checkpoint's states
    (the second list of :func:`hookloop.optimizer_and_scheduler_states`), in order.

    ``CheckpointError`` when the checkpoint holds another number of schedulers than this
    run has: zipped, the extra ones would be dropped silently, or a schedule would be
    restored into another scheduler. Nothing happens when either side has none. For a
    strategy's ``load_model_state`` that restores the model and optimizers itself.
    """
    configs = trainer.lr_scheduler_configs
    if not configs or not scheduler_states:
        return
    if len(scheduler_states) != len(configs):
        raise CheckpointError(
            f"the checkpoint holds {len(scheduler_states)} LR scheduler(s) and "
            f"configure_optimizers returned {len(configs)}: resume with the schedulers it "
            f"was saved with"
        )
    for config, state in zip(configs, scheduler_states, strict=True):  # lengths checked above
        config.scheduler.load_state_dict(state)


class LoopOptimizer:
    """What ``self.optimizers()`` returns under manual optimization.

    ``step()`` and ``zero_grad()`` go through the ``optimizer_step`` and ``zero_grad``
    hooks, so AMP's scaler, Horovod's synchronisation and DeepSpeed's engine take part,
    and every ``step()`` counts in ``trainer.global_step``. Everything else
    (``param_groups``, ``state``, ``state_dict``...) is the optimizer's own.
    """

    def __init__(self, trainer: Any, optimizer: Any):
        self._trainer = trainer
        self.optimizer = optimizer

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        """Step once. A ``closure`` (Lightning's: it computes the loss and calls
        ``manual_backward``) runs first, once; its result is returned. Lightning passes
        extra keyword arguments on to the optimizer's ``step``; hookloop's step goes through
        the ``optimizer_step`` hook, which takes none, so they are refused."""
        if kwargs:
            raise ConfigurationError(
                f"optimizer.step({', '.join(f'{k}=...' for k in kwargs)}): hookloop's manual "
                f"optimizer step passes no keyword arguments to {type(self.optimizer).__name__}"
                ".step (docs/lightning.md). Set what they choose on the optimizer before the "
                "step (opt.param_groups[0]['lr'] = ...), or call opt.optimizer.step(...) "
                "yourself (outside the run's optimizer_step hooks: no AMP scaling or clipping)")
        result = closure() if closure is not None else None
        self._trainer._manual_optimizer_step(self.optimizer)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        trainer = self._trainer
        event = trainer.state.on_before_zero_grad
        if event is not None:
            event(trainer=trainer, optimizer=self.optimizer)
        trainer.hook.zero_grad(trainer=trainer, optimizer=self.optimizer, model=trainer.model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"LoopOptimizer({self.optimizer!r})"


def repoint_optimizers(optimizers: list, old_names: dict[int, str], model: torch.nn.Module,
                       owner: str) -> None:
    """Point the optimizers of ``configure_optimizers`` at the parameters that replaced
    those they were built on (a strategy that shards or distributes the module's
    parameters: fsdp's ``fully_shard``, tp's ``parallelize_module``), in place: the same
    optimizer objects and ``param_groups``, so the schedulers keep driving them.

    ``old_names``: ``{id(parameter): name}`` of the module's parameters before they were
    replaced (``{id(p): n for n, p in module.named_parameters()}``); ``owner`` names the
    strategy in the errors. Raises ``ConfigurationError`` for an optimizer that already
    holds state or optimizes a tensor that is not a parameter of the module."""
    new = dict(model.named_parameters())
    for optimizer in optimizers:
        if any(optimizer.state.values()):
            raise ConfigurationError(
                f"{type(optimizer).__name__} from configure_optimizers already holds state; the "
                f"{owner} strategy replaces the parameters after configure_optimizers and cannot "
                "carry state over to them. Create the optimizer without state (load state with "
                "ckpt_path=...)")
        for group in optimizer.param_groups:
            replaced = []
            for p in group["params"]:
                name = old_names.get(id(p))
                if name is None or name not in new:
                    raise ConfigurationError(
                        f"{type(optimizer).__name__} from configure_optimizers optimizes a tensor "
                        f"that is not a parameter of the module ({tuple(p.shape)}): the {owner} "
                        "strategy replaces the module's parameters and re-points the optimizer at "
                        "them, so optimize self.parameters() (or some of them)")
                replaced.append(new[name])
            group["params"][:] = replaced  # in place: LBFGS-like optimizers keep a reference
        optimizer.state.clear()
