"""The loops: fit, validate, test and predict, and the training step.

Read top to bottom, this file is one batch's whole journey: ``fit`` opens a session
(process group, data, plugins), builds the model, then per epoch ``_train_epoch`` runs
the step built by ``make_training_step`` (forward, backward, optimizer step), validates
when due, and ends the epoch (schedulers, ``on_train_epoch_end``, checkpoint). Every
technique the loop does not spell out is a hook call, and every hook call on the per-step
path is resolved once per run: one nobody implements is never called.

``Trainer`` (``trainer.py``) keeps the configuration and the public API; it calls
:func:`fit`, :func:`evaluate` and :func:`predict` here, inside the worker processes.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from . import checkpoint as ckpt
from . import faults
from . import loader_state
from .datamodule import provides
from .errors import CheckpointError, ConfigurationError
from .helpers import (DistributedSamplerWrapper, OrderedSampler, apply_to_tensors, batch_size_of, gather_per_rank, move_to_device,
                      own_entry, rebuild_dataloader)
from .module import _STEP_BATCH, _defines_hook, module_hooks_plugin
from .optim import LoopOptimizer, parse_optimizers, step_schedulers
from .utilities import rank_zero_only

TRAIN, VALIDATE, TEST, PREDICT = "train", "validate", "test", "predict"
#: the user's step for each ``kind`` the step module is called with
STEP_METHODS = {TRAIN: "training_step", VALIDATE: "validation_step", TEST: "test_step", PREDICT: "predict_step"}
#: the prefix of each evaluation stage's events (``on_validation_start`` ...)
EVENT_PREFIX = {VALIDATE: "validation", TEST: "test", PREDICT: "predict"}
#: the trainer attribute with each stage's per-loader batch counts: num_<this>_batches
EVAL_COUNT = {VALIDATE: "val", TEST: "test"}
#: the ``stage`` argument of ``setup``/``teardown`` for each entry point
SETUP_STAGE = {"fit": "fit", VALIDATE: "validate", TEST: "test", PREDICT: "predict"}


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
# A run: the session around every entry point
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def session(trainer, stage: str):
    """Environment, data, plugins and the module's hooks for one ``fit``/``validate``/
    ``test``/``predict`` in this worker; torn down also after an exception."""
    hook, module = trainer.hook, trainer.module
    module.__dict__["_hookloop_trainer"] = trainer
    module_hooks = module_hooks_plugin(module)
    callbacks = trainer._callback_hooks
    if module_hooks is not None:
        trainer.plugin_manager.register(module_hooks, name=module_hooks.hookloop_name)
        if callbacks is not None:
            # Registered again after the module's hooks: both are tryfirst, the later runs
            # first, and Lightning calls the callbacks before the module's hook.
            trainer.plugin_manager.unregister(callbacks)
            trainer.plugin_manager.register(callbacks, name=callbacks.hookloop_name)
    _resolve_events(trainer)
    trainer.state.metrics.eval_logged_steps = {}
    datamodule = trainer.datamodule
    setup_stage = SETUP_STAGE[stage]
    set_up = False
    state = trainer.state
    state.fn, state.status = SETUP_STAGE[stage], "running"
    trainer.state.logged_metrics = {}
    trainer.state.metrics.reset_run()  # Lightning: every run starts with no metrics
    try:
        hook.setup_environment(trainer=trainer)
        rank_zero_only.rank = trainer.global_rank
        _resolve_run_dir(trainer)
        _prepare_data(trainer)
        if datamodule is not None:
            _attach_datamodule(datamodule, trainer)
            _datamodule_hook(datamodule, "setup", setup_stage)
        if callbacks is not None:
            callbacks.setup(trainer, setup_stage)  # Lightning: the callbacks', then the module's
        if _defines_hook(module, "setup"):
            # Lightning: the module's setup comes before its *_dataloader() methods (it may
            # build the datasets there); the plugins' setup (after) sees the loaders
            module.setup(setup_stage)
        _resolve_loaders(trainer, stage)
        hook.setup(trainer=trainer, stage=setup_stage)
        set_up = True
        yield
    except BaseException as exc:
        # A collective that timed out or lost a peer: say which one, and which rank.
        state.status = "interrupted"
        explained = faults.collective_failure_error(trainer, exc) if trainer.world_size > 1 else None
        if set_up and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            hook.on_exception(trainer=trainer, exception=explained or exc)
        if explained is not None:
            raise explained from exc
        raise
    finally:
        try:
            hook.teardown(trainer=trainer, stage=setup_stage)
            if datamodule is not None:
                _datamodule_hook(datamodule, "teardown", setup_stage)
        finally:
            if module_hooks is not None:
                trainer.plugin_manager.unregister(module_hooks)
            module.__dict__.pop("_hookloop_trainer", None)
            trainer.state.backward_events = None
            if state.status == "running":
                state.status = "finished"


def _attach_datamodule(datamodule: Any, trainer) -> None:
    """``datamodule.trainer = trainer``, for a DataModule of any kind: an object that only
    looks like one (Lightning's duck type) and takes no new attribute goes without."""
    try:
        datamodule.trainer = trainer
    except AttributeError:
        pass


def _datamodule_hook(datamodule: Any, name: str, *args: Any) -> None:
    """The DataModule's hook ``name`` if it defines one: a DataModule by duck type (any
    object with ``*_dataloader()`` methods) need not define ``setup``/``teardown``."""
    hook = getattr(datamodule, name, None)
    if callable(hook):
        hook(*args)


def claim_run_dirs(trainer) -> list[str]:
    """Global rank 0's directories for the run: ``[run directory, one per logger]`` (a
    logger's entry ``None`` when it writes into the run directory). A logger that places
    its own version directories (``hookloop_run_root()``, Lightning's ``save_dir/name``)
    gets one claimed there; the first logger's is the run directory, else it is
    ``<default_root_dir>/logs/version_N``."""
    from . import rundir

    token = rundir.run_token()
    dirs: list = []
    for logger in trainer.loggers:
        root = getattr(logger, "hookloop_run_root", None)
        root = root() if callable(root) else None
        dirs.append(None if root is None else str(rundir.claim_in(root[0], token, trainer.state.run_index, root[1])))
    run_dir = dirs[0] if dirs and dirs[0] is not None else str(rundir.claim(trainer.default_root_dir, token, trainer.state.run_index))
    return [run_dir, *dirs]


def adopt_run_dirs(trainer, dirs: list[str]) -> None:
    """Every rank: the run directory, and each logger's (``hookloop_use_run_dir``)."""
    trainer.state.log_dir = Path(dirs[0])
    for logger, path in zip(trainer.loggers, dirs[1:]):
        if path is not None:
            logger.hookloop_use_run_dir(path)


def _resolve_run_dir(trainer) -> None:
    """``trainer.log_dir`` and the loggers' directories: decided by global rank 0 (once
    per Trainer) and broadcast."""
    if trainer.state.log_dir is None:
        chosen = None
        if trainer.global_rank == 0:
            try:
                chosen = claim_run_dirs(trainer)
            except OSError as exc:
                # Told to every rank, so none waits for a directory that never comes.
                chosen = OSError(f"{exc.strerror or exc}: {exc.filename or trainer.default_root_dir}")
        chosen = trainer.broadcast(chosen, 0)
        if isinstance(chosen, OSError):
            raise ConfigurationError(
                f"cannot create the run directory under default_root_dir={str(trainer.default_root_dir)!r} "
                f"or a logger's save_dir ({chosen}): make it writable or choose another (Trainer(default_root_dir=...) "
                f"or --default-root-dir, the logger's save_dir)"
            )
        adopt_run_dirs(trainer, chosen)


try:
    from pluggy._callers import _multicall as _PLUGGY_MULTICALL
except ImportError:  # pragma: no cover - another pluggy: events always go through pluggy
    _PLUGGY_MULTICALL = None


def _event(trainer, name: str) -> Callable | None:
    """A caller of event ``name`` (keyword arguments, a list of the non-None results, as
    pluggy's), or ``None`` when nobody implements it.

    Resolved once per epoch or evaluation run, it is what the per-step path calls. When
    the implementations are plain functions (no wrappers) and nobody monitors the hook
    calls (pluggy's ``add_hookcall_monitoring``), it calls them directly, in pluggy's
    order and with pluggy's arguments: a per-step event then costs one call per
    implementation instead of pluggy's dispatch (about ten calls).
    """
    caller = getattr(trainer.hook, name)
    impls = caller.get_hookimpls()
    if not impls:
        return None
    if (_PLUGGY_MULTICALL is None or getattr(trainer.plugin_manager, "_inner_hookexec", None) is not _PLUGGY_MULTICALL
            or caller.spec is None or caller.spec.opts.get("firstresult")
            or any(impl.hookwrapper or impl.wrapper for impl in impls)):
        return caller
    return _direct_caller(name, caller.spec.argnames, [(impl.function, impl.argnames) for impl in reversed(impls)])


def _direct_caller(name: str, argnames: tuple[str, ...], impls: list) -> Callable:
    """``def call(*, <hook args>)`` calling each implementation with its own arguments."""
    namespace: dict[str, Any] = {}
    lines = [f"def {name}(*, {', '.join(argnames)}):", "    out = []"]
    for i, (function, names) in enumerate(impls):
        namespace[f"f{i}"] = function
        lines += [f"    r = f{i}({', '.join(names)})", "    if r is not None:", "        out.append(r)"]
    lines.append("    return out")
    exec("\n".join(lines), namespace)  # noqa: S102 - names from the hook specs and implementations
    return namespace[name]


def _resolve_events(trainer) -> None:
    # Read by public helpers on the step path (hookloop.before_optimizer_step).
    trainer.state.on_before_optimizer_step = _event(trainer, "on_before_optimizer_step")
    trainer.state.on_before_zero_grad = _event(trainer, "on_before_zero_grad")
    trainer.state.on_log_metrics = _event(trainer, "on_log_metrics")
    trainer.state.module_epoch_end = next((impl for impl in trainer.hook.on_train_epoch_end.get_hookimpls()
                                      if impl.plugin_name.startswith("module:")), None)


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


def _prepare_data(trainer) -> None:
    """``prepare_data`` of the DataModule and the module: once per node (or per job),
    on one rank, while the others wait."""
    sources = [s for s in (trainer.datamodule, trainer.module) if callable(getattr(type(s), "prepare_data", None))]
    if not sources:
        return
    for source in sources:
        per_node = getattr(source, "prepare_data_per_node", True)
        if (trainer.local_rank if per_node else trainer.global_rank) == 0:
            source.prepare_data()
    trainer.barrier("prepare_data")


def _resolve_loaders(trainer, stage: str) -> None:
    """The loaders of this run: those passed in, else the DataModule's, else the module's.

    As Lightning's fit: when a sanity check will run, the validation loaders are made
    first, and what ``val_dataloader()`` draws from the random generators is undone
    (Lightning makes them for the sanity check, inside ``isolate_rng``); the training
    loader is made after, from the generators as they were."""
    order = [
        ("train_dataloader", "train_dataloader", stage == "fit"),
        ("val_dataloaders", "val_dataloader", stage in ("fit", VALIDATE)),
        ("test_dataloaders", "test_dataloader", stage == TEST),
        ("predict_dataloaders", "predict_dataloader", stage == PREDICT),
    ]
    config = trainer.config
    isolate = (stage == "fit" and config.num_sanity_val_steps != 0 and config.limit_val_batches != 0
               and trainer.state.ckpt_path is None)
    if isolate:
        order[0], order[1] = order[1], order[0]
    for attr, method, wanted in order:
        if not wanted or getattr(trainer, attr) is not None:
            continue
        source = next((s for s in (trainer.datamodule, trainer.module) if s is not None and provides(s, method)), None)
        if source is None or getattr(source, method, None) is None:
            continue  # none, or set to None (how Lightning's tests turn a loader off)
        if attr == "val_dataloaders" and stage == "fit" and not callable(getattr(trainer.module, "validation_step", None)):
            trainer.print(f"hookloop: {type(source).__name__}.val_dataloader() is not used: {type(trainer.module).__name__} has no validation_step")
            continue
        if isolate and attr == "val_dataloaders":
            rng = ckpt.rng_state()
            try:
                loaders = getattr(source, method)()
            finally:
                ckpt.set_rng_state(rng)
        else:
            loaders = getattr(source, method)()
        setattr(trainer, attr, loaders if attr == "train_dataloader" else as_loader_list(loaders, f"{type(source).__name__}.{method}()"))
    if stage == "fit":
        if trainer.train_dataloader is None:
            raise ConfigurationError(
                "fit needs training data: pass train_dataloaders, or a datamodule (or module) "
                "with train_dataloader()"
            )
        check_loader(trainer.train_dataloader, "train_dataloaders")
    else:
        attr = {VALIDATE: "val_dataloaders", TEST: "test_dataloaders", PREDICT: "predict_dataloaders"}[stage]
        if not getattr(trainer, attr):
            raise ConfigurationError(
                f"{stage} needs data: pass dataloaders, or a datamodule (or module) with "
                f"{attr[:-1]}()"
            )


def check_loader(loader: Any, name: str) -> None:
    if isinstance(loader, (list, tuple, dict)):
        raise ConfigurationError(
            f"{name}: hookloop trains on one DataLoader, got a {type(loader).__name__}; combine "
            f"the datasets (torch.utils.data.ConcatDataset) into one loader"
        )
    if not isinstance(loader, DataLoader):
        raise TypeError(f"{name} must be a torch.utils.data.DataLoader, got {type(loader).__name__}")


def as_loader_list(loaders: Any, name: str) -> list[DataLoader] | None:
    """One loader, a list/tuple, or a dict (in its order) -> a list of DataLoaders."""
    if loaders is None:
        return None
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    for i, loader in enumerate(loaders):
        if not isinstance(loader, DataLoader):
            raise TypeError(f"{name}[{i}] must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
    return list(loaders)


# ---------------------------------------------------------------------------------------
# Model, optimizers and loaders
# ---------------------------------------------------------------------------------------


def build_model(trainer, stage: str) -> None:
    """``configure_model`` in the strategy's init context, ``configure_optimizers``, then
    the strategy wraps the model and (each of) the optimizers."""
    module, hook = trainer.module, trainer.hook
    if callable(getattr(module, "configure_model", None)):
        with hook.model_init_context(trainer=trainer):
            module.configure_model()
    optimizers: list = []
    trainer.lr_scheduler_configs = []
    if stage == "fit":
        optimizers, trainer.lr_scheduler_configs = parse_optimizers(
            module.configure_optimizers(), type(module).__name__, trainer.automatic_optimization
        )
    trainer.model = hook.wrap_model(
        trainer=trainer, model=_StepModule(module), optimizer=optimizers[0] if optimizers else None, optimizers=optimizers
    )
    wrapped = []
    for optimizer in optimizers:
        replaced = hook.wrap_optimizer(trainer=trainer, model=trainer.model, optimizer=optimizer)
        wrapped.append(optimizer if replaced is None else replaced)
    trainer.optimizers = wrapped


def prepare_loader(trainer, loader: DataLoader | None, training: bool) -> DataLoader | None:
    """The loader this rank iterates: the strategy's sampler in place of the user's."""
    if loader is None or not trainer.config.use_distributed_sampler:
        return loader
    sampler = trainer.hook.configure_sampler(trainer=trainer, dataloader=loader, training=training)
    return loader if sampler is None else rebuild_dataloader(loader, sampler)


def _sharded_samples(sampler: Any) -> int | None:
    """How many samples a sampler that hookloop knows shares out between the processes
    (``DistributedSampler``'s dataset; the user's sampler under ``DistributedSamplerWrapper``);
    ``None`` for any other sampler."""
    if isinstance(sampler, DistributedSampler):
        return len(sampler.dataset)
    if isinstance(sampler, DistributedSamplerWrapper):
        return len(sampler.sampler)
    return None


def repeated_samples(sampler: Any) -> tuple[int, int, int]:
    """``(samples, processes, repeated)`` for a sampler that shares a dataset between
    processes by padding (``DistributedSampler`` without ``drop_last``, hookloop's
    ``DistributedSamplerWrapper``): every rank gets ``ceil(samples / processes)`` indices,
    ``repeated`` of them drawn a second time. ``(0, 1, 0)`` for any other sampler."""
    total = _sharded_samples(sampler)
    if total is None or getattr(sampler, "drop_last", False):
        return 0, 1, 0
    world = sampler.num_replicas
    return total, world, -total % world


def warn_repeated_samples(trainer, loaders: list, what: str) -> None:
    """Say (on global rank 0, once per loader) when evaluation metrics will count some
    samples twice: a padding sampler repeats samples so every rank runs the same number of
    batches. Lightning does the same and warns; predictions are de-duplicated
    (``_gather_predictions``), metrics are not."""
    if trainer.global_rank != 0:
        return
    for index, loader in enumerate(loaders):
        total, world, repeated = repeated_samples(getattr(loader, "sampler", None))
        if repeated:
            which = f"the {what} loader" + (f" {index}" if len(loaders) > 1 else "")
            warnings.warn(
                f"{which} has {total} samples for {world} processes: the DistributedSampler repeats {repeated} of "
                f"them so that every rank gets {-(-total // world)}, and {what} metrics count those twice (as in "
                f"Lightning). For exact metrics run {what} on one process, or give the loader a multiple of {world} "
                f"samples.",
                stacklevel=2,
            )


def batch_limit(loader: Any, limit: int | float | None, name: str) -> int | None:
    """How many batches of ``loader`` to run: ``limit`` as a count or a fraction of its
    length; ``None`` for an unsized loader without a count."""
    try:
        n = len(loader)
    except TypeError:
        n = None
    if limit is None or (isinstance(limit, float) and limit == 1.0):
        return n
    if isinstance(limit, float):
        if n is None:
            raise ConfigurationError(
                f"{name}={limit} is a fraction of the loader, but the loader has no length (an "
                f"IterableDataset): give a number of batches, e.g. {name}=100"
            )
        count = int(n * limit)
        if count == 0 and limit > 0:
            raise ConfigurationError(
                f"{name}={limit} of {n} batches is less than one batch: use at least "
                f"{name}={1 / n:.4g} (or a number of batches)"
            )
        return count
    return limit if n is None else min(n, limit)


def _overfit_loader(trainer, loader: DataLoader) -> DataLoader:
    """``overfit_batches``: the same first batches every epoch, never shuffled."""
    if isinstance(loader.sampler, RandomSampler):
        trainer.print("hookloop: overfit_batches: the training loader's shuffling is turned off, so every epoch sees the same batches")
    sharded = trainer.world_size > 1 and trainer.config.use_distributed_sampler
    if isinstance(loader.sampler, RandomSampler) or (
            sharded and type(loader.sampler) is SequentialSampler and type(loader.batch_sampler) is BatchSampler):
        # Sequential, and kept so by the distributed sampler (which shuffles training loaders).
        return rebuild_dataloader(loader, OrderedSampler(loader.dataset))
    return loader


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
# fit
# ---------------------------------------------------------------------------------------


def fit(trainer) -> None:
    """Train ``trainer.module``: the whole of ``Trainer.fit`` inside one worker."""
    with session(trainer, "fit"):
        config, hook = trainer.config, trainer.hook
        build_model(trainer, "fit")
        train_loader = trainer.train_dataloader
        if config.overfit_batches:
            train_loader = _overfit_loader(trainer, train_loader)
        train_loader = prepare_loader(trainer, train_loader, training=True)
        # skippable by index, with per-batch worker seeds (hookloop.loader_state)
        train_loader = trainer.state.fit_train_loader = loader_state.resumable_loader(train_loader)
        # with workers: per-batch worker seeds, the same after a resume (hookloop.loader_state)
        val_loaders = [loader_state.resumable_loader(prepare_loader(trainer, v, training=False))
                       if getattr(v, "num_workers", 0) else prepare_loader(trainer, v, training=False)
                       for v in trainer.val_dataloaders or []]
        trainer.state.fit_val_loaders = val_loaders
        warn_repeated_samples(trainer, val_loaders, "validation")
        if val_loaders and not callable(getattr(trainer.module, "validation_step", None)):
            raise ConfigurationError(
                f"val_dataloaders were given but {type(trainer.module).__name__} has no "
                f"validation_step(batch, batch_idx)"
            )
        trainer.state.train_batch_size = _per_device_batch(train_loader)  # saved in checkpoints' loop state
        # Lightning's: known from setup on (progress bars read it at on_train_start)
        trainer.num_training_batches = batch_limit(train_loader, config.limit_train_batches, "limit_train_batches")
        if trainer.state.ckpt_path is not None:
            restore(trainer, trainer.state.ckpt_path, train_loader=train_loader)
        else:
            resume_after_restart(trainer, train_loader=train_loader)
        _print_effective_batch(trainer, train_loader)
        validation = _ValidationSchedule(trainer, train_loader, val_loaders)
        hook.on_fit_start(trainer=trainer)
        if val_loaders and config.num_sanity_val_steps and validation.enabled:
            _sanity_check(trainer, val_loaders)
        if trainer.should_stop:
            # Lightning's skip: stopped before training (a Timer whose time is up at fit
            # start): no training events, no epoch.
            hook.on_fit_end(trainer=trainer)
            return
        metrics = trainer.state.metrics
        fresh_epoch = not trainer.batch_idx and trainer.state.loop_stage != "epoch_end"
        if fresh_epoch:
            # what on_train_start logs belongs to the first epoch's values (Lightning)
            metrics.start("train")
            trainer.state.epoch_val_metrics = {}
        metrics.stage, metrics.epoch_level = "train", True
        try:
            hook.on_train_start(trainer=trainer)
        finally:
            metrics.epoch_level = False
        max_epochs = config.max_epochs
        if max_epochs is None:
            max_epochs = 1000 if config.max_steps is None else sys.maxsize
        step = make_training_step(trainer)
        # SIGTERM: stop at the next optimizer-step boundary with a checkpoint (hookloop.faults).
        preemption = trainer.state.preemption = faults.Preemption().install()
        try:
            preemption.prepare(trainer)
            _fit_epochs(trainer, train_loader, step, validation, max_epochs, started=fresh_epoch)
            preemption.finish()
            hook.on_train_end(trainer=trainer)
            hook.on_fit_end(trainer=trainer)
        except BaseException:
            preemption.uninstall(pass_on=False)
            raise
        finally:
            trainer.state.preemption = None
            loader_state.release(trainer)  # persistent workers end with fit, as before
        # A SIGTERM after the last step boundary goes to the handler from before fit.
        preemption.uninstall()


def _fit_epochs(trainer, train_loader, step, validation, max_epochs: int, started: bool = False) -> None:
    """The epochs of ``fit``, from where a restored checkpoint left off (``started``: the
    first epoch's metrics were already started, before ``on_train_start``)."""
    hook = trainer.hook
    while trainer.current_epoch < max_epochs and not _done(trainer):
        epoch = trainer.current_epoch
        resumed_stage = trainer.state.loop_stage
        if resumed_stage != "epoch_end":
            sampler = getattr(train_loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            if not trainer.batch_idx and not started:
                trainer.state.metrics.start("train")  # a mid-epoch resume keeps the restored sums
                trainer.state.epoch_val_metrics = {}
            started = False
            metrics = trainer.state.metrics
            metrics.stage = "train"
            trainer.model.train()
            metrics.epoch_level = True  # self.log here is per epoch (Lightning's defaults)
            try:
                hook.on_train_epoch_start(trainer=trainer, epoch=epoch)
            finally:
                metrics.epoch_level = False
            ended = _train_epoch(trainer, train_loader, step, validation)
            if ended == EPOCH_STOPPED:
                # Stopped inside the epoch (max_steps, should_stop): it ends, but the
                # position stays, so a checkpoint resumes at the next batch of this epoch.
                _end_epoch(trainer, epoch, resumed_stage, stopped=True)
                break
        else:
            ended = EPOCH_DONE  # resumed inside on_train_epoch_end: the epoch had all its batches
        _end_epoch(trainer, epoch, resumed_stage, complete=ended in (EPOCH_DONE, EPOCH_CUT))


def _done(trainer) -> bool:
    max_steps = trainer.config.max_steps
    return trainer.should_stop or (max_steps is not None and trainer.global_step >= max_steps)


def _per_device_batch(loader: Any) -> int | None:
    """The batch size of one process's training batches, ``None`` where the loader does
    not say (a custom batch sampler, an iterable dataset batching itself)."""
    size = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return int(size) if isinstance(size, int) else None


def _print_effective_batch(trainer, loader: DataLoader) -> None:
    if trainer.global_rank != 0 or trainer.world_size * trainer.accumulate_grad_batches <= 1:
        return
    per_device = _per_device_batch(loader)
    factors = f"{trainer.world_size} processes x {trainer.accumulate_grad_batches} accumulated batches"
    if per_device is None:
        print(f"hookloop: effective batch size = (batch_sampler's batches) x {factors}", flush=True)
        return
    total = per_device * trainer.world_size * trainer.accumulate_grad_batches
    print(f"hookloop: effective batch size {total} = {per_device} per device x {factors}", flush=True)


def _sanity_check(trainer, val_loaders: list) -> None:
    """``num_sanity_val_steps`` batches of each validation loader before training, to fail
    early on a broken validation_step. Its metrics are discarded and it draws nothing from
    the random generators, so training is the same with or without it."""
    hook = trainer.hook
    trainer.sanity_checking = True
    try:
        hook.on_sanity_check_start(trainer=trainer)
        steps = trainer.config.num_sanity_val_steps
        evaluate(trainer, VALIDATE, val_loaders, limit=None if steps == -1 else steps, publish=False)
        hook.on_sanity_check_end(trainer=trainer)
    finally:
        trainer.sanity_checking = False


class _ValidationSchedule:
    """When validation runs during ``fit``: Lightning's ``val_check_interval`` (every N
    batches, or a fraction of the epoch; default: at the end of the epoch) and
    ``check_val_every_n_epoch`` (``None``: count batches across epochs)."""

    def __init__(self, trainer, train_loader: DataLoader, val_loaders: list):
        config = trainer.config
        self.trainer, self.val_loaders = trainer, val_loaders
        self.enabled = bool(val_loaders) and config.limit_val_batches != 0
        self.every_n_epochs = config.check_val_every_n_epoch
        interval = config.val_check_interval
        n = batch_limit(train_loader, config.limit_train_batches, "limit_train_batches")
        self.batches: int | None  # validate after every this many batches; None: at the end
        if isinstance(interval, float):
            if n is None:
                if interval != 1.0:
                    raise ConfigurationError(
                        f"val_check_interval={interval} is a fraction of the epoch, but the training "
                        f"loader has no length (an IterableDataset): give a number of batches, "
                        f"val_check_interval=N, or 1.0 for the end of the epoch"
                    )
                self.batches = None
            else:
                self.batches = max(1, int(n * interval))
        else:
            if self.enabled and self.every_n_epochs is not None and n is not None and interval > n:
                raise ConfigurationError(
                    f"val_check_interval={interval} is more than the {n} training batches of an "
                    f"epoch: validate every N <= {n} batches, or count batches across epochs with "
                    f"check_val_every_n_epoch=None (limit_val_batches=0 turns validation off)"
                )
            self.batches = interval

    def due_this_epoch(self) -> bool:
        """Whether validation may run during the current epoch at all."""
        if not self.enabled:
            return False
        return self.every_n_epochs is None or (self.trainer.current_epoch + 1) % self.every_n_epochs == 0

    def due(self, batch_idx: int, is_last: bool) -> bool:
        """Whether validation runs after ``batch_idx`` (``due_this_epoch`` is checked first)."""
        trainer = self.trainer
        if not self.due_this_epoch():
            return False
        if self.batches is None:
            return is_last
        # across epochs: the batches trained so far, this one included
        done = batch_idx + 1 if self.every_n_epochs is not None else trainer.state.total_batch_idx
        return done % self.batches == 0

    def run(self) -> None:
        trainer = self.trainer
        results = evaluate(trainer, VALIDATE, self.val_loaders, limit=trainer.config.limit_val_batches)
        trainer.state.epoch_val_metrics = {k: v for r in results for k, v in r.items()}
        log_row(trainer, trainer.state.epoch_val_metrics)
        trainer.state.loop_stage = "validated"
        for after in trainer.state.after_validation:
            after(trainer)


def _lookahead(iterator, start: int, before_reading: Callable | None = None):
    """``(batch_idx, batch, is_last)`` of an unsized loader, read one batch ahead so that
    its last batch is known (it ends an accumulation window). ``before_reading()`` is
    called before each batch after the first is read."""
    try:
        batch = next(iterator)
    except StopIteration:
        return
    batch_idx = start
    while True:
        if before_reading is not None:
            before_reading()
        try:
            following = next(iterator)
        except StopIteration:
            break
        yield batch_idx, batch, False
        batch, batch_idx = following, batch_idx + 1
    yield batch_idx, batch, True


def _pending_state(trainer, loader) -> Callable:
    """Remember a stateful loader's state before the loop reads ahead: a checkpoint
    written after the current batch resumes at the next one, not the one after."""
    def remember() -> None:
        trainer.state.loader_state_pending = loader.state_dict()
    return remember


# How an epoch of training ended: all its batches, cut by on_train_batch_start returning -1,
# or stopped inside it (max_steps, should_stop).
EPOCH_DONE, EPOCH_CUT, EPOCH_STOPPED = "done", "cut", "stopped"


def _train_epoch(trainer, loader: DataLoader, step, validation: _ValidationSchedule) -> str:
    """Train one epoch (validating when due); how it ended (``EPOCH_*``)."""
    n = batch_limit(loader, trainer.config.limit_train_batches, "limit_train_batches")
    trainer.num_training_batches = n  # for observers (progress bars); None: unsized
    accumulate = trainer.accumulate_grad_batches
    set_accumulate = getattr(step, "set_accumulate", None)
    if set_accumulate is not None:
        set_accumulate(accumulate)  # a callback may change it at the epoch's start
    skip, resumed_stage = trainer.batch_idx, trainer.state.loop_stage
    if skip and n is not None and skip >= n:
        # The checkpoint was written after the epoch's last batch: nothing left to train.
        if resumed_stage == "train" and validation.due(skip - 1, True):
            validation.run()  # it came after the checkpoint in the interrupted run
        return EPOCH_DONE
    # Resuming mid-epoch: a stateful loader loads its state; hookloop's batch sampler skips
    # the done batches' indices; any other loader reads them again (hookloop.loader_state).
    replay = loader_state.start_epoch(trainer, loader, skip)
    if skip:
        # the epoch's shuffle is drawn as it was at its start
        resume_rng = ckpt.rng_state()
        ckpt.set_rng_state(trainer.state.epoch_rng)
    else:
        trainer.state.epoch_rng = ckpt.rng_state()
    iterator = loader_state.iterate(loader, trainer.current_epoch)
    if skip:
        if replay:
            for _ in range(skip):
                next(iterator)
        ckpt.set_rng_state(resume_rng)
        if resumed_stage == "train" and validation.due(skip - 1, False):
            validation.run()  # it came after the checkpoint in the interrupted run
    batch_start = _event(trainer, "on_train_batch_start")
    preemption = trainer.state.preemption
    single = trainer.world_size == 1  # one process: the SIGTERM flag is read, no call per step
    # Sized loaders (the common case) need no look-ahead; is_last is a comparison.
    if n is not None:
        batches = enumerate(iterator, skip)
    else:
        # a stateful loader's state is taken before the batch read ahead
        batches = _lookahead(iterator, skip, _pending_state(trainer, loader) if loader_state.is_stateful(loader) else None)
    validate = validation.due if validation.due_this_epoch() else None
    step_plateau = trainer.automatic_optimization and any(
        c.interval == "step" and c.reduce_on_plateau for c in trainer.lr_scheduler_configs)
    for item in batches:
        if n is not None:
            batch_idx, batch = item
            if batch_idx >= n:
                break
            is_last = batch_idx + 1 == n
        else:
            batch_idx, batch, is_last = item
        trainer.batch_idx = trainer.state.fetched_batch_idx = batch_idx
        trainer.is_last_batch = is_last
        if batch_start is not None and -1 in batch_start(trainer=trainer, batch=batch, batch_idx=batch_idx):
            # Lightning: on_train_batch_start returning -1 ends the epoch (inside a window:
            # its gradients are zeroed at the next window's start). Lightning marks the
            # skipping batch the epoch's last, so its (non-plateau) step and epoch
            # schedulers step there, and the epoch's plateau ones after on_train_epoch_end.
            trainer.is_last_batch = True
            if trainer.automatic_optimization and trainer.lr_scheduler_configs:
                step_schedulers(trainer, "step", plateau=False, count=batch_idx + 1)
                step_schedulers(trainer, "epoch", plateau=False, count=trainer.current_epoch + 1)
            return EPOCH_CUT
        boundary = is_last or (batch_idx + 1) % accumulate == 0
        stop = step(batch, batch_idx, boundary, is_last)  # it counts the batch as done (_batch_done)
        if boundary and preemption is not None and (preemption.requested if single else preemption.agreed(trainer)):
            preemption.stop(trainer)  # checkpoint and SystemExit, on every rank
        # As Lightning: validation when due, and when should_stop ends the epoch early;
        # should_stop set by that validation (early stopping) ends the epoch here.
        if validate is not None and (validate(batch_idx, is_last) or (stop and trainer.should_stop)):
            validation.run()
            stop = stop or trainer.should_stop
        if boundary and step_plateau:  # after validation, so it can monitor a validation metric
            step_schedulers(trainer, "step", plateau=True, count=batch_idx + 1)
        if stop:
            return EPOCH_DONE if is_last else EPOCH_STOPPED
    return EPOCH_DONE


def _end_epoch(trainer, epoch: int, resumed_stage: str, stopped: bool = False, complete: bool = False) -> None:
    """Epoch metrics, ``on_train_epoch_end``, plateau schedulers, then the next epoch.

    A run resumed from a checkpoint written inside ``on_train_epoch_end``
    (``resumed_stage == "epoch_end"``) does only what came after that event.

    ``stopped``: training stopped inside the epoch (``max_steps``, ``should_stop``). The
    epoch ends as in Lightning (its metrics over the batches trained, logged;
    ``on_train_epoch_end``; no scheduler steps), but the loop's position
    inside the epoch stays, and so do the epoch's partial metric sums, in memory and in
    any checkpoint written meanwhile: a resume continues at the next batch and reports
    the whole epoch's metrics.
    """
    metrics = trainer.state.metrics
    if resumed_stage != "epoch_end":
        metrics.stage = "train"
        partial = metrics.kept_train_sums = metrics.epoch_sums.get("train", {}) if stopped else None
        try:
            train_metrics = metrics.finish_epoch("train")
            trainer.state.epoch_row = train_metrics
            epoch_metrics = {**train_metrics, **trainer.state.epoch_val_metrics}
            if not stopped:
                trainer.state.loop_stage = "epoch_end"
            if trainer.state.module_epoch_end is None:
                log_epoch_row(trainer)
            # else the module's on_train_epoch_end (first of all implementations) logs the row
            # with what the module logs there, before any plugin (a checkpoint) sees the event
            trainer.hook.on_train_epoch_end(trainer=trainer, epoch=epoch, metrics=epoch_metrics)
            metrics.reset_metric_objects("train")  # torchmetrics Metrics, after the hook (Lightning)
        finally:
            if stopped:
                metrics.epoch_sums["train"], metrics.kept_train_sums = partial, None
    if stopped:
        return
    # ReduceLROnPlateau (epoch interval) after on_train_epoch_end, so it can monitor what the
    # module logs there; only after an epoch that ran all its batches (as Lightning).
    if complete and trainer.automatic_optimization:
        step_schedulers(trainer, "epoch", plateau=True, count=epoch + 1)
    trainer.current_epoch = epoch + 1
    trainer.batch_idx = 0
    trainer.state.loop_stage = "train"


# ---------------------------------------------------------------------------------------
# The training step
# ---------------------------------------------------------------------------------------


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
    if only_default("optimizer_step") and not trainer.gradient_clip_val and trainer.state.on_before_optimizer_step is None:
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


def make_training_step(trainer):
    """Build the per-micro-batch function once, with everything that can be decided
    before the first step decided. It returns True when training should stop."""
    hook, model, module, metrics = trainer.hook, trainer.model, trainer.module, trainer.state.metrics
    manual = not trainer.automatic_optimization
    contexts = [c for c in hook.forward_context(trainer=trainer) if c is not None]
    forward = _forward(trainer, TRAIN)
    step_end_user = getattr(module, "training_step_end", None)
    step_end_plugins = _event(trainer, "training_step_end")
    before_backward = _event(trainer, "on_before_backward")
    after_backward = _event(trainer, "on_after_backward")
    batch_end = _event(trainer, "on_train_batch_end")
    max_steps = trainer.config.max_steps
    device = trainer.root_device
    move = device.type != "cpu"
    log_rows = trainer.state.on_log_metrics is not None
    every = trainer.config.log_every_n_steps
    if manual:
        trainer.state.backward_events = (before_backward, after_backward)  # for manual_backward

        def step(batch, batch_idx: int, boundary: bool, is_last: bool = False) -> bool:
            if move:
                batch = move_to_device(batch, device)
            trainer.state.current_batch = batch
            metrics.step_token += 1
            with _enter(contexts):
                out = forward(batch, batch_idx)
            if step_end_user is not None:
                out = step_end_user(out)
            if step_end_plugins is not None:
                out = _step_end(step_end_plugins, trainer, out)
            loss = _manual_loss(out)
            _batch_done(trainer, batch_idx)
            logged = trainer.step_row_pending = (
                log_rows and trainer.global_step // every > trainer.state.logged_step // every)
            if batch_end is not None:
                outputs = apply_to_tensors(out, torch.Tensor.detach)
                batch_end(trainer=trainer, outputs=outputs, loss=loss, batch=batch, batch_idx=batch_idx)
            if logged:
                trainer.step_row_pending = False
                trainer.state.logged_step = trainer.global_step
                _log_step_metrics(trainer)
            return trainer.should_stop or (max_steps is not None and trainer.global_step >= max_steps)

        return step

    optimizer = trainer.optimizers[0]
    backward, optimizer_step, zero_grad = _step_functions(trainer, model, optimizer)
    accumulate = trainer.accumulate_grad_batches
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
        trainer.state.current_batch = batch  # for self.log's batch size, computed only if asked
        metrics.step_token += 1
        if batch_idx % accumulate == 0:
            # before the forward: a strategy may run the backward inside it (a pipeline)
            zero_grad()
        sync_ctx = None if boundary or accumulate == 1 else accumulation_context(trainer=trainer, model=model)
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
        if boundary:
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
        trainer.state.loop_stage = "train"
        trainer.state.total_batch_idx += 1
        if batch_end is not None:
            detached = loss.detach()
            outputs = detached if out is loss else apply_to_tensors(out, torch.Tensor.detach)
            batch_end(trainer=trainer, outputs=outputs, loss=detached, batch=batch, batch_idx=batch_idx)
        if logged:  # after on_train_batch_end, so what is logged there is in the row (Lightning)
            trainer.step_row_pending = False
            _log_step_metrics(trainer)
        # should_stop set by a plugin at this batch's end stops here (as in Lightning).
        return stop or trainer.should_stop

    def set_accumulate(value: int) -> None:
        nonlocal accumulate
        accumulate = value

    step.set_accumulate = set_accumulate
    return step


def _batch_done(trainer, batch_idx: int) -> None:
    """The loop's position after a batch, set before on_train_batch_end: a checkpoint
    written there resumes at the next batch."""
    trainer.batch_idx = batch_idx + 1
    trainer.state.loop_stage = "train"
    trainer.state.total_batch_idx += 1


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


# Manual optimization: what the module's self.optimizers() / manual_backward() call.


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
    before, after = events if events is not None else (_event(trainer, "on_before_backward"),
                                                       _event(trainer, "on_after_backward"))
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


# ---------------------------------------------------------------------------------------
# validate / test
# ---------------------------------------------------------------------------------------


def run_evaluation(trainer, stage: str) -> list[dict]:
    """``Trainer.validate``/``test`` inside one worker."""
    with session(trainer, stage):
        build_model(trainer, stage)
        attr = "val_dataloaders" if stage == VALIDATE else "test_dataloaders"
        loaders = [prepare_loader(trainer, loader, training=False) for loader in getattr(trainer, attr)]
        warn_repeated_samples(trainer, loaders, "validation" if stage == VALIDATE else "test")
        if trainer.state.ckpt_path is not None:
            restore(trainer, trainer.state.ckpt_path)
        limit = trainer.config.limit_val_batches if stage == VALIDATE else trainer.config.limit_test_batches
        results = evaluate(trainer, stage, loaders, limit=limit)
        log_row(trainer, {k: v for r in results for k, v in r.items()})
        if trainer.state.verbose and trainer.global_rank == 0:
            _print_results(stage, results)
        return results


def evaluate(trainer, stage: str, loaders: list, limit: Any, publish: bool = True) -> list[dict]:
    """Run ``validation_step``/``test_step`` over ``loaders``; one dict of metrics per
    loader (names suffixed ``/dataloader_idx_N`` when there are several).

    The model is in eval mode and gradients are off; the random generators are restored
    afterwards, so validating never changes what training draws. ``publish=False`` (the
    sanity check) keeps the metrics out of ``trainer.callback_metrics``.
    """
    hook, model, metrics = trainer.hook, trainer.model, trainer.state.metrics
    prefix = EVENT_PREFIX[stage]
    saved = (metrics.stage, metrics.suffix, metrics.epoch_level)
    was_training = model.training
    rng = ckpt.rng_state()
    batch_start = _event(trainer, f"on_{prefix}_batch_start")
    batch_end = _event(trainer, f"on_{prefix}_batch_end")
    step_end_user = getattr(trainer.module, f"{STEP_METHODS[stage]}_end", None)
    device = trainer.root_device
    move = device.type != "cpu"
    contexts = [c for c in hook.forward_context(trainer=trainer) if c is not None]
    forward = _forward(trainer, stage, len(loaders))
    model.eval()
    metrics.start(stage)
    # Lightning's per-loader batch counts, for progress bars (num_val_batches, ...)
    limit_name = f"limit_{'val' if stage == VALIDATE else stage}_batches"
    counts = [batch_limit(loader, limit, limit_name) for loader in loaders]
    setattr(trainer, "num_sanity_val_batches" if trainer.sanity_checking else f"num_{EVAL_COUNT[stage]}_batches", counts)
    try:
        getattr(hook, f"on_{prefix}_start")(trainer=trainer)
        _epoch_level_event(trainer, f"on_{prefix}_epoch_start")
        with torch.no_grad(), _enter(contexts):
            for dataloader_idx, loader in enumerate(loaders):
                metrics.suffix = f"/dataloader_idx_{dataloader_idx}" if len(loaders) > 1 else ""
                n = batch_limit(loader, limit, f"limit_{'val' if stage == VALIDATE else stage}_batches")
                if n == 0:
                    continue
                for batch_idx, batch in enumerate(loader_state.iterate_validation(loader)):
                    if move:
                        batch = move_to_device(batch, device)
                    trainer.state.current_batch = batch
                    if batch_start is not None:
                        batch_start(trainer=trainer, batch=batch, batch_idx=batch_idx, dataloader_idx=dataloader_idx)
                    out = forward(batch, batch_idx, dataloader_idx)
                    if step_end_user is not None:
                        out = step_end_user(out)
                    if batch_end is not None:
                        batch_end(trainer=trainer, outputs=out, batch=batch, batch_idx=batch_idx, dataloader_idx=dataloader_idx)
                    if metrics.eval_step_row:
                        _log_eval_step(trainer, stage, publish)
                    if n is not None and batch_idx + 1 >= n:
                        break
        metrics.suffix = ""
        _epoch_level_event(trainer, f"on_{prefix}_epoch_end")
        computed = metrics.finish_epoch(stage, publish=publish)
        # a name logged with on_step and on_epoch is a result as name_epoch only (Lightning)
        computed = {k: v for k, v in computed.items() if not (k in metrics.forked and f"{k}_epoch" in computed)}
        getattr(hook, f"on_{prefix}_end")(trainer=trainer, metrics=dict(computed))
        metrics.reset_metric_objects(stage)  # torchmetrics Metrics, after on_*_end (Lightning)
    finally:
        metrics.stage, metrics.suffix, metrics.epoch_level = saved
        model.train(was_training)
        ckpt.set_rng_state(rng)
    return _per_loader(computed, len(loaders))


def _log_eval_step(trainer, stage: str, publish: bool) -> None:
    """An evaluation batch's step values as a row of their own, with Lightning's ``step``:
    the number of ``stage`` batches logged so far in this run, and no epoch. Nothing in the
    sanity check."""
    metrics = trainer.state.metrics
    row, metrics.eval_step_row = metrics.eval_step_row, {}
    if publish:
        count = metrics.eval_logged_steps.get(stage, 0)
        metrics.eval_logged_steps[stage] = count + 1
        log_row(trainer, row, step=count, epoch=None)


def _epoch_level_event(trainer, name: str) -> None:
    metrics = trainer.state.metrics
    metrics.epoch_level = True
    try:
        getattr(trainer.hook, name)(trainer=trainer)
    finally:
        metrics.epoch_level = False


_LOADER_SUFFIX = re.compile(r"/dataloader_idx_(\d+)$")


def _per_loader(computed: dict, n_loaders: int) -> list[dict]:
    results: list[dict] = [{} for _ in range(max(n_loaders, 1))]
    for name, value in computed.items():
        match = _LOADER_SUFFIX.search(name)
        if match and int(match.group(1)) < len(results):
            results[int(match.group(1))][name] = value
        else:
            for result in results:
                result[name] = value
    return results


def _print_results(stage: str, results: list[dict]) -> None:
    names = sorted({k for r in results for k in r})
    if not names:
        return
    title = f"{'Validate' if stage == VALIDATE else 'Test'} metric"
    width = max(len(title), *(len(n) for n in names))
    header = "  ".join(f"DataLoader {i}".rjust(14) for i in range(len(results)))
    print(f"{title.ljust(width)}  {header}")
    for name in names:
        cells = "  ".join((f"{r[name]:.6g}" if name in r else "").rjust(14) for r in results)
        print(f"{name.ljust(width)}  {cells}", flush=True)


# ---------------------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------------------


def run_predict(trainer) -> Any:
    """``Trainer.predict`` inside one worker: per-batch outputs, in dataset order."""
    with session(trainer, PREDICT):
        build_model(trainer, PREDICT)
        loaders = [prepare_loader(trainer, loader, training=False) for loader in trainer.predict_dataloaders]
        if trainer.state.ckpt_path is not None:
            restore(trainer, trainer.state.ckpt_path)
        hook, model, metrics = trainer.hook, trainer.model, trainer.state.metrics
        keep = trainer.state.return_predictions
        batch_start = _event(trainer, "on_predict_batch_start")
        batch_end = _event(trainer, "on_predict_batch_end")
        contexts = [c for c in hook.forward_context(trainer=trainer) if c is not None]
        forward = _forward(trainer, PREDICT, len(loaders))
        device = trainer.root_device
        move = device.type != "cpu"
        was_training, saved_stage = model.training, metrics.stage
        model.eval()
        metrics.stage = PREDICT
        per_loader: list[list] = []
        trainer.num_predict_batches = [batch_limit(loader, trainer.config.limit_predict_batches, "limit_predict_batches")
                                       for loader in loaders]
        # Lightning's BasePredictionWriter callbacks: each batch's sample indices, and this
        # rank's predictions for write_on_epoch_end
        writing = trainer.state.prediction_writing = _prediction_writing(trainer, len(loaders))
        try:
            hook.on_predict_start(trainer=trainer)
            _epoch_level_event(trainer, "on_predict_epoch_start")
            with torch.no_grad(), _enter(contexts):
                for dataloader_idx, loader in enumerate(loaders):
                    outputs: list = []
                    n = batch_limit(loader, trainer.config.limit_predict_batches, "limit_predict_batches")
                    for batch_idx, batch in enumerate(loader if writing is None else writing.loader(loader)):
                        if n is not None and batch_idx >= n:
                            break
                        if writing is not None:
                            writing.batch_seen(dataloader_idx, batch_idx)
                        if move:
                            batch = move_to_device(batch, device)
                        trainer.state.current_batch = batch
                        if batch_start is not None:
                            batch_start(trainer=trainer, batch=batch, batch_idx=batch_idx, dataloader_idx=dataloader_idx)
                        out = forward(batch, batch_idx, dataloader_idx)
                        if batch_end is not None:
                            batch_end(trainer=trainer, outputs=out, batch=batch, batch_idx=batch_idx, dataloader_idx=dataloader_idx)
                        if keep:
                            outputs.append((batch_size_of(batch), out))
                        if writing is not None:
                            writing.prediction(dataloader_idx, out)
                    per_loader.append(outputs)
            _epoch_level_event(trainer, "on_predict_epoch_end")
            results = [_gather_predictions(trainer, loader, outputs) for loader, outputs in zip(loaders, per_loader)] if keep else None
            hook.on_predict_end(trainer=trainer)
        finally:
            metrics.stage = saved_stage
            model.train(was_training)
        if results is None:
            return None
        return results[0] if len(results) == 1 else results


def _prediction_writing(trainer, n_loaders: int):
    """The state the run's prediction writers read, or ``None`` when it has none."""
    from .callbacks import BasePredictionWriter, PredictionWriting

    callbacks = trainer._callback_hooks
    writers = callbacks.of_type(BasePredictionWriter) if callbacks is not None else []
    return PredictionWriting(writers, n_loaders) if writers else None


def _gather_predictions(trainer, loader: DataLoader, outputs: list) -> list:
    """This loader's per-batch outputs as one process would have returned them.

    Under several processes every rank predicted its share; the shares are gathered on
    every rank, each sample placed where one process would have predicted it, the
    padding's repeats dropped, and the samples batched again in the loader's batch size:

    * a ``DistributedSampler`` (hookloop's, or the user's own, shuffled or not,
      ``drop_last`` or not): each rank says which dataset index each of its predictions
      is, and the predictions come back in dataset order, each sample once (with
      ``drop_last`` the samples it drops are predicted by no rank: global rank 0 warns);
    * hookloop's ``DistributedSamplerWrapper``: the order of the user's sampler (rank
      ``r`` predicted positions ``r, r + W, ...`` of it);
    * any other sampler (an ``IterableDataset``'s, or the user's own with
      ``use_distributed_sampler=False``): which samples a rank predicted cannot be known,
      so the ranks' batches come back in rank order, and global rank 0 warns.

    Predictions gathered this way are on the CPU.
    """
    world = trainer.world_size
    if world == 1:
        return [out for _, out in outputs]
    sampler = loader.sampler
    local = [(count, apply_to_tensors(out, lambda t: t.detach().cpu())) for count, out in outputs]
    # The dataset index of each sample this rank predicted, in the order it predicted them
    # (a DistributedSampler draws the same order again for the same seed and epoch).
    indices = list(sampler) if isinstance(sampler, DistributedSampler) else None
    shares = trainer.all_gather_object((local, indices))
    if isinstance(sampler, DistributedSampler):
        keys = [share_indices for _, share_indices in shares]
        _warn_dropped_predictions(trainer, sampler)
    elif isinstance(sampler, DistributedSamplerWrapper):
        total = len(sampler.sampler)
        keys = [range(rank, sampler.total_size, world) for rank in range(world)]
        keys = [[k if k < total else None for k in rank_keys] for rank_keys in keys]
    else:
        if trainer.global_rank == 0:
            warnings.warn(
                f"predict under {world} processes with a loader whose sampler is a {type(sampler).__name__}: "
                f"hookloop cannot tell which samples each rank predicted, so the predictions come back as "
                f"rank 0's batches, then rank 1's, and so on (samples may be missing or repeated). For "
                f"predictions in dataset order give the loader a DistributedSampler, or let hookloop shard "
                f"it (use_distributed_sampler=True, a map-style dataset).",
                stacklevel=3,
            )
        return [out for share, _ in shares for _, out in share]
    samples: dict[int, Any] = {}
    for (share, _), rank_keys in zip(shares, keys):
        pieces = (piece for count, out in share for piece in _split(out, count))
        for key, piece in zip(rank_keys, pieces):
            if key is not None:
                samples.setdefault(key, piece)
    ordered = [samples[k] for k in sorted(samples)]
    size = _per_device_batch(loader) or 1
    return [_merge(ordered[i : i + size]) for i in range(0, len(ordered), size)]


def _warn_dropped_predictions(trainer, sampler: DistributedSampler) -> None:
    """Global rank 0 says which samples a ``drop_last`` sampler leaves unpredicted."""
    if trainer.global_rank != 0 or not sampler.drop_last:
        return
    total = len(sampler.dataset)
    dropped = total - sampler.num_samples * sampler.num_replicas
    if dropped > 0:
        warnings.warn(
            f"the predict loader's DistributedSampler has drop_last=True: {dropped} of its {total} samples "
            f"go to no rank, so predict returns no prediction for them. Build the sampler with "
            f"drop_last=False (its padding's repeats are dropped from the predictions), or give the "
            f"loader a multiple of {sampler.num_replicas} samples.",
            stacklevel=3,
        )


def _split(out: Any, count: int) -> list:
    """Per-sample pieces of one batch's output (tensors keep their batch dimension)."""
    if isinstance(out, torch.Tensor):
        if out.ndim == 0 or out.shape[0] != count:
            raise ConfigurationError(
                f"predict under several processes puts every sample's prediction back in dataset "
                f"order, so predict_step must return tensors (or lists/tuples/dicts of them) whose "
                f"first dimension is the batch ({count} here); got a tensor of shape "
                f"{tuple(out.shape)}. Return per-sample outputs, or pass return_predictions=False "
                f"and keep them yourself (e.g. in on_predict_batch_end)."
            )
        return list(out.split(1))
    if isinstance(out, dict):
        parts = {k: _split(v, count) for k, v in out.items()}
        return [type(out)((k, parts[k][i]) for k in out) for i in range(count)]
    if isinstance(out, (list, tuple)):
        parts = [_split(v, count) for v in out]
        make = (lambda items: type(out)(*items)) if hasattr(out, "_fields") else type(out)
        return [make([p[i] for p in parts]) for i in range(count)]
    raise ConfigurationError(
        f"predict under several processes puts every sample's prediction back in dataset order, "
        f"so predict_step must return tensors (or lists/tuples/dicts of them), got "
        f"{type(out).__name__}; or pass return_predictions=False and keep outputs yourself"
    )


def _merge(pieces: list) -> Any:
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(pieces)
    if isinstance(first, dict):
        return type(first)((k, _merge([p[k] for p in pieces])) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_merge([p[i] for p in pieces]) for i in range(len(first))))
    return type(first)(_merge([p[i] for p in pieces]) for i in range(len(first)))


# ---------------------------------------------------------------------------------------
# Checkpoints: the loop's position and everything a resume needs
# ---------------------------------------------------------------------------------------


def checkpoint_dict(trainer) -> dict:
    """The whole run state; plugins add theirs in ``on_save_checkpoint``.

    ``loop["stage"]`` says how far the loop got after ``batch_idx`` batches of ``epoch``:
    ``"train"`` (what follows the batch is still to do), ``"validated"`` (its validation
    is done) or ``"epoch_end"`` (written inside ``on_train_epoch_end``). A resume does
    exactly what the interrupted run would have done after the checkpoint.
    """
    import hookloop

    module = trainer.module
    # This rank's generators (and its CUDA devices'); global rank 0's are the file's "rng"
    # and "epoch_rng" (what a checkpoint of one process, or an older reader, has).
    rng = ckpt.rng_state(ckpt.rank_cuda_devices(trainer))
    epoch_rng = trainer.state.epoch_rng if trainer.batch_idx else None
    checkpoint = {
        "hookloop": {"version": hookloop.__version__, "format": ckpt.FORMAT_VERSION},
        "state_dict": module.state_dict(),
        "optimizer_states": [o.state_dict() for o in trainer.optimizers],
        "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        "loop": {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "batch_idx": trainer.batch_idx,
            "stage": trainer.state.loop_stage,
            "total_batch_idx": trainer.state.total_batch_idx,
            "epoch_val_metrics": dict(trainer.state.epoch_val_metrics),
            # What the position means in samples, for a resume on another world size
            # (see _adapt_position); checkpoints without them are taken as written on
            # the world size that resumes them.
            "world_size": trainer.world_size,
            "batch_size": trainer.state.train_batch_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "epoch_batches": getattr(trainer, "num_training_batches", None),
        },
        "metrics": trainer.state.metrics.state_dict(),
        "rng": rng,
        "epoch_rng": epoch_rng,
        "plugins": {},
    }
    # Every rank's own RNG states and (mid-epoch, the same on every rank) loader position:
    # a stateful loader's state_dict, or the RNG state the epoch's order was drawn from.
    # One gather, in rank order, on the CPU; rank r resumes with entry r (see _rank_rng).
    # Every rank builds the checkpoint, whichever rank writes it.
    loader = loader_state.loader_state(trainer, trainer.state.fit_train_loader) if trainer.batch_idx else None
    if trainer.world_size > 1:
        per_rank = gather_per_rank(trainer, {"rng": rng, "epoch_rng": epoch_rng, "loader": loader})
        # (an entry is None where a strategy's broadcast has no process group any more: after fit)
        checkpoint["rng_per_rank"] = [e if e is None else {"rng": e["rng"], "epoch_rng": e["epoch_rng"]}
                                      for e in per_rank]
        loaders = [e if e is None else e["loader"] for e in per_rank]
    else:
        loaders = [loader]
    hparams = getattr(module, "hparams", None)
    if hparams:
        checkpoint["hyper_parameters"] = dict(hparams)
    datamodule = trainer.datamodule
    if datamodule is not None and callable(getattr(datamodule, "state_dict", None)):
        state = datamodule.state_dict()
        if state:
            checkpoint["datamodule"] = state
    trainer.hook.on_save_checkpoint(trainer=trainer, checkpoint=checkpoint)
    per_rank = _event(trainer, "on_save_rank_checkpoint")
    if per_rank is not None:
        mine: dict = {}
        per_rank(trainer=trainer, rank_state=mine)
        # On the CPU: the list travels between ranks and is written by one of them.
        checkpoint["rank_states"] = trainer.all_gather_object(apply_to_tensors(mine, lambda t: t.detach().cpu()))
    if any(state is not None for state in loaders):
        checkpoint["loader_per_rank"] = loaders
    return checkpoint


def resume_after_restart(trainer, train_loader: Any = None) -> None:
    """Resume ``fit`` where the failed attempt left off, in a worker that an elastic agent
    restarted (``TORCHELASTIC_RESTART_COUNT`` > 0, ``hookloop run --max-restarts``).

    The restarted worker runs the script again from the top; a ``fit`` given no
    ``ckpt_path`` then loads this run's newest ``last.ckpt`` (its run directory is the
    same in every attempt: see :mod:`hookloop.rundir`), or starts from scratch when the
    run has written none yet. Global rank 0 chooses the file (every rank loads the same)
    and says what happened. Called once the run directory and the process group exist.
    """
    from .helpers import env_int

    restart = env_int("TORCHELASTIC_RESTART_COUNT", default=0)
    if not restart:
        return
    places = [Path(trainer.log_dir) / "checkpoints"]
    own = getattr(trainer.checkpoint_callback, "dir", None)  # ModelCheckpoint(dirpath=...)
    if own is not None and Path(own) not in places:
        places.insert(0, Path(own))
    found = None
    if trainer.global_rank == 0:
        # last.prev.ckpt alone: killed between its two renames (file systems without hard links)
        existing = [(place / name) for place in places for name in (ckpt.LAST, ckpt.PREVIOUS)
                    if (place / name).exists()]
        found = str(max(existing, key=lambda p: p.stat().st_mtime).with_name(ckpt.LAST)) if existing else None
    found = trainer.broadcast(found, 0)
    if found is None:
        trainer.print(f"hookloop: restart {restart} of this run (TORCHELASTIC_RESTART_COUNT={restart}): no "
                      f"last.ckpt under {' or '.join(str(p) for p in places)} yet, starting from scratch")
        return
    used = restore(trainer, found, fall_back=True, train_loader=train_loader)
    trainer.print(f"hookloop: restart {restart} of this run (TORCHELASTIC_RESTART_COUNT={restart}): resumed "
                  f"from {used} at epoch {trainer.current_epoch}, global step {trainer.global_step}")


def restore(trainer, ckpt_path: Any, fall_back: bool = False, train_loader: Any = None) -> Path | None:
    """Load ``ckpt_path`` (or ``"last"``) into the model, optimizers, loop and plugins;
    return the path loaded.

    ``train_loader`` (``fit``'s, as this rank iterates it) lets a checkpoint written on
    another number of processes resume: see :func:`_adapt_position`.

    ``"last"`` when no run wrote a ``last.ckpt`` yet loads nothing: the run starts from
    scratch, with a warning (Lightning's behaviour). For ``"last"`` (and with
    ``fall_back``) a ``last.ckpt`` that cannot be read (corrupt, truncated, missing) falls
    back to the ``last.prev.ckpt`` beside it, with a warning naming both.
    """
    from . import rundir

    path = Path(ckpt_path)
    if str(ckpt_path) == "best":
        best = getattr(trainer.checkpoint_callback, "best_model_path", "")
        if not best:
            raise CheckpointError(
                "ckpt_path='best' but this trainer's checkpoint plugin has no best checkpoint yet: fit with "
                "ModelCheckpoint(monitor=...) first, or pass a checkpoint path"
            )
        path = Path(best)
    elif str(ckpt_path) == "last":
        found = rundir.newest_last_checkpoint(trainer.default_root_dir)
        if found is None:
            # As Lightning: nothing to resume is a fresh start, not an error.
            if trainer.is_global_zero:
                warnings.warn(
                    f"ckpt_path='last' but no run under {trainer.default_root_dir / 'logs'} wrote a "
                    f"last.ckpt yet: starting from scratch")
            return None
        path, fall_back = found, True
    checkpoint, path = _read_checkpoint(trainer, path, fall_back)
    callbacks = trainer._callback_hooks
    if callbacks is not None and trainer.state.fn == "fit":
        # Lightning restores the callbacks before the optimizer states (BaseFinetuning
        # rebuilds its param groups first)
        callbacks.restore(trainer, checkpoint)
    trainer.hook.load_model_state(trainer=trainer, checkpoint=checkpoint)
    loop = checkpoint["loop"]
    trainer.current_epoch = int(loop["epoch"])
    trainer.global_step = int(loop["global_step"])
    trainer.batch_idx = int(loop.get("batch_idx", 0))
    trainer.state.loop_stage = loop.get("stage", "train")
    trainer.state.total_batch_idx = int(loop.get("total_batch_idx", 0))
    trainer.state.epoch_val_metrics = dict(loop.get("epoch_val_metrics") or {})
    rng, trainer.state.epoch_rng, derive = _rank_rng(trainer, checkpoint, loop)
    trainer.state.loader_resume_state = own_entry(checkpoint.get("loader_per_rank"), trainer)
    if trainer.batch_idx and trainer.state.loop_stage == "train" and trainer.state.epoch_rng is None:
        raise CheckpointError(f"{str(path)!r} was saved mid-epoch without the epoch's RNG state")
    if train_loader is not None:
        _adapt_position(trainer, loop, train_loader)
        loader_state.resumed(train_loader)
    if checkpoint.get("metrics"):
        trainer.state.metrics.load_state_dict(checkpoint["metrics"])
    if rng is not None:
        ckpt.set_rng_state(rng)
        if derive:
            ckpt.derive_rng_state(rng, trainer.global_rank)
    datamodule = trainer.datamodule
    if datamodule is not None and checkpoint.get("datamodule") and callable(getattr(datamodule, "load_state_dict", None)):
        datamodule.load_state_dict(checkpoint["datamodule"])
    trainer.hook.on_load_checkpoint(trainer=trainer, checkpoint=checkpoint)
    states = checkpoint.get("rank_states")
    if states is not None:
        mine = states[trainer.global_rank] if len(states) == trainer.world_size else None
        trainer.hook.on_load_rank_checkpoint(trainer=trainer, rank_state=mine, rank_states=states)
    return path


def _rank_rng(trainer, checkpoint: dict, loop: dict) -> tuple[dict | None, dict | None, bool]:
    """This rank's RNG states in ``checkpoint``: ``(rng, epoch_rng, derive)``.

    Global rank r takes entry r of ``rng_per_rank`` (written by runs of several
    processes). A checkpoint of one process, or one older than per-rank states, has one
    entry: global rank 0's ``rng``/``epoch_rng``. A rank the checkpoint has no entry of
    (it was written on fewer processes) takes the entry of rank ``r % saved`` and
    ``derive`` (:func:`hookloop.checkpoint.derive_rng_state`: its own stream, seeded
    from that entry and its rank), so no two ranks draw the same numbers. When the
    numbers of entries and processes differ, global rank 0 warns once.
    """
    entries = checkpoint.get("rng_per_rank")
    legacy = entries is None and int(loop.get("world_size") or 1) > 1
    rank0 = {"rng": checkpoint.get("rng"), "epoch_rng": checkpoint.get("epoch_rng")}
    if entries is None:
        entries = [rank0]
    # a rank whose state could not be gathered (saved after fit, its process group gone): rank 0's
    entries = [rank0 if e is None else e for e in entries]
    saved, world, rank = len(entries), trainer.world_size, trainer.global_rank
    if saved != world and trainer.is_global_zero:
        written = ("was written before checkpoints held every rank's RNG state (only global rank 0's)" if legacy
                   else f"holds the RNG states of {saved} process{'es' if saved != 1 else ''}")
        if saved < world:
            outcome = (f"the generators of {_ranks(saved, world - 1)} are seeded anew from the state of rank "
                       f"(r mod {saved}) and their own rank, so the random draws (dropout, augmentation) of this run "
                       f"differ from an uninterrupted one")
        else:
            outcome = f"each rank takes its own; the states of {_ranks(world, saved - 1)} are not used"
        warnings.warn(f"the checkpoint {written}, resumed on {world}: {outcome}", stacklevel=3)
    if rank < saved:
        entry = entries[rank]
        return entry.get("rng"), entry.get("epoch_rng"), False
    entry = entries[rank % saved]
    return entry.get("rng"), entry.get("epoch_rng"), entry.get("rng") is not None


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def _adapt_position(trainer, loop: dict, train_loader: Any) -> None:
    """Resume a checkpoint written on another number of processes (docs/decisions.md,
    "Changing world size").

    The weights, optimizer and step count carry over as they are (every process holds
    them whole); the distributed sampler re-shards the data by itself. What changes is
    the meaning of ``batch_idx``, which counts one process's batches: a mid-epoch
    position is converted by samples seen (``batch_idx x batch size x world size``,
    rounded to the nearest whole batch of the new world size), a position at the
    epoch's end stays the epoch's end. Global rank 0 prints one line saying so.
    Checkpoints without ``loop["world_size"]`` (older ones) are taken as written on
    this world size.
    """
    old_world = loop.get("world_size")
    if old_world is None or int(old_world) == trainer.world_size:
        return
    old_world, new_world = int(old_world), trainer.world_size
    old_batch, new_batch = loop.get("batch_size"), _per_device_batch(train_loader)
    old_acc, new_acc = int(loop.get("accumulate_grad_batches") or 1), trainer.accumulate_grad_batches
    batch_idx, stage = trainer.batch_idx, trainer.state.loop_stage
    epoch = trainer.current_epoch
    if not batch_idx or stage == "epoch_end":
        where = "start" if not batch_idx else "end"
        position = f"the checkpoint is at the {where} of epoch {epoch}, so the position carries over as it is"
    else:
        old_n = loop.get("epoch_batches")
        new_n = batch_limit(train_loader, trainer.config.limit_train_batches, "limit_train_batches")
        if old_batch and new_batch:
            seen = batch_idx * int(old_batch) * old_world
            converted = round(seen / (new_batch * new_world))
            unit = f" = {seen} samples"
        else:  # batch sizes unknown: the processes' share of the epoch
            converted, unit = round(batch_idx * old_world / new_world), ""
        if old_n is not None and batch_idx >= int(old_n) and new_n is not None:
            converted = new_n  # after the epoch's last batch: nothing of it is left to train
        elif new_n is not None:
            converted = min(converted, new_n)
        trainer.batch_idx = converted
        if not converted:
            trainer.state.loop_stage = "train"
        position = (f"the mid-epoch position ({batch_idx} batches per process{unit} of epoch {epoch}) becomes "
                    f"{converted} batches per process of the epoch's new sharding, by samples seen")
        if old_world > 1 and new_world > 1 and old_batch and new_batch and converted * new_batch * new_world == seen:
            position += " (the same samples: both shard one shuffled order)"
        else:
            position += (" (the rest of this epoch is drawn from the new order, so a few samples may be seen "
                         "twice or not at all in this epoch)")

    def effective(world: int, batch: Any, acc: int) -> str:
        procs = f"{world} process{'es' if world != 1 else ''} x {acc} accumulated batch{'es' if acc != 1 else ''}"
        return f"{int(batch) * world * acc} ({batch} per device x {procs})" if batch else f"(batches) x {procs}"

    trainer.print(f"hookloop: resuming a checkpoint of {old_world} processes on {new_world}: effective batch size "
                  f"{effective(old_world, old_batch, old_acc)} -> {effective(new_world, new_batch, new_acc)}; "
                  f"{position}", flush=True)


def _read_checkpoint(trainer, path: Path, fall_back: bool) -> tuple[dict, Path]:
    """Read the checkpoint at ``path``; with ``fall_back``, one that cannot be read makes
    the previous one (``last.prev.ckpt`` beside a ``last.ckpt``) the one read."""

    def read(p: Path) -> dict:
        checkpoint = trainer.hook.load_checkpoint(trainer=trainer, path=p)
        if not isinstance(checkpoint, dict) or "loop" not in checkpoint:
            raise CheckpointError(f"{str(p)!r} is not a hookloop checkpoint (no loop state)")
        return checkpoint

    previous = ckpt.previous_of(path) if fall_back else None
    try:
        return read(path), path
    except CheckpointError as exc:
        if previous is None or not previous.exists():
            raise
        newest = exc
    try:
        checkpoint = read(previous)
    except CheckpointError as exc:
        raise CheckpointError(f"neither checkpoint can be loaded: {newest}; and the previous one: {exc}") from exc
    if trainer.is_global_zero:
        warnings.warn(f"newest checkpoint {str(path)!r} cannot be loaded ({newest}); resuming from the previous "
                      f"checkpoint {str(previous)!r} instead")
    return checkpoint, previous
