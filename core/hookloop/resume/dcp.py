"""torch.distributed.checkpoint (DCP) directories: the format fsdp, tp and fsdp x tp share.

A strategy whose parameters are DTensors (fsdp's ``fully_shard``, tp's
``parallelize_module``, both on one mesh) writes its checkpoints here, so a checkpoint
of one layout resumes under another (2x2 -> 4x1 -> one process: DCP reshards by the
tensors' global offsets)::

    last.ckpt/
      latest                  the committed tag, replaced atomically (rename)
      step42/
        .hookloop-complete    written once every rank's shards are there
        model/                DCP: .metadata + one __<rank>_0.distcp per rank
        optimizer/            DCP: optimizer_<i>, keyed by parameter name
        pt           the loop's state (epoch, step, RNG, plugins...), rank 0

The tags are a :class:`TaggedCheckpointDir`: a save writes a new tag; once every
rank's shards and DCP's metadata (written last, by the coordinator) are on disk (a
barrier), rank 0 marks the tag complete, then replaces ``latest``, then removes the
older tags. A crash mid-save leaves ``latest`` naming the previous, complete tag.
Loading reads ``latest`` (falling back to the newest complete tag, with a warning).

The functions take the strategy as ``owner``: any object with ``owner.sharded.module``
(the user's module holding DTensor parameters, ``None`` outside a run) and a context
manager ``owner.sharded_state_dicts()`` inside which ``module.state_dict()`` returns
DTensors (fsdp's ``state_dict_type="full"`` gathers outside it; tp's needs nothing).

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load`` and reads non-tensor
entries with ``torch.load(weights_only=False)``: either can run code planted in a shared
checkpoint. :class:`SafeFileSystemReader` unpickles the metadata with an allow-list of
DCP's own metadata classes, and :func:`safe_dcp_load` / :func:`dcp_to_torch_save` load
inside :func:`weights_only_loads`.

Nothing here imports a plugin (issue 21 moved it here from hookloop-fsdp, which tp used).
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hookloop.resume.checkpoint import (
    TaggedCheckpointDir,
    atomic_save,
    check_state_dict,
    defer,
    deferring,
    optimizer_and_scheduler_states,
    safe_load,
)
from hookloop.distributed.collectives import cpu_process_group
from hookloop.contract.errors import CheckpointError
from hookloop.engine.optim import load_scheduler_states
from hookloop.resume.unpickling import unsafe_checkpoint_error, weights_only_loads

LATEST = "latest"
LOOP_FILE = "hookloop.pt"
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
#: The key under which :func:`load` tells :func:`load_model_state` where the shards are.
SHARDS_KEY = "_hookloop_fsdp_shards"
#: What the loop's file says about the shards beside it.
SHARDS_INFO = "fsdp_shards"
# Written by the model and optimizer shards themselves, never in the loop's file.
_SHARDED_KEYS = ("state_dict", "optimizer_states")

__all__ = [
    "LATEST", "LOOP_FILE", "MODEL_DIR", "OPTIMIZER_DIR", "SHARDS_INFO", "SHARDS_KEY", "SafeFileSystemReader",
    "check_shards", "committed_tag", "dcp_to_torch_save", "fqn_to_native", "load", "load_model_state", "native_to_fqn",
    "parameter_names", "safe_dcp_load", "save_sharded", "tagged",
]


# ---------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------


def save_sharded(owner, trainer, checkpoint: dict, path: Path) -> Path:
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
    module = owner.sharded.module
    background = deferring()  # ModelCheckpoint(async_save=True)
    writes = []  # DCP's background writes (futures), in an asynchronous save
    with owner.sharded_state_dicts():
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
                                             process_group=cpu_process_group(f"checkpoint.{name}")))
            else:
                dcp.save(state, checkpoint_id=str(target / name))
    if trainer.global_rank == 0:
        loop = {k: v for k, v in checkpoint.items() if k not in _SHARDED_KEYS}
        loop[SHARDS_INFO] = {"optimizers": len(trainer.optimizers), "stepped": stepped,
                             "world_size": trainer.world_size}
        atomic_save(loop, target / LOOP_FILE)  # asynchronous: a snapshot, written in the background
    if background:
        defer(lambda: _commit_when_written(trainer.global_rank, tags, tag, writes))
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


def tagged(path: Path) -> TaggedCheckpointDir:
    """``path`` as a directory of tags (``step<N>``); a tag of an older hookloop, without
    the complete marker, is whole when DCP's metadata (written last) is there."""
    return TaggedCheckpointDir(path, prefix="step",
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
        return safe_load(path)  # its error names the checkpoints beside it
    if not path.is_dir():
        return safe_load(path)
    tag = committed_tag(path, warn=trainer.global_rank == 0)
    checkpoint = safe_load(tag / LOOP_FILE)
    check_shards(tag, checkpoint.get(SHARDS_INFO, {}))
    checkpoint[SHARDS_KEY] = str(tag)
    return checkpoint


def check_shards(tag: Path, info: dict) -> None:
    """Refuse a tag whose shard files are not all there, or shorter than its metadata
    says (a copy that lost a rank's file, a disk that lost its end): named, before DCP
    reads anything, in ``load_checkpoint``, so that ``ckpt_path="last"`` and a restart
    fall back to ``last.prev.ckpt`` as for a damaged file. Reads only the metadata."""
    world = info.get("world_size")
    written = f"written by {world} process{'es' if world != 1 else ''}" if world else "one per rank"
    stepped = any(info.get("stepped", [True]))
    for part in (MODEL_DIR, OPTIMIZER_DIR):
        directory = tag / part
        if part == OPTIMIZER_DIR and not (stepped and directory.is_dir()):
            continue
        if not (directory / ".metadata").is_file():
            raise CheckpointError(
                f"sharded checkpoint {str(tag)!r} is incomplete: {part}/.metadata is missing. Resume from an "
                f"earlier checkpoint (last.prev.ckpt is the one before last.ckpt)")
        metadata = SafeFileSystemReader(str(directory)).read_metadata()
        ends: dict[str, int] = {}
        for item in metadata.storage_data.values():
            ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
        missing = sorted(name for name in ends if not (directory / name).is_file())
        short = sorted(name for name, end in ends.items()
                       if name not in missing and (directory / name).stat().st_size < end)
        if missing or short:
            what = []
            if missing:
                what.append(f"{', '.join(missing)} ({written}), which {'is' if len(missing) == 1 else 'are'} missing")
            if short:
                what.append(f"{', '.join(short)}, shorter than the metadata says (truncated)")
            raise CheckpointError(
                f"sharded checkpoint {str(tag)!r} is incomplete: its {part} shards name {'; and '.join(what)}. "
                f"Resume from an earlier checkpoint (last.prev.ckpt is the one before last.ckpt)")


def load_model_state(owner, trainer, checkpoint: dict) -> None:
    """Model and optimizer state into this run's shards, then the schedulers."""
    optimizer_states, scheduler_states = optimizer_and_scheduler_states(checkpoint)
    if SHARDS_KEY in checkpoint:
        _load_sharded(owner, trainer, Path(checkpoint.pop(SHARDS_KEY)), checkpoint)
    else:
        _load_full(owner, trainer, checkpoint, optimizer_states)
    load_scheduler_states(trainer, scheduler_states)


def _load_full(owner, trainer, checkpoint: dict, optimizer_states: list) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if "state_dict" not in checkpoint:
        raise CheckpointError("checkpoint has no 'state_dict': it was not written by hookloop")
    module = owner.sharded.module
    options = StateDictOptions(full_state_dict=True)
    with owner.sharded_state_dicts():
        check_state_dict(module, checkpoint["state_dict"])  # global shapes: no gathering
        set_model_state_dict(module, checkpoint["state_dict"], options=options)
        if trainer.optimizers and optimizer_states:
            _check_count(len(optimizer_states), len(trainer.optimizers))
            names = parameter_names(module)
            for optimizer, state in zip(trainer.optimizers, optimizer_states):
                if state.get("state"):
                    set_optimizer_state_dict(module, optimizer, native_to_fqn(state, optimizer, names), options=options)
                else:
                    _load_hyperparameters(optimizer, state)


def _load_sharded(owner, trainer, tag: Path, checkpoint: dict) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    module = owner.sharded.module
    info = checkpoint.get(SHARDS_INFO, {})
    with owner.sharded_state_dicts():
        model_state = get_model_state_dict(module)
        try:
            safe_dcp_load(model_state, tag / MODEL_DIR, source=tag)
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
            safe_dcp_load(states, tag / OPTIMIZER_DIR, source=tag)
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


# ---------------------------------------------------------------------------------------
# Reading DCP without running its code
# ---------------------------------------------------------------------------------------

# What the .metadata of torch 2.13's DCP references: the metadata's own dataclasses (plain
# fields), torch.Size, the memory-format enum, the layout looked up by name, and the path
# the checkpoint was saved to. torch dtypes (torch.float32, ...) are accepted besides.
_METADATA_GLOBALS = frozenset({
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size",
    "torch.serialization._get_layout",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
})


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals above (and torch dtypes); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {full} is not part of DCP's metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds no persistent references")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled through an allow-list: a
    metadata file holding any other object raises :class:`CheckpointError`
    naming it, before anything in it runs."""

    #: The refusal of a metadata file: DCP turns read_metadata's exception into the text of
    #: another one (and tries the per-rank metadata), so the callers below raise this.
    refusal: CheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The directory's metadata, unpickled without running code; see the class."""
        if self.refusal is not None:  # no falling back to another metadata file
            raise self.refusal
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except pickle.UnpicklingError as exc:
                what = str(exc).removeprefix("GLOBAL ").removesuffix(" is not part of DCP's metadata")
                self.refusal = unsafe_checkpoint_error(self.path, what, [str(path)])
                raise self.refusal from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"{str(path)!r} is not DCP metadata (it holds a {type(metadata).__name__}): the directory "
                f"is not a torch.distributed.checkpoint checkpoint")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_dcp_load(state_dict: dict, directory, source) -> None:
    """``torch.distributed.checkpoint.load`` of ``directory`` into ``state_dict``
    (in place), refusing pickled objects: :class:`SafeFileSystemReader` for the
    metadata, :func:`weights_only_loads` (naming ``source``) for the entries."""
    import torch.distributed.checkpoint as dcp

    reader = SafeFileSystemReader(str(directory))
    with weights_only_loads(source), _raising_refusal(reader):
        dcp.load(state_dict, storage_reader=reader)


def dcp_to_torch_save(directory, output, source) -> None:
    """``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, written atomically and refusing pickled
    objects as :func:`load` does: the same private loader and planner it uses (torch
    2.13), with :class:`SafeFileSystemReader` for its ``FileSystemReader``."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    reader = SafeFileSystemReader(str(directory))
    with weights_only_loads(source), _raising_refusal(reader):
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    atomic_save(state, output)  # a temporary file, fsync, rename; with a checksum


@contextlib.contextmanager
def _raising_refusal(reader: SafeFileSystemReader) -> Iterator[None]:
    """Whatever DCP raised, a refused metadata file is the error."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if reader.refusal is not None:
            raise reader.refusal from exc
        raise
