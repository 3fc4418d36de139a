"""One micro-batch: move, forward, backward, (unscale, clip,) optimizer step, zero-grad.

:class:`TrainStep` is built once per ``fit`` (:meth:`TrainStep.build`) and its
:meth:`TrainStep.run` is what the loop (:mod:`hookloop.engine.loop`) calls for each training
batch; automatic and manual optimization share its move, forward and step-end code. Read
top to bottom, ``run`` is one batch's journey from the loader to ``optimizer.step()``, as
nanoGPT's ``train.py`` reads: every hook it calls is a named field, called where it runs
(the hook callers come from :func:`hookloop.dispatch.event`; a hook nobody implements is a
``None`` field, not called; :data:`PLAIN_TORCH_DEFAULTS` names the three hooks that plain
torch replaces when only the built-in default implements them). The precision plugin
unscales and :func:`hookloop.engine.optim.before_optimizer_step` clips inside
``optimizer_step``.

:func:`make_evaluation_step` is the same for one validation, test or predict batch.
Also here: the step module that strategy wrappers wrap, the logging of step rows, and
manual optimization's ``self.optimizers()``/``manual_backward``.

Layer: above :mod:`hookloop.engine.state` and :mod:`hookloop.dispatch`; below the loop,
the session and the trainer.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookloop.contract.errors import ConfigurationError, HookSignatureError

# OBSERVER_CODES, observe_hook_calls, resolve_events: also hookloop.step's names of 0.10
from hookloop.dispatch import OBSERVER_CODES as OBSERVER_CODES
from hookloop.dispatch import event, only_default
from hookloop.dispatch import observe_hook_calls as observe_hook_calls
from hookloop.dispatch import resolve_events as resolve_events
from hookloop.engine.metrics import _STEP_BATCH
from hookloop.engine.optim import LoopOptimizer, custom_clipping, step_schedulers
from hookloop.helpers import apply_to_tensors, move_to_device

TRAIN, VALIDATE, TEST, PREDICT = "train", "validate", "test", "predict"
#: the user's step for each ``kind`` the step module is called with
STEP_METHODS = {TRAIN: "training_step", VALIDATE: "validation_step", TEST: "test_step",
                PREDICT: "predict_step"}
#: the prefix of each evaluation stage's events (``on_validation_start`` ...)
EVENT_PREFIX = {VALIDATE: "validation", TEST: "test", PREDICT: "predict"}


class _StepModule(nn.Module):
    """Routes ``forward(kind, batch, batch_idx, dataloader_idx=None)`` to the user's step.

    Strategy wrappers (DDP, DataParallel, DeepSpeed's engine) wrap this module, so their
    forward logic runs around every step exactly as it would around ``forward``.
    ``kind`` is ``"train"``, ``"validate"``, ``"test"`` or ``"predict"``.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module: Any = module
        #: the kinds whose step takes only the batch (Lightning passes what the signature takes)
        self.batch_only = frozenset(
            kind for kind, name in STEP_METHODS.items()
            if callable(getattr(module, name, None)) and not takes_batch_idx(getattr(module, name)))

    def forward(self, kind: str, batch: Any, batch_idx: int,
                dataloader_idx: int | None = None) -> Any:
        # Per thread: a DataParallel replica logs with its own share of the batch.
        _STEP_BATCH.batch = batch
        try:
            if kind in self.batch_only:
                return getattr(self.module, STEP_METHODS[kind])(batch)
            if kind == TRAIN:
                return self.module.training_step(batch, batch_idx)
            step: Any = getattr(self.module, STEP_METHODS[kind], None)
            if kind == PREDICT and not callable(step):
                return self.module(batch)  # Lightning's default predict_step
            if dataloader_idx is None:
                return step(batch, batch_idx)
            return step(batch, batch_idx, dataloader_idx)
        finally:
            _STEP_BATCH.batch = None


# ---------------------------------------------------------------------------------------
# Rows for the loggers
# ---------------------------------------------------------------------------------------


_CURRENT_EPOCH = object()


def stop_requested(trainer) -> bool:
    """Whether ``trainer.should_stop`` ends training now: once ``min_epochs`` epochs and
    ``min_steps`` optimizer steps are done (Lightning's ``_can_stop_early``; ``min_steps``
    alone makes ``min_epochs`` 1, as Lightning's ``_parse_loop_limits``). Until then
    training goes on with ``should_stop`` left set."""
    if not trainer.should_stop:
        return False
    config = trainer.config
    # current_epoch: the epochs whose batches are done (Lightning's "processed" count)
    if trainer.min_epochs and trainer.current_epoch < trainer.min_epochs:
        return False
    return not (config.min_steps and trainer.global_step < config.min_steps)


def log_row(trainer, metrics: dict, step: int | None = None, epoch: Any = _CURRENT_EPOCH) -> None:
    """Hand a row of metrics to the loggers (``on_log_metrics``), without the ones logged
    with ``logger=False``. Nothing happens when no logger is enabled."""
    event = trainer.state.on_log_metrics
    if event is None or not metrics:
        return
    hidden = trainer.state.metrics.not_for_logger
    row = {k: float(v) for k, v in metrics.items() if k not in hidden}
    if row:
        trainer.state.logged_metrics.update(row)
        event(trainer=trainer, metrics=row, step=trainer.global_step if step is None else step,
              epoch=trainer.current_epoch if epoch is _CURRENT_EPOCH else epoch)


def log_epoch_row(trainer, extra: dict | None = None) -> None:
    """The training epoch's row for the loggers, with ``extra`` (what the module logged in
    its ``on_train_epoch_end``)."""
    row = trainer.state.epoch_row
    trainer.state.epoch_row = None
    if row is not None:
        log_row(trainer, epoch_row_values(trainer, {**row, **(extra or {})}))


def epoch_row_values(trainer, row: dict) -> dict:
    """What of the training epoch's ``row`` goes to the loggers: a step metric was logged
    at its steps, a forked one goes as name_epoch."""
    metrics = trainer.state.metrics
    return {k: v for k, v in row.items()
            if k not in metrics.step_values and k not in metrics.forked}


def _log_step_metrics(trainer) -> None:
    """The step metrics, every ``log_every_n_steps`` optimizer steps (reads the device).
    A name logged with both ``on_step`` and ``on_epoch`` goes to the loggers as
    ``name_step`` only (its plain name is in ``callback_metrics``), as in Lightning."""
    m = trainer.state.metrics
    values = m.latest_step_values()
    m.callback_metrics.update(values)
    log_row(trainer, {k: v for k, v in values.items() if k not in m.forked} if m.forked else values)


# ---------------------------------------------------------------------------------------
# The user's step, as the loop calls it
# ---------------------------------------------------------------------------------------


def takes_batch_idx(method: Any) -> bool:
    """Whether a step method takes ``batch_idx`` (Lightning's rule: a parameter of that
    name, ``*args``, or at least two parameters); ``step(self, batch)`` gets the batch only."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return (any(p.name == "batch_idx" for p in params) or len(positional) >= 2
            or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params))


def _accepts_dataloader_idx(method: Any) -> bool:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return "dataloader_idx" in params or any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())


def _forward(trainer, kind: str, n_loaders: int = 1):
    """The call that runs the user's step for ``kind``: directly when no strategy wrapped
    the step module, else through the wrapper (so DDP/DP/DeepSpeed see it)."""
    model, module = trainer.model, trainer.module
    name = STEP_METHODS[kind]
    method: Any = getattr(module, name, None)
    # Lightning passes dataloader_idx only when there are several loaders: a single loader's
    # step(self, *args) gets (batch, batch_idx), as BoringModel's validation_step expects.
    # (_check_dataloader_idx refused a step that cannot take it, before the run)
    with_idx = (kind != TRAIN and n_loaders > 1 and callable(method)
                and _accepts_dataloader_idx(method))
    batch_only = callable(method) and not takes_batch_idx(method)
    if kind == TRAIN:
        # The per-step call: training_step itself when no strategy wrapped the module.
        if isinstance(model, _StepModule):
            return (lambda batch, batch_idx: method(batch)) if batch_only else method
        return lambda batch, batch_idx: model(TRAIN, batch, batch_idx)
    if isinstance(model, _StepModule):
        if kind == PREDICT and not callable(method):
            return lambda batch, batch_idx, dataloader_idx: module(batch)
        if batch_only:
            return lambda batch, batch_idx, dataloader_idx: method(batch)
        if with_idx:
            return method
        return lambda batch, batch_idx, dataloader_idx: method(batch, batch_idx)
    if with_idx:
        return lambda batch, batch_idx, dataloader_idx: model(kind, batch, batch_idx,
                                                              dataloader_idx)
    return lambda batch, batch_idx, dataloader_idx: model(kind, batch, batch_idx)


def _enter(contexts: list) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for context in contexts:
        stack.enter_context(context)
    return stack


# ---------------------------------------------------------------------------------------
# The training step
# ---------------------------------------------------------------------------------------


#: The step's hooks that one plain torch call replaces when the built-in
#: ``hookloop.defaults`` is their only implementation and nothing its implementation also
#: does is asked for: a run without plugins then costs what a hand-written loop costs
#: (benchmarks/loop_overhead.py; docs/decisions.md). Such a call is not a hook call:
#: :func:`hookloop.dispatch.observe_hook_calls` does not see it.
PLAIN_TORCH_DEFAULTS: dict[str, str] = {
    "backward": "loss.backward(): the default's backward_kwargs are empty on the automatic path",
    "optimizer_step": "optimizer.step(): when there is no gradient clipping (gradient_clip_val, "
                      "configure_gradient_clipping) and nobody implements on_before_optimizer_step",
    "zero_grad": "optimizer.zero_grad(set_to_none=True)",
}


@dataclass(slots=True, eq=False)
class TrainStep:
    """One training micro-batch, read top to bottom in :meth:`run`; built once per ``fit``
    (:meth:`build`) with everything that can be decided before the first step decided.

    Every hook the step calls is a field: a caller resolved by :func:`hookloop.dispatch.event`
    (``None`` when nobody implements the hook), or for ``backward``, ``optimizer_step`` and
    ``zero_grad`` a function of the loss or of nothing (plain torch where
    :data:`PLAIN_TORCH_DEFAULTS` says so, else the hook). Under manual optimization
    (``automatic_optimization = False``) the user's ``training_step`` does the backward and
    the optimizer steps itself (:func:`manual_backward`, :func:`manual_optimizer_step`);
    the step only moves the batch, runs it and ends it as the automatic step does.
    """

    trainer: Any
    model: nn.Module  # the step module, as the strategy wrapped it
    forward: Callable[[Any, int], Any]  # the user's training_step (through the wrapper)
    forward_contexts: list  # forward_context's context managers, around every forward
    manual: bool
    accumulate: int  # accumulate_grad_batches, read again at each epoch's start
    device: torch.device
    move: bool  # the batch goes to the device
    max_steps: int | None
    log_rows: bool  # somebody implements on_log_metrics
    log_every_n_steps: int
    step_schedules: bool  # a scheduler steps every optimizer step
    epoch_schedules: bool  # a scheduler steps after the epoch's last batch
    training_step_end: Callable[[Any], Any] | None  # the module's (Lightning's)
    on_training_step_end: Callable[..., list] | None  # the plugins' training_step_end
    on_before_zero_grad: Callable[..., list] | None
    on_before_backward: Callable[..., list] | None
    on_after_backward: Callable[..., list] | None
    on_train_batch_end: Callable[..., list] | None
    accumulation_context: Callable[..., Any] | None
    zero_grad: Callable[[], Any] | None
    backward: Callable[[torch.Tensor], Any] | None
    optimizer_step: Callable[[], Any] | None
    optimizer: Any

    @classmethod
    def build(cls, trainer: Any) -> TrainStep:
        """The step of this ``fit``: its hooks resolved, its settings read."""
        state, config = trainer.state, trainer.config
        manual = not trainer.automatic_optimization
        optimizer = None if manual else trainer.optimizers[0]
        before_backward = event(trainer, "on_before_backward")
        after_backward = event(trainer, "on_after_backward")
        configs = [] if manual else trainer.lr_scheduler_configs
        if manual:
            state.backward_events = (before_backward, after_backward)  # for manual_backward
            zero_grad = backward = optimizer_step = None
        else:
            zero_grad, backward, optimizer_step = _optimization_calls(trainer, optimizer)
        return cls(
            trainer=trainer, model=trainer.model, forward=_forward(trainer, TRAIN),
            forward_contexts=[c for c in trainer.hook.forward_context(trainer=trainer)
                              if c is not None],
            manual=manual, accumulate=trainer.accumulate_grad_batches,
            device=trainer.root_device, move=trainer.root_device.type != "cpu",
            max_steps=config.max_steps, log_rows=state.on_log_metrics is not None,
            log_every_n_steps=config.log_every_n_steps,
            step_schedules=any(c.interval == "step" and not c.reduce_on_plateau for c in configs),
            epoch_schedules=any(c.interval == "epoch" and not c.reduce_on_plateau for c in configs),
            training_step_end=getattr(trainer.module, "training_step_end", None),
            on_training_step_end=event(trainer, "training_step_end"),
            on_before_zero_grad=state.on_before_zero_grad,
            on_before_backward=before_backward, on_after_backward=after_backward,
            on_train_batch_end=event(trainer, "on_train_batch_end"),
            accumulation_context=None if manual else event(trainer, "accumulation_context"),
            zero_grad=zero_grad, backward=backward, optimizer_step=optimizer_step,
            optimizer=optimizer,
        )

    def run(self, batch: Any, batch_idx: int, boundary: bool, is_last: bool = False) -> bool:
        """One micro-batch: (at a window's first micro-batch) zero_grad, forward, backward,
        and at a window's end (``boundary``) the optimizer step and the schedulers due
        then. Returns True when training should stop.

        As in Lightning: gradients are zeroed at each window's first micro-batch
        (``batch_idx % accumulate == 0``), before its backward (here before its forward
        too: a pipeline strategy runs the backward inside it), so they stay readable in
        ``on_train_batch_end`` and a window cut short by the epoch's end is dropped;
        step-interval schedulers count the epoch's batches (``batch_idx + 1``); epoch-interval
        ones step after the epoch's last batch, before ``on_train_batch_end`` and validation.
        """
        trainer, state = self.trainer, self.trainer.state
        if self.move:
            batch = move_to_device(batch, self.device)
        state.current_batch = batch  # for self.log's batch size, computed only if asked
        state.metrics.step_token += 1
        sync = None
        if not self.manual:
            if batch_idx % self.accumulate == 0:
                if self.on_before_zero_grad is not None:
                    self.on_before_zero_grad(trainer=trainer, optimizer=self.optimizer)
                self.zero_grad()  # type: ignore[misc]
            if not boundary and self.accumulate != 1:  # no gradient sync inside a window
                context = self.accumulation_context
                sync = context(trainer=trainer, model=self.model)  # type: ignore[misc]
                if sync is not None:
                    sync.__enter__()
        try:
            if self.forward_contexts:
                with _enter(self.forward_contexts):
                    out = self.forward(batch, batch_idx)
            else:
                out = self.forward(batch, batch_idx)
            if self.training_step_end is not None:
                out = self.training_step_end(out)
            if self.on_training_step_end is not None:
                out = _step_end(self.on_training_step_end, trainer, out)
            if self.manual:
                loss: Any = _manual_loss(out)  # training_step did its backward and steps itself
            else:
                loss = out if type(out) is torch.Tensor else _loss_from(out, trainer)
                if loss is not None:  # None: Lightning skips the batch's backward (_loss_from)
                    if loss.ndim != 0:
                        raise TypeError(
                            f"training_step must return a scalar loss tensor (or a dict with a "
                            f"'loss' entry), got a tensor of shape {tuple(loss.shape)}: reduce "
                            f"it, e.g. with .mean()")
                    scaled = loss / self.accumulate if self.accumulate > 1 else loss
                    if self.on_before_backward is not None:
                        self.on_before_backward(trainer=trainer, loss=scaled)
                    self.backward(scaled)  # type: ignore[misc]
                    if self.on_after_backward is not None:
                        self.on_after_backward(trainer=trainer)
        finally:
            if sync is not None:
                sync.__exit__(None, None, None)
        stop = logged = False
        if self.manual:
            # the module stepped its optimizers (each step counted in global_step)
            every = self.log_every_n_steps
            logged = trainer.step_row_pending = (
                self.log_rows and trainer.global_step // every > state.logged_step // every)
        elif boundary:
            self.optimizer_step()  # type: ignore[misc]
            trainer.global_step += 1
            if self.step_schedules:
                step_schedulers(trainer, "step", plateau=False, count=batch_idx + 1)
            if is_last and self.epoch_schedules:
                step_schedulers(trainer, "epoch", plateau=False, count=trainer.current_epoch + 1)
            logged = trainer.step_row_pending = (
                self.log_rows and trainer.global_step % self.log_every_n_steps == 0)
            stop = self.max_steps is not None and trainer.global_step >= self.max_steps
        # The loop's position after the batch, set before on_train_batch_end: a checkpoint
        # written there resumes at the next batch.
        trainer.batch_idx = batch_idx + 1
        state.loop_stage = "train"
        state.total_batch_idx += 1
        if self.on_train_batch_end is not None:
            detached = loss if self.manual or loss is None else loss.detach()  # manual: detached
            outputs = detached if out is loss else apply_to_tensors(out, torch.Tensor.detach)
            self.on_train_batch_end(trainer=trainer, outputs=outputs, loss=detached, batch=batch,
                                    batch_idx=batch_idx)
        if logged:  # after on_train_batch_end, so what is logged there is in the row (Lightning)
            trainer.step_row_pending = False
            if self.manual:
                state.logged_step = trainer.global_step
            _log_step_metrics(trainer)
        if self.manual:
            stop = self.max_steps is not None and trainer.global_step >= self.max_steps
        # should_stop set by a plugin at this batch's end stops here (as in Lightning),
        # once min_epochs/min_steps are met.
        return stop or (trainer.should_stop and stop_requested(trainer))  # no call per batch

    def skip(self, batch_idx: int, boundary: bool, is_last: bool) -> bool:
        """A batch the loader yielded as ``None``, skipped as Lightning skips it (with its
        warning): no ``on_train_batch_start``, ``training_step``, zero_grad or optimizer
        step (``global_step`` stays); the schedulers due at this batch step all the same,
        the batch counts as done and ``on_train_batch_end`` sees ``outputs=None``,
        ``batch=None``. Returns True when training should stop."""
        warnings.warn("train_dataloader yielded None. If this was on purpose, ignore this "
                      "warning...", stacklevel=3)
        trainer, state = self.trainer, self.trainer.state
        if boundary and self.step_schedules:
            step_schedulers(trainer, "step", plateau=False, count=batch_idx + 1)
        if is_last and self.epoch_schedules:
            step_schedulers(trainer, "epoch", plateau=False, count=trainer.current_epoch + 1)
        trainer.batch_idx = batch_idx + 1
        state.loop_stage = "train"
        state.total_batch_idx += 1
        if self.on_train_batch_end is not None:
            self.on_train_batch_end(trainer=trainer, outputs=None, loss=None, batch=None,
                                    batch_idx=batch_idx)
        return trainer.should_stop


def _optimization_calls(trainer: Any, optimizer: Any) -> tuple[Callable, Callable, Callable]:
    """``zero_grad()``, ``backward(loss)`` and ``optimizer_step()`` of the automatic step:
    plain torch where :data:`PLAIN_TORCH_DEFAULTS` says so, else the hook's caller."""
    model = trainer.model
    hook_zero_grad: Any = event(trainer, "zero_grad")  # hookloop.defaults implements all three
    hook_backward: Any = event(trainer, "backward")
    hook_step: Any = event(trainer, "optimizer_step")

    def zero_grad() -> None:
        hook_zero_grad(trainer=trainer, optimizer=optimizer, model=model)

    def backward(loss: torch.Tensor) -> None:
        hook_backward(trainer=trainer, loss=loss, model=model, optimizer=optimizer)

    def optimizer_step() -> None:
        hook_step(trainer=trainer, optimizer=optimizer, model=model)

    if only_default(trainer, "zero_grad"):
        zero_grad = functools.partial(optimizer.zero_grad, set_to_none=True)
    if only_default(trainer, "backward"):
        backward = torch.Tensor.backward
    if (only_default(trainer, "optimizer_step") and not trainer.gradient_clip_val
            and trainer.state.on_before_optimizer_step is None
            and not custom_clipping(trainer.module)):
        optimizer_step = optimizer.step
    return zero_grad, backward, optimizer_step


def _step_end(callers, trainer, out):
    for replaced in callers(trainer=trainer, outputs=out):
        if replaced is not None:
            out = replaced
    return out


def _loss_from(out: Any, trainer: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (not a tensor itself): a dict's
    ``loss``, or ``None`` when the step returned ``None``.

    As in Lightning, ``None`` skips the batch's backward (and ``on_before_backward``/
    ``on_after_backward``); the window's ``zero_grad`` and optimizer step still run, so a
    window whose every batch returned ``None`` steps without gradients (nothing changes)
    and ``global_step`` counts it.
    """
    if out is None:
        if trainer.world_size > 1:
            raise ConfigurationError(
                "training_step returned None under several processes: skipping a batch on one "
                "rank leaves the others waiting in the gradient all-reduce. Return a loss on "
                "every rank (e.g. loss * 0 for a batch to ignore)")
        # once per place, as Python shows a warning (Lightning's WarningCache: once)
        warnings.warn("`training_step` returned `None`. If this was on purpose, ignore this "
                      "warning... (the batch's backward is skipped, as in Lightning)", stacklevel=4)
        return None
    if isinstance(out, dict) and "loss" in out:
        out = out["loss"]
    if isinstance(out, torch.Tensor):
        return out
    raise TypeError(
        f"training_step must return the loss as a scalar tensor (or a dict with a 'loss' "
        f"entry), or None to skip the batch, got {type(out).__name__}: return e.g. "
        f"F.cross_entropy(logits, y)"
    )


def _manual_loss(out: Any) -> torch.Tensor | None:
    if isinstance(out, dict):
        out = out.get("loss")
    return out.detach() if isinstance(out, torch.Tensor) else None


# ---------------------------------------------------------------------------------------
# One evaluation batch (validate, test, predict)
# ---------------------------------------------------------------------------------------


_LOADER_ARGUMENT = {VALIDATE: "val", TEST: "test", PREDICT: "predict"}


def _check_dataloader_idx(module: Any, stage: str, n_loaders: int) -> None:
    """Lightning's check when an evaluation starts: with one loader, a step or batch hook
    whose ``dataloader_idx`` has no default (it is passed only with several loaders); with
    several, a step or batch hook that cannot take one (a parameter of that name, or
    ``*args``)."""
    prefix = EVENT_PREFIX[stage]
    names = (STEP_METHODS[stage], f"on_{prefix}_batch_start", f"on_{prefix}_batch_end")
    loader = f"{_LOADER_ARGUMENT[stage]}_dataloader"
    for name in names:
        method = getattr(module, name, None)
        if getattr(method, "hookloop_placeholder", False):
            continue  # the base class's do-nothing hook, not the user's
        try:
            params = inspect.signature(method).parameters if callable(method) else None
        except (TypeError, ValueError):
            params = None
        if params is None:
            continue
        where = f"`{type(module).__name__}.{name}()`"
        index = params.get("dataloader_idx")
        if n_loaders == 1 and index is not None and index.default is inspect.Parameter.empty:
            raise HookSignatureError(
                f"You provided only a single `{loader}`, but have included `dataloader_idx` in "
                f"{where}: it is passed only with several loaders. Either remove the argument or "
                f"give it a default value i.e. `dataloader_idx=0`.")
        if n_loaders > 1 and not _accepts_dataloader_idx(method):
            raise HookSignatureError(
                f"You provided multiple `{loader}`, but no `dataloader_idx` argument in {where}. "
                f"Try adding `dataloader_idx=0` to its signature.")


def make_evaluation_step(trainer, stage: str, n_loaders: int) -> Callable:
    """The function running one batch of ``stage`` (``"validate"``, ``"test"`` or
    ``"predict"``) over ``n_loaders`` loaders: move the batch, ``on_<stage>_batch_start``,
    the user's step (and its ``<step>_end``, not for predict), ``on_<stage>_batch_end``.
    It returns ``(batch, output)``, the batch as moved to the device. Gradients off, eval
    mode and the forward contexts are the caller's, around the whole run."""
    state = trainer.state
    prefix = EVENT_PREFIX[stage]
    _check_dataloader_idx(trainer.module, stage, n_loaders)
    batch_start = event(trainer, f"on_{prefix}_batch_start")
    batch_end = event(trainer, f"on_{prefix}_batch_end")
    step_end_user = (None if stage == PREDICT
                     else getattr(trainer.module, f"{STEP_METHODS[stage]}_end", None))
    forward = _forward(trainer, stage, n_loaders)
    device = trainer.root_device
    move = device.type != "cpu"

    def run(batch: Any, batch_idx: int, dataloader_idx: int) -> tuple[Any, Any]:
        if move:
            batch = move_to_device(batch, device)
        state.current_batch = batch
        if batch_start is not None:
            batch_start(trainer=trainer, batch=batch, batch_idx=batch_idx,
                        dataloader_idx=dataloader_idx)
        out = forward(batch, batch_idx, dataloader_idx)
        if step_end_user is not None:
            out = step_end_user(out)
        if batch_end is not None:
            batch_end(trainer=trainer, outputs=out, batch=batch, batch_idx=batch_idx,
                      dataloader_idx=dataloader_idx)
        return batch, out

    return run


# ---------------------------------------------------------------------------------------
# Manual optimization: what the module's self.optimizers() / manual_backward() call
# ---------------------------------------------------------------------------------------


def loop_optimizers(trainer) -> list[LoopOptimizer]:
    if trainer.automatic_optimization:
        raise ConfigurationError(
            "self.optimizers() is for manual optimization: set self.automatic_optimization = "
            "False in your module's __init__ (the loop steps the optimizer otherwise)"
        )
    cache = trainer.state.loop_optimizer_cache
    if cache is None or [o.optimizer for o in cache] != trainer.optimizers:
        cache = trainer.state.loop_optimizer_cache = [LoopOptimizer(trainer, o)
                                                      for o in trainer.optimizers]
    return cache


_BACKWARD_ARGS = ("gradient", "retain_graph", "create_graph", "inputs")


def manual_backward(trainer, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    if trainer.automatic_optimization:
        raise ConfigurationError(
            "self.manual_backward(loss) is for manual optimization: set "
            "self.automatic_optimization = False (the loop calls backward on the returned loss "
            "otherwise)"
        )
    # Resolved once per fit by TrainStep.build (as the automatic path's); resolved
    # here only when called outside fit's steps.
    events = trainer.state.backward_events
    before, after = events if events is not None else (event(trainer, "on_before_backward"),
                                                       event(trainer, "on_after_backward"))
    if before is not None:
        before(trainer=trainer, loss=loss)
    if args or kwargs:
        # Tensor.backward's arguments (Lightning passes them on to loss.backward)
        if len(args) > len(_BACKWARD_ARGS) or any(k not in _BACKWARD_ARGS for k in kwargs):
            raise TypeError(
                f"manual_backward(loss, *args, **kwargs) takes Tensor.backward's arguments "
                f"({', '.join(_BACKWARD_ARGS)}); got {len(args)} positional and {sorted(kwargs)}")
        trainer.backward_kwargs = {**dict(zip(_BACKWARD_ARGS, args, strict=False)), **kwargs}
    try:
        trainer.hook.backward(trainer=trainer, loss=loss, model=trainer.model, optimizer=None)
    finally:
        if args or kwargs:
            trainer.backward_kwargs = {}
    if after is not None:
        after(trainer=trainer)


def manual_optimizer_step(trainer, optimizer) -> None:
    trainer.hook.optimizer_step(trainer=trainer, optimizer=optimizer, model=trainer.model)
    trainer.global_step += 1
