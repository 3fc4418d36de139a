"""The user's side: ``hookloop.Module``, an ``nn.Module`` with Lightning's API.

A training module defines ``training_step(batch, batch_idx)`` returning the loss (a
scalar tensor, or a dict with a ``"loss"`` entry) and ``configure_optimizers()``; it may
define ``validation_step``, ``test_step``, ``predict_step`` (default: ``self(batch)``),
``configure_model`` (layers built inside the strategy's sharded-initialisation context),
``training_step_end`` (DataParallel's gathered outputs) and any hook of
:data:`hookloop.contract.hookspecs.MODULE_HOOKS` (``on_train_epoch_end``, ``on_save_checkpoint``
...). It holds no device code: the loop moves the model and every batch.

Any ``nn.Module`` with those methods works; subclass ``hookloop.Module`` to get
``self.log``, ``self.trainer``, ``self.device``, hyperparameters and manual optimization.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

import torch
from torch import nn

from hookloop.contract.errors import ConfigurationError
from hookloop.distributed.collectives import REDUCE_OPS
from hookloop.contract.hookspecs import MODULE_HOOKS
from hookloop.engine.metrics import _STEP_BATCH, Metrics, _is_torchmetrics  # noqa: F401 - Metrics, _STEP_BATCH: their old home
from hookloop.engine.session import defines_hook as _defines_hook

# ---------------------------------------------------------------------------------------
# Hyperparameters (shared with DataModule)
# ---------------------------------------------------------------------------------------


class AttributeDict(dict):
    """A dict whose keys read as attributes: ``self.hparams.lr``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no hyperparameter {name!r}; saved: {', '.join(self) or 'none'}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


# What torch.load(weights_only=True) reads back: hyperparameters must be made of these.
_SAFE_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.device)


def _unsafe_part(value: Any) -> str | None:
    """The type name of the first part of ``value`` a weights-only load cannot hold."""
    if isinstance(value, _SAFE_LEAVES):
        return None
    if isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            bad = _unsafe_part(item)
            if bad:
                return bad
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            bad = _unsafe_part(k) or _unsafe_part(v)
            if bad:
                return bad
        return None
    return type(value).__name__


class HyperparametersMixin:
    """``save_hyperparameters()`` and ``hparams``, as in Lightning."""

    @property
    def hparams(self) -> AttributeDict:
        hparams = self.__dict__.get("_hookloop_hparams")
        if hparams is None:
            hparams = AttributeDict()
            self.__dict__["_hookloop_hparams"] = hparams
        return hparams

    def save_hyperparameters(self, *args: Any, ignore: str | list[str] | None = None, frame: Any = None, logger: bool = True) -> None:
        """Keep the ``__init__`` arguments in ``self.hparams`` and in every checkpoint.

        Called in ``__init__`` with no arguments it takes all of ``__init__``'s arguments
        (by their values at the time of the call); names pick some of them, a dict gives
        them directly (an ``argparse.Namespace`` too, as its entries); ``ignore`` leaves some out. ``Module.load_from_checkpoint(path)``
        re-creates the module from them. Checkpoints are loaded with
        ``torch.load(weights_only=True)``, so each value must be made of numbers,
        strings, tensors, ``None``, lists, tuples and dicts: anything else (a module, a
        loss function) is an error naming it; pass it in ``ignore``.
        """
        ignore = [ignore] if isinstance(ignore, str) else list(ignore or ())
        if len(args) == 1 and isinstance(args[0], dict):
            values = dict(args[0])
        elif len(args) == 1 and isinstance(args[0], argparse.Namespace):
            values = vars(args[0]).copy()  # Lightning's: the Namespace's entries are the hyperparameters
        else:
            caller = frame if frame is not None else inspect.currentframe().f_back
            init_args = _init_arguments(caller)
            names = [a for a in args if isinstance(a, str)]
            unknown = [n for n in names if n not in init_args]
            if unknown:
                raise ConfigurationError(
                    f"save_hyperparameters({', '.join(map(repr, unknown))}): not an argument of "
                    f"{type(self).__name__}.__init__ (its arguments: {', '.join(init_args) or 'none'})"
                )
            values = {n: init_args[n] for n in names} if names else init_args
        values = {k: v for k, v in values.items() if k not in ignore}
        for key, value in values.items():
            bad = _unsafe_part(value)
            if bad:
                raise ConfigurationError(
                    f"hyperparameter {key!r} of {type(self).__name__} is (or holds) a {bad}, which a "
                    f"checkpoint cannot keep: checkpoints are loaded with torch.load(weights_only=True), "
                    f"which reads only numbers, strings, tensors, None, lists, tuples and dicts. Leave "
                    f"it out with self.save_hyperparameters(ignore=[{key!r}]) (and build it in __init__)."
                )
        self.hparams.update(values)


def _init_arguments(frame: Any) -> dict[str, Any]:
    """The arguments of the ``__init__`` running in ``frame`` (without ``self``)."""
    code = frame.f_code
    if code.co_name != "__init__":
        raise ConfigurationError(
            "save_hyperparameters() without arguments must be called inside __init__; elsewhere "
            "pass the values: self.save_hyperparameters({'lr': lr})"
        )
    count = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:count])
    local = frame.f_locals
    values = {n: local[n] for n in names[1:] if n in local}
    if code.co_flags & inspect.CO_VARKEYWORDS:
        extra = local.get(code.co_varnames[count + bool(code.co_flags & inspect.CO_VARARGS)], {})
        values.update(extra if isinstance(extra, dict) else {})
    return values


# ---------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------


def _trainer_value(module: Any, name: str, default: Any = 0) -> Any:
    """``module.trainer.<name>`` during a run, ``default`` outside one (no error)."""
    trainer = module.__dict__.get("_hookloop_trainer")
    return getattr(trainer, name) if trainer is not None else default


class Module(HyperparametersMixin, nn.Module):
    """Base class for training modules: ``nn.Module`` plus Lightning's module API.

    ``log``/``log_dict``, ``trainer``, ``device``, ``current_epoch``, ``global_step``,
    ``save_hyperparameters``/``hparams``/``load_from_checkpoint``, and manual
    optimization (``automatic_optimization = False``, ``optimizers()``,
    ``lr_schedulers()``, ``manual_backward``, ``clip_gradients``,
    ``toggle_optimizer``). Every hook in :data:`hookloop.contract.hookspecs.MODULE_HOOKS` exists
    here as a no-op, so ``super().on_train_epoch_end()`` works; only the ones a subclass
    overrides are called.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = True

    # -- the run this module is attached to ---------------------------------------------

    @property
    def trainer(self):
        trainer = self.__dict__.get("_hookloop_trainer")
        if trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return trainer

    @property
    def device(self) -> torch.device:
        """The device the loop runs this module on (its parameters' device outside a run)."""
        trainer = self.__dict__.get("_hookloop_trainer")
        if trainer is not None:
            return trainer.root_device
        for tensor in self.parameters():
            return tensor.device
        for tensor in self.buffers():
            return tensor.device
        return torch.device("cpu")

    @property
    def current_epoch(self) -> int:
        return _trainer_value(self, "current_epoch")

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (every optimizer's, under manual optimization)."""
        return _trainer_value(self, "global_step")

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes (0 outside a run)."""
        return _trainer_value(self, "global_rank")

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (0 outside a run)."""
        return _trainer_value(self, "local_rank")

    @property
    def loggers(self) -> list:
        """The run's logger plugins (``[]`` outside a run or without a logger)."""
        trainer = self.__dict__.get("_hookloop_trainer")
        return trainer.loggers if trainer is not None else []

    @property
    def logger(self) -> Any:
        """The run's first logger plugin, or ``None``."""
        trainer = self.__dict__.get("_hookloop_trainer")
        return trainer.logger if trainer is not None else None

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's ``data`` (a tensor, a number, or a list/tuple/dict of them): each
        tensor stacked along a new first dimension in rank order (shape ``(world_size,
        *shape)``), as Lightning's; in one process the tensors as they are. Numbers become
        tensors on ``self.device``. ``sync_grads=True`` keeps the gather differentiable.
        ``group`` (a process subgroup) is not supported: pass ``None``."""
        if group is not None:
            raise ConfigurationError("self.all_gather(..., group=...): hookloop gathers over all ranks only; leave group out")
        device = self.device
        data = _numbers_to_tensors(data, device)
        trainer = self.__dict__.get("_hookloop_trainer")
        if trainer is None or trainer.world_size == 1:
            return data
        from hookloop.helpers import apply_to_tensors

        return apply_to_tensors(data, lambda t: trainer.all_gather(t.to(device), sync_grads=sync_grads))

    # -- logging ------------------------------------------------------------------------

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
        reduce_op: str | None = None,
    ) -> None:
        """Record a metric (Lightning's ``self.log``; the same arguments).

        Defaults follow Lightning: in ``training_step`` a value is kept per step
        (``on_step=True``); in validation/test steps and in epoch-level hooks it is
        averaged over the epoch, weighted by batch size (``batch_size=`` overrides the
        size inferred from the batch). With both ``on_step`` and ``on_epoch`` the metric
        is reported as ``name_step`` and ``name_epoch`` (and ``name``). ``sync_dist=True``
        reduces across ranks with ``reduce_fx`` (``"mean"``, ``"sum"``, ``"max"``,
        ``"min"`` in any case, ``torch.mean``... or Python's ``sum``/``max``/``min``), so
        every rank reports the same number; with
        several evaluation loaders the name gets ``/dataloader_idx_N``. A torchmetrics
        ``Metric`` (updated in the step) is logged as in Lightning: its ``forward`` result
        per step, its ``compute()`` per epoch (it syncs itself; ``sync_dist`` and
        ``reduce_fx`` do not apply), then ``reset()``. Read metrics
        back from ``trainer.callback_metrics``. ``logger=False`` keeps the metric from
        loggers; ``enable_graph``, ``sync_dist_group``, ``metric_attribute`` and
        ``rank_zero_only`` are accepted for compatibility and do nothing. What Lightning
        refuses is refused in its words: a value that is not a number, a one-element tensor
        or a Metric (a ``ValueError``), a name holding ``/dataloader_idx_`` while
        ``add_dataloader_idx=True``, a custom ``reduce_fx``.
        """
        _check_loggable(name, value)
        op = _reduce_op(reduce_op if reduce_op is not None else reduce_fx)
        trainer = self.__dict__.get("_hookloop_trainer")
        if trainer is None:
            return  # called outside a run (e.g. a unit test of training_step)
        if on_step is False and on_epoch is False:  # Lightning's refusal, from a callback's hook too
            raise ConfigurationError(
                f"`self.log({name!r}, ..., on_step=False, on_epoch=False)` is not useful: the value would be "
                f"kept neither per step nor per epoch. Give on_step=True or on_epoch=True (or leave both out "
                f"for the hook's defaults)")
        if add_dataloader_idx and "/dataloader_idx_" in name:  # Lightning's refusal: the suffix is added for you
            raise ConfigurationError(
                f"You called `self.log` with the key `{name}` but it should not contain information about "
                f"`dataloader_idx` when `add_dataloader_idx=True`: log it as {name.split('/dataloader_idx_')[0]!r} "
                f"(hookloop appends /dataloader_idx_N with several loaders), or pass add_dataloader_idx=False")
        trainer.state.metrics.log(name, value, prog_bar, logger is not False, on_step, on_epoch, op, sync_dist, add_dataloader_idx, batch_size)

    def log_dict(self, dictionary: Any, **kwargs: Any) -> None:
        """``self.log(name, value, **kwargs)`` for every entry of ``dictionary`` (a dict, or
        a torchmetrics ``MetricCollection``: each metric under its prefixed name)."""
        if _is_torchmetrics(dictionary, "MetricCollection"):
            # as Lightning: the prefixed names; metrics of one compute group share their states
            items = dictionary.items(keep_base=False, copy_state=not getattr(dictionary, "_enable_compute_groups", False))
        else:
            items = dictionary.items()
        for name, value in items:
            self.log(name, value, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        trainer = self.__dict__.get("_hookloop_trainer")
        if trainer is None or trainer.global_rank == 0:
            print(*args, **kwargs)

    # -- manual optimization ------------------------------------------------------------

    def optimizers(self, use_pl_optimizer: bool = True):
        """The run's optimizers (one object, or a list of several), for manual optimization.

        Their ``step()`` and ``zero_grad()`` go through the strategy's and the precision
        plugin's hooks (AMP's scaler, Horovod's synchronisation, DeepSpeed's engine) and
        each ``step()`` counts in ``global_step``.
        """
        optimizers = self.trainer._loop_optimizers()
        return optimizers[0] if len(optimizers) == 1 else optimizers

    def lr_schedulers(self):
        """The schedulers from ``configure_optimizers`` (one, a list, or ``None``).

        Under manual optimization the loop steps none of them: call ``.step()``.
        """
        schedulers = [c.scheduler for c in self.trainer.lr_scheduler_configs]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward(*args, **kwargs)`` through the strategy and precision plugins
        (AMP scales the loss, DeepSpeed's engine runs the backward, DDP synchronises
        gradients); ``retain_graph=True`` and the other arguments of ``backward`` pass on."""
        self.trainer._manual_backward(loss, *args, **kwargs)

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None) -> None:
        """Clip ``optimizer``'s gradients at its next ``step()``.

        Applied inside the step, after the precision plugin unscales and the strategy
        averages the gradients, so it clips the true gradients whatever the plugins.
        """
        self.trainer._request_clip(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's: called before every optimizer step of automatic optimization, after
        unscaling and the strategy's averaging, with ``Trainer(gradient_clip_val=...,
        gradient_clip_algorithm=...)``. Override it to clip another way: ``self.clip_gradients(
        optimizer, gradient_clip_val=..., gradient_clip_algorithm=...)`` inside it clips at
        once. Not overridden, the Trainer's settings clip (the ``clip_gradients`` hook)."""
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    configure_gradient_clipping.hookloop_placeholder = True  # the Trainer's settings: optim.custom_clipping

    # Lightning's optimization hooks: overridden, they are called as Lightning calls them
    # (hookloop.lightning.optimization); these defaults are what the loop does without them.

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Any = None) -> None:
        """Lightning's: ``optimizer.step(closure=optimizer_closure)``, once per accumulation
        window of automatic optimization (``batch_idx``: the window's last batch). Override
        it to change how, or whether, the optimizer steps (warm-up, skipping steps)."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Lightning's: ``optimizer.zero_grad()`` at each accumulation window's first batch
        (automatic optimization). Override it to zero the gradients another way."""
        optimizer.zero_grad()

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Lightning's: ``scheduler.step()`` (``scheduler.step(metric)`` on a plateau),
        whenever the loop steps a scheduler (automatic optimization). Override it for a
        scheduler whose ``step`` takes other arguments."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's: ``loss.backward(*args, **kwargs)`` for every micro-batch (and every
        ``manual_backward``). Override it to backpropagate another way."""
        loss.backward(*args, **kwargs)

    for _hook in (optimizer_step, optimizer_zero_grad, lr_scheduler_step, backward):
        _hook.hookloop_placeholder = True  # not the user's: optimization.overridden
    del _hook

    # Lightning's model-mode hooks of evaluation: overridden, each replaces what the loop
    # does (hookloop.engine.loop._eval_mode/_train_mode); these defaults are that.

    def on_validation_model_eval(self) -> None:
        """Lightning's: ``self.trainer.model.eval()`` before validation (the sanity check's
        too). Override it to keep some layers in train mode."""
        self.trainer.model.eval()

    def on_validation_model_train(self) -> None:
        """Lightning's: after validation, the train mode back (the loop restores the mode
        the model had; an override sets it instead)."""
        self.trainer.model.train()

    def on_test_model_eval(self) -> None:
        """Lightning's: ``self.trainer.model.eval()`` before testing."""
        self.trainer.model.eval()

    def on_test_model_train(self) -> None:
        """Lightning's: after testing, the train mode back (see on_validation_model_train)."""
        self.trainer.model.train()

    def on_predict_model_eval(self) -> None:
        """Lightning's: ``self.trainer.model.eval()`` before predicting."""
        self.trainer.model.eval()

    def on_predict_model_train(self) -> None:
        """Lightning's: after predicting, the train mode back (see on_validation_model_train)."""
        self.trainer.model.train()

    for _hook in (on_validation_model_eval, on_validation_model_train, on_test_model_eval, on_test_model_train,
                  on_predict_model_eval, on_predict_model_train):
        _hook.hookloop_placeholder = True  # not the user's: hookloop.engine.loop._module_override
    del _hook

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Freeze every parameter that ``optimizer`` does not train (``requires_grad=False``)
        until :meth:`untoggle_optimizer`, as Lightning's GAN examples do."""
        own = {id(p) for group in optimizer.param_groups for p in group["params"]}
        saved = self.__dict__.setdefault("_hookloop_toggled", {})
        for p in self.parameters():
            if id(p) not in own and id(p) not in saved:
                saved[id(p)] = (p, p.requires_grad)
                p.requires_grad_(False)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Give back what :meth:`toggle_optimizer` froze."""
        for p, requires_grad in self.__dict__.pop("_hookloop_toggled", {}).values():
            p.requires_grad_(requires_grad)

    # -- checkpoints --------------------------------------------------------------------

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = "cpu", strict: bool = True, **overrides: Any):
        """A module built from the hyperparameters in a checkpoint, with its weights.

        ``cls(**hyperparameters, **overrides)``, then the checkpoint's ``state_dict``
        (checked against the model first when ``strict``). The file is read with
        ``torch.load(weights_only=True)``.
        """
        from hookloop.resume.checkpoint import check_format, check_state_dict, safe_load

        checkpoint = safe_load(checkpoint_path, map_location=map_location)
        check_format(checkpoint, checkpoint_path)
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            from hookloop.contract.errors import CheckpointError

            raise CheckpointError(f"{str(checkpoint_path)!r} is not a hookloop checkpoint (no state_dict)")
        kwargs = dict(checkpoint.get("hyper_parameters") or {})
        parameters = inspect.signature(cls.__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in parameters}
        kwargs.update(overrides)
        module = cls(**kwargs)
        if strict:
            check_state_dict(module, checkpoint["state_dict"], source=str(checkpoint_path))
        module.load_state_dict(checkpoint["state_dict"], strict=strict)
        if _defines_hook(module, "on_load_checkpoint"):
            module.on_load_checkpoint(checkpoint)
        return module

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_hookloop_trainer", None)  # the trainer does not travel with the module
        return state


def _noop_hook(name: str, args: tuple[str, ...]):
    def hook(self, *values):
        """Does nothing; override it (Lightning's module hook of the same name)."""

    hook.__name__ = hook.__qualname__ = name
    hook.hookloop_placeholder = True  # not the user's: hookloop.session.defines_hook
    hook.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(a, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in args]
    )
    return hook


for _name, _args in MODULE_HOOKS.items():
    setattr(Module, _name, _noop_hook(_name, _args))
Module.predict_step = None  # not a hook: absent means "call forward"


def _numbers_to_tensors(data: Any, device: torch.device) -> Any:
    """``data`` with every int/float a tensor and every tensor on ``device`` (Lightning's
    ``convert_to_tensors``)."""
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return torch.tensor(data, device=device)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_numbers_to_tensors(d, device) for d in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_numbers_to_tensors(d, device) for d in data)
    if isinstance(data, dict):
        return type(data)((k, _numbers_to_tensors(v, device)) for k, v in data.items())
    return data


def _check_loggable(name: str, value: Any) -> None:
    """Lightning's refusals of what ``self.log`` cannot record (a ``ValueError`` in its
    words; ``ConfigurationError`` is a ``ValueError``): anything but a number, a one-element
    tensor or a torchmetrics ``Metric``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            # the shape, not Lightning's print of the whole tensor
            raise ConfigurationError(
                f"`self.log({name}, ...)` was called, but the tensor must have a single element, got a tensor "
                f"of shape {tuple(value.shape)}: reduce it first, e.g. `self.log({name}, value.mean())`, or log "
                f"each element under its own name")
        return
    if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
        raise ConfigurationError(f"`self.log({name}, {value})` was called, but nested dictionaries cannot be "
                                 "logged: log each entry under its own name (self.log_dict takes a flat dict)")
    if value is None or isinstance(value, (str, bytes, dict, list, tuple)) or not (
            hasattr(value, "__float__") or _is_torchmetrics(value, "Metric") or _is_torchmetrics(value, "MetricCollection")):
        raise ConfigurationError(f"`self.log({name}, {value})` was called, but `{type(value).__name__}` values "
                                 "cannot be logged: log a number, a one-element tensor or a torchmetrics Metric "
                                 "(self.log_dict logs a dict's entries)")


#: Lightning's reductions given as Python's builtins
_BUILTIN_REDUCTIONS = {max: "max", min: "min", sum: "sum"}


def _reduce_op(fx: Any) -> str:
    """Lightning's ``reduce_fx``: ``"mean"``/``"avg"``, ``"sum"``, ``"max"``, ``"min"`` in any
    case, or ``torch.mean``/``torch.sum``/``torch.max``/``torch.min`` (``sum``/``max``/``min``)."""
    if isinstance(fx, str):
        name = fx.lower()
        name = {"avg": "mean", "average": "mean"}.get(name, name)
    else:
        name = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}.get(fx)
        name = name or _BUILTIN_REDUCTIONS.get(fx)
    if name not in REDUCE_OPS:
        raise ConfigurationError(
            f"Only `self.log(..., reduce_fx={{min,max,mean,sum}})` are supported. If you need a custom reduction, "
            f"please log a `torchmetrics.Metric` instance instead. Found: {fx!r} (give 'mean', 'sum', 'max' or "
            f"'min', or torch.mean, torch.sum, torch.max, torch.min)")
    return name
