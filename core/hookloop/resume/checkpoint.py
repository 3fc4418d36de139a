"""Checkpoint I/O: atomic writes, safe loads, RNG state, and model compatibility checks.

Public helpers for plugins: :func:`atomic_save`, :func:`safe_load`,
:func:`check_state_dict`, :func:`cpu_snapshot`, :func:`atomic_copy_tree`, :class:`TaggedCheckpointDir`,
:func:`tag_entry`.
"""

from __future__ import annotations

import copy as _copy
import hashlib
import os
import pickle
import random
import re
import shutil
import socket
import struct
import tempfile
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

from hookloop.contract.errors import CheckpointError
from hookloop.resume.unpickling import refused_object, unsafe_checkpoint_error

#: 2: ``optimizer_states`` and ``lr_schedulers`` are lists (several optimizers), the
#: loop state has a ``stage``, and ``metrics`` holds the epoch's partial sums.
FORMAT_VERSION = 2


#: A replaced ``last.ckpt`` is kept under this name, so the last two always exist.
LAST, PREVIOUS = "last.ckpt", "last.prev.ckpt"
#: Where the checkpoint observer writes a state whose weights are not finite when a
#: ``last.ckpt`` is there already: the finite one stays the one resumed.
NONFINITE = "last.nonfinite.ckpt"

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

    Inside :class:`deferred_writes` (an asynchronous save), it only takes a
    :func:`cpu_snapshot` of ``obj``; the write happens later, in the background.
    """
    deferral = getattr(_deferral, "active", None)
    if deferral is not None:  # inside deferred_writes(): copy now, write in the background
        used: list = []
        deferral.writes.append((cpu_snapshot(obj, reuse=deferral.spare, used=used), Path(path), used))
        return Path(path)
    return _write_checkpoint(obj, path)


def _write_checkpoint(obj: Any, path: str | os.PathLike) -> Path:
    def write(f) -> None:
        writer = _ChecksumWriter(f)
        torch.save(obj, writer)
        writer.write_trailer()

    return _atomic_write(path, write)


# ---------------------------------------------------------------------------------------
# Asynchronous saving: a CPU snapshot now, the write in a background thread
# ---------------------------------------------------------------------------------------


_deferral = threading.local()


def cpu_snapshot(obj: Any, reuse: list | None = None, used: list | None = None) -> Any:
    """A copy of the checkpoint ``obj`` that training can no longer change: every tensor
    copied to new CPU memory (also CPU tensors: the optimizer step mutates them in place),
    dicts, lists and tuples rebuilt, other values shared (numbers, strings) or copied.

    One pass, no pickling: each storage is copied once (``memcpy``, or one device-to-host
    copy), and tensors that share a storage share the copy, so ``torch.save`` of the
    snapshot writes what it would have written of ``obj``.

    reuse: CPU storages (``torch.UntypedStorage``) of an earlier snapshot that nothing
        reads any more: a storage of the same size is taken out of the list and copied
        into (memory already mapped copies about twice as fast as fresh memory).
    used: a list the storages of the copy are appended to (to reuse them next time).
    """
    storages: dict[tuple, torch.UntypedStorage] = {}
    seen: dict[int, Any] = {}
    spare: dict[int, list] = {}
    for storage in reuse or ():
        spare.setdefault(storage.nbytes(), []).append(storage)
    if reuse:
        reuse.clear()
    copy = _snapshot(obj, storages, seen, spare)
    if used is not None:
        used.extend(storages.values())
    return copy


def _snapshot(obj: Any, storages: dict, seen: dict, spare: dict) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return obj
    known = seen.get(id(obj))
    if known is not None:
        return known[1]
    if isinstance(obj, torch.Tensor):
        copy = _snapshot_tensor(obj, storages, spare)
    elif isinstance(obj, dict):
        copy = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        seen[id(obj)] = (obj, copy)
        for key, value in obj.items():
            copy[key] = _snapshot(value, storages, seen, spare)
        metadata = getattr(obj, "_metadata", None)  # a module state dict's versions
        if metadata is not None:
            copy._metadata = _copy.deepcopy(metadata)
        return copy
    elif isinstance(obj, list):
        copy = []
        seen[id(obj)] = (obj, copy)
        copy.extend(_snapshot(value, storages, seen, spare) for value in obj)
        return copy
    elif isinstance(obj, tuple):
        items = [_snapshot(value, storages, seen, spare) for value in obj]
        copy = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        try:
            copy = _copy.deepcopy(obj)
        except Exception:  # an object that cannot be copied: written as it is then
            copy = obj
    seen[id(obj)] = (obj, copy)  # keep obj alive: ids stay unique during the pass
    return copy


def _snapshot_tensor(tensor: torch.Tensor, storages: dict, spare: dict) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.layout != torch.strided or tensor.is_quantized or type(tensor) is not torch.Tensor:
        return tensor.to("cpu", copy=True)  # sparse, quantized, DTensor...: their own copy
    source = tensor.untyped_storage()
    key = (source.device, source.data_ptr(), source.nbytes())
    storage = storages.get(key)
    if storage is None:
        free = spare.get(source.nbytes())
        storage = free.pop() if free else torch.UntypedStorage(source.nbytes(), device="cpu")
        storage.copy_(source)
        storages[key] = storage
    copy = torch.empty((0,), dtype=tensor.dtype, device="cpu")
    copy.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
    return copy


class deferred_writes:
    """``with deferred_writes(spare) as writes:``: the :func:`atomic_save` calls made by
    this thread inside the block take a :func:`cpu_snapshot` of their object (into the
    ``spare`` storages where sizes match) and return at once; ``writes`` then lists
    ``(snapshot, path, storages)`` for a background job to write (and the storages to
    reuse after), and the steps :func:`defer` queued, in order. The pause of an
    asynchronous save is the snapshot."""

    def __init__(self, spare: list | None = None):
        self.spare = spare if spare is not None else []
        self.writes: list = []

    def __enter__(self) -> list:
        if getattr(_deferral, "active", None) is not None:
            raise RuntimeError("deferred_writes() blocks do not nest")
        _deferral.active = self
        return self.writes

    def __exit__(self, *exc: Any) -> None:
        _deferral.active = None


def deferring() -> bool:
    """Whether this thread is inside an asynchronous save (``ModelCheckpoint(async_save=
    True)``, :class:`deferred_writes`): a strategy's ``save_checkpoint`` that writes
    checkpoint directories itself (e.g. with ``torch.distributed.checkpoint.async_save``)
    then starts its writes, and hands what must wait for them to :func:`defer`."""
    return getattr(_deferral, "active", None) is not None


def defer(step: Callable[[], Any]) -> None:
    """Inside an asynchronous save: run ``step()`` in the background writer, after the
    writes queued before it and before the checkpoint observer's own steps (the copy to
    ``last.ckpt``, the removal of checkpoints pushed out of the top k). Outside one: run it
    now. An error it raises is raised in training at the next save or at the end of
    ``fit``, as a failed background write is."""
    deferral = getattr(_deferral, "active", None)
    if deferral is None:
        step()
    else:
        deferral.writes.append(step)


class AsyncCheckpointWriter:
    """Runs one checkpoint job at a time in a background thread (the trainer's:
    ``trainer.state.checkpoint_writer``).

    :meth:`submit` first waits for the job in flight, so at most one is; an error of a
    job (a failed write, a full disk) is raised by the next :meth:`submit` or
    :meth:`wait` as a :class:`CheckpointError` naming the checkpoint, never lost.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: tuple[str, BaseException] | None = None
        #: the CPU storages of the last snapshot written, for the next one to copy into
        #: (one extra copy of the checkpoint stays allocated between saves)
        self.spare: list = []

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], Any], path: str | os.PathLike) -> None:
        """Run ``job()`` (which writes ``path``, and what goes with it) in the background,
        after the previous job has finished (its error is raised here, and ``job`` is then
        not run)."""
        self.wait()
        thread = threading.Thread(target=self._run, args=(job, str(path)), daemon=False,
                                  name=f"hookloop checkpoint writer ({Path(path).name})")
        self._thread = thread
        thread.start()

    def _run(self, job: Callable[[], Any], path: str) -> None:
        try:
            job()
        except BaseException as exc:  # kept for the training thread, which raises it
            self._error = (path, exc)

    def wait(self) -> None:
        """Wait for the job in flight; raise its error, if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            path, exc = error
            if isinstance(exc, CheckpointError):
                raise CheckpointError(f"the background save of checkpoint {path!r} failed: {exc}") from exc
            raise CheckpointError(
                f"the background save of checkpoint {path!r} failed ({type(exc).__name__}: {exc}); the "
                f"checkpoints written before it are unchanged") from exc


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
            try:
                write(f)
            except RuntimeError as exc:
                raise _short_write_cause(f) or exc
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


def atomic_copy_tree(source: str | os.PathLike, path: str | os.PathLike, keep_previous: bool = True) -> Path:
    """Install a copy of the checkpoint *directory* ``source`` (a strategy's shards) at
    ``path`` so that a crash at any moment leaves a loadable checkpoint there or at
    :func:`previous_of` ``path``.

    The copy is made complete under a temporary name beside ``path`` (each shard of at
    least :data:`LINK_MIN_BYTES` hard-linked where the file system allows, the rest
    copied; then fsynced), then the directory it replaces becomes ``last.prev.ckpt`` (for
    a ``last.ckpt`` and ``keep_previous``; the prev it replaces is removed), then the copy
    is renamed into place. A kill between the
    two renames leaves ``last.prev.ckpt`` alone, which the restart resume and
    ``ckpt_path="last"`` load (:func:`hookloop.resume.run.restore`'s fall-back). Hard links
    share the files' bytes: strategies must write a new shard file rather than rewrite one
    in place (the in-tree ones write every save into a new tag). An ``OSError`` becomes a
    :class:`CheckpointError` and leaves ``path`` as it was.
    """
    source, path = Path(source), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.{_writer()}.tmp")
    _remove_tree(tmp)
    try:
        shutil.copytree(source, tmp, copy_function=_link_or_copy)
        _fsync_tree(tmp)
        _install_tree(tmp, path, keep_previous)
    except BaseException as exc:
        _remove_tree(tmp)
        if isinstance(exc, OSError):
            raise _write_error(path, exc) from exc
        raise
    return path


#: Files at least this large are hard-linked by :func:`atomic_copy_tree`; smaller ones
#: (``latest``, markers, DeepSpeed's ``zero_to_fp32.py``, which it rewrites in place at
#: every save) are copied, so no small file is shared between two directories.
LINK_MIN_BYTES = 1 << 20


def _link_or_copy(src: str, dst: str) -> str:
    try:
        if os.stat(src).st_size >= LINK_MIN_BYTES:
            os.link(src, dst)
            return dst
    except OSError:  # another file system, or none with hard links
        pass
    shutil.copy2(src, dst)
    return dst


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (directories last: their entries)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _install_tree(tmp: Path, path: Path, keep_previous: bool) -> None:
    """Rename the complete directory ``tmp`` to ``path``; the one it replaces first becomes
    :func:`previous_of` ``path`` (or is renamed aside and removed afterwards)."""
    previous = previous_of(path) if keep_previous else None
    trash: list[Path] = []
    if os.path.lexists(path):
        if previous is not None:
            if os.path.lexists(previous):  # aside first: never a half-removed last.prev.ckpt
                aside = previous.with_name(f".{previous.name}.{_writer()}.old.tmp")
                _remove_tree(aside)
                os.rename(previous, aside)
                trash.append(aside)
            os.rename(path, previous)  # from here until the next rename only the previous exists
        else:
            aside = path.with_name(f".{path.name}.{_writer()}.old.tmp")
            _remove_tree(aside)
            os.rename(path, aside)
            trash.append(aside)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    for old in trash:
        _remove_tree(old)


#: The file that marks a tag of a :class:`TaggedCheckpointDir` complete.
COMPLETE_MARKER = ".hookloop-complete"


class TaggedCheckpointDir:
    """A sharded checkpoint directory of tags, committed atomically (the scheme of the
    fsdp and deepspeed strategies)::

        last.ckpt/
          latest              the committed tag's name, replaced atomically (rename)
          step42/             one save: every rank's shards, then .hookloop-complete

    A save is: ``tag = d.new_tag(global_step)`` (on rank 0, then broadcast), every rank
    writes its shards into ``d.path / tag``, a barrier, then rank 0 calls
    ``d.commit(tag)`` (fsyncs the tag, writes :data:`COMPLETE_MARKER` into it, then
    ``latest``) and ``d.prune()`` (removes the other tags, including those a killed save
    left incomplete), and a second barrier. A crash before ``commit`` leaves ``latest``
    naming the previous complete tag.

    Loading calls :meth:`committed`: the tag ``latest`` names if it is complete; if it is
    not (``latest`` written before the shards, as DeepSpeed's own writer does), or
    ``latest`` is missing, the newest complete tag, with a warning. ``legacy_complete(tag
    directory)`` tells whether a tag without the marker (written before hookloop wrote
    markers) is whole; such a tag is trusted only when ``latest`` names it and no tag has
    a marker.

    :param path: the directory (``last.ckpt``, a top-k checkpoint)
    :param prefix: tag names are ``<prefix><global step>`` (``.1``, ``.2``... appended
        when that step has tags there already; a name is never reused)
    """

    LATEST = "latest"

    def __init__(self, path: str | os.PathLike, prefix: str = "step",
                 legacy_complete: Callable[[Path], bool] | None = None):
        self.path, self.prefix, self.legacy_complete = Path(path), prefix, legacy_complete
        self._pattern = re.compile(rf"{re.escape(prefix)}(\d+)(?:\.(\d+))?")

    def tags(self) -> list[str]:
        """Every tag in the directory, complete or not, oldest first: by when it was
        committed (its marker's mtime), or for an incomplete one when its last file was
        created (the directory's mtime). Not by name: a run that restarts from an earlier
        step, or a new run saving into the same path, writes lower steps later."""
        if not self.path.is_dir():
            return []
        found = []
        for p in self.path.iterdir():
            m = self._pattern.fullmatch(p.name)
            if m and p.is_dir():
                try:  # the step and suffix break ties of the file system's clock (coarse: ~ms)
                    found.append((self._written(p), int(m[1]), int(m[2] or 0), p.name))
                except OSError:  # removed meanwhile
                    pass
        return [f[-1] for f in sorted(found)]

    @staticmethod
    def _written(tag: Path) -> int:
        marker = tag / COMPLETE_MARKER
        return (marker if marker.is_file() else tag).stat().st_mtime_ns

    def new_tag(self, global_step: int) -> str:
        """A name no tag in the directory has had yet, for a save at ``global_step``
        (``<prefix><step>``, then ``.1``, ``.2``... after the highest suffix there)."""
        used = [self._pattern.fullmatch(p.name) for p in self.path.iterdir()] if self.path.is_dir() else []
        suffixes = [int(m[2] or 0) for m in used if m and int(m[1]) == global_step]
        if not suffixes:
            return f"{self.prefix}{global_step}"
        return f"{self.prefix}{global_step}.{max(suffixes) + 1}"

    def is_complete(self, tag: str) -> bool:
        return (self.path / tag / COMPLETE_MARKER).is_file()

    def commit(self, tag: str) -> None:
        """Mark ``tag`` complete and make it the one loaded: call it on one rank, after a
        barrier that every rank reached once its shards were written."""
        target = self.path / tag
        if not target.is_dir():
            raise CheckpointError(f"cannot commit tag {tag!r}: {str(target)!r} is not a directory")
        _fsync_tree(target)
        atomic_write_text(target / COMPLETE_MARKER, tag + "\n")
        atomic_write_text(self.path / self.LATEST, tag + "\n")

    def prune(self, keep: int = 1) -> list[str]:
        """Remove every tag but the committed one and the ``keep - 1`` newest other complete
        ones (an interrupted save's incomplete tags go too): call it on the committing
        rank, after :meth:`commit`. Returns the tags removed."""
        tags, latest = self.tags(), self._latest()
        complete = [t for t in tags if self.is_complete(t) and t != latest]
        kept = set(complete[len(complete) - (keep - 1):] if keep > 1 else [])
        if latest is not None:
            kept.add(latest)
        removed = [t for t in tags if t not in kept]
        for tag in removed:
            shutil.rmtree(self.path / tag, ignore_errors=True)
        return removed

    def newest_complete(self) -> str | None:
        complete = [t for t in self.tags() if self.is_complete(t)]
        return complete[-1] if complete else None

    def _latest(self) -> str | None:
        try:
            return (self.path / self.LATEST).read_text().strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def entry(self, tag: str, source: str | None = None) -> Path:
        """The directory of ``tag`` inside this checkpoint directory: :func:`tag_entry`
        (``source``: where the name came from, ``latest`` by default)."""
        return tag_entry(self.path, tag, source or f"its '{self.LATEST}' file")

    def committed(self, warn: bool = True) -> Path:
        """The directory of the tag to load (see the class); ``CheckpointError`` when the
        directory holds no complete tag. Warns (``warn``: on one rank, say) when it is not
        the newest tag on disk (a save was interrupted) or when ``latest`` names an
        incomplete one."""
        import warnings

        latest, tags = self._latest(), self.tags()
        if latest is not None:
            self.entry(latest)  # a name that leads out of the directory is refused, never followed
        complete = [t for t in tags if self.is_complete(t) and _inside(self.path, self.path / t)]
        if latest is not None and latest in complete:
            chosen = latest
        elif complete:
            chosen = complete[-1]
            why = (f"its 'latest' names tag {latest!r}, which is incomplete (no {COMPLETE_MARKER}: a save was "
                   f"interrupted)" if latest is not None else f"it has no readable '{self.LATEST}' file")
            if warn:
                warnings.warn(f"sharded checkpoint {str(self.path)!r}: {why}; loading the newest complete tag "
                              f"{chosen!r} instead", stacklevel=2)
            return self.path / chosen
        elif (latest is not None and (self.path / latest).is_dir()
              and (self.legacy_complete is None or self.legacy_complete(self.path / latest))):
            return self.path / latest  # written before hookloop marked tags complete
        elif latest is None:
            raise CheckpointError(
                f"{str(self.path)!r} is a directory but holds no committed checkpoint (no '{self.LATEST}' file "
                f"and no complete tag): a sharded checkpoint whose first save was interrupted has none yet")
        else:
            raise CheckpointError(
                f"{str(self.path)!r} names tag {latest!r} as the latest, and it is incomplete; no other complete "
                f"tag is there to fall back to (tags: {', '.join(tags) or 'none'})")
        newer = [t for t in tags[tags.index(chosen) + 1:] if not self.is_complete(t)]
        if newer and warn:
            warnings.warn(f"sharded checkpoint {str(self.path)!r}: a save was interrupted, leaving "
                          f"{', '.join(newer)} incomplete; loading the committed tag {chosen!r}", stacklevel=2)
        return self.path / chosen


def tag_entry(directory: str | os.PathLike, tag: str, source: str = "its 'latest' file") -> Path:
    """The entry named ``tag`` inside the checkpoint directory ``directory``: what every
    strategy that follows a tag (a ``latest`` file, a ``--tag`` option) must use.

    A tag is the plain name of an entry of the directory itself: an absolute path, ``.``,
    ``..``, a path separator, or a symbolic link that resolves outside the directory is
    refused with :class:`CheckpointError` (``source`` says where the name came from),
    so a checkpoint cannot lead a resume into another run's files.
    """
    directory = Path(directory)
    text = str(tag)
    why = None
    if not text:
        why = "it is empty"
    elif os.path.isabs(text) or text.startswith("~"):
        why = "it is an absolute path"
    elif text in (".", "..") or any(sep in text for sep in ("/", "\\", os.sep)) or "\0" in text:
        why = "it is a path, not the name of an entry of the directory"
    elif not _inside(directory, directory / text):
        why = "it is a symbolic link that leads out of the directory"
    if why is not None:
        names = [p.name for p in sorted(directory.iterdir()) if p.is_dir() and not p.is_symlink()] if directory.is_dir() else []
        raise CheckpointError(
            f"checkpoint {str(directory)!r}: {source} names the tag {text!r}, and {why}; a tag is the name of a "
            f"directory inside the checkpoint ({', '.join(names) or 'it holds none'}). hookloop does not follow "
            f"a tag out of its checkpoint: the checkpoint was altered or written by other code. Write the name of "
            f"one of its own tags there, or pass the checkpoint you mean as ckpt_path")
    return directory / text


def _inside(directory: Path, entry: Path) -> bool:
    """Whether ``entry``, with every symbolic link resolved, is inside ``directory``."""
    try:
        return entry.resolve().is_relative_to(directory.resolve())
    except (OSError, RuntimeError):  # a loop of links
        return False


def _short_write_cause(f) -> OSError | None:
    """The ``OSError`` behind a ``RuntimeError`` of torch's zip writer: a large record
    written straight through hits the file size limit or a full disk as a short write,
    which torch reports as "unexpected pos"; one more byte at the end tells why."""
    try:
        f.flush()
        os.write(f.fileno(), b"\0")
    except OSError as exc:
        return exc
    return None


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
                _remove_tree(path.parent / entry)  # a directory's copy (atomic_copy_tree) too
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


def intact_checkpoints_beside(path: str | os.PathLike) -> list[Path]:
    """The other checkpoints in the folder of ``path`` (``*.ckpt``, but not
    ``last.ckpt``, ``last.prev.ckpt`` or :data:`NONFINITE`), newest first: files whose checksum and zip structure
    are whole (:func:`verify_checksum`, nothing unpickled) and non-empty directories
    (a strategy's sharded checkpoints, not verified here)."""
    folder = Path(path).parent
    found = []
    try:
        candidates = [p for p in folder.glob("*.ckpt") if p.name not in (LAST, PREVIOUS, NONFINITE)]
    except OSError:
        return []
    for candidate in candidates:
        try:
            if candidate.is_dir():
                if not any(candidate.iterdir()):
                    continue
            elif candidate.stat().st_size == 0 or not zipfile.is_zipfile(candidate):
                continue
            else:
                verify_checksum(candidate)
            found.append((candidate.stat().st_mtime_ns, candidate.name, candidate))
        except (CheckpointError, OSError):
            continue
    return [entry[-1] for entry in sorted(found, reverse=True)]


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
        if not any(path.iterdir()):
            raise CheckpointError(
                f"checkpoint {str(path)!r} is an empty directory: it holds no checkpoint (nothing was saved "
                f"there, or a save into it was removed). Pass a checkpoint file (.ckpt) or a sharded "
                f"checkpoint directory, or ckpt_path='last' for this run's newest")
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


def check_format(checkpoint: Any, source: str | os.PathLike) -> None:
    """Refuse a checkpoint written in a newer format than this hookloop reads
    (``checkpoint["hookloop"]["format"]`` above :data:`FORMAT_VERSION`), naming the
    hookloop that wrote it and this one. Older formats, and checkpoints without the mark
    (plain ``torch.save`` files, older hookloops), pass: the loaders read them as before.
    The format is the compatibility contract: a newer hookloop that writes the same
    format writes checkpoints this one reads."""
    mark = checkpoint.get("hookloop") if isinstance(checkpoint, dict) else None
    if not isinstance(mark, dict) or mark.get("format") is None:
        return
    written, version = mark.get("format"), mark.get("version")
    by = f"hookloop {version}" if version else "a hookloop"
    from hookloop import _version

    if not isinstance(written, int) or isinstance(written, bool):
        raise CheckpointError(
            f"checkpoint {str(source)!r} says it was written by {by} in checkpoint format {written!r}, which is not a "
            f"format number; this hookloop ({_version.__version__}) reads formats 1 to {FORMAT_VERSION}: the file "
            f"was altered or written by other code")
    if written > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(source)!r} was written by {by} in checkpoint format {written}, and this hookloop "
            f"({_version.__version__}) reads formats up to {FORMAT_VERSION}: upgrade hookloop (pip install --upgrade "
            f"hookloop and its plugins) to resume from it")


#: Keys every checkpoint of pytorch-lightning's ``Trainer.save_checkpoint`` has.
_LIGHTNING_KEYS = ("state_dict", "epoch", "global_step", "loops")


def lightning_checkpoint_error(checkpoint: Any, source: str | os.PathLike) -> CheckpointError | None:
    """The error for resuming from a pytorch-lightning checkpoint (recognised by its
    ``pytorch-lightning_version``, or by Lightning's keys without hookloop's loop
    state), saying how to start from its weights; ``None`` for any other checkpoint.
    hookloop does not resume Lightning's loop state: its loops' and callbacks' states
    are Lightning's own (docs/decisions.md, "Checkpoints")."""
    if not isinstance(checkpoint, dict) or "loop" in checkpoint:
        return None
    version = checkpoint.get("pytorch-lightning_version") or checkpoint.get("lightning_version")
    if version is None and not all(key in checkpoint for key in _LIGHTNING_KEYS):
        return None
    where = ""
    if "epoch" in checkpoint and "global_step" in checkpoint:
        where = f" (epoch {checkpoint['epoch']}, global step {checkpoint['global_step']})"
    return CheckpointError(
        f"checkpoint {str(source)!r} was written by pytorch-lightning{f' {version}' if version else ''}{where}, not "
        f"by hookloop: hookloop cannot resume Lightning's loop state (its 'loops' and callbacks). To start from its "
        f"weights, load them into the module before fit: module.load_state_dict(torch.load(path, "
        f"weights_only=True)['state_dict']), or MyModule.load_from_checkpoint(path)")


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
