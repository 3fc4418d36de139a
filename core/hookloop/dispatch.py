"""Calling the plugins' hooks on the per-step path, and watching every hook call.

Two things live here, beside each other because each must know the other:

* :func:`event` resolves one hook, once per run (or per epoch, per evaluation), into the
  callable the step calls: ``None`` when nobody implements the hook (pluggy would call
  nothing), a plain closure over the implementations when they are plain functions
  (``call(**kwargs)``: each implementation with its own arguments, in pluggy's order, with
  pluggy's results), or pluggy's own caller otherwise (a hook wrapper, a historic hook,
  keyword parameters with defaults, or someone monitoring pluggy itself). No code is
  generated: a caller is the function below, over a tuple of ``(function, argnames)``.
* :func:`observe_hook_calls` calls back around every hook call and every implementation
  (the ``ledger`` and the ``profiler`` are built on it). The callers of :func:`event`
  read one attribute per call (``observers.on``) and, while an observer is installed, go
  through :meth:`_Observers.call`; calls that go through pluggy are observed in its hook
  execution chain (below).

pluggy's private API. Observing each implementation of a call that pluggy dispatches
needs a place inside that dispatch, and pluggy's public API has none: its
``add_hookcall_monitoring`` sees a call, not its implementations. So this module (and no
other in the core) uses three private names, all in :class:`_Observers`: it reads and
replaces ``PluginManager._inner_hookexec`` (where ``add_hookcall_monitoring`` puts its
monitor), compares it with ``pluggy._callers._multicall`` (pluggy's dispatch, with nobody
monitoring), and passes ``_multicall`` stand-ins for the observed implementations
(:class:`_ObservedImpl`, the ``HookImpl`` attributes with the function observed: the
registered ``HookImpl`` is never changed). The pluggy versions this is tested with are
:data:`PLUGGY_TESTED` (pyproject.toml pins the same range; tests/test_dispatch.py fails
on another with a message saying so).

Layer: above :mod:`hookloop.contract.errors`; below the engine (:mod:`hookloop.engine.step`,
the loop, the session) and the ``ledger``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hookloop.contract.errors import ConfigurationError

PLUGGY_DISPATCH: Callable[..., Any] | None
try:  # pluggy's dispatch (private; see the module's docstring)
    from pluggy._callers import _multicall as PLUGGY_DISPATCH
except ImportError:  # pragma: no cover - another pluggy: every event goes through pluggy
    PLUGGY_DISPATCH = None

#: The pluggy versions whose private names this module uses (``>=`` first, ``<`` second),
#: as pinned in pyproject.toml.
PLUGGY_TESTED = ("1.5", "1.8")

CallObserver = Callable[[str, Any, dict], None]  # (hook_name, impls, kwargs)
ImplObserver = Callable[[str, Any], None]  # (hook_name, impl)


# ---------------------------------------------------------------------------------------
# The per-step callers
# ---------------------------------------------------------------------------------------


def event(trainer: Any, name: str) -> Callable[..., Any] | None:
    """A caller of hook ``name`` (keyword arguments; a list of the non-None results, or the
    first one for a ``firstresult`` hook, as pluggy's), or ``None`` when nobody implements
    it.

    Resolved once per epoch or evaluation run, it is what the per-step path calls. When the
    implementations are plain functions and nothing monitors pluggy's dispatch, it calls
    them itself (one call per implementation instead of pluggy's dispatch, about ten);
    otherwise it is pluggy's caller. Observers added or undone later are seen by callers
    resolved before them (:func:`observe_hook_calls`).
    """
    caller = getattr(trainer.hook, name)
    impls = caller.get_hookimpls()
    if not impls:
        return None
    observers = _observers(trainer.plugin_manager)
    spec = caller.spec
    plain = all(not (impl.hookwrapper or impl.wrapper or getattr(impl, "kwargnames", ()))
                for impl in impls)
    if spec is None or spec.opts.get("historic") or not plain or not observers.plain_dispatch():
        return caller
    return _plain_caller(name, impls, observers, bool(spec.opts.get("firstresult")))


def _plain_caller(name: str, impls: list, observers: _Observers,
                  firstresult: bool) -> Callable[..., Any]:
    """``call(**kwargs)`` calling each of ``impls`` (pluggy's list: the last one first) with
    the arguments it declares, as pluggy's dispatch would."""
    in_order = tuple(reversed(impls))
    plan = tuple((impl.function, impl.argnames) for impl in in_order)

    if firstresult:
        def call_first(**kwargs: Any) -> Any:
            if observers.on:
                return observers.call(name, impls, in_order, kwargs, firstresult=True)
            for function, argnames in plan:
                result = function(*map(kwargs.__getitem__, argnames))
                if result is not None:
                    return result
            return None

        return call_first

    def call_all(**kwargs: Any) -> list:
        if observers.on:
            return observers.call(name, impls, in_order, kwargs, firstresult=False)
        results = []
        for function, argnames in plan:
            result = function(*map(kwargs.__getitem__, argnames))
            if result is not None:
                results.append(result)
        return results

    return call_all


def resolve_events(trainer: Any) -> None:
    """The events read on the step path by helpers outside the step, resolved for this run
    (``trainer.state``)."""
    state = trainer.state
    # Read by public helpers on the step path (hookloop.before_optimizer_step).
    state.on_before_optimizer_step = event(trainer, "on_before_optimizer_step")
    state.on_before_zero_grad = event(trainer, "on_before_zero_grad")
    state.on_log_metrics = event(trainer, "on_log_metrics")
    state.module_epoch_end = next((impl for impl in trainer.hook.on_train_epoch_end.get_hookimpls()
                                   if impl.plugin_name.startswith("module:")), None)


def only_default(trainer: Any, name: str) -> bool:
    """Whether the built-in ``hookloop.defaults`` is the only implementation of ``name``."""
    impls = getattr(trainer.hook, name).get_hookimpls()
    return len(impls) == 1 and impls[0].plugin_name == "hookloop.defaults"


# ---------------------------------------------------------------------------------------
# Observing hook calls
# ---------------------------------------------------------------------------------------


def observe_hook_calls(trainer: Any, before: CallObserver | None = None,
                       after: CallObserver | None = None, *,
                       before_impl: ImplObserver | None = None,
                       after_impl: ImplObserver | None = None) -> Callable[[], None]:
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
    plugin's per-batch half, in ``setup``) are observed from their first call. The step's
    plain-torch defaults (``hookloop.engine.step.PLAIN_TORCH_DEFAULTS``: ``backward``,
    ``optimizer_step``, ``zero_grad`` when only ``hookloop.defaults`` implements them) are
    not hook calls and are not seen.

    While an observer is installed every per-step event pays the observers' dispatch;
    with none, the step path makes the same calls as without this helper (the resolved
    events read one attribute). :data:`OBSERVER_CODES` are the code objects of this
    machinery (a call counter, as the ``ledger``'s, leaves them out).
    """
    for callback in (before, after, before_impl, after_impl):
        if callback is not None and not callable(callback):
            raise ConfigurationError(f"observe_hook_calls: {callback!r} is not callable")
    calls = (before or _noop, after or _noop) if before or after else None
    impls = (before_impl or _noop, after_impl or _noop) if before_impl or after_impl else None
    return _observers(trainer.plugin_manager).add(calls, impls)


def _noop(*_args: Any) -> None:
    return None


class _ObservedImpl:
    """A ``HookImpl`` as one observed call of pluggy's dispatch sees it: the same
    attributes, the function called between the implementation observers."""

    def __init__(self, impl: Any, function: Callable[..., Any]):
        names = getattr(type(impl), "__slots__", None) or vars(impl)
        self.__dict__.update({name: getattr(impl, name) for name in names})
        self.function = function


class _Observers:
    """The observers of one plugin manager (``pm._hookloop_observers``)."""

    def __init__(self, pm: Any):
        self.pm = pm
        self.on = False  # any observer: what a plain caller reads per call
        self.calls: tuple = ()  # (before, after) per call observer
        self.impls: tuple = ()  # (before_impl, after_impl) per implementation observer
        self.stand_ins: dict[tuple[str, int], tuple[Any, _ObservedImpl]] = {}
        self.hookexec: Callable[..., Any] | None = None  # ours in pluggy's chain, while observed

    # -- adding and removing ---------------------------------------------------------------

    def add(self, calls: tuple | None, impls: tuple | None) -> Callable[[], None]:
        if calls is not None:
            self.calls += (calls,)
        if impls is not None:
            self.impls += (impls,)
        self.update()
        done: list[bool] = []

        def undo() -> None:
            if done:
                return
            done.append(True)
            self.calls = tuple(o for o in self.calls if o is not calls)
            self.impls = tuple(o for o in self.impls if o is not impls)
            self.update()

        return undo

    def update(self) -> None:
        """Put ours into pluggy's chain (``pm._inner_hookexec``) when the first observer
        comes, take it out when the last goes (pluggy's monitors are undone last-in-first-
        out: ours, when one was added on top of it, stays as a pass-through until it is on
        top again)."""
        pm = self.pm
        self.on = bool(self.calls or self.impls)
        if self.on and self.hookexec is None:
            self.hookexec = pm._inner_hookexec = self._observed_hookexec(pm._inner_hookexec)
        elif not self.on:
            self.hookexec = None
            self.stand_ins = {}
        top = pm._inner_hookexec
        while getattr(top, "hookloop_inner", None) is not None and top is not self.hookexec:
            top = pm._inner_hookexec = top.hookloop_inner

    def plain_dispatch(self) -> bool:
        """Whether pluggy's dispatch is unmonitored (ours, observing or retired, skipped):
        then a plain caller does what pluggy would."""
        hookexec = self.pm._inner_hookexec
        while getattr(hookexec, "hookloop_inner", None) is not None:
            hookexec = hookexec.hookloop_inner
        return PLUGGY_DISPATCH is not None and hookexec is PLUGGY_DISPATCH

    # -- calls -------------------------------------------------------------------------------

    def _observed_hookexec(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def observed_hookexec(hook_name: str, impls: list, kwargs: dict, firstresult: bool) -> Any:
            if self.hookexec is not observed_hookexec:  # retired, under another's monitor
                return inner(hook_name, impls, kwargs, firstresult)
            if self.impls:
                impls_seen, impls = impls, [self.stand_in(hook_name, impl) for impl in impls]
            else:
                impls_seen = impls
            observers = self.calls
            for before, _ in observers:
                before(hook_name, impls_seen, kwargs)
            try:
                return inner(hook_name, impls, kwargs, firstresult)
            finally:
                for _, after in reversed(observers):
                    after(hook_name, impls_seen, kwargs)

        observed_hookexec.hookloop_inner = inner  # type: ignore[attr-defined]
        return observed_hookexec

    def stand_in(self, hook_name: str, impl: Any) -> Any:
        """``impl`` for pluggy's dispatch while implementations are observed."""
        if impl.hookwrapper or impl.wrapper:
            return impl
        entry = self.stand_ins.get((hook_name, id(impl)))
        if entry is None or entry[0] is not impl:
            observed = self._observed(hook_name, impl, impl.function)
            functools.update_wrapper(observed, impl.function)
            entry = self.stand_ins[(hook_name, id(impl))] = (impl, _ObservedImpl(impl, observed))
        return entry[1]

    def _observed(self, hook_name: str, impl: Any,
                  function: Callable[..., Any]) -> Callable[..., Any]:
        def observed(*args: Any, **kwargs: Any) -> Any:
            around = self.impls
            for before, _ in around:
                before(hook_name, impl)
            try:
                return function(*args, **kwargs)
            finally:
                for _, after in reversed(around):
                    after(hook_name, impl)

        return observed

    def call(self, hook_name: str, impls: list, in_order: tuple, kwargs: dict,
             firstresult: bool) -> Any:
        """A plain caller's call while observed (``impls`` in pluggy's order, ``in_order``
        the order they are called in), as pluggy's observed dispatch would be."""
        observers = self.calls
        for before, _ in observers:
            before(hook_name, impls, kwargs)
        try:
            results = []
            for impl in in_order:
                around = self.impls
                for before_impl, _ in around:
                    before_impl(hook_name, impl)
                try:
                    result = impl.function(*map(kwargs.__getitem__, impl.argnames))
                finally:
                    for _, after_impl in reversed(around):
                        after_impl(hook_name, impl)
                if result is not None:
                    if firstresult:
                        return result
                    results.append(result)
            return None if firstresult else results
        finally:
            for _, after in reversed(observers):
                after(hook_name, impls, kwargs)


def _observers(pm: Any) -> _Observers:
    observers = pm.__dict__.get("_hookloop_observers")
    if observers is None:
        observers = pm._hookloop_observers = _Observers(pm)
    return observers


def _codes(*functions: Any) -> frozenset:
    found = set()
    todo = [f.__code__ for f in functions]
    while todo:
        code = todo.pop()
        found.add(code)
        todo += [c for c in code.co_consts if isinstance(c, type(code))]
    return frozenset(found)


#: The code objects of :func:`observe_hook_calls`' machinery (its wrappers and dispatch).
OBSERVER_CODES = _codes(_noop, *(f for cls in (_Observers, _ObservedImpl)
                                 for f in vars(cls).values() if hasattr(f, "__code__")))
