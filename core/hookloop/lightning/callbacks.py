"""Lightning-style callbacks: ``hookloop.Callback`` and the callbacks real code subclasses.

A :class:`Callback` has Lightning 2.6.6's callback API: every hook takes
``(trainer, pl_module, ...)`` with Lightning's arguments, ``state_dict``/``load_state_dict``
keep its state in checkpoints under ``checkpoint["callbacks"][state_key]``. A run turns the
callbacks of ``Trainer(callbacks=[...])`` into one observer plugin, :class:`CallbackHooks`,
that implements only the events some callback overrides (a callback that overrides no
per-step hook costs nothing per step) and calls the callbacks in list order, before the
module's hook of the same event, as Lightning does.

How Lightning's hooks map to hookloop's events (:mod:`hookloop.hookspecs`, section 7): each
``on_*`` hook is called through the event of the same name, with ``pl_module`` =
``trainer.module`` added and the event's hookloop-only arguments left out:

* ``on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)``: ``outputs`` is
  Lightning's dict, ``{"loss": loss / accumulate_grad_batches (detached), **the other
  entries training_step returned}`` (the event's ``outputs`` is what ``training_step``
  returned, its ``loss`` undivided);
* ``on_train_epoch_end(trainer, pl_module)``, ``on_validation_end(trainer, pl_module)``,
  ``on_test_end(trainer, pl_module)``: the event's ``epoch``/``metrics`` are not passed
  (read ``trainer.callback_metrics``);
* ``on_{validation,test,predict}_batch_{start,end}(..., batch, batch_idx,
  dataloader_idx=0)``: ``dataloader_idx`` is passed only when the stage has several loaders
  (as Lightning: with one, the hook's default ``0`` applies);
* ``setup``/``teardown(trainer, pl_module, stage)``: ``setup`` runs after the DataModule's
  ``setup`` and before the module's (Lightning's order), not through the ``setup`` event;
* ``on_save_checkpoint(trainer, pl_module, checkpoint)``: after every callback's
  ``state_dict()`` is stored under ``checkpoint["callbacks"]``;
* ``on_load_checkpoint(trainer, pl_module, checkpoint)`` then ``load_state_dict(state)``:
  when ``fit`` resumes, before the optimizer states are loaded (hookloop builds the
  optimizers before it restores; Lightning after restoring the callbacks), so a callback
  that rebuilds param groups (:class:`BaseFinetuning`) does so before they are filled.

A hookimpl plugin (``@hookloop.hookimpl`` methods taking hookloop's event arguments by
name) and a Callback are both welcome in ``callbacks=``; any other object there is an
error, never silently ignored.
"""

from __future__ import annotations

import copy
import enum
import inspect
import logging
import sys
from typing import Any, Iterable, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hookloop.contract import pluginspec
from hookloop.contract.errors import ConfigurationError
from hookloop.distributed.ranks import rank_zero_warn
from hookloop.lightning import optimization as lightning_optimization
from hookloop.observers import bars, csvlog, early_stopping, lr_monitor, model_summary, progress, timer
from hookloop.observers import checkpoint as model_checkpoint

#: Where the classes that ``hookloop`` exports under Lightning's names live (this module
#: and the built-in observers): read by :func:`not_honoured_error`, without importing the
#: package's facade.
_LIGHTNING_NAMED = (bars, model_checkpoint, csvlog, early_stopping, lr_monitor, model_summary, progress, timer)

# Lightning 2.6.6's Callback hooks (other than setup/teardown and the checkpoint ones):
# name -> (the hookloop event that calls it, the Lightning arguments after pl_module,
# given as the event's argument names).
EVENT_HOOKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "on_fit_start": ("on_fit_start", ()),
    "on_fit_end": ("on_fit_end", ()),
    "on_sanity_check_start": ("on_sanity_check_start", ()),
    "on_sanity_check_end": ("on_sanity_check_end", ()),
    "on_train_start": ("on_train_start", ()),
    "on_train_end": ("on_train_end", ()),
    "on_train_epoch_start": ("on_train_epoch_start", ()),
    "on_train_epoch_end": ("on_train_epoch_end", ()),
    "on_train_batch_start": ("on_train_batch_start", ("batch", "batch_idx")),
    "on_train_batch_end": ("on_train_batch_end", ("outputs", "batch", "batch_idx")),
    "on_before_backward": ("on_before_backward", ("loss",)),
    "on_after_backward": ("on_after_backward", ()),
    "on_before_optimizer_step": ("on_before_optimizer_step", ("optimizer",)),
    "on_before_zero_grad": ("on_before_zero_grad", ("optimizer",)),
    "on_validation_start": ("on_validation_start", ()),
    "on_validation_end": ("on_validation_end", ()),
    "on_validation_epoch_start": ("on_validation_epoch_start", ()),
    "on_validation_epoch_end": ("on_validation_epoch_end", ()),
    "on_validation_batch_start": ("on_validation_batch_start", ("batch", "batch_idx", "dataloader_idx")),
    "on_validation_batch_end": ("on_validation_batch_end", ("outputs", "batch", "batch_idx", "dataloader_idx")),
    "on_test_start": ("on_test_start", ()),
    "on_test_end": ("on_test_end", ()),
    "on_test_epoch_start": ("on_test_epoch_start", ()),
    "on_test_epoch_end": ("on_test_epoch_end", ()),
    "on_test_batch_start": ("on_test_batch_start", ("batch", "batch_idx", "dataloader_idx")),
    "on_test_batch_end": ("on_test_batch_end", ("outputs", "batch", "batch_idx", "dataloader_idx")),
    "on_predict_start": ("on_predict_start", ()),
    "on_predict_end": ("on_predict_end", ()),
    "on_predict_epoch_start": ("on_predict_epoch_start", ()),
    "on_predict_epoch_end": ("on_predict_epoch_end", ()),
    "on_predict_batch_start": ("on_predict_batch_start", ("batch", "batch_idx", "dataloader_idx")),
    "on_predict_batch_end": ("on_predict_batch_end", ("outputs", "batch", "batch_idx", "dataloader_idx")),
    "on_exception": ("on_exception", ("exception",)),
}
#: Hooks the adapter calls itself (not through an event of the same arguments).
SPECIAL_HOOKS = ("setup", "teardown", "on_save_checkpoint", "on_load_checkpoint", "state_dict", "load_state_dict")
#: Every hook of Lightning 2.6.6's ``Callback``.
LIGHTNING_HOOKS = tuple(EVENT_HOOKS) + SPECIAL_HOOKS

# The loaders of an evaluation event's stage: dataloader_idx is passed when there are several.
_STAGE_LOADERS = {"validation": "val_dataloaders", "test": "test_dataloaders", "predict": "predict_dataloaders"}


class Callback:
    """Lightning's ``Callback`` (2.6.6): override the hooks you need.

    Every hook takes ``(trainer, pl_module, ...)`` with Lightning's arguments (see the
    module docstring for how each maps to a hookloop event). Only the hooks a subclass
    overrides are called; overriding none per step costs nothing per step. Callbacks run
    in the order of ``Trainer(callbacks=[...])``, before the module's hook of the same
    event. ``state_dict()`` is saved in checkpoints under ``checkpoint["callbacks"]
    [state_key]`` (when not empty) and given back to ``load_state_dict`` when ``fit``
    resumes. A method named ``on_*`` that is no Lightning hook is an error at
    ``Trainer(...)`` (it would never be called). From ``setup`` on, ``self.log`` and
    ``self.log_dict`` are the module's, as Lightning attaches them.
    """

    @property
    def state_key(self) -> str:
        """The key of this callback's state in checkpoints; make it unique (with
        :meth:`_generate_state_key`) when a run may hold several of the class."""
        return type(self).__qualname__

    def _generate_state_key(self, **kwargs: Any) -> str:
        return f"{type(self).__qualname__}{repr(kwargs)}"

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Called when fit, validate, test or predict begins (before the module's setup)."""

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """Called when fit, validate, test or predict ends."""

    def on_fit_start(self, trainer, pl_module) -> None:
        """Called when fit begins."""

    def on_fit_end(self, trainer, pl_module) -> None:
        """Called when fit ends."""

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        """Called when the validation sanity check starts."""

    def on_sanity_check_end(self, trainer, pl_module) -> None:
        """Called when the validation sanity check ends."""

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        """Called when the train batch begins (its return value is ignored)."""

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called when the train batch ends; ``outputs`` is what ``training_step`` returned."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        """Called when the train epoch begins."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        """Called when the train epoch ends."""

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        """Called when the val epoch begins."""

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        """Called when the val epoch ends."""

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        """Called when the test epoch begins."""

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        """Called when the test epoch ends."""

    def on_predict_epoch_start(self, trainer, pl_module) -> None:
        """Called when the predict epoch begins."""

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        """Called when the predict epoch ends."""

    def on_validation_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called when the validation batch begins."""

    def on_validation_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        """Called when the validation batch ends."""

    def on_test_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called when the test batch begins."""

    def on_test_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        """Called when the test batch ends."""

    def on_predict_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called when the predict batch begins."""

    def on_predict_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        """Called when the predict batch ends."""

    def on_train_start(self, trainer, pl_module) -> None:
        """Called when the train begins."""

    def on_train_end(self, trainer, pl_module) -> None:
        """Called when the train ends."""

    def on_validation_start(self, trainer, pl_module) -> None:
        """Called when the validation loop begins."""

    def on_validation_end(self, trainer, pl_module) -> None:
        """Called when the validation loop ends."""

    def on_test_start(self, trainer, pl_module) -> None:
        """Called when the test begins."""

    def on_test_end(self, trainer, pl_module) -> None:
        """Called when the test ends."""

    def on_predict_start(self, trainer, pl_module) -> None:
        """Called when the predict begins."""

    def on_predict_end(self, trainer, pl_module) -> None:
        """Called when predict ends."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Called when any trainer execution is interrupted by an exception."""

    def state_dict(self) -> dict[str, Any]:
        """The callback's state for checkpoints (tensors, numbers, strings, lists, dicts)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state ``state_dict`` returned."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """Called when saving a checkpoint, to add to (or read) the checkpoint dict."""

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """Called when loading a checkpoint, with the whole checkpoint dict."""

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        """Called before ``loss.backward()``."""

    def on_after_backward(self, trainer, pl_module) -> None:
        """Called after ``loss.backward()`` and before optimizers are stepped."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer: torch.optim.Optimizer) -> None:
        """Called before ``optimizer.step()``."""

    def on_before_zero_grad(self, trainer, pl_module, optimizer: torch.optim.Optimizer) -> None:
        """Called before ``optimizer.zero_grad()``."""


def overridden(callback: Callback, name: str) -> bool:
    """Whether ``callback``'s class overrides ``Callback.name``."""
    method = getattr(type(callback), name, None)
    return method is not None and method is not getattr(Callback, name)


def check_callback(callback: Callback) -> None:
    """Refuse ``on_*`` methods that are no Lightning hook (never called), and Lightning
    hooks whose hookloop event does not exist."""
    specs = pluginspec.specs()
    for name in dir(type(callback)):
        if not name.startswith("on_") or not callable(getattr(type(callback), name, None)):
            continue
        if name in EVENT_HOOKS:
            if overridden(callback, name) and EVENT_HOOKS[name][0] not in specs:
                raise ConfigurationError(
                    f"callback {type(callback).__name__} overrides {name}, a Lightning hook hookloop "
                    f"cannot call (it has no such event): move its work to another hook"
                )
            continue
        if name in SPECIAL_HOOKS:
            continue
        import difflib

        close = difflib.get_close_matches(name, LIGHTNING_HOOKS, n=1)
        raise ConfigurationError(
            f"callback {type(callback).__name__} defines {name}, which is not a hook of Lightning 2.6.6's "
            f"Callback, so it would never be called"
            + (f" (did you mean {close[0]!r}?)" if close else " (a hook removed in Lightning 1.x?)")
            + f"; rename it to one of: {', '.join(LIGHTNING_HOOKS)}, or to a name not starting with 'on_'"
        )


def not_honoured_error(obj: Any) -> ConfigurationError:
    """The error for an object in ``callbacks=`` that hookloop cannot call."""
    cls = type(obj)
    where = f"{cls.__module__}.{cls.__qualname__}"
    lightning = next((c for c in cls.__mro__ if c.__module__.split(".")[0] in ("lightning", "pytorch_lightning")), None)
    if lightning is not None:
        base = lightning.__name__
        if any(isinstance(getattr(home, base, None), type) for home in (sys.modules[__name__], *_LIGHTNING_NAMED)):
            hint = (
                f"it is a Lightning callback (the import was not changed): change `from lightning.pytorch.callbacks "
                f"import {base}` (or pytorch_lightning's) to `from hookloop import {base}`"
            )
        else:
            hint = (
                f"it is a Lightning callback ({base}), which hookloop does not have: make the class subclass "
                f"hookloop.Callback (the same hooks), or use a hookloop plugin that does the same"
            )
    else:
        hint = (
            "make its class subclass hookloop.Callback (Lightning's hooks, `(trainer, pl_module, ...)`), or "
            "mark its hook methods with @hookloop.hookimpl (hookloop's events, see hookloop.hookspecs)"
        )
    return ConfigurationError(
        f"callbacks=[...] holds a {where}, which is neither a hookloop.Callback nor a plugin with "
        f"@hookloop.hookimpl methods, so hookloop would never call it: {hint}"
    )


class CallbackHooks:
    """The observer plugin that calls a run's :class:`Callback` objects, in list order.

    It implements only the events some callback overrides; each implementation calls the
    overriding callbacks' methods with Lightning's arguments. Its implementations are
    ``tryfirst`` and the run registers it after the module's hooks, so callbacks run
    before the module's hook of the same event (Lightning's order).
    """

    hookloop_name = "callbacks"
    hookloop_role = "observer"

    def __init__(self, members: Sequence[Any]):
        from hookloop.contract.hookspecs import hookimpl

        # members: the Callbacks, and the hookloop plugins (EarlyStopping, TQDMProgressBar,
        # EMA...) whose user subclass overrides Lightning hooks with Lightning's arguments
        # (see lightning_overrides: those overrides are called here, the plugins' own
        # hook implementations stay theirs), in the order of callbacks=[...]
        members = list(members)
        self.callbacks = [cb for cb in members if isinstance(cb, Callback)]
        self.subclassed = [cb for cb in members if not isinstance(cb, Callback)]
        for callback in self.callbacks:
            check_callback(callback)
        for name, (event, args) in EVENT_HOOKS.items():
            methods = [_lightning_method(cb, name) for cb in members if _calls(cb, name)]
            if methods:
                function = _event_function(event, args, methods)
                if event == "on_train_epoch_end":
                    function = self._train_epoch_end(function)
                setattr(self, event, hookimpl(tryfirst=True)(function))
        self._members = members
        if any(_calls(cb, "teardown") for cb in members):
            def teardown(trainer, stage):
                module = trainer.module
                for cb in self._members:
                    if _calls(cb, "teardown"):
                        _lightning_method(cb, "teardown")(trainer, module, stage)

            self.teardown = hookimpl(tryfirst=True)(teardown)
        if any(overridden(cb, "on_save_checkpoint") or overridden(cb, "state_dict") for cb in self.callbacks):
            def on_save_checkpoint(trainer, checkpoint):
                self._save(trainer, checkpoint)

            self.on_save_checkpoint = hookimpl(tryfirst=True)(on_save_checkpoint)

    @staticmethod
    def _train_epoch_end(call):
        """The callbacks' ``on_train_epoch_end``, where ``self.log`` is per epoch (Lightning's
        defaults in epoch-level hooks). The module's implementation, which the session
        registers whenever this one exists and which runs after it, adds their values to
        the epoch's metrics, the ``metrics`` the plugins get and the loggers' epoch row."""

        def on_train_epoch_end(trainer):
            store = trainer.state.metrics
            store.epoch_level = True
            try:
                call(trainer)
            finally:
                store.epoch_level = False

        return on_train_epoch_end

    def __reduce__(self):
        # The implementations are closures: a spawn-based strategy pickles the callbacks
        # and builds them again.
        return (CallbackHooks, (self._members,))

    def setup(self, trainer, stage: str) -> None:  # not a hookimpl: the session calls it
        module = trainer.module
        if callable(getattr(module, "log", None)):
            # Lightning's: every callback's self.log / self.log_dict are the module's for
            # the run (they log as the module does from the hook they are called in)
            for cb in self._members:
                cb.log, cb.log_dict = module.log, module.log_dict
        for cb in self._members:
            if _calls(cb, "setup"):
                _lightning_method(cb, "setup")(trainer, module, stage)

    def _save(self, trainer, checkpoint):
        states = {}
        for cb in self.callbacks:
            state = cb.state_dict()
            if state:
                states[cb.state_key] = state
        if states:  # beside what hookloop's own ModelCheckpoint/EarlyStopping put there
            checkpoint.setdefault("callbacks", {}).update(states)
        module = trainer.module
        for cb in self.callbacks:
            cb.on_save_checkpoint(trainer, module, checkpoint)

    def restore(self, trainer, checkpoint: dict) -> None:
        """When ``fit`` resumes: every callback's ``on_load_checkpoint``, then its
        ``load_state_dict`` (Lightning's order), before the optimizer states are loaded."""
        states = checkpoint.get("callbacks")
        module = trainer.module
        for cb in self.callbacks:
            cb.on_load_checkpoint(trainer, module, checkpoint)
        if states is None:
            return
        for cb in self.callbacks:
            state = states.get(cb.state_key)
            if state:
                cb.load_state_dict(copy.deepcopy(state))
        for cb in self.callbacks:
            before_optimizers = getattr(cb, "_restore_before_optimizer_states", None)
            if before_optimizers is not None:
                before_optimizers(trainer, module)

    def of_type(self, cls: type) -> list:
        return [cb for cb in self.callbacks if isinstance(cb, cls)]

    def prediction_writing(self, n_loaders: int) -> "PredictionWriting | None":
        """The state the run's prediction writers read, or ``None`` when it has none
        (hookloop.engine.loop.predict asks; the loop does not import this module)."""
        writers = self.of_type(BasePredictionWriter)
        return PredictionWriting(writers, n_loaders) if writers else None


def _event_function(event: str, args: tuple[str, ...], methods: list):
    """``def event(trainer, <args>)`` calling every method with ``(trainer, module, <args>)``;
    ``dataloader_idx`` only when the stage has several loaders."""
    params = ", ".join(("trainer",) + args)
    namespace: dict[str, Any] = {"_methods": tuple(methods)}
    if "dataloader_idx" in args:
        stage = event.split("_")[1]
        head = ", ".join(a for a in args if a != "dataloader_idx")
        body = (
            f"    module = trainer.module\n"
            f"    if len(trainer.{_STAGE_LOADERS[stage]} or ()) > 1:\n"
            f"        for m in _methods:\n"
            f"            m(trainer, module, {head}, dataloader_idx)\n"
            f"    else:\n"
            f"        for m in _methods:\n"
            f"            m(trainer, module, {head})\n"
        )
    elif event == "on_train_batch_end":
        # Lightning's outputs: {"loss": the detached loss / accumulate_grad_batches, **the
        # other entries of training_step's dict} (manual optimization: its dict as returned)
        namespace["_outputs"] = lightning_train_outputs
        params = "trainer, outputs, loss, batch, batch_idx"
        body = (
            "    module = trainer.module\n"
            "    outputs = _outputs(trainer, outputs, loss, batch)\n"
            "    for m in _methods:\n"
            "        m(trainer, module, outputs, batch, batch_idx)\n"
        )
    else:
        call = ", ".join(("trainer", "trainer.module") + args)
        if len(methods) == 1:
            namespace["_m"] = methods[0]
            body = f"    _m({call})\n"
        else:
            body = f"    module = trainer.module\n    for m in _methods:\n        m({call.replace('trainer.module', 'module')})\n"
    exec(f"def {event}({params}):\n{body}", namespace)  # noqa: S102 - names from EVENT_HOOKS
    return namespace[event]


def lightning_train_outputs(trainer, outputs: Any, loss: Any, batch: Any = ()) -> dict | None:
    """``on_train_batch_end``'s ``outputs`` as Lightning's callbacks get them: ``None``
    for a batch the loader yielded as ``None``, ``{}`` when ``training_step`` returned
    ``None`` (automatic optimization)."""
    from collections.abc import Mapping

    if batch is None:
        return None
    if getattr(trainer, "automatic_optimization", True):
        if loss is None:
            return {}
        accumulate = trainer.accumulate_grad_batches
        scaled = loss / accumulate if loss is not None else None
        extra = {k: v for k, v in outputs.items() if k != "loss"} if isinstance(outputs, Mapping) else {}
        return {"loss": scaled, **extra}
    if isinstance(outputs, Mapping):
        return dict(outputs)
    if isinstance(outputs, torch.Tensor):
        return {"loss": outputs}
    return {}


def callback_hooks(objects: Iterable[Any], given_callbacks: Sequence[Any] = ()) -> tuple[list, CallbackHooks | None]:
    """``objects`` with the :class:`Callback` objects replaced by one :class:`CallbackHooks`
    (where the first of them stood), and that plugin (``None`` when there are none).

    A hookloop plugin of ``given_callbacks`` (Lightning's ``callbacks=``) whose user
    subclass overrides Lightning hooks with Lightning's arguments
    (:func:`lightning_overrides`) stays in ``objects``, and its overrides are called by
    the :class:`CallbackHooks` too, in list order. Given as ``plugins=``, the same object
    is a plugin under the plugin contract (those overrides refused)."""
    objects = list(objects)
    members = [o for o in objects if isinstance(o, Callback)
               or (any(o is c for c in given_callbacks) and _lightning_subclassed(o))]
    if not members:
        return objects, None
    for o in members:
        if not isinstance(o, Callback):
            _hide_overrides(o)
    hooks = CallbackHooks(members)
    out, placed = [], False
    for o in objects:
        if (isinstance(o, Callback) or any(o is m for m in hooks.subclassed)) and not placed:
            out.append(hooks)
            placed = True
        if not isinstance(o, Callback):
            out.append(o)
    return out, hooks


# ---------------------------------------------------------------------------------------
# Subclasses of hookloop's Lightning-named plugins
# ---------------------------------------------------------------------------------------
# EarlyStopping, TQDMProgressBar, EMA... are hookloop plugins: their hook implementations
# take hookloop's event arguments. Lightning code subclasses them and overrides a hook with
# Lightning's arguments (``on_train_epoch_end(self, trainer, pl_module)``, ``setup(self,
# trainer, pl_module, stage)``), calling ``super()`` with those. The plugin contract
# (hookloop.contract.pluginspec.hookimpl_options) keeps an undecorated override of an
# inherited hook implementation one, with the event's arguments, and refuses other
# arguments; that stays so for plugin authors. An object given in ``callbacks=`` is
# Lightning's argument, though: there an override in the user's subclass whose arguments
# are not the event's is Lightning's hook, called as Lightning calls it (by the
# CallbackHooks adapter, with ``(trainer, pl_module, ...)``), and hidden from the plugin
# manager on that object. The base's hook methods take Lightning's arguments too, so the
# override's ``super()`` call runs the plugin's own behaviour, as in Lightning.

#: Lightning hooks a subclass of a hookloop plugin may override with Lightning's arguments
_SUBCLASS_HOOKS: dict[str, str] = {**{name: event for name, (event, _) in EVENT_HOOKS.items()},
                                   "setup": "setup", "teardown": "teardown"}


def _own_code(cls: type) -> bool:
    """Whether ``cls`` is hookloop's (the core or a hookloop_* plugin package), not the user's."""
    top = cls.__module__.split(".")[0]
    return top == "hookloop" or top.startswith("hookloop_")


def lightning_overrides(cls: type) -> tuple[str, ...]:
    """The Lightning hooks that ``cls``, a user's subclass of a hookloop plugin, overrides
    with Lightning's arguments: undecorated, defined in the user's code, and taking an
    argument the hookloop event of that name does not have (``pl_module``)."""
    if isinstance(cls, type) and issubclass(cls, Callback) or _own_code(cls):
        return ()
    if not any(_own_code(base) and any(True for _ in pluginspec.implementations(base)) for base in cls.__mro__[1:]):
        return ()
    specs = pluginspec.specs()
    found = []
    for name, event in _SUBCLASS_HOOKS.items():
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is None or _own_code(owner) or event not in specs:
            continue
        function = getattr(owner.__dict__[name], "__func__", owner.__dict__[name])
        if not callable(function) or getattr(function, pluginspec.IMPL_ATTRIBUTE, None) is not None:
            continue  # decorated: a hook implementation, under the plugin contract
        if any(arg not in specs[event] for arg in pluginspec.varnames(function)[0]):
            found.append(name)
    return tuple(found)


def _lightning_subclassed(obj: Any) -> bool:
    import types

    return not isinstance(obj, (str, type, types.ModuleType)) and obj is not None \
        and bool(lightning_overrides(type(obj)))


def _hide_overrides(obj: Any) -> None:
    """The plugin manager does not see ``obj``'s Lightning overrides as hook
    implementations (the adapter calls them); calling them on ``obj`` still works."""
    import functools

    for name in lightning_overrides(type(obj)):
        obj.__dict__[name] = functools.partial(getattr(type(obj), name), obj)


def _calls(member: Any, name: str) -> bool:
    """Whether the adapter calls ``member``'s Lightning hook ``name``."""
    if isinstance(member, Callback):
        return overridden(member, name)
    return name in lightning_overrides(type(member))


def _lightning_method(member: Any, name: str):
    """``member.name`` as Lightning calls it (a subclassed plugin's: the class's method,
    not the attribute that hides it from the plugin manager)."""
    if isinstance(member, Callback):
        return getattr(member, name)
    import types

    return types.MethodType(getattr(type(member), name), member)


def check_callbacks_argument(objects: Iterable[Any]) -> None:
    """Every object of ``callbacks=`` is a Callback, a plugin with hook implementations,
    or a plugin's name (a string or class, loaded as plugins are)."""
    import types

    for obj in objects:
        if isinstance(obj, type) and issubclass(obj, Callback):
            raise ConfigurationError(
                f"callbacks=[...] holds the class {obj.__name__}, not an instance of it: pass "
                f"callbacks=[{obj.__name__}(...)]")
        if isinstance(obj, (str, type, types.ModuleType, Callback)) or obj is None:
            continue
        if not any(True for _ in pluginspec.implementations(obj)):
            raise not_honoured_error(obj)


# ---------------------------------------------------------------------------------------
# The callbacks real code subclasses
# ---------------------------------------------------------------------------------------


class GradientAccumulationScheduler(Callback):
    """Change ``accumulate_grad_batches`` by epoch, as Lightning's: ``scheduling={epoch:
    factor}`` (epochs from 0; epochs before the first key accumulate 1). Set at each
    ``on_train_epoch_start``; not with ``Trainer(accumulate_grad_batches != 1)``, manual
    optimization or DeepSpeed."""

    def __init__(self, scheduling: dict[int, int]):
        super().__init__()
        if not scheduling:
            raise TypeError("GradientAccumulationScheduler(scheduling={}) is empty: give {epoch: factor, ...}")
        if any(not isinstance(key, int) or key < 0 for key in scheduling):
            raise ConfigurationError(
                f"GradientAccumulationScheduler(scheduling={scheduling!r}): Epoch should be an int greater than or "
                f"equal to 0. Got {list(scheduling.keys())}. The keys are the epochs (from 0) where a factor starts.")
        if any(not isinstance(value, int) or value < 1 for value in scheduling.values()):
            raise ConfigurationError(
                f"GradientAccumulationScheduler(scheduling={scheduling!r}): Accumulation factor should be an int "
                f"greater than 0. Got {list(scheduling.values())}. The values are how many batches to accumulate.")
        scheduling = dict(scheduling)
        if min(scheduling) != 0:
            scheduling[0] = 1
        self.scheduling = scheduling
        self.epochs = sorted(scheduling)

    def going_to_accumulate_grad_batches(self) -> bool:
        return any(v > 1 for v in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        for start in reversed(self.epochs):
            if epoch >= start:
                return self.scheduling[start]
        return 1

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning's checks, errors and warning (RuntimeError, a UserWarning, ValueError)
        if not (getattr(pl_module, "automatic_optimization", True) and getattr(trainer, "automatic_optimization", True)):
            raise RuntimeError(
                "Automatic gradient accumulation and the `GradientAccumulationScheduler` is not supported for "
                "manual optimization (self.automatic_optimization = False). Please remove the callback or switch "
                "to automatic optimization.")
        if self.going_to_accumulate_grad_batches() and any(
                lightning_optimization.overridden(pl_module, name)
                for name in ("optimizer_step", "optimizer_zero_grad")):
            rank_zero_warn(
                "When using `Trainer(accumulate_grad_batches != 1)` and overriding "
                "`LightningModule.optimizer_{step,zero_grad}`, the hooks will not be called on every batch "
                "(rather, they are called on every optimization step).")
        strategy = getattr(trainer, "strategy", None)
        if strategy is not None and "deepspeed" in type(strategy).__module__:
            raise RuntimeError(
                f"The `{type(strategy).__name__}` does not support `accumulate_grad_batches` changing between "
                f"epochs: remove the GradientAccumulationScheduler or choose another strategy.")
        if trainer.config.global_batch_size is not None:
            raise ConfigurationError(
                f"Trainer(global_batch_size={trainer.config.global_batch_size}) and GradientAccumulationScheduler "
                f"are both set: the accumulation is derived from global_batch_size; remove one of them")
        if trainer.config.accumulate_grad_batches != 1 and not trainer.state.accumulation_scheduled:
            raise ConfigurationError(
                f"You have set `accumulate_grad_batches` and are using the `GradientAccumulationScheduler` "
                f"callback (Trainer(accumulate_grad_batches={trainer.config.accumulate_grad_batches})). Either remove "
                f"`accumulate_grad_batches` from the Trainer or remove the callback.")
        trainer.state.accumulation_scheduled = True

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        trainer.accumulate_grad_batches = self.get_accumulate_grad_batches(trainer.current_epoch)


class BaseFinetuning(Callback):
    """Lightning's ``BaseFinetuning``: freeze modules before training
    (:meth:`freeze_before_training`, called in ``setup``, before ``configure_optimizers``)
    and unfreeze them as training goes on (:meth:`finetune_function`, called at every
    epoch's start for every optimizer), adding their parameters to the optimizer as new
    param groups (:meth:`unfreeze_and_add_param_group`). The param groups it made are in
    its ``state_dict`` and are rebuilt when ``fit`` resumes."""

    def __init__(self) -> None:
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._restarting = False

    def state_dict(self) -> dict[str, Any]:
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restarting = True
        if "internal_optimizer_metadata" in state_dict:
            self._internal_optimizer_metadata = state_dict["internal_optimizer_metadata"]
        else:
            self._internal_optimizer_metadata = state_dict  # type: ignore[assignment]

    def _restore_before_optimizer_states(self, trainer, pl_module) -> None:
        # Lightning rebuilds the param groups in on_fit_start, before it loads the optimizer
        # states; hookloop loads them before on_fit_start, so they are rebuilt here.
        self.on_fit_start(trainer, pl_module)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self._restarting:
            if self._internal_optimizer_metadata:
                named_parameters = dict(pl_module.named_parameters())
                for opt_idx, optimizer in enumerate(trainer.optimizers):
                    groups = self._internal_optimizer_metadata.get(opt_idx)
                    if groups is None:
                        groups = self._internal_optimizer_metadata.get(str(opt_idx))
                    if groups is not None:
                        optimizer.param_groups = self._apply_mapping_to_param_groups(groups, named_parameters)
            self._restarting = False

    @staticmethod
    def flatten_modules(modules: nn.Module | Iterable[Any]) -> list[nn.Module]:
        """The leaf modules of ``modules`` (a module or an iterable of them), and the
        parent modules that hold parameters themselves."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            flat: list[nn.Module] = []
            for m in modules:
                flat.extend(BaseFinetuning.flatten_modules(m))
            found = iter(flat)
        else:
            found = modules.modules()
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(modules: nn.Module | Iterable[Any], train_bn: bool = True, requires_grad: bool = True):
        """Yield the parameters of ``modules`` whose ``requires_grad`` is ``requires_grad``
        (BatchNorm layers left out when not ``train_bn``)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and not train_bn:
                continue
            for param in mod.parameters(recurse=False):
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: nn.Module | Iterable[Any]) -> None:
        """Unfreeze the parameters of ``modules``."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freeze the parameters of ``module`` (not recursing)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: nn.Module | Iterable[Any], train_bn: bool = True) -> None:
        """Freeze the parameters of ``modules`` (BatchNorm layers stay trainable with
        ``train_bn``)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(mod)
            else:
                BaseFinetuning.freeze_module(mod)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable) -> list:
        """``params`` without those already in one of ``optimizer``'s param groups."""
        import warnings

        out, removed = [], []
        for param in params:
            if not any(torch.equal(p, param) for group in optimizer.param_groups for p in group["params"]):
                out.append(param)
            else:
                removed.append(param)
        if removed:
            warnings.warn(
                "The provided params to be frozen already exist within another group of this optimizer. "
                "Those parameters will be skipped.\nHINT: Did you init your optimizer in `configure_optimizer` "
                f"as such:\n {type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ")
        return out

    @staticmethod
    def unfreeze_and_add_param_group(modules: nn.Module | Iterable[Any], optimizer: torch.optim.Optimizer,
                                     lr: float | None = None, initial_denom_lr: float = 10.0,
                                     train_bn: bool = True) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as a new param
        group, with learning rate ``lr`` (default: the first group's divided by
        ``initial_denom_lr``)."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        params = BaseFinetuning.filter_on_optimizer(optimizer, params)
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.freeze_before_training(pl_module)
        strategy = getattr(trainer, "strategy", None)
        if strategy is not None and "deepspeed" in type(strategy).__module__:
            raise NotImplementedError(
                "The Finetuning callback does not support running with the DeepSpeed strategy. Choose a different "
                "strategy or disable the callback.")

    @staticmethod
    def _apply_mapping_to_param_groups(param_groups: list[dict[str, Any]], mapping: dict) -> list[dict[str, Any]]:
        output = []
        for g in param_groups:
            group_state = {k: v for k, v in g.items() if k != "params"}
            group_state["params"] = [mapping[p] for p in g["params"]]
            output.append(group_state)
        return output

    def _store(self, pl_module, opt_idx: int, num_param_groups: int, current_param_groups: list[dict]) -> None:
        mapping = {p: n for n, p in pl_module.named_parameters()}
        if opt_idx not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[opt_idx] = self._apply_mapping_to_param_groups(
                current_param_groups, mapping)
        elif num_param_groups != len(current_param_groups):
            self._internal_optimizer_metadata[opt_idx].extend(
                self._apply_mapping_to_param_groups(current_param_groups[num_param_groups:], mapping))

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            num_param_groups = len(optimizer.param_groups)
            self.finetune_function(pl_module, trainer.current_epoch, optimizer)
            self._store(pl_module, opt_idx, num_param_groups, optimizer.param_groups)

    def finetune_function(self, pl_module, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        """Override to add your unfreeze logic."""
        raise NotImplementedError

    def freeze_before_training(self, pl_module) -> None:
        """Override to add your freeze logic."""
        raise NotImplementedError


def multiplicative(epoch: int) -> float:
    """:class:`BackboneFinetuning`'s default ``lambda_func``: the backbone's learning rate
    doubles every epoch (Lightning's)."""
    return 2.0


class BackboneFinetuning(BaseFinetuning):
    """Lightning's ``BackboneFinetuning``: the module's ``backbone`` (an ``nn.Module``) is
    frozen before training and unfrozen at ``unfreeze_backbone_at_epoch`` as a new param
    group of every optimizer, with learning rate ``backbone_initial_lr`` (default: the first
    group's times ``backbone_initial_ratio_lr``), then multiplied by
    ``lambda_func(epoch + 1)`` at each later epoch's start, up to the first group's learning
    rate when ``should_align``. ``verbose`` logs both rates (``hookloop`` logger) at each
    change, rounded to ``rounding`` digits."""

    def __init__(self, unfreeze_backbone_at_epoch: int = 10, lambda_func: Any = multiplicative,
                 backbone_initial_ratio_lr: float = 10e-2, backbone_initial_lr: float | None = None,
                 should_align: bool = True, initial_denom_lr: float = 10.0, train_bn: bool = True,
                 verbose: bool = False, rounding: int = 12) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata,
                "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict["previous_backbone_lr"]
        super().load_state_dict(state_dict)

    def _check_backbone(self, pl_module) -> None:
        if not isinstance(getattr(pl_module, "backbone", None), nn.Module):
            raise ConfigurationError(
                f"BackboneFinetuning needs the module's backbone: {type(pl_module).__name__} has no "
                f"nn.Module attribute `backbone` (set self.backbone = ... in __init__, or subclass "
                f"hookloop.BaseFinetuning to freeze other modules)")

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._check_backbone(pl_module)  # before freeze_before_training reads it
        super().setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._check_backbone(pl_module)
        super().on_fit_start(trainer, pl_module)

    def freeze_before_training(self, pl_module) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            backbone_lr = (self.backbone_initial_lr if self.backbone_initial_lr is not None
                           else current_lr * self.backbone_initial_ratio_lr)
            self.previous_backbone_lr = backbone_lr
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, backbone_lr, train_bn=self.train_bn,
                                              initial_denom_lr=self.initial_denom_lr)
        elif epoch > self.unfreeze_backbone_at_epoch:
            backbone_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and backbone_lr > current_lr:
                backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = backbone_lr
            self.previous_backbone_lr = backbone_lr
        else:
            return
        if self.verbose:
            logging.getLogger("hookloop").info(f"Current lr: {round(current_lr, self.rounding)}, "
                                               f"Backbone lr: {round(backbone_lr, self.rounding)}")


class _Refused:
    """A Lightning name hookloop does not have: making one raises a
    :class:`~hookloop.ConfigurationError` that names what to use instead (docs/lightning.md)."""

    instead = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # the refused Lightning name, also when a subclass of it is made (class Mine(WeightAveraging))
        refused = next(c for c in type(self).__mro__ if _Refused in c.__bases__)
        raise ConfigurationError(f"hookloop has no {refused.__name__} (docs/lightning.md): {self.instead}")


class LearningRateFinder(_Refused):
    """Lightning's ``LearningRateFinder`` callback, refused: the finder is
    ``hookloop.Tuner(trainer).lr_find(model, ...)`` before ``fit``, or ``hookloop tune lr``."""

    instead = ("run the finder before fit with hookloop.Tuner(trainer).lr_find(model, ...) (Lightning's "
               "arguments; .suggestion()), or from the command line with `hookloop tune lr SCRIPT`, and "
               "remove the callback")


class BatchSizeFinder(_Refused):
    """Lightning's ``BatchSizeFinder`` callback, refused: the search is
    ``hookloop.Tuner(trainer).scale_batch_size(model, ...)`` before ``fit``, or
    ``hookloop tune batch-size``."""

    instead = ("run the search before fit with hookloop.Tuner(trainer).scale_batch_size(model, ...) "
               "(Lightning's arguments), or from the command line with `hookloop tune batch-size "
               "SCRIPT`, and remove the callback")


class CombinedLoader(_Refused):
    """Lightning's ``CombinedLoader``, refused: several validation/test/predict loaders
    are a list; one training loader."""

    instead = ("give several validation, test or predict loaders as a list (val_dataloaders=[a, b]: each "
               "its own dataloader_idx, as CombinedLoader's 'sequential' mode); for training, combine "
               "the data in one loader (torch.utils.data.ConcatDataset, or a Dataset returning one "
               "item of each)")


class WeightAveraging(_Refused):
    """Lightning's generic ``WeightAveraging`` base class (subclassed with a
    ``should_update`` schedule), refused: hookloop's averaging plugins are its two
    schedules, ``hookloop_averaging.EMA`` (Lightning's ``EMAWeightAveraging``) and
    ``hookloop_averaging.SWA`` (``StochasticWeightAveraging``)."""

    instead = ("use hookloop_averaging.EMA (Lightning's EMAWeightAveraging: decay, update_every_n_steps, "
               "update_starting_at_step, use_buffers, avg_fn=) or hookloop_averaging.SWA "
               "(StochasticWeightAveraging) in callbacks= (pip install hookloop-averaging); a custom "
               "should_update schedule has no equivalent: EMA's update_every_n_steps/update_starting_at_step")


class WriteInterval(enum.Enum):
    BATCH = "batch"
    EPOCH = "epoch"
    BATCH_AND_EPOCH = "batch_and_epoch"

    @property
    def on_batch(self) -> bool:
        return self in (WriteInterval.BATCH, WriteInterval.BATCH_AND_EPOCH)

    @property
    def on_epoch(self) -> bool:
        return self in (WriteInterval.EPOCH, WriteInterval.BATCH_AND_EPOCH)


class BasePredictionWriter(Callback):
    """Lightning's ``BasePredictionWriter``: write predictions as ``trainer.predict``
    makes them. ``write_interval="batch"`` calls :meth:`write_on_batch_end` after every
    batch, ``"epoch"`` calls :meth:`write_on_epoch_end` once with this rank's predictions
    (on the CPU; a list per loader when there are several) and their dataset indices
    (``batch_indices``: per loader, per batch, the sample indices the sampler gave this
    rank), ``"batch_and_epoch"`` both."""

    def __init__(self, write_interval: str = "batch") -> None:
        values = [i.value for i in WriteInterval]
        if write_interval not in values and not isinstance(write_interval, WriteInterval):
            raise ConfigurationError(f"`write_interval` should be one of {values}, got {write_interval!r}.")
        self.interval = WriteInterval(write_interval)

    def setup(self, trainer, pl_module, stage: str) -> None:
        step = getattr(pl_module, "predict_step", None)
        if callable(step):
            try:
                params = inspect.signature(step).parameters
            except (TypeError, ValueError):
                return
            if "dataloader_iter" in params:
                raise ConfigurationError("BasePredictionWriter does not support a predict_step taking dataloader_iter")

    def write_on_batch_end(self, trainer, pl_module, prediction: Any, batch_indices: Sequence[int] | None,
                           batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        """Override with the logic to write a single batch."""
        raise NotImplementedError()

    def write_on_epoch_end(self, trainer, pl_module, predictions: Sequence[Any], batch_indices: Sequence[Any]) -> None:
        """Override with the logic to write all batches."""
        raise NotImplementedError()

    def on_predict_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        if not self.interval.on_batch:
            return
        state = trainer.state.prediction_writing
        self.write_on_batch_end(trainer, pl_module, outputs, state.current_batch_indices, batch, batch_idx,
                                dataloader_idx)

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        if not self.interval.on_epoch:
            return
        state = trainer.state.prediction_writing
        self.write_on_epoch_end(trainer, pl_module, state.predictions, state.epoch_batch_indices)


class _RecordingSampler(torch.utils.data.Sampler):
    """A sampler that remembers the indices it gave, in order (for the batch indices of
    the prediction writers)."""

    def __init__(self, sampler: Any):
        self.sampler = sampler
        self.seen: list = []

    def __iter__(self):
        for index in self.sampler:
            self.seen.append(index)
            yield index

    def __len__(self) -> int:
        return len(self.sampler)


class PredictionWriting:
    """What ``trainer.predict`` keeps for the run's :class:`BasePredictionWriter` callbacks
    (Lightning's ``predict_loop.current_batch_indices``/``epoch_batch_indices``/``predictions``)."""

    def __init__(self, writers: list, n_loaders: int):
        self.on_epoch = any(w.interval.on_epoch for w in writers)
        self.on_batch = any(w.interval.on_batch for w in writers)
        self.current_batch_indices: list = []
        self.epoch_batch_indices: list[list] = [[] for _ in range(n_loaders)]
        self._predictions: list[list] = [[] for _ in range(n_loaders)]
        self._recorders: list = []

    @property
    def predictions(self) -> list:
        return self._predictions[0] if len(self._predictions) == 1 else self._predictions

    def loader(self, loader: Any) -> Any:
        """``loader`` drawing through a recording sampler (a copy), or ``loader`` itself
        when its batches cannot be traced to indices (a custom batch sampler)."""
        from torch.utils.data import BatchSampler

        from hookloop.helpers import rebuild_dataloader

        batch_sampler = getattr(loader, "batch_sampler", None)
        if batch_sampler is None or type(batch_sampler) is not BatchSampler:
            self._recorders.append(None)
            return loader
        recorder = _RecordingSampler(loader.sampler)
        self._recorders.append((recorder, batch_sampler.batch_size))
        return rebuild_dataloader(loader, recorder)

    def batch_seen(self, dataloader_idx: int, batch_idx: int) -> None:
        entry = self._recorders[dataloader_idx]
        if entry is None:
            indices: list = []
        else:
            recorder, size = entry
            indices = list(recorder.seen[batch_idx * size:(batch_idx + 1) * size])
        if self.on_epoch:
            self.epoch_batch_indices[dataloader_idx].append(indices)
        if self.on_batch:
            self.current_batch_indices = indices

    def prediction(self, dataloader_idx: int, out: Any) -> None:
        if self.on_epoch:
            from hookloop.helpers import apply_to_tensors

            self._predictions[dataloader_idx].append(apply_to_tensors(out, lambda t: t.to("cpu")))
