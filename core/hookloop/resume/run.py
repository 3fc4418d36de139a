"""Checkpoints of the run: what one holds (:func:`checkpoint_dict`), and how a run resumes
from one (:func:`restore`, :func:`resume_after_restart`).

The loop's position is ``trainer.state``'s (:meth:`hookloop.engine.state.LoopState.state_dict`);
next to it a checkpoint holds the weights, the optimizers and schedulers, the metrics'
partial sums, every rank's random generators and loader position, and what plugins add.

Layer: above :mod:`hookloop.loop`; below the session and the trainer.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from hookloop.resume import checkpoint as ckpt
from hookloop.resume import loader_state
from hookloop.distributed.elastic import WORKERS_ENV, is_elastic
from hookloop.distributed.strategy import data_parallel_rank
from hookloop.contract.errors import CheckpointError, ConfigurationError
from hookloop.helpers import apply_to_tensors, gather_per_rank, own_entry
from hookloop.engine.loop import _per_device_batch, batch_limit
from hookloop.dispatch import event


#: The ``pytorch-lightning_version`` hookloop's checkpoints carry: the Lightning release
#: whose checkpoint layout they follow (hookloop never imports pytorch_lightning).
LIGHTNING_FORMAT_VERSION = "2.6.6"


def checkpoint_dict(trainer) -> dict:
    """The whole run state; plugins add theirs in ``on_save_checkpoint``.

    ``loop["stage"]`` says how far the loop got after ``batch_idx`` batches of ``epoch``:
    ``"train"`` (what follows the batch is still to do), ``"validated"`` (its validation
    is done) or ``"epoch_end"`` (written inside ``on_train_epoch_end``). A resume does
    exactly what the interrupted run would have done after the checkpoint.
    """
    from hookloop import _version as hookloop  # hookloop.__version__, without the package's facade

    module = trainer.module
    # This rank's generators (and its CUDA devices'); global rank 0's are the file's "rng"
    # and "epoch_rng" (what a checkpoint of one process, or an older reader, has).
    rng = ckpt.rng_state(ckpt.rank_cuda_devices(trainer))
    epoch_rng = trainer.state.epoch_rng if trainer.batch_idx else None
    checkpoint = {
        # Lightning's keys, beside hookloop's own, so what reads a Lightning checkpoint
        # (ckpt["epoch"], ckpt["callbacks"][state_key]) reads this one; "loops" cannot be
        # Lightning's progress objects: None, which Lightning's restore skips
        # (docs/decisions.md, "Lightning's checkpoint keys")
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": LIGHTNING_FORMAT_VERSION,
        "loops": None,
        "callbacks": {},
        "hookloop": {"version": hookloop.__version__, "format": ckpt.FORMAT_VERSION},
        "state_dict": module.state_dict(),
        "optimizer_states": [o.state_dict() for o in trainer.optimizers],
        "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        # the position, and what it means in samples (see _adapt_position)
        "loop": trainer.state.state_dict(),
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
    per_rank = event(trainer, "on_save_rank_checkpoint")
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
    restarted (``TORCHELASTIC_RESTART_COUNT`` > 0, ``hookloop run --max-restarts``), or
    that another launcher started again (``HOOKLOOP_ATTEMPT`` > 0).

    The restarted worker runs the script again from the top; a ``fit`` given no
    ``ckpt_path`` then loads this run's newest ``last.ckpt`` (its run directory is the
    same in every attempt: see :mod:`hookloop.rundir`), or starts from scratch when the
    run has written none yet. Global rank 0 chooses the file (every rank loads the same)
    and says what happened. Called once the run directory and the process group exist.
    """
    from hookloop.distributed.ranks import attempt
    from hookloop.resume import rundir

    restart, variable = attempt()
    if not restart:
        return
    places = [Path(trainer.log_dir) / "checkpoints"]
    own = getattr(trainer.checkpoint_callback, "dir", None)  # ModelCheckpoint(dirpath=...)
    if own is not None and Path(own) not in places:
        places.insert(0, Path(own))
    found = None
    if trainer.global_rank == 0:
        # last.prev.ckpt alone: killed between its two renames (file systems without hard links)
        # a staged place (a root on a store): its committed last.ckpt, by the commit's time
        written = [(t, place / ckpt.LAST) for place in places
                   if (t := rundir.written_at(place / ckpt.LAST)) is not None]
        found = str(max(written, key=lambda w: w[0])[1]) if written else None
    found = trainer.broadcast(found, 0)
    if found is None:
        hint = ("" if trainer.loggers else "; a run without a logger writes a last.ckpt only with "
                "ModelCheckpoint(save_last=True), docs/decisions.md")
        trainer.print(f"hookloop: restart {restart} of this run ({variable}={restart}): no "
                      f"last.ckpt under {' or '.join(str(p) for p in places)} yet, starting from scratch{hint}")
        return
    used = restore(trainer, found, fall_back=True, train_loader=train_loader)
    trainer.print(f"hookloop: restart {restart} of this run ({variable}={restart}): resumed "
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
    from hookloop.resume import rundir, storage

    # a URL (s3://.../last.ckpt): its committed payload, downloaded into its staging directory
    path = storage.local_root(ckpt_path) if storage.is_url(ckpt_path) else Path(ckpt_path)
    if str(ckpt_path) == "best":
        best = getattr(trainer.checkpoint_callback, "best_model_path", "")
        if not best:
            raise CheckpointError(
                "ckpt_path='best' but this trainer's checkpoint plugin has no best checkpoint yet: fit with "
                "ModelCheckpoint(monitor=...) first, or pass a checkpoint path"
            )
        path = Path(best)
    elif str(ckpt_path) == "last":
        # Lightning looks in the checkpoint callback's directory: a dirpath's save_last file
        found = rundir.newest_last_checkpoint(trainer.default_root_dir,
                                              getattr(trainer.checkpoint_callback, "dir", None))
        if found is None:
            # As Lightning: nothing to resume is a fresh start, not an error.
            if trainer.is_global_zero:
                hint = ("" if trainer.loggers else " (a run without a logger writes one only with "
                        "ModelCheckpoint(save_last=True))")
                warnings.warn(
                    f"ckpt_path='last' but no run under {trainer.default_root_dir / 'logs'} wrote a "
                    f"last.ckpt yet: starting from scratch{hint}")
            return None
        path, fall_back = found, True
    if storage.remote_of(path) is not None and not _fetch(trainer, path) and storage.is_url(ckpt_path):
        raise CheckpointError(f"checkpoint {ckpt_path} does not exist: nothing is committed there (no "
                              f"{storage.join(str(ckpt_path), storage.LATEST)}). Pass the URL of a checkpoint "
                              f"hookloop committed, or ckpt_path='last' for this root's newest")
    checkpoint, path = _read_checkpoint(trainer, path, fall_back)
    # Lightning's trainer.ckpt_path: what ModelCheckpoint's pruning never removes
    trainer.state.loaded_ckpt_path = path
    ckpt.check_format(checkpoint, path)  # a readable file of a newer hookloop: no falling back
    callbacks = trainer._callback_hooks
    if callbacks is not None and trainer.state.fn == "fit":
        # Lightning restores the callbacks before the optimizer states (BaseFinetuning
        # rebuilds its param groups first)
        callbacks.restore(trainer, checkpoint)
    trainer.hook.load_model_state(trainer=trainer, checkpoint=checkpoint)
    loop = checkpoint["loop"]
    trainer.state.load_state_dict(loop)
    max_epochs = trainer.max_epochs
    if trainer.state.fn == "fit" and max_epochs not in (None, -1) and trainer.current_epoch > max_epochs:
        # Lightning's refusal: the run would train nothing and say nothing
        raise ConfigurationError(
            f"You restored a checkpoint with current_epoch={trainer.current_epoch}, but you have set "
            f"Trainer(max_epochs={max_epochs}) ({str(path)!r}): set max_epochs to more than "
            f"{trainer.current_epoch} (or -1 for no limit) to train on, or resume from an earlier checkpoint")
    rng, trainer.state.epoch_rng, derive = _rank_rng(trainer, checkpoint, loop)
    trainer.state.loader_resume_state = own_entry(checkpoint.get("loader_per_rank"), trainer)
    if trainer.batch_idx and trainer.state.loop_stage == "train" and trainer.state.epoch_rng is None:
        raise CheckpointError(f"{str(path)!r} was saved mid-epoch without the epoch's RNG state")
    if train_loader is not None:
        _adapt_position(trainer, loop, train_loader)
        loader_state.resumed(train_loader)
    if checkpoint.get("metrics") and trainer.state.fn == "fit":
        # only a resumed fit goes on with the saved metrics: validate/test/predict from a
        # checkpoint start with none, as every run does (Lightning's)
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


def _fetch(trainer, path: Path) -> bool:
    """The store's committed copy of the staged checkpoint ``path``, downloaded once per
    machine (by its local rank 0; the other ranks read that copy after a barrier: a
    sharded checkpoint's directory is replaced whole, never under a reader); whether
    one was committed (global rank 0's answer, the same store for every machine)."""
    from hookloop.resume import storage

    fetched = storage.fetch(path) if trainer.local_rank == 0 else False
    trainer.barrier("checkpoint_fetch")
    return bool(trainer.broadcast(fetched, 0))


def _rank_rng(trainer, checkpoint: dict, loop: dict) -> tuple[dict | None, dict | None, bool]:
    """This rank's RNG states in ``checkpoint``: ``(rng, epoch_rng, derive)``.

    Global rank r takes entry r of ``rng_per_rank`` (written by runs of several
    processes). A checkpoint of one process, or one older than per-rank states, has one
    entry: global rank 0's ``rng``/``epoch_rng``. A rank the checkpoint has no entry of
    (it was written on fewer processes) takes the entry of rank ``r % saved`` and
    ``derive`` (:func:`hookloop.resume.checkpoint.derive_rng_state`: its own stream, seeded
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
    # Counted in data-parallel replicas (hookloop.data_parallel_rank): the processes of a
    # tp group share their batches. Checkpoints without "replicas": their world size.
    if loop.get("world_size") is None:
        return  # an older checkpoint: taken as written on this world size
    old_world, new_world = int(loop.get("replicas", loop["world_size"])), data_parallel_rank(trainer)[0]
    if old_world == new_world:
        return
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

    elastic = is_elastic(trainer.config) or bool(os.environ.get(WORKERS_ENV))  # a launcher's range of workers
    policy = f" (elastic_batch={trainer.config.elastic_batch!r})" if elastic else ""
    trainer.print(f"hookloop: resuming a checkpoint of {old_world} processes on {new_world}: effective batch size "
                  f"{effective(old_world, old_batch, old_acc)} -> {effective(new_world, new_batch, new_acc)}"
                  f"{policy}; {position}", flush=True)


def _others_beside(path: Path) -> str:
    """The sentence naming the intact checkpoints beside a damaged ``last.ckpt`` and
    ``last.prev.ckpt`` (the top-k files), and how to resume from one."""
    others = ckpt.intact_checkpoints_beside(path)
    if not others:
        return f" No other checkpoint is beside them in {str(path.parent)!r}."
    return (f" Intact checkpoints beside them, newest first: {', '.join(p.name for p in others)} (in "
            f"{str(path.parent)!r}): resume from one with ckpt_path={str(others[0])!r}")


def _read_checkpoint(trainer, path: Path, fall_back: bool) -> tuple[dict, Path]:
    """Read the checkpoint at ``path``; with ``fall_back``, one that cannot be read makes
    the previous one (``last.prev.ckpt`` beside a ``last.ckpt``) the one read."""

    def read(p: Path) -> dict:
        checkpoint = trainer.hook.load_checkpoint(trainer=trainer, path=p)
        lightning = ckpt.lightning_checkpoint_error(checkpoint, p)
        if lightning is not None:
            raise lightning
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
        raise CheckpointError(f"neither checkpoint can be loaded: {str(newest).rstrip('.')}; and the previous one: {exc}"
                              f"{_others_beside(path)}") from exc
    if trainer.is_global_zero:
        warnings.warn(f"newest checkpoint {str(path)!r} cannot be loaded ({newest}); resuming from the previous "
                      f"checkpoint {str(previous)!r} instead")
    return checkpoint, previous
