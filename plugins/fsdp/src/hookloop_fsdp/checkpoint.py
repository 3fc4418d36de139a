"""Checkpoints of the fsdp strategy: hookloop's single file, or a sharded directory.

``state_dict_type="full"``: the model's full state dict (gathered by ``state_dict()``)
and the optimizers' (gathered to rank 0 by ``get_optimizer_state_dict(full_state_dict=
True, cpu_offload=True)``, then keyed as ``optimizer.state_dict()`` keys them), written
by rank 0 with :func:`hookloop.atomic_save`: the file any strategy, or a plain model,
loads.

``state_dict_type="sharded"``: a directory, written by every rank at once with
``torch.distributed.checkpoint`` (DCP)::

    last.ckpt/
      latest                  the committed tag, replaced atomically (rename)
      step42/
        .hookloop-complete    written once every rank's shards are there
        model/                DCP: .metadata + one __<rank>_0.distcp per rank
        optimizer/            DCP: optimizer_<i>, keyed by parameter name
        hookloop.pt           the loop's state (epoch, step, RNG, plugins...), rank 0

The tags are a :class:`hookloop.TaggedCheckpointDir` (the scheme the deepspeed strategy
shares): a save writes a new tag; once every rank's shards and DCP's metadata (written
last, by the coordinator) are on disk (a barrier), rank 0 marks the tag complete
(``.hookloop-complete``), then replaces ``latest``, then removes the older tags. A crash
mid-save leaves ``latest`` naming the previous, complete tag. Loading reads ``latest``
(falling back to the newest complete tag, with a warning, when it names an incomplete
one); DCP reshards to the number of processes of the run that loads.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

import hookloop
from hookloop import CheckpointError

LATEST = "latest"
LOOP_FILE = "hookloop.pt"
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
# The key under which load() tells load_model_state where the shards are.
SHARDS_KEY = "_hookloop_fsdp_shards"
# What the loop's file says about the shards beside it.
SHARDS_INFO = "fsdp_shards"
# Written by the model and optimizer shards themselves, never in the loop's file.
_SHARDED_KEYS = ("state_dict", "optimizer_states")


# ---------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------


def save_full(strategy, trainer, checkpoint: dict, path: Path) -> Path:
    """hookloop's file: the module's state dict is already full (``state_dict()``
    gathers under ``state_dict_type="full"``); gather the optimizers' on rank 0."""
    if path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a directory (a sharded checkpoint?), but state_dict_type='full' writes "
            f"one file there: remove it, choose another path, or use state_dict_type='sharded'")
    running = dist.is_available() and dist.is_initialized() and strategy.sharded is not None
    if not running and any(hasattr(v, "to_local") for v in checkpoint.get("state_dict", {}).values()):
        raise CheckpointError(
            "the module holds the shards of a run that failed (they were not gathered at its end), "
            "and there is no process group to gather them now: save inside a run, or resume from "
            "the run's last checkpoint")
    if running:
        checkpoint["optimizer_states"] = [
            _full_optimizer_state(strategy, trainer, optimizer) for optimizer in trainer.optimizers]
    if trainer.global_rank == 0:
        hookloop.atomic_save(checkpoint, path)
    if running:
        trainer.barrier("fsdp_save_checkpoint")
    return path


def _full_optimizer_state(strategy, trainer, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not any(optimizer.state.values()):
        return optimizer.state_dict()  # nothing stepped yet: nothing to gather
    with strategy.sharded_state_dicts():
        state = get_optimizer_state_dict(strategy.sharded.module, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank != 0:
        return {}
    return fqn_to_native(state, optimizer, parameter_names(strategy.sharded.module))


def save_sharded(strategy, trainer, checkpoint: dict, path: Path) -> Path:
    """Every rank writes its shards of the model and optimizers into a new tag of the
    directory ``path``; rank 0 writes the loop's state, then commits the tag."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a file (a single-file checkpoint?), but state_dict_type='sharded' "
            f"writes a checkpoint directory there: remove it, choose another path, or use "
            f"state_dict_type='full'")
    tags = tagged(path)
    tag = trainer.broadcast(tags.new_tag(trainer.global_step) if trainer.global_rank == 0 else None, 0)
    target = path / tag
    module = strategy.sharded.module
    background = hookloop.deferring()  # ModelCheckpoint(async_save=True)
    writes = []  # DCP's background writes (futures), in an asynchronous save
    with strategy.sharded_state_dicts():
        stepped = [bool(any(o.state.values())) for o in trainer.optimizers]
        states = [(MODEL_DIR, get_model_state_dict(module))]
        optimizers = {f"optimizer_{i}": get_optimizer_state_dict(module, o)
                      for i, o in enumerate(trainer.optimizers) if stepped[i]}
        if optimizers:
            states.append((OPTIMIZER_DIR, optimizers))
        for name, state in states:
            if background:
                # Copied to CPU now (DCP's stager), written by DCP's thread; its collectives
                # run on a gloo group of their own, never beside training's on the same one.
                writes.append(dcp.async_save(state, checkpoint_id=str(target / name),
                                             process_group=hookloop.cpu_process_group(f"checkpoint.{name}")))
            else:
                dcp.save(state, checkpoint_id=str(target / name))
    if trainer.global_rank == 0:
        loop = {k: v for k, v in checkpoint.items() if k not in _SHARDED_KEYS}
        loop[SHARDS_INFO] = {"optimizers": len(trainer.optimizers), "stepped": stepped,
                             "world_size": trainer.world_size}
        hookloop.atomic_save(loop, target / LOOP_FILE)  # asynchronous: a snapshot, written in the background
    if background:
        hookloop.defer(lambda: _commit_when_written(trainer.global_rank, tags, tag, writes))
        return path
    trainer.barrier("fsdp_sharded_written")
    if trainer.global_rank == 0:
        tags.commit(tag)  # complete marker, then latest: fsync'd, then renamed
        tags.prune()  # older tags, and those an interrupted save left
    trainer.barrier("fsdp_sharded_committed")
    return path


def _commit_when_written(rank: int, tags, tag: str, writes: list) -> None:
    """The end of an asynchronous sharded save, in the background writer: wait for DCP's
    writes; then rank 0 commits the tag. A DCP save ends (on every rank) once its
    coordinator has gathered every rank's write results and written the metadata, so
    rank 0's writes done means every rank's shards are on disk, with no barrier. A rank
    killed before that leaves ``latest`` naming the previous tag."""
    for write in writes:
        write.result()
    if rank == 0:
        tags.commit(tag)
        tags.prune()


def save_after_run(strategy, trainer, checkpoint: dict, path: Path) -> Path:
    """``trainer.save_checkpoint`` after ``fit`` under ``state_dict_type="sharded"``: the
    run's process group is gone and the module holds this rank's shards. Every rank
    calls this: a process group is made for the write (ddp's ``setup_environment``), the
    module's shards and the optimizers' state are re-attached to it, the directory is
    written as during a run, and the group is released again (``teardown``)."""
    step_module = trainer.model
    if step_module is None or getattr(step_module, "module", None) is not trainer.module:
        raise CheckpointError(
            "trainer.save_checkpoint after fit needs the module that fit trained; call it "
            "after trainer.fit(...) returned, on every rank")
    states = [_state_by_position(o) for o in trainer.optimizers]
    for optimizer in trainer.optimizers:
        optimizer.state.clear()
    strategy.setup_environment(trainer)
    try:
        strategy.make_mesh(trainer)
        strategy.wrap_model(trainer, step_module, list(trainer.optimizers))
        for optimizer, state in zip(trainer.optimizers, states):
            _restore_by_position(optimizer, state)
        save_sharded(strategy, trainer, checkpoint, path)
    finally:
        strategy.teardown(trainer)  # the shards stay; the group goes
    return path


def _state_by_position(optimizer) -> list[dict]:
    """Each parameter's optimizer state in param-group order; a DTensor as its local
    shard and layout, to be put on the new run's mesh."""
    from torch.distributed.tensor import DTensor

    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append({k: ((v.to_local(), tuple(v.placements), v.shape, v.stride()) if isinstance(v, DTensor) else v)
                        for k, v in optimizer.state.get(p, {}).items()})
    return out


def _restore_by_position(optimizer, states: list[dict]) -> None:
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p, state in zip(params, states):
        if state:
            optimizer.state[p] = {
                k: (DTensor.from_local(v[0], p.device_mesh, v[1], run_check=False, shape=v[2], stride=v[3])
                    if isinstance(v, tuple) else v)
                for k, v in state.items()}


def tagged(path: Path) -> hookloop.TaggedCheckpointDir:
    """``path`` as a directory of tags (``step<N>``); a tag of an older hookloop, without
    the complete marker, is whole when DCP's metadata (written last) is there."""
    return hookloop.TaggedCheckpointDir(path, prefix="step",
                                        legacy_complete=lambda tag: (tag / MODEL_DIR / ".metadata").is_file())


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


def committed_tag(path: Path, warn: bool = True) -> Path:
    """The directory of the committed checkpoint in ``path`` (its ``latest`` tag, or the
    newest complete one with a warning when ``latest`` names an incomplete tag), or
    ``path`` itself when it is a tag; ``CheckpointError`` otherwise."""
    if (path / MODEL_DIR / ".metadata").is_file():
        return path
    tags = tagged(path)
    if not (path / LATEST).is_file() and not tags.tags():
        raise CheckpointError(
            f"{str(path)!r} is a directory but not a checkpoint of the fsdp strategy (no "
            f"'{LATEST}' file and no '{MODEL_DIR}/.metadata'); a sharded checkpoint whose first "
            f"save was interrupted has no '{LATEST}' yet")
    return tags.committed(warn=warn)


def load(trainer, path: Path) -> dict:
    """The checkpoint's loop state: a file is read whole (``torch.load(weights_only=True)``);
    for a directory, its ``hookloop.pt``, with a note of where the shards are."""
    if not path.exists():
        return hookloop.safe_load(path)  # its error names the checkpoints beside it
    if not path.is_dir():
        return hookloop.safe_load(path)
    tag = committed_tag(path, warn=trainer.global_rank == 0)
    checkpoint = hookloop.safe_load(tag / LOOP_FILE)
    checkpoint[SHARDS_KEY] = str(tag)
    return checkpoint


def load_model_state(strategy, trainer, checkpoint: dict) -> None:
    """Model and optimizer state into this run's shards, then the schedulers."""
    optimizer_states, scheduler_states = hookloop.optimizer_and_scheduler_states(checkpoint)
    if SHARDS_KEY in checkpoint:
        _load_sharded(strategy, trainer, Path(checkpoint.pop(SHARDS_KEY)), checkpoint)
    else:
        _load_full(strategy, trainer, checkpoint, optimizer_states)
    hookloop.load_scheduler_states(trainer, scheduler_states)


def _load_full(strategy, trainer, checkpoint: dict, optimizer_states: list) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if "state_dict" not in checkpoint:
        raise CheckpointError("checkpoint has no 'state_dict': it was not written by hookloop")
    module = strategy.sharded.module
    options = StateDictOptions(full_state_dict=True)
    with strategy.sharded_state_dicts():
        hookloop.check_state_dict(module, checkpoint["state_dict"])  # global shapes: no gathering
        set_model_state_dict(module, checkpoint["state_dict"], options=options)
        if trainer.optimizers and optimizer_states:
            _check_count(len(optimizer_states), len(trainer.optimizers))
            names = parameter_names(module)
            for optimizer, state in zip(trainer.optimizers, optimizer_states):
                if state.get("state"):
                    set_optimizer_state_dict(module, optimizer, native_to_fqn(state, optimizer, names), options=options)
                else:
                    _load_hyperparameters(optimizer, state)


def _load_sharded(strategy, trainer, tag: Path, checkpoint: dict) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from . import safe_dcp  # DCP unpickles with plain pickle: never run a shared checkpoint's code

    module = strategy.sharded.module
    info = checkpoint.get(SHARDS_INFO, {})
    with strategy.sharded_state_dicts():
        model_state = get_model_state_dict(module)
        try:
            safe_dcp.load(model_state, tag / MODEL_DIR, source=tag)
        except CheckpointError:
            raise
        except Exception as exc:  # DCP raises assorted types for another model's shards
            raise CheckpointError(
                f"cannot load the model shards of {str(tag)!r} into {type(trainer.module).__name__}: "
                f"{type(exc).__name__}: {_first_line(exc)}. Pass the checkpoint of this model") from exc
        set_model_state_dict(module, model_state)
        if not trainer.optimizers:
            return
        stepped = info.get("stepped", [])
        _check_count(int(info.get("optimizers", 0)), len(trainer.optimizers))
        wanted = {f"optimizer_{i}": o for i, o in enumerate(trainer.optimizers) if i < len(stepped) and stepped[i]}
        if not wanted:
            return
        states = {key: get_optimizer_state_dict(module, o) for key, o in wanted.items()}
        try:
            safe_dcp.load(states, tag / OPTIMIZER_DIR, source=tag)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"cannot load the optimizer shards of {str(tag)!r}: {type(exc).__name__}: "
                f"{_first_line(exc)}. Resume with the optimizers the checkpoint was saved with") from exc
        for key, optimizer in wanted.items():
            set_optimizer_state_dict(module, optimizer, states[key])


def _check_count(saved: int, now: int) -> None:
    if saved != now:
        raise CheckpointError(
            f"the checkpoint holds the state of {saved} optimizer(s) and configure_optimizers "
            f"returned {now}: resume with the optimizers it was saved with")


def _load_hyperparameters(optimizer, state: dict) -> None:
    for group, saved in zip(optimizer.param_groups, state.get("param_groups", [])):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---------------------------------------------------------------------------------------
# Optimizer state: keyed by parameter name (DCP) or by position (optimizer.state_dict())
# ---------------------------------------------------------------------------------------


def parameter_names(module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _positions(optimizer, names: dict[int, str]) -> list[str]:
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError("an optimizer parameter is not a parameter of the module")
            out.append(names[id(p)])
    return out


def fqn_to_native(state: dict, optimizer, names: dict[int, str]) -> dict:
    """``get_optimizer_state_dict``'s form (keys are parameter names) -> the form of
    ``optimizer.state_dict()`` (keys are positions), which any optimizer loads."""
    index = {name: i for i, name in enumerate(_positions(optimizer, names))}
    return {
        "state": {index[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
                         for g in state.get("param_groups", [])],
    }


def native_to_fqn(state: dict, optimizer, names: dict[int, str]) -> dict:
    """The form of ``optimizer.state_dict()`` -> keys by parameter name, for ``optimizer``
    (the checkpoint's positions are this optimizer's, in its param groups' order)."""
    order = _positions(optimizer, names)
    saved = [i for g in state.get("param_groups", []) for i in g["params"]]
    if len(saved) != len(order):
        raise CheckpointError(
            f"the checkpoint's optimizer state covers {len(saved)} parameters and "
            f"{type(optimizer).__name__} has {len(order)}: resume with the optimizer it was saved with")
    name_of = dict(zip(saved, order))
    return {
        "state": {name_of[i]: value for i, value in state.get("state", {}).items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[i] for i in g["params"]]}
                         for g in state.get("param_groups", [])],
    }
