"""Checkpoint I/O: atomic writes, safe loads, RNG state, and model compatibility checks.

Public helpers for plugins: :func:`atomic_save`, :func:`safe_load`,
:func:`check_state_dict`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import re
import shutil
import socket
import struct
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import CheckpointError
from .unpickling import refused_object, unsafe_checkpoint_error

#: 2: ``optimizer_states`` and ``lr_schedulers`` are lists (several optimizers), the
#: loop state has a ``stage``, and ``metrics`` holds the epoch's partial sums.
FORMAT_VERSION = 2


#: A replaced ``last.ckpt`` is kept under this name, so the last two always exist.
LAST, PREVIOUS = "last.ckpt", "last.prev.ckpt"

#: The checksum trailer: the zip archive's comment (which ``torch.load`` ignores), the
#: last bytes of the file: this prefix and the SHA-256 (64 hex digits) of every byte
#: before the digest. Check one by hand: ``head -c -64 F | sha256sum; tail -c 64 F``.
CHECKSUM_PREFIX = b"hookloop-sha256:"
_DIGEST_LEN = 64
_TRAILER_LEN = len(CHECKSUM_PREFIX) + _DIGEST_LEN
_EOCD = b"PK\x05\x06"  # the zip end-of-central-directory record: its last 2 bytes are the comment length


def previous_of(path: str | os.PathLike) -> Path | None:
    """Where the checkpoint that ``path`` replaces is kept (``last.prev.ckpt`` beside a
    ``last.ckpt``), or ``None`` for files whose predecessor is not kept."""
    path = Path(path)
    return path.with_name(PREVIOUS) if path.name == LAST else None


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over it.

    A crash at any moment leaves either the previous file or the new one, never a torn
    one: the rename is atomic on POSIX file systems. The file ends with a SHA-256
    checksum of its bytes (see :data:`CHECKSUM_PREFIX`; :func:`safe_load` verifies it),
    and replacing a ``last.ckpt`` keeps the one it replaces as ``last.prev.ckpt``. A
    write that fails (disk full, file size limit) raises :class:`CheckpointError`,
    removes the temporary file and leaves ``path`` as it was.
    """

    def write(f) -> None:
        writer = _ChecksumWriter(f)
        torch.save(obj, writer)
        writer.write_trailer()

    return _atomic_write(path, write)


def atomic_copy(source: str | os.PathLike, path: str | os.PathLike, keep_previous: bool = True) -> Path:
    """Copy the checkpoint file ``source`` to ``path`` as :func:`atomic_save` writes one
    (temporary file, fsync, rename; a replaced ``last.ckpt`` kept as ``last.prev.ckpt``
    unless ``keep_previous`` is false). The copy carries the source's checksum trailer,
    bytes and all."""

    def write(f) -> None:
        with open(source, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)

    return _atomic_write(path, write, keep_previous)


def _atomic_write(path: str | os.PathLike, write: Callable[[Any], None], keep_previous: bool = True) -> Path:
    """``write(file)`` into a temporary file beside ``path``, fsync, then install it over
    ``path`` (keeping a replaced ``last.ckpt`` as ``last.prev.ckpt``). A failed write
    removes the temporary file; an ``OSError`` becomes a :class:`CheckpointError`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{_writer()}.", suffix=".tmp")
    try:
        # mkstemp creates 0600 and the rename keeps it: give the file the mode that
        # open(path, "w") would, so other users and groups read it as the umask allows.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        _install(tmp, path, keep_previous)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise _write_error(path, exc) from exc
        raise
    return path


def _writer() -> str:
    """``HOST-PID``: temporary files are named after their writer, so that a later save can
    tell the leftovers of a process killed mid-save (and only those) and remove them."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary files a killed process left beside ``path`` (``.last.ckpt.
    HOST-PID.XXXX.tmp``, ``.last.prev.ckpt.HOST-PID.tmp``): those written on this host by a
    process that no longer exists. Another host's, or a live process's, are left alone."""
    host = re.escape(socket.gethostname())
    names = [path.name] + ([previous_of(path).name] if previous_of(path) else [])
    patterns = [re.compile(rf"\.{re.escape(name)}\.{host}-(\d+)\.(?:\w+\.)?tmp") for name in names]
    try:
        entries = os.listdir(path.parent)
    except OSError:
        return
    for entry in entries:
        found = next((m for m in (p.fullmatch(entry) for p in patterns) if m), None)
        if found and not _process_exists(int(found[1])):
            try:
                os.unlink(path.parent / entry)
            except OSError:
                pass


def _process_exists(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user's
        return True
    return True


def _write_error(path: Path, exc: OSError) -> CheckpointError:
    kept = "is unchanged" if path.exists() else "was not written"
    return CheckpointError(
        f"writing checkpoint {str(path)!r} failed ({exc.strerror or exc}); {path.name} {kept} and no temporary "
        f"file is left. Free disk space or raise the file size limit (ulimit -f), or checkpoint elsewhere "
        f"(ModelCheckpoint(dirpath=...))."
    )


def _install(tmp: str, path: Path, keep_previous: bool = True) -> None:
    """Rename the finished temporary file ``tmp`` over ``path``, first keeping the file it
    replaces as :func:`previous_of` ``path`` (a hard link, so ``path`` exists at every
    moment; a rename where the file system has no hard links), then fsync the directory."""
    previous = previous_of(path) if keep_previous else None
    if previous is not None and path.is_file():
        link = previous.with_name(f".{previous.name}.{_writer()}.tmp")
        try:
            if os.path.lexists(link):
                os.unlink(link)
            os.link(path, link)
            os.replace(link, previous)
        except OSError:
            os.replace(path, previous)  # no hard links here: path is missing until the next rename
    os.replace(tmp, path)
    try:  # make the renames themselves durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


class _ChecksumWriter:
    """The file object ``torch.save`` writes through: hashes what passes, holding back the
    last 2 bytes (the zip comment length, which :meth:`write_trailer` sets)."""

    def __init__(self, f):
        self.f, self.hash, self.tail = f, hashlib.sha256(), b""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= 2:
            self.hash.update(self.tail)
            self.hash.update(view[:-2])
            self.tail = bytes(view[-2:])
        else:
            both = self.tail + bytes(view)
            self.hash.update(both[:-2])
            self.tail = both[-2:]
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def write_trailer(self) -> None:
        if self.tail != b"\x00\x00":  # not a zip without a comment: leave the file as torch wrote it
            return
        self.f.seek(-2, os.SEEK_CUR)
        head = struct.pack("<H", _TRAILER_LEN) + CHECKSUM_PREFIX
        self.hash.update(head)
        self.f.write(head + self.hash.hexdigest().encode("ascii"))


def verify_checksum(path: str | os.PathLike) -> str | None:
    """Check the checksum trailer of the checkpoint file ``path`` without unpickling it.

    :returns: the verified SHA-256 (hex), or ``None`` for a file without a trailer that
        is otherwise whole (written by plain ``torch.save`` or an older hookloop).
    :raises CheckpointError: the bytes do not match the checksum (naming both), or a zip
        archive ends without its end record or trailer (truncated).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            return None  # not a zip archive: torch.load says what it is
        f.seek(max(0, size - (1 << 16) - 22))
        end = f.read()
        trailer = end[-(_TRAILER_LEN + 22):]
        if (len(trailer) == _TRAILER_LEN + 22 and trailer.startswith(_EOCD)
                and trailer[20:22] == struct.pack("<H", _TRAILER_LEN) and trailer[22:].startswith(CHECKSUM_PREFIX)):
            expected = trailer[-_DIGEST_LEN:].decode("ascii", "replace")
            actual = _sha256(f, size - _DIGEST_LEN)
            if actual != expected:
                raise CheckpointError(
                    f"checkpoint {str(path)!r} is corrupt: the SHA-256 of its bytes is {actual}, the checksum "
                    f"written with it is {expected}. Resume from an earlier checkpoint (last.prev.ckpt is the "
                    f"one before last.ckpt)."
                )
            return actual
        if _EOCD in end:
            return None  # a whole zip archive without hookloop's trailer
        actual = _sha256(f, size)
        raise CheckpointError(
            f"checkpoint {str(path)!r} is truncated or corrupt: it ends ({size} bytes) without the zip end record "
            f"and hookloop's checksum trailer, so the expected checksum is lost with its end (actual SHA-256 of "
            f"what is left: {actual}). Resume from an earlier checkpoint (last.prev.ckpt is the one before "
            f"last.ckpt)."
        )


def _sha256(f, length: int) -> str:
    f.seek(0)
    digest, left, chunk = hashlib.sha256(), length, bytearray(1 << 20)
    view = memoryview(chunk)
    while left > 0:
        n = f.readinto(view[: min(left, len(chunk))])
        if not n:
            break
        digest.update(view[:n])
        left -= n
    return digest.hexdigest()


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
    """Write ``text`` (UTF-8) to ``path`` as :func:`atomic_save` writes a checkpoint: a
    temporary file of its own, fsync, then a rename, so a reader sees the old text or the
    new, never a torn one."""
    data = text.encode("utf-8")
    return _atomic_write(path, lambda f: f.write(data))


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
    verify_checksum(path)  # before anything is unpickled
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as exc:
        refused = refused_object(exc)
        if refused is not None:
            raise unsafe_checkpoint_error(path, refused) from exc
        # torch's weights-only message starts with advice to load unsafely; keep its reason.
        reason = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(exc))
        first = (reason.group(1).strip() if reason else
                 str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
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


def rng_state(cuda_devices: Any = None) -> dict:
    """This process's random generators (torch CPU, CUDA, Python, NumPy) as tensors and
    plain types (``torch.load(weights_only=True)`` reads them); :func:`set_rng_state`
    puts them back.

    ``cuda_devices``: the CUDA device indices whose generators to keep, under
    ``"cuda_devices"`` (``{index: state}``, restored on the same index): what a rank of a
    multi-process run saves, the devices it uses (:func:`rank_cuda_devices`). ``None``
    (saving and restoring within one process): every device's, under ``"cuda"``. No
    CUDA state is taken while CUDA is not initialised (nothing drew from it).
    """
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _python_state_to_safe(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        if cuda_devices is None:
            state["cuda"] = torch.cuda.get_rng_state_all()
        else:
            state["cuda_devices"] = {int(i): torch.cuda.get_rng_state(int(i)) for i in sorted(set(cuda_devices))}
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
    """Put back what :func:`rng_state` took. CUDA states are skipped on a machine without
    CUDA, and a saved device index this machine does not have is skipped too."""
    torch.set_rng_state(state["torch"])
    random.setstate(_python_state_from_safe(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    devices = state.get("cuda_devices")
    if devices and torch.cuda.is_available():
        count = torch.cuda.device_count()
        for index, device_state in devices.items():
            if int(index) < count:
                torch.cuda.set_rng_state(device_state, int(index))
    if "numpy" in state:
        try:
            import numpy as np

            s = state["numpy"]
            np.random.set_state(
                (s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"])
            )
        except ImportError:
            pass


def rank_cuda_devices(trainer: Any) -> list[int]:
    """The CUDA devices this process uses, whose generators its checkpoint section keeps:
    ``trainer.root_device``, and the strategy's ``device_ids`` where one process drives
    several GPUs (dp). Empty on the CPU."""
    devices: set[int] = set()
    root = getattr(trainer, "root_device", None)
    if root is not None and root.type == "cuda" and torch.cuda.is_available():
        devices.add(root.index if root.index is not None else torch.cuda.current_device())
    ids = getattr(getattr(trainer, "strategy", None), "device_ids", None)
    if isinstance(ids, (list, tuple)):
        devices.update(i for i in ids if isinstance(i, int))
    return sorted(devices)


def derive_rng_state(state: dict, rank: int) -> None:
    """Seed every generator (torch CPU and CUDA, Python, NumPy) from a seed derived from
    ``state`` (another rank's :func:`rng_state`) and ``rank``: the stream of a rank that a
    checkpoint has no state of (it was written on fewer processes). Deterministic (the
    same checkpoint and rank give the same stream) and distinct per rank."""
    digest = hashlib.sha256(state["torch"].numpy().tobytes() + f"/rank{int(rank)}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little") >> 1
    torch.manual_seed(seed)  # the CUDA devices' too
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def _python_state_to_safe(state: tuple) -> dict:
    version, internal, gauss = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def _python_state_from_safe(state: dict) -> tuple:
    return (state["version"], tuple(int(x) for x in state["internal"].tolist()), state["gauss"])
