"""The loops: ``fit``'s epochs and its validation schedule, ``evaluate`` and ``predict``.

Read top to bottom with :mod:`hookloop.engine.step`, this is one batch's whole journey:
:func:`fit` (called by the session once the model, the loaders and any checkpoint are
in place, as pytest's ``runtestloop`` inside ``wrap_session``) runs the sanity check,
then per epoch :func:`_train_epoch` calls :meth:`hookloop.engine.step.TrainStep.run` for
each batch (forward, backward, optimizer step), validates when due
(:class:`_ValidationSchedule`), and :func:`_end_epoch` ends the epoch (epoch metrics,
``on_train_epoch_end``, plateau schedulers). :func:`evaluate` and
:func:`predict` run one batch at a time through
:func:`hookloop.engine.step.make_evaluation_step`.

Layer: above :mod:`hookloop.engine.step`; below the session and the trainer.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from hookloop.contract.errors import ConfigurationError, PossibleUserWarning
from hookloop.contract.pluginspec import plugin_name
from hookloop.dispatch import event
from hookloop.distributed import faults
from hookloop.distributed.ranks import rank_zero_warn
from hookloop.engine.optim import step_schedulers
from hookloop.engine.step import (
    EVENT_PREFIX,
    PREDICT,
    TEST,
    VALIDATE,
    TrainStep,
    _enter,
    log_epoch_row,
    log_row,
    make_evaluation_step,
    stop_requested,
)
from hookloop.helpers import DistributedSamplerWrapper, apply_to_tensors, batch_size_of
from hookloop.resume import checkpoint as ckpt
from hookloop.resume import loader_state

#: the trainer attribute with each stage's per-loader batch counts: num_<this>_batches
EVAL_COUNT = {VALIDATE: "val", TEST: "test"}


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


def _per_device_batch(loader: Any) -> int | None:
    """The batch size of one process's training batches, ``None`` where the loader does
    not say (a custom batch sampler, an iterable dataset batching itself)."""
    sampler = getattr(loader, "batch_sampler", None)
    size = getattr(loader, "batch_size", None) or getattr(sampler, "batch_size", None)
    return int(size) if isinstance(size, int) else None


# ---------------------------------------------------------------------------------------
# fit
# ---------------------------------------------------------------------------------------


def fit(trainer, train_loader: Any, val_loaders: list) -> None:
    """``fit``'s loop, from where a restored checkpoint left off: the sanity check,
    ``on_train_start``, the epochs, ``on_train_end``/``on_fit_end`` (the session made
    the model, the loaders and the restore)."""
    config, hook, state = trainer.config, trainer.hook, trainer.state
    _settle_max_epochs(trainer)
    validation = _ValidationSchedule(trainer, train_loader, val_loaders)
    hook.on_fit_start(trainer=trainer)
    if val_loaders and config.num_sanity_val_steps and validation.enabled:
        _sanity_check(trainer, val_loaders)
    if stop_requested(trainer):
        # Lightning's skip: stopped before training (a Timer whose time is up at fit
        # start): no training events, no epoch (with min_epochs/min_steps: it trains).
        hook.on_fit_end(trainer=trainer)
        return
    metrics = state.metrics
    fresh_epoch = not trainer.batch_idx and state.loop_stage != "epoch_end"
    if fresh_epoch:
        # what on_train_start logs belongs to the first epoch's values (Lightning)
        metrics.start("train")
        state.epoch_val_metrics = {}
    metrics.stage, metrics.epoch_level = "train", True
    _warn_if_modules_in_eval_mode(trainer.model)
    try:
        hook.on_train_start(trainer=trainer)
    finally:
        metrics.epoch_level = False
    max_epochs = config.max_epochs
    if max_epochs is None or max_epochs == -1:  # Lightning's: no epoch limit
        max_epochs = sys.maxsize
    step = TrainStep.build(trainer)
    # SIGTERM: stop at an optimizer-step boundary the ranks agree on, with a checkpoint
    # (hookloop.faults: every stop_check_every_n_steps boundaries, asynchronously).
    preemption = state.preemption = faults.Preemption().install()
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
        state.preemption = None
        loader_state.release(trainer)  # persistent workers end with fit, as before
    # A SIGTERM after the last step boundary goes to the handler from before fit.
    preemption.uninstall()


def _settle_max_epochs(trainer) -> None:
    """``max_epochs`` not given: 1000 epochs, with Lightning's warning, unless ``max_steps``
    or a ``Timer`` (``max_time``) ends the fit; then no epoch limit (-1). Set for the
    trainer's fits, as Lightning's ``trainer.max_epochs`` reads it from the first fit on."""
    config = trainer.config
    if config.max_epochs is not None:
        return
    if config.max_steps is None and not any(plugin_name(p) == "timer" for p in trainer.plugins):
        rank_zero_warn("`max_epochs` was not set. Setting it to 1000 epochs. To train without an "
                       "epoch limit, set `max_epochs=-1`.", category=PossibleUserWarning)
        config.max_epochs = 1000
    else:
        config.max_epochs = -1


def _fit_epochs(trainer, train_loader, step: TrainStep, validation, max_epochs: int,
                started: bool = False) -> None:
    """The epochs of ``fit``, from where a restored checkpoint left off (``started``: the
    first epoch's metrics were already started, before ``on_train_start``)."""
    hook = trainer.hook
    while trainer.current_epoch < max_epochs and not _done(trainer):
        epoch = trainer.current_epoch
        resumed_stage = trainer.state.loop_stage
        if resumed_stage != "epoch_end":
            _set_sampler_epoch(train_loader, epoch)
            if not trainer.batch_idx and not started:
                trainer.state.metrics.start("train")  # a mid-epoch resume keeps the restored sums
                trainer.state.epoch_val_metrics = {}
            started = False
            metrics = trainer.state.metrics
            metrics.stage = "train"
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
            # a stateful loader loads its state at the epoch's end (its workers' datasets)
            loader_state.start_epoch(trainer, train_loader, trainer.batch_idx, iterating=False)
        _end_epoch(trainer, epoch, resumed_stage, complete=ended in (EPOCH_DONE, EPOCH_CUT))


def _done(trainer) -> bool:
    max_steps = trainer.config.max_steps
    return stop_requested(trainer) or (max_steps is not None and trainer.global_step >= max_steps)


def _sanity_check(trainer, val_loaders: list) -> None:
    """``num_sanity_val_steps`` batches of each validation loader before training, to fail
    early on a broken validation_step. Its metrics are discarded and it draws nothing from
    the random generators, so training is the same with or without it."""
    hook = trainer.hook
    trainer.sanity_checking = True
    try:
        hook.on_sanity_check_start(trainer=trainer)
        steps = trainer.config.num_sanity_val_steps
        limit = None if steps == -1 else steps
        # Lightning knows the validation loaders' counts from the sanity check on
        val_limit = trainer.config.limit_val_batches
        trainer.num_val_batches = [batch_limit(x, val_limit, "limit_val_batches")
                                   for x in val_loaders]
        evaluate(trainer, VALIDATE, val_loaders, limit=limit, publish=False)
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
                        f"val_check_interval={interval} is a fraction of the epoch, but the "
                        "training loader has no length (an IterableDataset): give a number of "
                        "batches, val_check_interval=N, or 1.0 for the end of the epoch"
                    )
                self.batches = None
            else:
                self.batches = max(1, int(n * interval))
        else:
            if self.enabled and self.every_n_epochs is not None and n is not None and interval > n:
                raise ConfigurationError(
                    f"`val_check_interval` ({interval}) must be less than or equal to the number "
                    f"of the training batches ({n}) of an epoch: validate every N <= {n} batches, "
                    f"or count batches across epochs with check_val_every_n_epoch=None "
                    f"(limit_val_batches=0 turns validation off)"
                )
            self.batches = interval

    def due_this_epoch(self) -> bool:
        """Whether validation may run during the current epoch at all."""
        if not self.enabled:
            return False
        every = self.every_n_epochs
        return every is None or (self.trainer.current_epoch + 1) % every == 0

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
        limit = trainer.config.limit_val_batches
        results = evaluate(trainer, VALIDATE, self.val_loaders, limit=limit)
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


def _train_epoch(trainer, loader: DataLoader, step: TrainStep,
                 validation: _ValidationSchedule) -> str:
    """Train one epoch (validating when due); how it ended (``EPOCH_*``)."""
    n = batch_limit(loader, trainer.config.limit_train_batches, "limit_train_batches")
    trainer.num_training_batches = n  # for observers (progress bars); None: unsized
    accumulate = step.accumulate = trainer.accumulate_grad_batches  # a callback may change it
    skip, resumed_stage = trainer.batch_idx, trainer.state.loop_stage
    if skip and n is not None and skip >= n:
        # The checkpoint was written after the epoch's last batch: nothing left to train. A
        # stateful loader still loads its state (its workers' datasets at the epoch's end).
        loader_state.start_epoch(trainer, loader, skip, iterating=False)
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
    batch_start = event(trainer, "on_train_batch_start")
    preemption = trainer.state.preemption
    single = trainer.world_size == 1  # one process: the SIGTERM flag is read, no call per step
    # Sized loaders (the common case) need no look-ahead; is_last is a comparison.
    if n is not None:
        batches: Iterator[tuple] = enumerate(iterator, skip)
    else:
        # a stateful loader's state is taken before the batch read ahead
        pending = _pending_state(trainer, loader) if loader_state.is_stateful(loader) else None
        batches = _lookahead(iterator, skip, pending)
    validate = validation.due if validation.due_this_epoch() else None
    step_plateau = trainer.automatic_optimization and any(
        c.interval == "step" and c.reduce_on_plateau for c in trainer.lr_scheduler_configs)
    trained = False  # a resumed unsized epoch may have no batch left (see the end)
    for item in batches:
        trained = True
        if n is not None:
            batch_idx, batch = item
            if batch_idx >= n:
                break
            is_last = batch_idx + 1 == n
        else:
            batch_idx, batch, is_last = item
        trainer.batch_idx = trainer.state.fetched_batch_idx = batch_idx
        trainer.is_last_batch = is_last
        boundary = is_last or (batch_idx + 1) % accumulate == 0
        if batch is None:  # Lightning skips a batch the loader yields as None, with a warning
            stop = step.skip(batch_idx, boundary, is_last)
        elif batch_start is not None and -1 in batch_start(trainer=trainer, batch=batch,
                                                           batch_idx=batch_idx):
            # Lightning: on_train_batch_start returning -1 ends the epoch (inside a window:
            # its gradients are zeroed at the next window's start). Lightning marks the
            # skipping batch the epoch's last, so its (non-plateau) step and epoch
            # schedulers step there, and the epoch's plateau ones after on_train_epoch_end.
            trainer.is_last_batch = True
            if trainer.automatic_optimization and trainer.lr_scheduler_configs:
                step_schedulers(trainer, "step", plateau=False, count=batch_idx + 1)
                step_schedulers(trainer, "epoch", plateau=False, count=trainer.current_epoch + 1)
            return EPOCH_CUT
        else:
            stop = step.run(batch, batch_idx, boundary, is_last)  # it counts the batch as done
        # Several processes: the agreement, a no-op off its every-K schedule (hookloop.faults).
        if boundary and preemption is not None and (
                preemption.requested if single else preemption.agreed(trainer)):
            preemption.stop(trainer)  # checkpoint and SystemExit, on every rank
        # As Lightning: validation when due, and when should_stop ends the epoch early;
        # should_stop set by that validation (early stopping) ends the epoch here.
        if validate is not None and (validate(batch_idx, is_last)
                                     or (stop and stop_requested(trainer))):
            validation.run()
            stop = stop or stop_requested(trainer)
        if boundary and step_plateau:  # after validation, so it can monitor a validation metric
            step_schedulers(trainer, "step", plateau=True, count=batch_idx + 1)
        if stop:
            return EPOCH_DONE if is_last else EPOCH_STOPPED
    if (skip and not trained and resumed_stage == "train" and validation.due(skip - 1, True)
            and not validation.due(skip - 1, False)):
        # An unsized loader resumed after its epoch's last batch (its state says so): the
        # end-of-epoch validation came after the checkpoint in the interrupted run.
        validation.run()
    return EPOCH_DONE


def _end_epoch(trainer, epoch: int, resumed_stage: str, stopped: bool = False,
               complete: bool = False) -> None:
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
            metrics.reset_metric_objects("train")  # torchmetrics', after the hook (Lightning)
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
# validate / test
# ---------------------------------------------------------------------------------------


def _set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler and its batch sampler's sampler (once
    each), those that have one."""
    samplers = {id(s): s for s in (getattr(loader, "sampler", None),
                                   getattr(getattr(loader, "batch_sampler", None), "sampler", None))
                if s is not None}
    for sampler in samplers.values():
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


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
    was_training: list | None = _module_modes(model)
    rng = ckpt.rng_state()
    contexts = [c for c in hook.forward_context(trainer=trainer) if c is not None]
    run_batch = make_evaluation_step(trainer, stage, len(loaders))
    _eval_mode(trainer, prefix)
    metrics.start(stage)
    # Lightning's per-loader batch counts, for progress bars (num_val_batches, ...)
    limit_name = f"limit_{'val' if stage == VALIDATE else stage}_batches"
    counts = [batch_limit(loader, limit, limit_name) for loader in loaders]
    sanity = trainer.sanity_checking
    setattr(trainer, "num_sanity_val_batches" if sanity else f"num_{EVAL_COUNT[stage]}_batches",
            counts)
    # as the training loader's: a sampler that shuffles by epoch (a DistributedSampler
    # (shuffle=True)) follows the training epochs, at each validation of a fit and once
    # per validate/test run (Lightning's)
    for loader in loaders:
        _set_sampler_epoch(loader, trainer.current_epoch)
    try:
        getattr(hook, f"on_{prefix}_start")(trainer=trainer)
        _epoch_level_event(trainer, f"on_{prefix}_epoch_start")
        with torch.no_grad(), _enter(contexts):
            for dataloader_idx, loader in enumerate(loaders):
                metrics.suffix = f"/dataloader_idx_{dataloader_idx}" if len(loaders) > 1 else ""
                metrics.dataloader_idx = dataloader_idx if len(loaders) > 1 else None
                n = batch_limit(loader, limit, limit_name)
                if n == 0:
                    continue
                for batch_idx, batch in enumerate(loader_state.iterate_validation(loader)):
                    run_batch(batch, batch_idx, dataloader_idx)
                    if metrics.eval_step_row:
                        _log_eval_step(trainer, stage, publish)
                    if n is not None and batch_idx + 1 >= n:
                        break
        metrics.suffix, metrics.dataloader_idx = "", None
        _epoch_level_event(trainer, f"on_{prefix}_epoch_end")
        computed = metrics.finish_epoch(stage, publish=publish)
        # a name logged with on_step and on_epoch is a result as name_epoch only (Lightning)
        computed = {k: v for k, v in computed.items()
                    if not (k in metrics.forked and metrics.forked[k][1] in computed)}
        end_args = {"sanity_checking": trainer.sanity_checking} if prefix == "validation" else {}
        getattr(hook, f"on_{prefix}_end")(trainer=trainer, metrics=dict(computed), **end_args)
        metrics.reset_metric_objects(stage)  # torchmetrics Metrics, after on_*_end (Lightning)
        was_training = _train_mode(trainer, prefix, was_training)
    finally:
        metrics.stage, metrics.suffix, metrics.epoch_level = saved
        metrics.dataloader_idx = None
        if was_training is not None:
            _restore_modes(was_training)
        ckpt.set_rng_state(rng)
    return _per_loader(computed, len(loaders), dict(metrics.loader_of))


def _module_override(trainer, name: str) -> Callable[[], None] | None:
    """The module's own ``name`` (Lightning's ``on_validation_model_eval``, ...) when its
    class defines one, else None (the loop's default applies)."""
    method = getattr(type(trainer.module), name, None)
    if callable(method) and not getattr(method, "hookloop_placeholder", False):
        return getattr(trainer.module, name)
    return None


def _eval_mode(trainer, prefix: str) -> None:
    """Eval mode for an evaluation run: ``model.eval()``, or the module's
    ``on_{prefix}_model_eval`` override in its place (Lightning's hook)."""
    override = _module_override(trainer, f"on_{prefix}_model_eval")
    if override is not None:
        override()
    else:
        trainer.model.eval()


def _module_modes(model: torch.nn.Module) -> list:
    """Every submodule's train/eval mode, to give back after an evaluation run: a submodule
    the user keeps in eval mode (a frozen BatchNorm backbone) stays so (Lightning's
    ``_ModuleMode``); ``model.train()`` would switch it to training, its running statistics
    moving, a silently different function."""
    return [(module, module.training) for module in model.modules()]


def _restore_modes(modes: list) -> None:
    for module, training in modes:
        module.training = training


def _warn_if_modules_in_eval_mode(model: torch.nn.Module) -> None:
    """The loop trains the modules in the modes they have (it never calls ``model.train()``):
    one in eval mode at the start of training is said, in Lightning's words."""
    in_eval = [name for name, module in model.named_modules() if not module.training]
    if in_eval:
        rank_zero_warn(
            f"Found {len(in_eval)} module(s) in eval mode at the start of training. This may lead "
            "to unexpected behavior during training. If this is intentional, you can ignore this "
            "warning.", category=PossibleUserWarning)


def _train_mode(trainer, prefix: str, was_training: list | None) -> list | None:
    """After a finished evaluation run: the module's ``on_{prefix}_model_train`` override
    (then None: it set the mode), else ``was_training``, the modes to restore."""
    override = _module_override(trainer, f"on_{prefix}_model_train")
    if override is None:
        return was_training
    override()
    return None


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


def _per_loader(computed: dict, n_loaders: int, loader_of: dict[str, int]) -> list[dict]:
    """Each loader's result: what was logged while it ran (Lightning's), and what the
    epoch-level hooks logged, in every loader's."""
    results: list[dict] = [{} for _ in range(max(n_loaders, 1))]
    for name, value in computed.items():
        index = loader_of.get(name)
        if index is not None and index < len(results):
            results[index][name] = value
        else:
            for result in results:
                result[name] = value
    return results


# ---------------------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------------------


def predict(trainer, loaders: list) -> Any:
    """``predict_step`` over ``loaders``: per-batch outputs, in dataset order (a list per
    loader when there are several); ``None`` with ``return_predictions=False``."""
    hook, model, state = trainer.hook, trainer.model, trainer.state
    metrics = state.metrics
    keep = state.return_predictions
    contexts = [c for c in hook.forward_context(trainer=trainer) if c is not None]
    run_batch = make_evaluation_step(trainer, PREDICT, len(loaders))
    was_training: list | None = _module_modes(model)
    saved_stage = metrics.stage
    _eval_mode(trainer, "predict")
    metrics.stage = PREDICT
    per_loader: list[list] = []
    limit = trainer.config.limit_predict_batches
    trainer.num_predict_batches = [batch_limit(x, limit, "limit_predict_batches") for x in loaders]
    for loader in loaders:
        _set_sampler_epoch(loader, trainer.current_epoch)  # as evaluate's
    # Lightning's BasePredictionWriter callbacks: each batch's sample indices, and this
    # rank's predictions for write_on_epoch_end
    writing = state.prediction_writing = _prediction_writing(trainer, len(loaders))
    try:
        hook.on_predict_start(trainer=trainer)
        _epoch_level_event(trainer, "on_predict_epoch_start")
        with torch.no_grad(), _enter(contexts):
            for dataloader_idx, loader in enumerate(loaders):
                outputs: list = []
                n = batch_limit(loader, limit, "limit_predict_batches")
                source = loader if writing is None else writing.loader(loader)
                for batch_idx, batch in enumerate(source):
                    if n is not None and batch_idx >= n:
                        break
                    if writing is not None:
                        writing.batch_seen(dataloader_idx, batch_idx)
                    batch, out = run_batch(batch, batch_idx, dataloader_idx)
                    if keep:
                        outputs.append((batch_size_of(batch), out))
                    if writing is not None:
                        writing.prediction(dataloader_idx, out)
                per_loader.append(outputs)
        _epoch_level_event(trainer, "on_predict_epoch_end")
        # one outputs list per loader, appended above
        results = [_gather_predictions(trainer, loader, outputs)
                   for loader, outputs in zip(loaders, per_loader, strict=True)] if keep else None
        hook.on_predict_end(trainer=trainer)
        was_training = _train_mode(trainer, "predict", was_training)
    finally:
        metrics.stage = saved_stage
        if was_training is not None:
            _restore_modes(was_training)
    if results is None:
        return None
    return results[0] if len(results) == 1 else results


def _prediction_writing(trainer, n_loaders: int):
    """The state the run's prediction writers read, or ``None`` when it has none."""
    callbacks = trainer._callback_hooks  # the Lightning-style callbacks' adapter
    return callbacks.prediction_writing(n_loaders) if callbacks is not None else None


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
        total = len(sampler.sampler)  # type: ignore[arg-type]  # torch's Sampler: no __len__
        keys = [range(rank, sampler.total_size, world) for rank in range(world)]
        keys = [[k if k < total else None for k in rank_keys] for rank_keys in keys]
    else:
        if trainer.global_rank == 0:
            warnings.warn(
                f"predict under {world} processes with a loader whose sampler is a "
                f"{type(sampler).__name__}: hookloop cannot tell which samples each rank "
                "predicted, so the predictions come back as rank 0's batches, then rank 1's, and "
                "so on (samples may be missing or repeated). For predictions in dataset order give "
                "the loader a DistributedSampler, or let hookloop shard it "
                "(use_distributed_sampler=True, a map-style dataset).",
                stacklevel=3,
            )
        return [out for share, _ in shares for _, out in share]
    samples: dict[int, Any] = {}
    for (share, _), rank_keys in zip(shares, keys, strict=True):  # one of each per rank
        pieces = (piece for count, out in share for piece in _split(out, count))
        # fewer pieces than keys where limit_predict_batches cut the loader short
        for key, piece in zip(rank_keys, pieces, strict=False):
            if key is not None:
                samples.setdefault(key, piece)
    ordered = [samples[k] for k in sorted(samples)]
    size = _per_device_batch(loader) or 1
    return [_merge(ordered[i : i + size]) for i in range(0, len(ordered), size)]


def _warn_dropped_predictions(trainer, sampler: DistributedSampler) -> None:
    """Global rank 0 says which samples a ``drop_last`` sampler leaves unpredicted."""
    if trainer.global_rank != 0 or not sampler.drop_last:
        return
    total = len(sampler.dataset)  # type: ignore[arg-type]  # torch's Dataset: no __len__
    dropped = total - sampler.num_samples * sampler.num_replicas
    if dropped > 0:
        warnings.warn(
            f"the predict loader's DistributedSampler has drop_last=True: {dropped} of its {total} "
            "samples go to no rank, so predict returns no prediction for them. Build the sampler "
            "with drop_last=False (its padding's repeats are dropped from the predictions), or "
            f"give the loader a multiple of {sampler.num_replicas} samples.",
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
        columns = [_split(v, count) for v in out]
        make = (lambda items: type(out)(*items)) if hasattr(out, "_fields") else type(out)
        return [make([p[i] for p in columns]) for i in range(count)]
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
