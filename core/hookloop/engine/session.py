"""The session around every entry point: what ``fit``, ``validate``, ``test`` and
``predict`` do in a worker before and after the loop (:mod:`hookloop.loop`), as
pytest's ``wrap_session`` around ``runtestloop``.

:func:`session` sets up and tears down: the module's hooks as a plugin, the events of
the run, the environment (process group, device), the run directory, ``prepare_data``,
the DataModule's and the module's ``setup``/``teardown`` and the loaders. The entry
points (:func:`fit`, :func:`run_evaluation`, :func:`run_predict`) then build the model,
shard the loaders, restore a checkpoint (:mod:`hookloop.resume`) and hand over to the
loop.

Layer: above :mod:`hookloop.resume` and :mod:`hookloop.loop`; below the trainer. It
imports neither the trainer nor the user's API (``hookloop.module``,
``hookloop.datamodule``): a base class's placeholder methods carry
``hookloop_placeholder = True``, which is how :func:`provides` and :func:`defines_hook`
tell them from the user's.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
)

from hookloop.contract.errors import CheckpointError, ConfigurationError
from hookloop.contract.hookspecs import MODULE_HOOKS, hookimpl
from hookloop.dispatch import resolve_events
from hookloop.distributed import faults
from hookloop.distributed.elastic import WORKERS_ENV, elastic_range, plan_batch
from hookloop.distributed.mesh import build_device_mesh
from hookloop.distributed.ranks import env_int, launched_by_hookloop, rank_zero_only, rank_zero_warn
from hookloop.distributed.strategy import data_parallel_rank
from hookloop.engine import loop
from hookloop.engine.loop import _per_device_batch, batch_limit
from hookloop.engine.optim import parse_optimizers
from hookloop.engine.step import PREDICT, TEST, VALIDATE, _StepModule, log_epoch_row, log_row
from hookloop.helpers import DistributedSamplerWrapper, OrderedSampler, rebuild_dataloader
from hookloop.observers.checkpoint import log_dirs
from hookloop.resume import checkpoint as ckpt
from hookloop.resume import loader_state, storage
from hookloop.resume.run import restore, resume_after_restart

#: the ``stage`` argument of ``setup``/``teardown`` for each entry point
SETUP_STAGE = {"fit": "fit", VALIDATE: "validate", TEST: "test", PREDICT: "predict"}


# ---------------------------------------------------------------------------------------
# The entry points
# ---------------------------------------------------------------------------------------


def fit(trainer) -> None:
    """Train ``trainer.module``: the whole of ``Trainer.fit`` inside one worker."""
    with session(trainer, "fit"):
        config, state = trainer.config, trainer.state
        # before the strategy wraps (DeepSpeed's config reads it)
        _accumulate_for_global_batch(trainer)
        _plan_elastic_batch(trainer)
        build_model(trainer, "fit")
        train_loader = trainer.train_dataloader
        if config.overfit_batches:
            train_loader = _overfit_loader(trainer, train_loader)
        train_loader = prepare_loader(trainer, train_loader, training=True)
        if config.stateful_dataloader:
            train_loader = loader_state.stateful_loader(train_loader)
        loader_state.check_rank_split(trainer, train_loader)
        # skippable by index, with per-batch worker seeds (hookloop.loader_state)
        train_loader = state.fit_train_loader = loader_state.resumable_loader(train_loader)
        # with workers: per-batch worker seeds, the same after a resume (hookloop.loader_state)
        val_given = trainer.val_dataloaders or []
        if config.overfit_batches:
            val_given = [_overfit_loader(trainer, v, "val") for v in val_given]
        val_loaders = [loader_state.resumable_loader(prepare_loader(trainer, v, training=False))
                       if getattr(v, "num_workers", 0)
                       else prepare_loader(trainer, v, training=False)
                       for v in val_given]
        state.fit_val_loaders = val_loaders
        warn_repeated_samples(trainer, val_loaders, "validation")
        if val_loaders and not callable(getattr(trainer.module, "validation_step", None)):
            raise ConfigurationError(
                f"val_dataloaders were given but {type(trainer.module).__name__} has no "
                f"validation_step(batch, batch_idx)"
            )
        state.train_batch_size = _per_device_batch(train_loader)  # saved in checkpoints' loop state
        # Lightning's: known from setup on (progress bars read it at on_train_start)
        trainer.num_training_batches = batch_limit(train_loader, config.limit_train_batches,
                                                   "limit_train_batches")
        if state.ckpt_path is not None:
            restore(trainer, state.ckpt_path, train_loader=train_loader)
        else:
            resume_after_restart(trainer, train_loader=train_loader)
        _print_effective_batch(trainer, train_loader)
        loop.fit(trainer, train_loader, val_loaders)


def run_evaluation(trainer, stage: str) -> list[dict]:
    """``Trainer.validate``/``test`` inside one worker."""
    with session(trainer, stage):
        build_model(trainer, stage)
        attr = "val_dataloaders" if stage == VALIDATE else "test_dataloaders"
        loaders = [prepare_loader(trainer, x, training=False) for x in getattr(trainer, attr)]
        warn_repeated_samples(trainer, loaders, "validation" if stage == VALIDATE else "test")
        if trainer.state.ckpt_path is not None:
            restore(trainer, trainer.state.ckpt_path)
        config = trainer.config
        limit = config.limit_val_batches if stage == VALIDATE else config.limit_test_batches
        results = loop.evaluate(trainer, stage, loaders, limit=limit)
        log_row(trainer, {k: v for r in results for k, v in r.items()})
        if trainer.state.verbose and trainer.global_rank == 0:
            _print_results(stage, results)
        return results


def run_predict(trainer) -> Any:
    """``Trainer.predict`` inside one worker: per-batch outputs, in dataset order."""
    with session(trainer, PREDICT):
        build_model(trainer, PREDICT)
        loaders = [prepare_loader(trainer, x, training=False)
                   for x in trainer.predict_dataloaders]
        if trainer.state.ckpt_path is not None:
            restore(trainer, trainer.state.ckpt_path)
        return loop.predict(trainer, loaders)


# ---------------------------------------------------------------------------------------
# A run: the session around every entry point
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def session(trainer, stage: str):
    """Environment, data, plugins and the module's hooks for one ``fit``/``validate``/
    ``test``/``predict`` in this worker; torn down also after an exception."""
    hook, module = trainer.hook, trainer.module
    module.__dict__["_hookloop_trainer"] = trainer
    callbacks = trainer._callback_hooks
    # the Lightning-style callbacks' on_train_epoch_end: the module's implementation (after
    # theirs) hands the epoch row to the loggers with what they logged, hook or not
    module_hooks = module_hooks_plugin(module, epoch_end=hasattr(callbacks, "on_train_epoch_end"))
    if module_hooks is not None:
        trainer.plugin_manager.register(module_hooks, name=module_hooks.hookloop_name)
        if callbacks is not None:
            # Registered again after the module's hooks: both are tryfirst, the later runs
            # first, and Lightning calls the callbacks before the module's hook.
            trainer.plugin_manager.unregister(callbacks)
            trainer.plugin_manager.register(callbacks, name=callbacks.hookloop_name)
    resolve_events(trainer)
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
        # a function attribute (as Lightning's rank_zero_only.rank), which mypy cannot type
        rank_zero_only.rank = trainer.global_rank  # type: ignore[attr-defined]
        _say_environment_settings(trainer)
        build_device_mesh(trainer)  # the process group exists: the run's one mesh, on_device_mesh
        _resolve_run_dir(trainer)
        _prepare_data(trainer)
        if datamodule is not None:
            _attach_datamodule(datamodule, trainer)
            _datamodule_hook(datamodule, "setup", setup_stage)
        if callbacks is not None:
            callbacks.setup(trainer, setup_stage)  # Lightning: the callbacks', then the module's
        if defines_hook(module, "setup"):
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
        explained = None
        if trainer.world_size > 1:
            explained = faults.collective_failure_error(trainer, exc)
        if set_up and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            hook.on_exception(trainer=trainer, exception=explained or exc)
        if explained is not None:
            raise explained from exc
        raise
    finally:
        try:
            hook.teardown(trainer=trainer, stage=setup_stage)
            if trainer.is_global_zero:  # a staged run's logs, closed by teardown, to its store
                storage.push_logs(log_dirs(trainer))
            trainer.device_mesh = None
            if datamodule is not None:
                _datamodule_hook(datamodule, "teardown", setup_stage)
        finally:
            if module_hooks is not None:
                trainer.plugin_manager.unregister(module_hooks)
            module.__dict__.pop("_hookloop_trainer", None)
            trainer.state.backward_events = None
            if state.status == "running":
                state.status = "finished"


def _say_environment_settings(trainer) -> None:
    """The run's first lines, on global rank 0, once per Trainer: the settings that came
    from the environment (``Trainer._environment_settings``), which nothing else shows."""
    if trainer.__dict__.get("_environment_said"):
        return
    trainer.__dict__["_environment_said"] = True
    if trainer.global_rank == 0:
        for line in getattr(trainer, "_environment_settings", ()):
            print(line, flush=True)


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
    ``<default_root_dir>/logs/version_N``. A run without a logger claims nothing: its
    directory is ``default_root_dir`` (Lightning's ``trainer.log_dir`` then), where it
    writes only what it is asked to (docs/decisions.md, "A run without a logger")."""
    from hookloop.resume import rundir

    if not trainer.loggers:
        return [str(trainer.default_root_dir)]
    token = rundir.run_token()
    dirs: list = []
    for logger in trainer.loggers:
        root = getattr(logger, "hookloop_run_root", None)
        root = root() if callable(root) else None
        index = trainer.state.run_index
        dirs.append(None if root is None else str(rundir.claim_in(root[0], token, index, root[1])))
    run_dir = dirs[0] if dirs and dirs[0] is not None else str(
        rundir.claim(trainer.default_root_dir, token, trainer.state.run_index))
    return [run_dir, *dirs]


def adopt_run_dirs(trainer, dirs: list[str]) -> None:
    """Every rank: the run directory, and each logger's (``hookloop_use_run_dir``)."""
    trainer.state.log_dir = Path(dirs[0])
    trainer.state.run_dirs = list(dirs)
    for logger, path in zip(trainer.loggers, dirs[1:], strict=False):
        if path is not None:
            logger.hookloop_use_run_dir(path)


def _resolve_run_dir(trainer) -> None:
    """``trainer.log_dir`` and the loggers' directories: decided by global rank 0 (once
    per Trainer) and broadcast."""
    if trainer.state.log_dir is None:
        chosen: list[str] | OSError | None = None
        if trainer.global_rank == 0:
            try:
                chosen = claim_run_dirs(trainer)
            except OSError as exc:
                # Told to every rank, so none waits for a directory that never comes.
                chosen = OSError(f"{exc.strerror or exc}: "
                                 f"{exc.filename or trainer.default_root_dir}")
            except CheckpointError as exc:  # a root on a store that did not answer (retried)
                chosen = OSError(str(exc))
        chosen = trainer.broadcast(chosen, 0)
        if isinstance(chosen, OSError):
            raise ConfigurationError(
                "cannot create the run directory under "
                f"default_root_dir={str(trainer.config.default_root_dir)!r} or a logger's save_dir "
                f"({chosen}): make it writable or choose another (Trainer(default_root_dir=...) or "
                "--default-root-dir, the logger's save_dir)"
            )
        adopt_run_dirs(trainer, chosen)


def _prepare_data(trainer) -> None:
    """``prepare_data`` of the DataModule and the module: once per node (or per job),
    on one rank, while the others wait."""
    sources = [s for s in (trainer.datamodule, trainer.module)
               if callable(getattr(type(s), "prepare_data", None))]
    if not sources:
        return
    for source in sources:
        per_node = getattr(source, "prepare_data_per_node", True)
        if (trainer.local_rank if per_node else trainer.global_rank) == 0:
            source.prepare_data()
    trainer.barrier("prepare_data")


def provides(source: Any, method: str) -> bool:
    """Whether ``source`` (a DataModule, or a module) defines the loader ``method`` (not
    ``hookloop.DataModule``'s placeholder, which raises)."""
    fn = getattr(type(source), method, None)
    return callable(fn) and not getattr(fn, "hookloop_placeholder", False)


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
        source = next((s for s in (trainer.datamodule, trainer.module)
                       if s is not None and provides(s, method)), None)
        if source is None or getattr(source, method, None) is None:
            continue  # none, or set to None (how Lightning's tests turn a loader off)
        if attr == "val_dataloaders" and stage == "fit" and not callable(
                getattr(trainer.module, "validation_step", None)):
            trainer.print(f"hookloop: {type(source).__name__}.val_dataloader() is not used: "
                          f"{type(trainer.module).__name__} has no validation_step")
            continue
        if isolate and attr == "val_dataloaders":
            rng = ckpt.rng_state()
            try:
                loaders = getattr(source, method)()
            finally:
                ckpt.set_rng_state(rng)
        else:
            loaders = getattr(source, method)()
        if attr != "train_dataloader":
            loaders = as_loader_list(loaders, f"{type(source).__name__}.{method}()")
        setattr(trainer, attr, loaders)
    if stage == "fit":
        if trainer.train_dataloader is None:
            raise ConfigurationError(
                "fit needs training data: pass train_dataloaders, or a datamodule (or module) "
                "with train_dataloader()"
            )
        check_loader(trainer.train_dataloader, "train_dataloaders")
    else:
        attr = {VALIDATE: "val_dataloaders", TEST: "test_dataloaders",
                PREDICT: "predict_dataloaders"}[stage]
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
        raise TypeError(f"{name} must be a torch.utils.data.DataLoader, got "
                        f"{type(loader).__name__}")


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
            raise TypeError(f"{name}[{i}] must be a torch.utils.data.DataLoader, got "
                            f"{type(loader).__name__}")
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
        # a module that steps its schedulers itself (lr_scheduler_step) may return any object
        step_hook = getattr(type(module), "lr_scheduler_step", None)
        custom_step = callable(step_hook) and not getattr(step_hook, "hookloop_placeholder", False)
        optimizers, trainer.lr_scheduler_configs = parse_optimizers(
            module.configure_optimizers(), type(module).__name__, trainer.automatic_optimization,
            custom_step=custom_step)
    trainer.model = hook.wrap_model(
        trainer=trainer, model=_StepModule(module), optimizer=optimizers[0] if optimizers else None,
        optimizers=optimizers,
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
    # torch's stubs give Dataset and Sampler no __len__; these two samplers need one
    if isinstance(sampler, DistributedSampler):
        return len(sampler.dataset)  # type: ignore[arg-type]
    if isinstance(sampler, DistributedSamplerWrapper):
        return len(sampler.sampler)  # type: ignore[arg-type]
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
                f"{which} has {total} samples for {world} processes: the DistributedSampler "
                f"repeats {repeated} of them so that every rank gets {-(-total // world)}, and "
                f"{what} metrics count those twice (as in Lightning). For exact metrics run {what} "
                f"on one process, or give the loader a multiple of {world} samples.",
                stacklevel=2,
            )


def _overfit_loader(trainer, loader: DataLoader, prefix: str = "train") -> DataLoader:
    """``overfit_batches``: the same first batches every epoch, never shuffled. A map-style
    loader whose sampler is not sequential (a ``RandomSampler``, any custom sampler) gets a
    sequential one, with Lightning's warning (``prefix``: Lightning's name of the loader)."""
    sampler = loader.sampler
    if not isinstance(sampler, SequentialSampler) and not isinstance(loader.dataset,
                                                                     IterableDataset):
        rank_zero_warn(f"You requested to overfit but enabled {prefix} dataloader shuffling. We "
                       f"are turning off the {prefix} dataloader shuffling for you.")
        return rebuild_dataloader(loader, OrderedSampler(loader.dataset))  # type: ignore[arg-type]
    sharded = trainer.world_size > 1 and trainer.config.use_distributed_sampler
    if prefix == "train" and (
            sharded and type(sampler) is SequentialSampler
            and type(loader.batch_sampler) is BatchSampler):
        # Sequential, and kept so by the distributed sampler (which shuffles training loaders).
        # a map-style dataset (sized: RandomSampler and SequentialSampler take its len)
        return rebuild_dataloader(loader, OrderedSampler(loader.dataset))  # type: ignore[arg-type]
    return loader


def _accumulate_for_global_batch(trainer) -> None:
    """``accumulate_grad_batches = global_batch_size / (batch_size x data-parallel processes)``
    with ``Trainer(global_batch_size=...)``: known only now, after the environment and the
    mesh (a tp group is one data-parallel process). Refused unless it divides exactly."""
    wanted = trainer.config.global_batch_size
    if wanted is None:
        return
    loader = trainer.train_dataloader
    per_device = _per_device_batch(loader)
    if per_device is None:
        has_sampler = getattr(loader, "batch_sampler", None) is not None
        what = "a batch_sampler" if has_sampler else "no batch_size"
        raise ConfigurationError(
            f"global_batch_size={wanted} needs the training loader's batch size, and the loader "
            f"has {what} (it makes its own batches): give DataLoader(batch_size=...), or "
            "accumulate_grad_batches instead of global_batch_size")
    replicas = data_parallel_rank(trainer)[0]
    per_step = per_device * replicas
    if wanted % per_step:
        near = max(per_step, round(wanted / per_step) * per_step)
        raise ConfigurationError(
            f"global_batch_size={wanted} is not a multiple of batch_size {per_device} (the "
            f"training loader's) x {replicas} data-parallel process(es) = {per_step} samples per "
            f"batch: give a global_batch_size that is a multiple of {per_step} (e.g. {near}), or "
            "change the loader's batch_size or the number of processes")
    trainer.accumulate_grad_batches = wanted // per_step


def _plan_elastic_batch(trainer) -> None:
    """An elastic job's accumulation at this world size, by its ``elastic_batch`` policy
    (:func:`hookloop.distributed.elastic.plan_batch`; refused at start when the global
    batch does not divide on some size of the range); global rank 0 states the policy
    and the batch. The range is ``config``'s nodes, or the worker processes of a launcher
    that places them itself (``HOOKLOOP_ELASTIC_WORKERS``, honoured only in its workers)."""
    config = trainer.config
    found = elastic_range(config, os.environ.get(WORKERS_ENV) if launched_by_hookloop() else None)
    if found is None:
        return
    low, high, unit = found
    replicas = data_parallel_rank(trainer)[0]
    if unit == "worker":  # one process per worker: the launcher's count is the world size
        now = trainer.world_size
    else:
        per_node = max(1, config.num_processes())
        now = env_int("GROUP_WORLD_SIZE") or max(1, trainer.world_size // per_node)
    settings = getattr(trainer, "settings", None)
    base = getattr(settings, "accumulate_grad_batches", None) or 1
    if config.global_batch_size is not None:
        base = trainer.accumulate_grad_batches  # _accumulate_for_global_batch's, for this world
    plan = plan_batch(config.elastic_batch, _per_device_batch(trainer.train_dataloader), replicas,
                      now, (low, high), base, config.global_batch_size, unit=unit)
    trainer.accumulate_grad_batches = plan.accumulate
    if trainer.global_rank == 0:
        kept = ("the global batch is kept, the accumulation follows the world size"
                if plan.policy == "global"
                else "each process's batch is kept, the global batch follows the world size")
        print(f"hookloop: elastic job on {now} of {low}:{high} {unit}s, "
              f"elastic_batch={plan.policy!r} ({kept}): global batch {plan.describe()}", flush=True)


def _print_effective_batch(trainer, loader: DataLoader) -> None:
    # a tp group is one replica: its processes share batches
    replicas = data_parallel_rank(trainer)[0]
    wanted = trainer.config.global_batch_size
    one = replicas * trainer.accumulate_grad_batches <= 1
    if trainer.global_rank != 0 or (one and wanted is None):
        return
    per_device = _per_device_batch(loader)
    if wanted is not None:  # the loader's batch size is known (_accumulate_for_global_batch)
        print(f"hookloop: effective batch size {wanted} = {per_device} per device x {replicas} "
              f"data-parallel process(es) x {trainer.accumulate_grad_batches} accumulated batches "
              f"(global_batch_size={wanted})",
              flush=True)
        return
    factors = f"{replicas} processes x {trainer.accumulate_grad_batches} accumulated batches"
    if per_device is None:
        print(f"hookloop: effective batch size = (batch_sampler's batches) x {factors}", flush=True)
        return
    total = per_device * replicas * trainer.accumulate_grad_batches
    print(f"hookloop: effective batch size {total} = {per_device} per device x {factors}",
          flush=True)


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
# The module's hooks as a plugin
# ---------------------------------------------------------------------------------------


def defines_hook(module: Any, name: str) -> bool:
    """Whether ``module``'s class defines hook ``name`` (not ``hookloop.Module``'s no-op)."""
    method = getattr(type(module), name, None)
    return callable(method) and not getattr(method, "hookloop_placeholder", False)


def module_hooks_plugin(module: nn.Module, epoch_end: bool = False) -> Any:
    """A plugin calling the hooks ``module`` defines, or ``None`` when it defines none.

    Its implementations are ``tryfirst``: the module's hook runs before the plugins'
    (a metric it logs in ``on_train_epoch_end`` is in their ``metrics``). Only defined
    hooks become implementations, so undefined ones cost nothing per step;
    ``epoch_end``: ``on_train_epoch_end`` is one anyway (what Lightning-style callbacks log
    there joins the epoch's row, as what the module logs).
    """
    # setup is not among them: the session calls it before the module's *_dataloader()
    defined = [name for name in MODULE_HOOKS if name != "setup"
               and (defines_hook(module, name) or (epoch_end and name == "on_train_epoch_end"))]
    if not defined:
        return None
    namespace: dict[str, Any] = {"hookloop_name": f"module:{type(module).__name__}",
                                 "hookloop_role": "observer"}
    for name in defined:
        namespace[name] = _module_hook_impl(module, name, MODULE_HOOKS[name])
    return type("ModuleHooks", (), namespace)()


def _module_hook_impl(module: nn.Module, name: str, args: tuple[str, ...]):
    method = getattr(module, name, None) or (lambda: None)  # epoch_end= for a plain nn.Module
    if name == "on_train_epoch_end":
        # Values the module logs here are reduced at once and handed to the plugins
        # that see the same event after it.
        def impl(self, trainer, metrics):
            metrics_store = trainer.state.metrics
            metrics_store.epoch_level = True
            try:
                method()
            finally:
                metrics_store.epoch_level = False
            finished = metrics_store.finish_epoch("train")
            metrics.update(finished)
            log_epoch_row(trainer, finished)

    else:
        impl = _forwarding_function(name, args, method)
    return hookimpl(tryfirst=True)(impl)


#: ``self, <args> -> target(<args>)`` for each argument list of ``MODULE_HOOKS``: pluggy
#: passes each hook argument by the name the implementation's code declares, so every
#: list has its own function (a hook with a new list fails at start, naming it).
_FORWARDERS: dict[tuple[str, ...], Callable[[Any], Callable[..., Any]]] = {
    (): lambda t: lambda self: t(),
    ("stage",): lambda t: lambda self, stage: t(stage),
    ("loss",): lambda t: lambda self, loss: t(loss),
    ("optimizer",): lambda t: lambda self, optimizer: t(optimizer),
    ("checkpoint",): lambda t: lambda self, checkpoint: t(checkpoint),
    ("batch", "batch_idx"): lambda t: lambda self, batch, batch_idx: t(batch, batch_idx),
    ("outputs", "batch", "batch_idx"):
        lambda t: lambda self, outputs, batch, batch_idx: t(outputs, batch, batch_idx),
}

# An evaluation batch hook gets ``dataloader_idx`` only when its stage has several loaders
# (as Lightning calls it: ``on_validation_batch_start(self, batch, batch_idx)`` is valid).
_EVAL_FORWARDERS: dict[tuple[str, ...], Callable[[Any, str], Callable[..., Any]]] = {
    ("batch", "batch_idx", "dataloader_idx"):
        lambda t, loaders: lambda self, trainer, batch, batch_idx, dataloader_idx: (
            t(batch, batch_idx, dataloader_idx) if len(getattr(trainer, loaders) or ()) > 1
            else t(batch, batch_idx)),
    ("outputs", "batch", "batch_idx", "dataloader_idx"):
        lambda t, loaders: lambda self, trainer, outputs, batch, batch_idx, dataloader_idx: (
            t(outputs, batch, batch_idx, dataloader_idx) if len(getattr(trainer, loaders) or ()) > 1
            else t(outputs, batch, batch_idx)),
}
_STAGE_LOADERS = {"validation": "val_dataloaders", "test": "test_dataloaders",
                  "predict": "predict_dataloaders"}


def _forwarding_function(name: str, args: tuple[str, ...], target: Any) -> Callable[..., Any]:
    """``def name(self, <args>): return target(<args>)`` with those parameter names."""
    if args in _EVAL_FORWARDERS:
        forward = _EVAL_FORWARDERS[args](target, _STAGE_LOADERS[name.split("_")[1]])
        forward.__name__ = forward.__qualname__ = name
        return forward
    if args not in _FORWARDERS:
        raise TypeError(f"module hook {name!r} takes {args}: add its forwarder to _FORWARDERS")
    forward = _FORWARDERS[args](target)
    forward.__name__ = forward.__qualname__ = name
    return forward
