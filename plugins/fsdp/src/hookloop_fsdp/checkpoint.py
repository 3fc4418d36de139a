"""Checkpoints of the fsdp strategy: hookloop's single file, or a sharded directory.

``state_dict_type="full"``: the model's full state dict (gathered by ``state_dict()``)
and the optimizers' (gathered to rank 0 by ``get_optimizer_state_dict(full_state_dict=
True, cpu_offload=True)``, then keyed as ``optimizer.state_dict()`` keys them), written
by rank 0 with :func:`hookloop.atomic_save`: the file any strategy, or a plain model,
loads.

``state_dict_type="sharded"``: a directory written by every rank at once with
``torch.distributed.checkpoint``, in the format of :mod:`hookloop.dcp` (the core's,
shared with tp and fsdp x tp; its names are re-exported here for older imports).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

import hookloop
from hookloop import CheckpointError
from hookloop.resume.dcp import (  # noqa: F401 (re-exported: the names of hookloop_fsdp.checkpoint before issue 21)
    LATEST,
    LOOP_FILE,
    MODEL_DIR,
    OPTIMIZER_DIR,
    SHARDS_INFO,
    SHARDS_KEY,
    committed_tag,
    fqn_to_native,
    load,
    load_model_state,
    native_to_fqn,
    parameter_names,
    save_sharded,
    tagged,
)

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
