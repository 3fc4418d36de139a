"""Checkpoint I/O: atomic writes, safe loads, RNG state, and model compatibility checks.

Public helpers for plugins: :func:`atomic_save`, :func:`safe_load`,
:func:`check_state_dict`.
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError

#: 2: ``optimizer_states`` and ``lr_schedulers`` are lists (several optimizers), the
#: loop state has a ``stage``, and ``metrics`` holds the epoch's partial sums.
FORMAT_VERSION = 2


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over it.

    A crash at any moment leaves either the previous file or the new one, never a torn
    one: the rename is atomic on POSIX file systems.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600 and the rename keeps it: give the file the mode that
        # open(path, "w") would, so other users and groups read it as the umask allows.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path


def _umask() -> int:
    """The process umask, read without changing it where the system allows."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # No /proc (macOS, old Linux kernels): os.umask is the only portable way to read it,
    # and it sets it too; another thread creating a file in between gets 0o022 for a moment.
    old = os.umask(0o022)
    os.umask(old)
    return old


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename (never torn)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def safe_load(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)``, with errors that say what is wrong with the file."""
    path = Path(path)
    if not path.exists():
        hint = ""
        if path.parent.is_dir():
            ckpts = sorted(p.name for p in path.parent.glob("*.ckpt"))
            if ckpts:
                hint = f" Checkpoints in {path.parent}: {', '.join(ckpts)}."
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist.{hint}")
    if path.is_dir():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is a directory: a sharded checkpoint, which only the "
            f"strategy that wrote it (e.g. --plugins deepspeed) can load"
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({first}); it is corrupt or not a "
            f"hookloop/torch checkpoint. Resume from an earlier checkpoint."
        ) from exc


def optimizer_and_scheduler_states(checkpoint: dict) -> tuple[list, list]:
    """The optimizer and scheduler states of a checkpoint, as lists (format 1 kept one
    of each under ``optimizer`` / ``lr_scheduler``)."""
    if "optimizer_states" in checkpoint or "lr_schedulers" in checkpoint:
        return list(checkpoint.get("optimizer_states") or []), list(checkpoint.get("lr_schedulers") or [])
    optimizer, scheduler = checkpoint.get("optimizer"), checkpoint.get("lr_scheduler")
    return ([optimizer] if optimizer is not None else []), ([scheduler] if scheduler is not None else [])


def check_state_dict(model: torch.nn.Module, state_dict: dict, source: str = "checkpoint") -> None:
    """Raise ``CheckpointError`` if ``state_dict`` does not fit ``model`` exactly.

    Names missing and unexpected keys and shape mismatches, so that loading the
    checkpoint of another model fails before any weight is touched.
    """
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"{source} holds no model state dict")
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if unexpected and all(k.startswith("module.") for k in unexpected):
        stripped = {k[len("module."):] for k in unexpected}
        if stripped >= set(missing):
            raise CheckpointError(
                f"{source} was saved from a wrapped model (keys start with 'module.'); "
                f"strip the prefix: {{k.removeprefix('module.'): v for k, v in sd.items()}}"
            )
    shapes = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
        for k, v in own.items()
        if k in state_dict
        and isinstance(v, torch.Tensor)
        and isinstance(state_dict[k], torch.Tensor)
        and v.shape != state_dict[k].shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {_short(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_short(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches {_short(shapes)}")
        raise CheckpointError(
            f"{source} belongs to a different model ({'; '.join(parts)}). "
            f"Pass the checkpoint of this model, or build the model it was saved from."
        )


def _short(items: list[str], n: int = 5) -> str:
    shown = ", ".join(items[:n])
    return f"[{shown}{', ...' if len(items) > n else ''}] ({len(items)})"


# ---------------------------------------------------------------------------------------
# RNG state, in a form that torch.load(weights_only=True) accepts
# ---------------------------------------------------------------------------------------


def rng_state() -> dict:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _python_state_to_safe(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_python_state_from_safe(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np

            s = state["numpy"]
            np.random.set_state(
                (s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"])
            )
        except ImportError:
            pass


def _python_state_to_safe(state: tuple) -> dict:
    version, internal, gauss = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def _python_state_from_safe(state: dict) -> tuple:
    return (state["version"], tuple(int(x) for x in state["internal"].tolist()), state["gauss"])
