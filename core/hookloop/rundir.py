"""Run directories: ``<default_root_dir>/logs/version_N/``, one per run, shared by its ranks
and by every elastic restart of it.

Global rank 0 decides and broadcasts, so the ranks agree. A directory belongs to a run by
a marker file naming the launcher's run id (torchrun's ``TORCHELASTIC_RUN_ID``, which its
restarted workers keep; hookloop's own id for processes it spawns) and the Trainer's
index among the runs of this process (a script that builds two Trainers gets two
directories, the same two on every rank and after every restart). Without a launcher a
process makes up its run id, so every new process starts new versions.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

MARKER = ".hookloop-run"
RUN_ID_ENV = "HOOKLOOP_RUN_TOKEN"
_VERSION = re.compile(r"^version_(\d+)$")
_runs_in_process = 0


def run_token() -> str:
    """This job's run id: torchrun's, or one made here and passed on to child processes."""
    token = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(RUN_ID_ENV)
    if not token or token == "none":
        token = uuid.uuid4().hex
        os.environ[RUN_ID_ENV] = token  # processes spawned from here inherit it
    return token


def next_index() -> int:
    """The index of the next run in this process (counted alike on every rank)."""
    global _runs_in_process
    _runs_in_process += 1
    return _runs_in_process - 1


def versions(logs: Path) -> list[tuple[int, Path]]:
    if not logs.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in logs.iterdir() if p.is_dir() and (m := _VERSION.match(p.name))]
    return sorted(found)


def claim(root: Path, token: str, index: int) -> Path:
    """The run directory for ``(token, index)`` under ``root``: the one a previous attempt
    of the same run marked, else a new ``version_N`` (claimed with an exclusive mkdir)."""
    return claim_in(root / "logs", token, index)


def next_version(versions_root: Path) -> int:
    """The next free ``version_N`` number under ``versions_root`` (0 when none), as
    Lightning's loggers count: one more than the largest."""
    found = versions(Path(versions_root))
    return found[-1][0] + 1 if found else 0


def claim_in(versions_root: Path, token: str, index: int, version: int | str | None = None) -> Path:
    """A run directory in ``versions_root``: ``version`` given, ``version_<int>`` or the
    string itself (created if missing, shared with whoever else uses it, as Lightning's
    loggers do); else the ``version_N`` a previous attempt of the run ``(token, index)``
    marked, else the next free ``version_N`` (claimed with an exclusive mkdir)."""
    logs = Path(versions_root)
    if version is not None:
        path = logs / (version if isinstance(version, str) else f"version_{version}")
        path.mkdir(parents=True, exist_ok=True)
        return path
    key = f"{token}:{index}"
    for _, path in versions(logs):
        marker = path / MARKER
        if marker.is_file() and marker.read_text().strip() == key:
            return path
    logs.mkdir(parents=True, exist_ok=True)
    number = next_version(logs)
    while True:
        path = logs / f"version_{number}"
        try:
            path.mkdir()
        except FileExistsError:  # another run took it meanwhile
            number += 1
            continue
        (path / MARKER).write_text(key + "\n")
        return path


def newest_last_checkpoint(root: Path) -> Path | None:
    """``last.ckpt`` of the most recently written run under ``root`` (or the pre-version
    location ``<root>/checkpoints/last.ckpt``), or ``None``. A directory holding only its
    ``last.prev.ckpt`` (killed between two renames) counts too: the path returned is then
    a missing ``last.ckpt``, and loading it falls back to the previous one."""
    directories = [p / "checkpoints" for _, p in versions(root / "logs")] + [root / "checkpoints"]
    existing = [d / name for d in directories for name in ("last.ckpt", "last.prev.ckpt") if (d / name).exists()]
    if not existing:
        return None
    return max(existing, key=lambda c: c.stat().st_mtime).with_name("last.ckpt")
