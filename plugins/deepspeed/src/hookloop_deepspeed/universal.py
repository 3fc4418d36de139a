"""Resuming a ZeRO 1-3 checkpoint on another number of processes, through DeepSpeed's
universal checkpoints (docs/decisions.md, "Changing world size").

A ZeRO checkpoint's optimizer (and for ZeRO-3 parameter) shards are partitioned for the
processes that wrote it, and DeepSpeed's engine does not re-partition them. DeepSpeed's
own converter, ``deepspeed.checkpoint.ds_to_universal``, rewrites them as one whole
fp32 tensor per parameter and per optimizer state (``zero/<name>/fp32.pt``,
``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``), which its engine loads on any number of
processes when its config says ``"checkpoint": {"load_universal": true}``.

The universal copy lives inside the tag it was converted from (``last.ckpt/
global_step46/universal``), so it is removed with that tag when a later save prunes it
or the checkpoint callback removes the directory, and a second resume of the same tag
reuses it. It is converted whole under a temporary name, then installed with
:func:`hookloop.atomic_copy_tree`: a conversion that was interrupted leaves no
``universal`` directory, and is never taken for a complete one.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import hookloop
from hookloop import CheckpointError

from .safe_globals import checkpoint_safe_globals

#: The universal copy of a tag: ``<checkpoint>/<tag>/UNIVERSAL``, loaded as DeepSpeed
#: tag ``UNIVERSAL`` of the load directory ``<checkpoint>/<tag>``.
UNIVERSAL = "universal"
_TEMPORARY = ".universal-"
#: Written into the converted copy before it is installed: a ``universal`` directory
#: without it (made by hand with ``ds_to_universal``, perhaps interrupted) is converted again.
CONVERTED_MARKER = ".hookloop-converted"

#: The optimizer states DeepSpeed 0.19's converter carries: Adam's two moments (and the
#: step). It reads exactly these keys of every parameter group (``extract_zero_shards``).
CONVERTED_STATES = ("exp_avg", "exp_avg_sq")


def universal_copy(path: Path, tag: str) -> Path:
    """The complete universal copy of ``path``'s ``tag``, converting it first when there is
    none: call on one rank (global rank 0), then a barrier. Returns its directory."""
    target = path / tag / UNIVERSAL
    if is_converted(target):
        return target  # installed whole by an earlier resume
    for leftover in (path / tag).glob(f"{_TEMPORARY}*"):  # of a conversion that was killed
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        scratch = Path(tempfile.mkdtemp(prefix=_TEMPORARY, dir=path / tag))
    except OSError as exc:
        raise CheckpointError(
            f"resuming {str(path)!r} on another number of processes converts it into a universal checkpoint "
            f"inside {str(path / tag)!r}, which cannot be written ({exc}): copy the checkpoint directory to a "
            f"writable place and resume from the copy, or resume on the number of processes that wrote it") from exc
    try:
        _convert(path, tag, scratch / UNIVERSAL)
        (scratch / UNIVERSAL / CONVERTED_MARKER).write_text(f"{tag}\n")
        hookloop.atomic_copy_tree(scratch / UNIVERSAL, target, keep_previous=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def is_converted(target: Path) -> bool:
    """Whether ``target`` is a universal copy this module installed whole."""
    return (target / CONVERTED_MARKER).is_file()


def _convert(path: Path, tag: str, output: Path) -> None:
    """``ds_to_universal.main`` on the tag's shards, in this process (one worker: the
    converter's process pools would fork a process that holds the process group), its
    progress output kept out of the run's; weights-only loads as for every shard read."""
    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(input_folder=str(path / tag), output_folder=str(output), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True,
                     # hookloop's engines are data parallel only: the converter's default
                     # layout information (no tensor/pipeline slicing) is the right one.
                     inject_missing_state=True)
    chatter = io.StringIO()
    try:
        with hookloop.weights_only_loads(path, checkpoint_safe_globals()), \
                contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
    except CheckpointError:
        raise
    except KeyError as exc:
        if exc.args and exc.args[0] in CONVERTED_STATES:
            raise CheckpointError(_not_adam(path, None, None, None)) from exc
        raise _failed(path, exc, chatter) from exc
    except Exception as exc:  # noqa: BLE001 - the converter raises assorted types
        raise _failed(path, exc, chatter) from exc


def optimizer_state_keys(shard: Path) -> set[str]:
    """The per-parameter-group optimizer state keys in one ZeRO optimizer shard
    (``exp_avg``... for Adam, ``momentum_buffer`` for SGD): a weights-only load."""
    import torch
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT

    with hookloop.weights_only_loads(shard.parent, checkpoint_safe_globals()):
        saved = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
    optim = saved.get(OPTIMIZER_STATE_DICT) or {}
    # ZeRO 1/2 keep the torch optimizer's state under base_optimizer_state, ZeRO-3 under
    # optimizer_state_dict.
    inner = optim.get(BASE_OPTIMIZER_STATE) or optim.get(OPTIMIZER_STATE_DICT) or {}
    keys: set[str] = set()
    for group in (inner.get("state") or {}).values():
        if isinstance(group, dict):
            keys.update(group)
    return keys


def check_convertible(path: Path, tag: str, written: int, world_size: int, optimizer_keys: set[str], stage: int,
                      nvme_offload: bool) -> None:
    """Refuse, with the reason, a checkpoint the universal conversion cannot carry over
    whole: optimizer state other than Adam's moments (SGD's momentum, ...), or a run whose
    optimizer state is offloaded to NVMe (DeepSpeed restores that from its swap files,
    which are per rank, and not from a universal checkpoint)."""
    if nvme_offload:
        raise CheckpointError(_refusal(
            path, stage, written, world_size,
            "this run offloads the optimizer state to NVMe, which DeepSpeed restores from each rank's swap "
            "files, never from a universal checkpoint, so the optimizer state cannot be re-partitioned"))
    other = sorted(optimizer_keys - set(CONVERTED_STATES) - {"step"})
    if other:
        raise CheckpointError(_not_adam(path, stage, written, world_size, other))


def _not_adam(path: Path, stage: int | None, written: int | None, world_size: int | None,
              other: list[str] | None = None) -> str:
    held = f"; this one holds {', '.join(other)}" if other else ""
    return _refusal(
        path, stage, written, world_size,
        f"DeepSpeed's universal checkpoint converter (ds_to_universal) carries Adam's optimizer state only "
        f"(exp_avg and exp_avg_sq: torch's Adam and AdamW, DeepSpeedCPUAdam{held}), so the optimizer state "
        f"cannot be re-partitioned")


def _refusal(path: Path, stage: int | None, written: int | None, world_size: int | None, why: str) -> str:
    zero = f"ZeRO-{stage}" if stage is not None else "ZeRO"
    plural = "es" if written != 1 else ""
    procs = f"of {written} process{plural} and this run has {world_size}" if written else "of another number of processes"
    devices = f" on {written} processes (--devices {written})" if written else " on the number of processes that wrote it"
    return (f"{str(path)!r} is a {zero} checkpoint {procs}: {why}. Resume it{devices}, or start from its weights "
            f"here: `hookloop deepspeed collate {path} OUT.pt`, then load OUT.pt into the module before fit "
            f"(module.load_state_dict(torch.load('OUT.pt', weights_only=True))); the optimizer state and the loop "
            f"position are not carried over")


def _failed(path: Path, exc: BaseException, chatter: io.StringIO) -> CheckpointError:
    # The converter's last words (where it stopped), without its progress bars.
    lines = [line for line in chatter.getvalue().splitlines() if line.strip() and "%|" not in line]
    said = "\n".join(lines[-3:])
    return CheckpointError(
        f"DeepSpeed's universal checkpoint converter (ds_to_universal) could not convert {str(path)!r} for a resume "
        f"on another number of processes: {type(exc).__name__}: {exc}"
        f"{(chr(10) + said) if said else ''}\nResume it on the number of processes that wrote it, or start from "
        f"its weights: `hookloop deepspeed collate {path} OUT.pt`")


@contextlib.contextmanager
def universal_loading(engine):
    """Inside the block the engine loads universal checkpoints: DeepSpeed 0.19 reads its
    config's ``checkpoint.load_universal`` only through ``engine.load_universal_checkpoint()``
    while loading, so it is switched on for this one load and back off after it (the
    config is built at set-up, before anyone knows which checkpoint a fit resumes)."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def timed_copy(path: Path, tag: str) -> tuple[Path, float | None]:
    """:func:`universal_copy` and the seconds its conversion took (``None``: reused)."""
    existed = is_converted(path / tag / UNIVERSAL)
    start = time.perf_counter()
    target = universal_copy(path, tag)
    return target, None if existed else time.perf_counter() - start
