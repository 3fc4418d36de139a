"""A module's ``optimizer_step``, ``optimizer_zero_grad`` and ``lr_scheduler_step``
overrides, called as Lightning calls them (automatic optimization).

Lightning's module owns these three steps of its loop; hookloop's engine owns them as
the ``optimizer_step`` and ``zero_grad`` hooks and the scheduler configs. When a fit's
module overrides any of them, :func:`attach` registers :class:`ModuleOptimization`, a
plugin implementing only what the module overrides, so a module without overrides
costs nothing per step (the engine's plain-torch path stays):

* ``optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)``: once per
  accumulation window, at its last batch, as Lightning; ``optimizer.step(closure=...)``
  steps through the rest of the run's ``optimizer_step`` implementations (the precision
  plugin's unscaling, clipping, ``on_before_optimizer_step``). The window's forward and
  backward ran before (hookloop's step order), so ``optimizer_closure()`` returns
  ``None`` and runs nothing: an optimizer that calls its closure several times (LBFGS) is
  not supported (docs/decisions.md);
* ``optimizer_zero_grad(epoch, batch_idx, optimizer)``: at each window's first batch,
  after ``on_before_zero_grad``;
* ``lr_scheduler_step(scheduler, metric)``: for every scheduler step the loop takes
  (``metric``: the monitored value of a plateau scheduler, else ``None``);
* ``backward(loss, **backward_kwargs)``: in place of ``loss.backward()``, for every
  micro-batch and every ``manual_backward`` (as Lightning). A plugin that runs the
  backward itself (fp16's loss scaling, DeepSpeed's engine) cannot hand it over: with one
  of them the override is refused when ``fit`` starts.

Under manual optimization the first three are not called (as Lightning): the module steps
its optimizers.
"""

from __future__ import annotations

from typing import Any

from hookloop.contract.hookspecs import hookimpl

#: the plugin's name in a run
NAME = "lightning_module_optimization"
HOOKS = ("optimizer_step", "optimizer_zero_grad", "lr_scheduler_step", "backward")


def overridden(module: Any, name: str) -> bool:
    """Whether ``module``'s class defines ``name`` itself (not ``hookloop.Module``'s
    default, which does what the loop does without it)."""
    method = getattr(type(module), name, None)
    return callable(method) and not getattr(method, "hookloop_placeholder", False)


def attach(trainer: Any, module: Any) -> None:
    """Before a fit: the plugin calling ``module``'s overrides, in place of the previous
    fit's (none when it overrides none of :data:`HOOKS`)."""
    manager = trainer.plugin_manager
    previous = manager.get_plugin(NAME)
    if previous is not None:
        manager.unregister(previous)
    hooks = [name for name in HOOKS if overridden(module, name)]
    if hooks:
        manager.register(ModuleOptimization.with_hooks(hooks), name=NAME)


class LightningOptimizer:
    """The ``optimizer`` a module's ``optimizer_step`` gets (Lightning's
    ``LightningOptimizer``): ``step(closure=None)`` steps through the run's plugins;
    every other attribute is the optimizer's own."""

    def __init__(self, optimizer: Any, step: Any):
        self._optimizer, self._step = optimizer, step

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        self._step()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return f"LightningOptimizer({self._optimizer!r})"


def _closure() -> None:
    """Lightning's ``optimizer_closure``: the window's forward and backward already ran."""
    return None


class ModuleOptimization:
    """The plugin of :func:`attach` (use :meth:`with_hooks`)."""

    hookloop_name = NAME
    hookloop_role = "observer"

    def __init__(self) -> None:
        self._rest: Any = None  # the run's other optimizer_step implementations

    @classmethod
    def with_hooks(cls, hooks: list[str]) -> ModuleOptimization:
        """An instance implementing the engine hooks for the module's ``hooks`` only."""
        namespace: dict[str, Any] = {}
        if "optimizer_step" in hooks:
            def optimizer_step(self, trainer, optimizer, model):
                return self._optimizer_step(trainer, optimizer, model)
            namespace["optimizer_step"] = hookimpl(tryfirst=True)(optimizer_step)
        if "optimizer_zero_grad" in hooks:
            def zero_grad(self, trainer, optimizer, model):
                return self._zero_grad(trainer, optimizer, model)
            namespace["zero_grad"] = hookimpl(tryfirst=True)(zero_grad)
        if "lr_scheduler_step" in hooks or "backward" in hooks:
            def on_fit_start(self, trainer):
                if "lr_scheduler_step" in hooks:
                    self._route_schedulers(trainer)
                if "backward" in hooks:
                    _check_backward_handover(trainer, self)
            namespace["on_fit_start"] = hookimpl(tryfirst=True)(on_fit_start)
        if "backward" in hooks:
            # before hookloop.defaults' loss.backward(), which it replaces (any other
            # implementation is refused at on_fit_start); a wrapper (DDP's reducer) wraps it
            def backward(self, trainer, loss):
                trainer.module.backward(loss, **trainer.backward_kwargs)
                return True
            namespace["backward"] = hookimpl(backward)
        return type(cls.__name__, (cls,), namespace)()

    def _optimizer_step(self, trainer: Any, optimizer: Any, model: Any) -> bool | None:
        if not trainer.automatic_optimization:
            return None  # manual: opt.step() steps at once (Lightning calls no override)
        if self._rest is None:
            self._rest = _other_implementations(trainer, "optimizer_step", self)
        taken: list = []

        def step() -> None:
            taken.append(self._rest(trainer=trainer, optimizer=optimizer, model=model))

        trainer.module.optimizer_step(trainer.current_epoch, trainer.batch_idx,
                                      LightningOptimizer(optimizer, step), _closure)
        return bool(taken and taken[-1] is not False)

    def _zero_grad(self, trainer: Any, optimizer: Any, model: Any) -> bool | None:
        if not trainer.automatic_optimization:
            return None  # manual: opt.zero_grad() is the optimizer's own (Lightning)
        trainer.module.optimizer_zero_grad(trainer.current_epoch, trainer.batch_idx, optimizer)
        return True

    def _route_schedulers(self, trainer: Any) -> None:
        step = trainer.module.lr_scheduler_step
        for config in trainer.lr_scheduler_configs:
            config.step_with = step


def _check_backward_handover(trainer: Any, plugin: Any) -> None:
    """The module's ``backward`` override is called where ``loss.backward()`` would be: a
    plugin that runs the backward itself (before it, not as a wrapper) would bypass it."""
    from hookloop.contract.errors import ConfigurationError
    from hookloop.contract.pluginspec import plugin_name

    others = sorted({plugin_name(impl.plugin) for impl in trainer.hook.backward.get_hookimpls()
                     if impl.plugin is not plugin and not (impl.wrapper or impl.hookwrapper)
                     and impl.plugin_name != "hookloop.defaults"})
    if others:
        raise ConfigurationError(
            f"{type(trainer.module).__name__} overrides backward(), and {', '.join(others)} runs the backward itself "
            f"(fp16 loss scaling, a strategy's engine), so the override would not be called: remove the override "
            f"(put what it adds in on_before_backward/on_after_backward) or run without {', '.join(others)}")


def _other_implementations(trainer: Any, name: str, plugin: Any) -> Any:
    """A caller of hook ``name`` without ``plugin`` and without the wrappers (which
    already run around ``plugin``'s implementation)."""
    wrappers = [impl.plugin for impl in getattr(trainer.hook, name).get_hookimpls()
                if impl.wrapper or impl.hookwrapper]
    return trainer.plugin_manager.subset_hook_caller(name, remove_plugins=[plugin, *wrappers])
