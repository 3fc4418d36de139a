"""One micro-batch: move, forward, backward, (unscale, clip,) optimizer step, zero-grad.

:func:`make_training_step` builds, once per ``fit``, the function the loop
(:mod:`hookloop.loop`) calls for each training batch; automatic and manual optimization
share its move, forward and step-end code. Read top to bottom it is one batch's journey
from the loader to ``optimizer.step()``: what the loop does not spell out is a hook call
(``backward``, ``optimizer_step``, ``zero_grad``; the precision plugin unscales and
:func:`hookloop.engine.optim.before_optimizer_step` clips inside ``optimizer_step``), and every
hook call on this path is resolved once per run: one nobody implements is never called,
and where only the built-in default implements one, plain torch is called directly.

:func:`make_evaluation_step` is the same for one validation, test or predict batch.
Also here: the step module that strategy wrappers wrap, the events resolved once per run
(:func:`event`), the logging of step rows, and manual optimization's
``self.optimizers()``/``manual_backward``.

Layer: above :mod:`hookloop.state`; below the loop, the session and the trainer.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable

import torch
from torch import nn

from hookloop.contract.errors import ConfigurationError
from hookloop.helpers import apply_to_tensors, move_to_device
from hookloop.engine.metrics import _STEP_BATCH
from hookloop.engine.optim import LoopOptimizer, custom_clipping, step_schedulers

TRAIN, VALIDATE, TEST, PREDICT = "train", "validate", "test", "predict"
#: the user's step for each ``kind`` the step module is called with
STEP_METHODS = {TRAIN: "training_step", VALIDATE: "validation_step", TEST: "test_step", PREDICT: "predict_step"}
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
        self.module = module
        #: the kinds whose step takes only the batch (Lightning passes what the signature takes)
        self.batch_only = frozenset(kind for kind, name in STEP_METHODS.items()
                                    if callable(getattr(module, name, None)) and not takes_batch_idx(getattr(module, name)))

    def forward(self, kind: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None):
        # Per thread: a DataParallel replica logs with its own share of the batch.
        _STEP_BATCH.batch = batch
        try:
            if kind in self.batch_only:
                return getattr(self.module, STEP_METHODS[kind])(batch)
            if kind == TRAIN:
                return self.module.training_step(batch, batch_idx)
            step = getattr(self.module, STEP_METHODS[kind], None)
            if kind == PREDICT and not callable(step):
                return self.module(batch)  # Lightning's default predict_step
            if dataloader_idx is None:
                return step(batch, batch_idx)
            return step(batch, batch_idx, dataloader_idx)
        finally:
            _STEP_BATCH.batch = None


# ---------------------------------------------------------------------------------------
# Events, resolved once per run
# ---------------------------------------------------------------------------------------


try:
    from pluggy._callers import _multicall as _PLUGGY_MULTICALL
except ImportError:  # pragma: no cover - another pluggy: events always go through pluggy
    _PLUGGY_MULTICALL = None


def event(trainer, name: str) -> Callable | None:
    """A caller of event ``name`` (keyword arguments, a list of the non-None results, as
    pluggy's), or ``None`` when nobody implements it.

    Resolved once per epoch or evaluation run, it is what the per-step path calls. When
    the implementations are plain functions (no wrappers) and nobody monitors the hook
    calls with pluggy's ``add_hookcall_monitoring``, it calls them directly, in pluggy's
    order and with pluggy's arguments: a per-step event then costs one call per
    implementation instead of pluggy's dispatch (about ten calls). While
    :func:`observe_hook_calls` has an observer, such a caller goes through the observers
    (read at each call: an observer added or undone later is seen by callers resolved
    before it).
    """
    caller = getattr(trainer.hook, name)
    impls = caller.get_hookimpls()
    if not impls:
        return None
    pm = trainer.plugin_manager
    observers = _hook_observers(pm)
    if observers.impls:
        observers.wrap(name, impls)  # registered since the first implementation observer
    hookexec = observers.beneath()  # ours skipped: the direct caller observes as pluggy's dispatch would
    if (_PLUGGY_MULTICALL is None or hookexec is not _PLUGGY_MULTICALL
            or caller.spec is None or caller.spec.opts.get("firstresult")
            or any(impl.hookwrapper or impl.wrapper for impl in impls)):
        return caller
    return _direct_caller(name, caller.spec.argnames, list(reversed(impls)), observers)


def _direct_caller(name: str, argnames: tuple[str, ...], impls: list, observers: "_HookObservers") -> Callable:
    """``def call(*, <hook args>)`` calling each implementation with its own arguments
    (through ``observers`` while it has any: an attribute read, not a call, otherwise)."""
    namespace: dict[str, Any] = {"_observers": observers, "_impls": tuple(impls)}
    lines = [f"def {name}(*, {', '.join(argnames)}):",
             "    if _observers.on:",
             f"        return _observers.direct({name!r}, _impls, {{{', '.join(f'{a!r}: {a}' for a in argnames)}}})",
             "    out = []"]
    for i, impl in enumerate(impls):
        namespace[f"f{i}"] = observers.original(impl)
        lines += [f"    r = f{i}({', '.join(impl.argnames)})", "    if r is not None:", "        out.append(r)"]
    lines.append("    return out")
    exec("\n".join(lines), namespace)  # noqa: S102 - names from the hook specs and implementations
    return namespace[name]


# ---------------------------------------------------------------------------------------
# Observing hook calls
# ---------------------------------------------------------------------------------------


def observe_hook_calls(trainer, before: Callable | None = None, after: Callable | None = None, *,
                       before_impl: Callable | None = None, after_impl: Callable | None = None) -> Callable[[], None]:
    """Call back around every hook call of ``trainer``'s plugins, the step's resolved
    events (:func:`event`) included; returns ``undo()``.

    * ``before(hook_name, impls, kwargs)`` / ``after(hook_name, impls, kwargs)``: around
      each call of a hook, all its implementations (hook wrappers too) inside; ``impls``
      are pluggy's ``HookImpl``s of the call, ``kwargs`` its arguments (pluggy's
      ``add_hookcall_monitoring`` without the outcome);
    * ``before_impl(hook_name, impl)`` / ``after_impl(hook_name, impl)``: around each
      implementation that is a plain function (not a hook wrapper); ``impl.plugin`` and
      ``impl.plugin_name`` say whose it is.

    Any of the four may be ``None``. Observers compose: several at once are called in the
    order they were added (``after`` in reverse), and each ``undo`` removes its own, in
    any order (called twice, it does nothing). Every ``before`` gets its ``after``, also
    when the hook raises and when the observer is undone in between; an observer added
    during a call sees neither for that call. Implementations registered later (a
    plugin's per-batch half, in ``setup``) are observed from their first call. The loop's
    plain-torch shortcuts (``backward``, ``optimizer_step``, ``zero_grad`` when only
    ``hookloop.defaults`` implements them) are not hook calls and are not seen.

    While an observer is installed every per-step event pays the observers' dispatch;
    with none, the step path makes the same calls as without this helper (the resolved
    events read one attribute). :data:`OBSERVER_CODES` are the code objects of this
    machinery (a call counter, as the ``ledger``'s, leaves them out).
    """
    for callback in (before, after, before_impl, after_impl):
        if callback is not None and not callable(callback):
            raise ConfigurationError(f"observe_hook_calls: {callback!r} is not callable")
    return _hook_observers(trainer.plugin_manager).add(
        (before, after) if before or after else None, (before_impl, after_impl) if before_impl or after_impl else None)


def _noop(*_args) -> None:
    return None


class _HookObservers:
    """The observers of one plugin manager (``pm._hookloop_observers``)."""

    def __init__(self, pm):
        self.pm = pm
        self.on = False  # any observer: the direct callers' one read
        self.calls: tuple = ()  # (before, after) per call observer
        self.impls: tuple = ()  # (before_impl, after_impl) per implementation observer
        self.wrapped: dict[int, tuple] = {}  # id(impl): (impl, original function, wrapper)
        self.hookexec = None  # ours in the plugin manager's chain (pluggy's _inner_hookexec), while observed

    # -- adding and removing ---------------------------------------------------------------

    def add(self, calls, impls) -> Callable[[], None]:
        if calls is not None:
            calls = (calls[0] or _noop, calls[1] or _noop)
            self.calls += (calls,)
        if impls is not None:
            impls = (impls[0] or _noop, impls[1] or _noop)
            self.impls += (impls,)
        self.update()
        done = []

        def undo() -> None:
            if done:
                return
            done.append(True)
            if calls is not None:
                self.calls = tuple(o for o in self.calls if o is not calls)
            if impls is not None:
                self.impls = tuple(o for o in self.impls if o is not impls)
            self.update()

        return undo

    def update(self) -> None:
        pm = self.pm
        self.on = bool(self.calls or self.impls)
        if self.on and self.hookexec is None:
            inner = pm._inner_hookexec

            def observed_hookexec(hook_name, impls, kwargs, firstresult):
                if self.hookexec is observed_hookexec:
                    return self.dispatch(inner, hook_name, impls, kwargs, firstresult)
                return inner(hook_name, impls, kwargs, firstresult)  # retired, under another's monitor

            observed_hookexec._hookloop_inner = inner
            self.hookexec = pm._inner_hookexec = observed_hookexec
        elif not self.on and self.hookexec is not None:
            self.hookexec = None
        # ours, retired, on top (undone last-in-first-out, as pluggy's monitors) go
        while getattr(pm._inner_hookexec, "_hookloop_inner", None) is not None and pm._inner_hookexec is not self.hookexec:
            pm._inner_hookexec = pm._inner_hookexec._hookloop_inner
        if self.impls:
            for hook_name, caller in vars(pm.hook).items():
                get = getattr(caller, "get_hookimpls", None)
                if get is not None:
                    self.wrap(hook_name, get())
        else:
            for impl, original, wrapper in self.wrapped.values():
                if impl.function is wrapper:
                    impl.function = original
            self.wrapped = {}

    def original(self, impl) -> Callable:
        """``impl``'s function without our wrapper."""
        entry = self.wrapped.get(id(impl))
        return entry[1] if entry is not None and impl.function is entry[2] else impl.function

    def wrap(self, hook_name, impls) -> None:
        wrapped = self.wrapped
        for impl in impls:
            entry = wrapped.get(id(impl))
            if entry is not None and impl.function is entry[2] or impl.hookwrapper or impl.wrapper:
                continue
            function = impl.function
            wrapper = _observed_implementation(self, hook_name, impl, function)
            impl.function = wrapper
            wrapped[id(impl)] = (impl, function, wrapper)

    # -- calls -------------------------------------------------------------------------------

    def beneath(self) -> Callable:
        """The plugin manager's hookexec, ours (observing or retired) skipped."""
        hookexec = self.pm._inner_hookexec
        while getattr(hookexec, "_hookloop_inner", None) is not None:
            hookexec = hookexec._hookloop_inner
        return hookexec

    def dispatch(self, inner, hook_name, impls, kwargs, firstresult):
        """pluggy's hook calls (``pm._inner_hookexec``), ``inner`` the hookexec under ours."""
        if self.impls:
            self.wrap(hook_name, impls)
        observers = self.calls
        if not observers:
            return inner(hook_name, impls, kwargs, firstresult)
        for before, _ in observers:
            before(hook_name, impls, kwargs)
        try:
            return inner(hook_name, impls, kwargs, firstresult)
        finally:
            for _, after in reversed(observers):
                after(hook_name, impls, kwargs)

    def direct(self, hook_name, impls, kwargs):
        """A resolved event's call (:func:`event`; ``impls`` in call order), as pluggy's
        would be observed (the observers get ``impls`` in pluggy's order). Its
        implementations were wrapped when it was resolved or when the first
        implementation observer came."""
        observers = self.calls
        hookimpls = impls[::-1] if observers else impls
        for before, _ in observers:
            before(hook_name, hookimpls, kwargs)
        try:
            out = []
            for impl in impls:
                r = impl.function(*map(kwargs.__getitem__, impl.argnames))
                if r is not None:
                    out.append(r)
            return out
        finally:
            for _, after in reversed(observers):
                after(hook_name, hookimpls, kwargs)


def _observed_implementation(observers: _HookObservers, hook_name: str, impl, function) -> Callable:
    def observed(*args, **kwargs):
        around = observers.impls
        if not around:
            return function(*args, **kwargs)
        for before, _ in around:
            before(hook_name, impl)
        try:
            return function(*args, **kwargs)
        finally:
            for _, after in reversed(around):
                after(hook_name, impl)

    functools.update_wrapper(observed, function)  # its name and docstring (and __wrapped__)
    observed._hookloop_observed = observers
    return observed


def _hook_observers(pm) -> _HookObservers:
    observers = pm.__dict__.get("_hookloop_observers")
    if observers is None:
        observers = pm._hookloop_observers = _HookObservers(pm)
    return observers


def _codes(*functions) -> frozenset:
    found = set()
    todo = [f.__code__ for f in functions]
    while todo:
        code = todo.pop()
        found.add(code)
        todo += [c for c in code.co_consts if isinstance(c, type(code))]
    return frozenset(found)


#: The code objects of :func:`observe_hook_calls`' machinery (its wrappers and dispatch).
OBSERVER_CODES = _codes(_noop, _observed_implementation, *(f for f in vars(_HookObservers).values()
                                                          if hasattr(f, "__code__")))


def resolve_events(trainer) -> None:
    """The events read on the step path, resolved for this run (``trainer.state``)."""
    state = trainer.state
    # Read by public helpers on the step path (hookloop.before_optimizer_step).
    state.on_before_optimizer_step = event(trainer, "on_before_optimizer_step")
    state.on_before_zero_grad = event(trainer, "on_before_zero_grad")
    state.on_log_metrics = event(trainer, "on_log_metrics")
    state.module_epoch_end = next((impl for impl in trainer.hook.on_train_epoch_end.get_hookimpls()
                                   if impl.plugin_name.startswith("module:")), None)


# ---------------------------------------------------------------------------------------
# Rows for the loggers
# ---------------------------------------------------------------------------------------


_CURRENT_EPOCH = object()


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
    return {k: v for k, v in row.items() if k not in metrics.step_values and k not in metrics.forked}


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
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return (any(p.name == "batch_idx" for p in params) or len(positional) >= 2
            or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params))


def _accepts_dataloader_idx(method: Any) -> bool:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return "dataloader_idx" in params or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())


def _forward(trainer, kind: str, n_loaders: int = 1):
    """The call that runs the user's step for ``kind``: directly when no strategy wrapped
    the step module, else through the wrapper (so DDP/DP/DeepSpeed see it)."""
    model, module = trainer.model, trainer.module
    name = STEP_METHODS[kind]
    method = getattr(module, name, None)
    # Lightning passes dataloader_idx only when there are several loaders: a single loader's
    # step(self, *args) gets (batch, batch_idx), as BoringModel's validation_step expects.
    with_idx = kind != TRAIN and n_loaders > 1 and callable(method) and _accepts_dataloader_idx(method)
    if n_loaders > 1 and kind != PREDICT and not with_idx:
        raise ConfigurationError(
            f"{n_loaders} {kind} dataloaders were given, but {type(module).__name__}.{name}(batch, "
            f"batch_idx) does not take dataloader_idx: define {name}(self, batch, batch_idx, "
            f"dataloader_idx=0)"
        )
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
        return lambda batch, batch_idx, dataloader_idx: model(kind, batch, batch_idx, dataloader_idx)
    return lambda batch, batch_idx, dataloader_idx: model(kind, batch, batch_idx)


def _enter(contexts: list) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for context in contexts:
        stack.enter_context(context)
    return stack


# ---------------------------------------------------------------------------------------
# The training step
# ---------------------------------------------------------------------------------------


def make_training_step(trainer):
    """Build the per-micro-batch function once, with everything that can be decided
    before the first step decided. It returns True when training should stop.

    Under manual optimization (``automatic_optimization = False``) the user's
    ``training_step`` does the backward and the optimizer steps itself
    (:func:`manual_backward`, :func:`manual_optimizer_step`); the step only moves the
    batch, runs it and ends it as the automatic step does."""
    hook, model, module, state = trainer.hook, trainer.model, trainer.module, trainer.state
    metrics = state.metrics
    manual = not trainer.automatic_optimization
    contexts = [c for c in hook.forward_context(trainer=trainer) if c is not None]
    forward = _forward(trainer, TRAIN)
    step_end_user = getattr(module, "training_step_end", None)
    step_end_plugins = event(trainer, "training_step_end")
    before_backward = event(trainer, "on_before_backward")
    after_backward = event(trainer, "on_after_backward")
    batch_end = event(trainer, "on_train_batch_end")
    max_steps = trainer.config.max_steps
    device = trainer.root_device
    move = device.type != "cpu"
    log_rows = state.on_log_metrics is not None
    every = trainer.config.log_every_n_steps
    accumulate = trainer.accumulate_grad_batches
    if manual:
        state.backward_events = (before_backward, after_backward)  # for manual_backward
        backward = optimizer_step = zero_grad = accumulation_context = None
        step_schedules = epoch_schedules = False
    else:
        backward, optimizer_step, zero_grad = _step_functions(trainer, model, trainer.optimizers[0])
        accumulation_context = hook.accumulation_context
        configs = trainer.lr_scheduler_configs
        step_schedules = any(c.interval == "step" and not c.reduce_on_plateau for c in configs)
        epoch_schedules = any(c.interval == "epoch" and not c.reduce_on_plateau for c in configs)

    def step(batch, batch_idx: int, boundary: bool, is_last: bool = False) -> bool:
        """One micro-batch: (at a window's first micro-batch) zero_grad, forward, backward,
        and at a window's end the optimizer step and the schedulers due then.

        As in Lightning: gradients are zeroed at each window's first micro-batch
        (``batch_idx % accumulate_grad_batches == 0``), before its backward (here before
        its forward too: a pipeline strategy runs the backward inside it), so they stay readable
        in ``on_train_batch_end`` and a window cut short by the epoch's end is dropped;
        step-interval schedulers count the epoch's batches (``batch_idx + 1``); epoch-interval
        ones step after the epoch's last batch, before ``on_train_batch_end`` and validation."""
        if move:
            batch = move_to_device(batch, device)
        state.current_batch = batch  # for self.log's batch size, computed only if asked
        metrics.step_token += 1
        sync_ctx = None
        if not manual:
            if batch_idx % accumulate == 0:
                # before the forward: a strategy may run the backward inside it (a pipeline)
                zero_grad()
            if not boundary and accumulate != 1:
                sync_ctx = accumulation_context(trainer=trainer, model=model)
                if sync_ctx is not None:
                    sync_ctx.__enter__()
        try:
            if contexts:
                with _enter(contexts):
                    out = forward(batch, batch_idx)
            else:
                out = forward(batch, batch_idx)
            if step_end_user is not None:
                out = step_end_user(out)
            if step_end_plugins is not None:
                out = _step_end(step_end_plugins, trainer, out)
            if manual:
                loss = _manual_loss(out)  # training_step did its backward and steps itself
            else:
                loss = out if type(out) is torch.Tensor else _loss_from(out)
                if loss.ndim != 0:
                    raise TypeError(
                        f"training_step must return a scalar loss tensor (or a dict with a 'loss' "
                        f"entry), got a tensor of shape {tuple(loss.shape)}: reduce it, e.g. with .mean()"
                    )
                scaled = loss / accumulate if accumulate > 1 else loss
                if before_backward is not None:
                    before_backward(trainer=trainer, loss=scaled)
                backward(scaled)
                if after_backward is not None:
                    after_backward(trainer=trainer)
        finally:
            if sync_ctx is not None:
                sync_ctx.__exit__(None, None, None)
        stop = False
        logged = False
        if manual:
            # the module stepped its optimizers (each step counted in global_step)
            logged = trainer.step_row_pending = (
                log_rows and trainer.global_step // every > state.logged_step // every)
        elif boundary:
            optimizer_step()
            trainer.global_step += 1
            if step_schedules:
                step_schedulers(trainer, "step", plateau=False, count=batch_idx + 1)
            if is_last and epoch_schedules:
                step_schedulers(trainer, "epoch", plateau=False, count=trainer.current_epoch + 1)
            logged = trainer.step_row_pending = log_rows and trainer.global_step % every == 0
            stop = max_steps is not None and trainer.global_step >= max_steps
        # The loop's position after the batch, set before on_train_batch_end: a checkpoint
        # written there resumes at the next batch (inline: this is the per-step path).
        trainer.batch_idx = batch_idx + 1
        state.loop_stage = "train"
        state.total_batch_idx += 1
        if batch_end is not None:
            detached = loss if manual else loss.detach()  # (manual: detached, or None)
            outputs = detached if out is loss else apply_to_tensors(out, torch.Tensor.detach)
            batch_end(trainer=trainer, outputs=outputs, loss=detached, batch=batch, batch_idx=batch_idx)
        if logged:  # after on_train_batch_end, so what is logged there is in the row (Lightning)
            trainer.step_row_pending = False
            if manual:
                state.logged_step = trainer.global_step
            _log_step_metrics(trainer)
        if manual:
            stop = max_steps is not None and trainer.global_step >= max_steps
        # should_stop set by a plugin at this batch's end stops here (as in Lightning).
        return stop or trainer.should_stop

    def set_accumulate(value: int) -> None:
        nonlocal accumulate
        accumulate = value

    step.set_accumulate = set_accumulate
    return step


def _step_functions(trainer, model, optimizer):
    """``backward(loss)``, ``optimizer_step()`` and ``zero_grad()`` for this run.

    Where only the built-in default implements a hook (and nothing listens to the events
    around it), the loop calls plain torch directly, so a run without plugins costs what
    a hand-written loop costs; otherwise each call goes through pluggy.
    """
    hook = trainer.hook

    def only_default(name: str) -> bool:
        impls = getattr(hook, name).get_hookimpls()
        return len(impls) == 1 and impls[0].plugin_name == "hookloop.defaults"

    if only_default("backward"):
        backward = torch.Tensor.backward
    else:
        def backward(loss):
            hook.backward(trainer=trainer, loss=loss, model=model, optimizer=optimizer)
    if (only_default("optimizer_step") and not trainer.gradient_clip_val
            and trainer.state.on_before_optimizer_step is None and not custom_clipping(trainer.module)):
        optimizer_step = optimizer.step
    else:
        def optimizer_step():
            hook.optimizer_step(trainer=trainer, optimizer=optimizer, model=model)
    before_zero_grad = trainer.state.on_before_zero_grad
    if only_default("zero_grad") and before_zero_grad is None:
        def zero_grad():
            optimizer.zero_grad(set_to_none=True)
    else:
        def zero_grad():
            if before_zero_grad is not None:
                before_zero_grad(trainer=trainer, optimizer=optimizer)
            hook.zero_grad(trainer=trainer, optimizer=optimizer, model=model)
    return backward, optimizer_step, zero_grad


def _step_end(callers, trainer, out):
    for replaced in callers(trainer=trainer, outputs=out):
        if replaced is not None:
            out = replaced
    return out


def _loss_from(out: Any) -> torch.Tensor:
    if isinstance(out, dict) and "loss" in out:
        out = out["loss"]
    if isinstance(out, torch.Tensor):
        return out
    raise TypeError(
        f"training_step must return the loss as a scalar tensor (or a dict with a 'loss' "
        f"entry), got {type(out).__name__}: return e.g. F.cross_entropy(logits, y)"
    )


def _manual_loss(out: Any) -> torch.Tensor | None:
    if isinstance(out, dict):
        out = out.get("loss")
    return out.detach() if isinstance(out, torch.Tensor) else None


# ---------------------------------------------------------------------------------------
# One evaluation batch (validate, test, predict)
# ---------------------------------------------------------------------------------------


def make_evaluation_step(trainer, stage: str, n_loaders: int) -> Callable:
    """The function running one batch of ``stage`` (``"validate"``, ``"test"`` or
    ``"predict"``) over ``n_loaders`` loaders: move the batch, ``on_<stage>_batch_start``,
    the user's step (and its ``<step>_end``, not for predict), ``on_<stage>_batch_end``.
    It returns ``(batch, output)``, the batch as moved to the device. Gradients off, eval
    mode and the forward contexts are the caller's, around the whole run."""
    state = trainer.state
    prefix = EVENT_PREFIX[stage]
    batch_start = event(trainer, f"on_{prefix}_batch_start")
    batch_end = event(trainer, f"on_{prefix}_batch_end")
    step_end_user = None if stage == PREDICT else getattr(trainer.module, f"{STEP_METHODS[stage]}_end", None)
    forward = _forward(trainer, stage, n_loaders)
    device = trainer.root_device
    move = device.type != "cpu"

    def run(batch: Any, batch_idx: int, dataloader_idx: int) -> tuple[Any, Any]:
        if move:
            batch = move_to_device(batch, device)
        state.current_batch = batch
        if batch_start is not None:
            batch_start(trainer=trainer, batch=batch, batch_idx=batch_idx, dataloader_idx=dataloader_idx)
        out = forward(batch, batch_idx, dataloader_idx)
        if step_end_user is not None:
            out = step_end_user(out)
        if batch_end is not None:
            batch_end(trainer=trainer, outputs=out, batch=batch, batch_idx=batch_idx, dataloader_idx=dataloader_idx)
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
    if trainer.state.loop_optimizer_cache is None or [o.optimizer for o in trainer.state.loop_optimizer_cache] != trainer.optimizers:
        trainer.state.loop_optimizer_cache = [LoopOptimizer(trainer, o) for o in trainer.optimizers]
    return trainer.state.loop_optimizer_cache


_BACKWARD_ARGS = ("gradient", "retain_graph", "create_graph", "inputs")


def manual_backward(trainer, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    if trainer.automatic_optimization:
        raise ConfigurationError(
            "self.manual_backward(loss) is for manual optimization: set "
            "self.automatic_optimization = False (the loop calls backward on the returned loss otherwise)"
        )
    # Resolved once per fit by make_training_step (as the automatic path's); resolved
    # here only when called outside fit's steps.
    events = trainer.state.backward_events
    before, after = events if events is not None else (event(trainer, "on_before_backward"),
                                                       event(trainer, "on_after_backward"))
    if before is not None:
        before(trainer=trainer, loss=loss)
    if args or kwargs:
        # Tensor.backward's arguments (Lightning passes them on to loss.backward)
        if len(args) > len(_BACKWARD_ARGS) or any(k not in _BACKWARD_ARGS for k in kwargs):
            raise TypeError(f"manual_backward(loss, *args, **kwargs) takes Tensor.backward's arguments "
                            f"({', '.join(_BACKWARD_ARGS)}); got {len(args)} positional and {sorted(kwargs)}")
        trainer.backward_kwargs = {**dict(zip(_BACKWARD_ARGS, args)), **kwargs}
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
