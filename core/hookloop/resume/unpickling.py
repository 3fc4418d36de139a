"""Checkpoints never run code: refusing pickled objects that are not plain data.

hookloop reads its own checkpoint files with ``torch.load(weights_only=True)``
(:func:`hookloop.safe_load`). Strategies read formats whose loaders belong to another
library (DeepSpeed's shards, ``torch.distributed.checkpoint`` directories), and those
loaders may call ``torch.load(weights_only=False)`` themselves. :func:`weights_only_loads`
makes every ``torch.load`` inside it a weights-only load, and turns a refused object
into a :class:`~hookloop.CheckpointError` that names the checkpoint; a strategy that
unpickles a file by other means turns its refusal into the same error with
:func:`unsafe_checkpoint_error`.

There is deliberately no option to unpickle such a checkpoint anyway (docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from pathlib import Path
from typing import Any, Iterator

import torch

from hookloop.contract.errors import CheckpointError

# torch.load(weights_only=True) starts the message of every object it refuses with this.
_TORCH_REFUSAL = "Weights only load failed"
_GLOBAL = re.compile(r"GLOBAL (\S+)")
_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
#: The opposite switch (a common workaround since torch 2.6 made weights-only the
#: default): torch raises on every load while both are set, so it is lifted for the block.
_FORCE_NO = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
_SCANNED_FILES = 256  # at most this many files of a directory are searched for the culprit


def refused_object(exc: BaseException) -> str | None:
    """What torch's weights-only unpickler refused, if ``exc`` or an exception that
    caused it is such a refusal (e.g. ``"posix.system"``); ``None`` otherwise.

    Follows ``__cause__``/``__context__`` and the per-rank ``failures`` of
    ``torch.distributed.checkpoint``'s ``CheckpointException``, through which libraries
    pass the error on.
    """
    for current in _chain(exc):
        if isinstance(current, pickle.UnpicklingError) and _TORCH_REFUSAL in str(current):
            found = _GLOBAL.search(str(current))
            if found:
                return found.group(1)
            if "Unsupported operand" in str(current):
                continue  # not a pickle at all (a damaged or foreign file), not a refused object
            return "an object that is not a tensor, number, string or container"
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception behind it: causes, contexts, and the per-rank failures
    a ``torch.distributed.checkpoint.CheckpointException`` carries."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        current = todo.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]


def unsafe_checkpoint_error(source: str | os.PathLike, what: str, files: list[str] | tuple[str, ...] = ()) -> CheckpointError:
    """The :class:`~hookloop.CheckpointError` for the checkpoint ``source`` holding a
    pickled object that is not plain data (``what``: the refused global, e.g.
    ``"posix.system"``), in ``files`` where known. It says why it was refused and how to
    proceed with a checkpoint whose source is trusted."""
    where = f" (in {', '.join(repr(f) for f in files)})" if files else ""
    return CheckpointError(
        f"checkpoint {str(source)!r} contains objects that are not plain tensors and containers: "
        f"{what}{where}. hookloop does not unpickle such objects, because unpickling them can run "
        f"arbitrary code; the checkpoints hookloop and its strategies write contain none, so this one "
        f"was altered or written by other code. There is no option to load it anyway: if you trust "
        f"its source, load the file yourself (torch.load(file, weights_only=False)), keep only tensors, "
        f"numbers, strings and containers of them, and save those with torch.save."
    )


@contextlib.contextmanager
def weights_only_loads(source: str | os.PathLike, safe_globals: list[Any] | tuple[Any, ...] = ()) -> Iterator[None]:
    """Make every ``torch.load`` in the block a weights-only load, even one that passes
    ``weights_only=False`` (third-party loaders such as DeepSpeed's); the classes in
    ``safe_globals`` are accepted besides plain data. A refused object raises
    :class:`~hookloop.CheckpointError` naming ``source`` (the checkpoint being read) and,
    for a directory, the files in it that hold such objects.

    Works through torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, which is process-wide: other
    threads' ``torch.load`` calls during the block are weights-only loads as well. A
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` set by the user is lifted for the block (torch
    refuses every load while both are set) and put back after it: the loads inside stay
    weights-only whatever it says.
    """
    previous, previous_no = os.environ.get(_FORCE), os.environ.pop(_FORCE_NO, None)
    os.environ[_FORCE] = "1"
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            try:
                yield
            except CheckpointError:
                raise
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                for inner in _chain(exc):
                    if isinstance(inner, CheckpointError):  # hookloop's, passed on by a library
                        raise inner from exc
                what = refused_object(exc)
                if what is None:
                    raise
                raise unsafe_checkpoint_error(source, what, _culprits(Path(source))) from exc
    finally:
        if previous is None:
            os.environ.pop(_FORCE, None)
        else:
            os.environ[_FORCE] = previous
        if previous_no is not None:
            os.environ[_FORCE_NO] = previous_no


def _culprits(source: Path) -> list[str]:
    """The torch.save files in (or at) ``source`` that hold objects a weights-only load
    refuses, found without unpickling them (torch disassembles the pickle)."""
    try:
        files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    except OSError:
        return []
    found = []
    for path in files[:_SCANNED_FILES]:
        try:
            if torch.serialization.get_unsafe_globals_in_checkpoint(path):
                found.append(str(path))
        except Exception:  # not a torch.save zip file, or unreadable: not what was refused
            continue
    return found
