"""Run directories: ``<default_root_dir>/logs/version_N/``, one per run, shared by its ranks
and by every elastic restart of it.

Global rank 0 decides and broadcasts, so the ranks agree. A directory belongs to a run by
a marker file naming the job's id (:func:`run_token`) and the Trainer's index among the
runs of this process (a script that builds two Trainers gets two directories, the same
two on every rank and after every restart).

A marked directory is taken again only by a later attempt of the same job
(:func:`reuses_marked_directories`): a worker that an elastic agent restarted
(``TORCHELASTIC_RESTART_COUNT`` > 0, which resumes from the directory's ``last.ckpt``), or
a job the user named (``HOOKLOOP_RUN_ID``, ``hookloop run --run-id``: the same name is the
same job, as a resubmitted job means). A first attempt always claims a new ``version_N``,
so an id that unrelated jobs share (torchrun's rendezvous id, a process's leftover
variables) cannot make them share a directory. The id is never exported into this
process's environment: a child process of a run is a job of its own unless a hookloop
launcher hands it the id (:data:`TOKEN_ENV`, in the worker's environment only).

A root on a store (``default_root_dir="s3://bucket/run"``) works in its local staging
directory (:func:`hookloop.resume.storage.local_root`); its versions are those on the store,
and a claim there is the exclusive creation of the new directory's marker object (S3's
``If-None-Match: *``), so two runs on two machines never take one ``version_N``.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from hookloop.resume import storage

MARKER = ".hookloop-run"
#: The job id the user gives (``hookloop run --run-id`` sets it): public. Also torchrun's
#: rendezvous id for several nodes (:func:`hookloop.launch.elastic_command`).
RUN_ID_ENV = "HOOKLOOP_RUN_ID"
#: The id a hookloop launcher hands the workers it starts (``ddp_spawn``): private, and
#: only honoured in a process that launcher started (:func:`run_token`).
TOKEN_ENV = "HOOKLOOP_RUN_TOKEN"
_VERSION = re.compile(r"^version_(\d+)$")
_runs_in_process = 0
_process_token: str | None = None


def scheduler_job_id() -> str | None:
    """The scheduler's id of this job (SLURM's, an array task's own; PBS, LSF, Flux), or
    ``None`` outside a scheduler."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"slurm-{array_job}_{array_task}"
    for name, prefix in (("SLURM_JOB_ID", "slurm"), ("PBS_JOBID", "pbs"), ("LSB_JOBID", "lsf"),
                         ("FLUX_JOB_ID", "flux")):
        value = os.environ.get(name)
        if value:
            return f"{prefix}-{value}"
    return None


def run_token() -> str:
    """This job's id: the user's ``HOOKLOOP_RUN_ID``, else torchrun's run id
    (``--rdzv-id``; a fresh one for every single-node launch), else the one a hookloop
    launcher handed this worker, else the scheduler's job id, else one made up for this
    process (kept in this process: a child process it starts is a job of its own)."""
    global _process_token
    for source in (lambda: os.environ.get(RUN_ID_ENV), lambda: os.environ.get("TORCHELASTIC_RUN_ID"),
                   _launcher_token, scheduler_job_id):
        token = source()
        if token and token != "none":
            return token
    if _process_token is None:
        _process_token = uuid.uuid4().hex
    return _process_token


def _launcher_token() -> str | None:
    """:data:`TOKEN_ENV`, in a process that the hookloop launcher that set it started
    (``HOOKLOOP_LAUNCHER_PID`` names an ancestor); ``None`` elsewhere, as in a process
    that only inherited it."""
    token = os.environ.get(TOKEN_ENV)
    if not token:
        return None
    from hookloop.distributed.ranks import launched_by_hookloop

    return token if launched_by_hookloop() else None


def reuses_marked_directories() -> bool:
    """Whether this process is a later attempt of a job that may already have marked its
    directories: restarted by torchrun's agent (its ``fit`` resumes from the directory's
    ``last.ckpt``), or named by the user (``HOOKLOOP_RUN_ID``). A first attempt of an
    unnamed job never is; nor is a requeued SLURM job (a new run, which
    ``ckpt_path="last"`` resumes from the newest ``last.ckpt`` in any directory, while the
    old one's stays as it was)."""
    from hookloop.distributed.ranks import attempt

    return bool(attempt()[0] or os.environ.get(RUN_ID_ENV))


def next_index() -> int:
    """The index of the next run in this process (counted alike on every rank)."""
    global _runs_in_process
    _runs_in_process += 1
    return _runs_in_process - 1


def versions(logs: Path) -> list[tuple[int, Path]]:
    """The ``version_N`` directories under ``logs``, by N: on the store for a staged one."""
    remote = storage.remote_of(logs)
    if remote is not None:
        found = [(int(m.group(1)), Path(logs) / name) for name in storage.listdir(remote)
                 if (m := _VERSION.match(name))]
        return sorted(found)
    if not logs.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in logs.iterdir() if p.is_dir() and (m := _VERSION.match(p.name))]
    return sorted(found)


def claim(root: Path, token: str, index: int, reuse: bool | None = None) -> Path:
    """The run directory for ``(token, index)`` under ``root``: the one a previous attempt
    of the same run marked, else a new ``version_N`` (claimed with an exclusive mkdir)."""
    return claim_in(root / "logs", token, index, reuse=reuse)


def next_version(versions_root: Path) -> int:
    """The next free ``version_N`` number under ``versions_root`` (0 when none), as
    Lightning's loggers count: one more than the largest."""
    found = versions(Path(versions_root))
    return found[-1][0] + 1 if found else 0


def claim_in(versions_root: Path, token: str, index: int, version: int | str | None = None,
             reuse: bool | None = None) -> Path:
    """A run directory in ``versions_root``: ``version`` given, ``version_<int>`` or the
    string itself (created if missing, shared with whoever else uses it, as Lightning's
    loggers do); else, in a later attempt of the job (``reuse``; default
    :func:`reuses_marked_directories`), the newest ``version_N`` that an attempt of the run
    ``(token, index)`` marked; else the next free ``version_N`` (claimed with an
    exclusive mkdir)."""
    logs = Path(versions_root)
    if version is not None:
        path = logs / (version if isinstance(version, str) else f"version_{version}")
        path.mkdir(parents=True, exist_ok=True)
        return path
    key = f"{token}:{index}"
    if reuse is None:
        reuse = reuses_marked_directories()
    if storage.remote_of(logs) is not None:
        return _claim_on_store(logs, key, reuse)
    # The newest: jobs that shared an id in turn (a requeued job's earlier runs) each
    # marked one, and this attempt continues the latest.
    for _, path in reversed(versions(logs) if reuse else []):
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


def _claim_on_store(logs: Path, key: str, reuse: bool) -> Path:
    """:func:`claim_in` for a staged ``logs``: the markers are objects on the store, a new
    ``version_N`` is claimed by creating its marker only if none is there; the staging
    directory of a newly claimed version is emptied (a leftover of a run whose store copy
    is gone)."""
    remote = storage.remote_of(logs)
    assert remote is not None
    found = versions(logs)
    for _, path in reversed(found if reuse else []):
        marker = storage.read_bytes(storage.join(remote, path.name, MARKER))
        if marker is not None and marker.decode("utf-8", "replace").strip() == key:
            path.mkdir(parents=True, exist_ok=True)
            return path
    number = found[-1][0] + 1 if found else 0
    while not storage.write_bytes(storage.join(remote, f"version_{number}", MARKER), (key + "\n").encode(),
                                  exclusive=True):
        number += 1  # another run took it meanwhile
    path = logs / f"version_{number}"
    if path.exists():
        import shutil

        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARKER).write_text(key + "\n")
    return path


def written_at(checkpoint: Path) -> float | None:
    """When ``checkpoint`` (a ``last.ckpt``) was written: its commit on the store for a
    staged one, else the newer of its file and its ``last.prev.ckpt``; ``None``: none."""
    remote = storage.remote_of(checkpoint)
    if remote is not None:
        return storage.committed_at(remote)
    times = [p.stat().st_mtime for p in (checkpoint, checkpoint.with_name("last.prev.ckpt")) if p.exists()]
    return max(times) if times else None


def newest_last_checkpoint(root: Path, also: Path | None = None) -> Path | None:
    """``last.ckpt`` of the most recently written run under ``root`` (or in
    ``<root>/checkpoints``, a run's without a logger, or in ``also``: the checkpoint
    directory a ``dirpath`` gave), or ``None``. A directory holding only its
    ``last.prev.ckpt`` (killed between two renames) counts too: the path returned is then
    a missing ``last.ckpt``, and loading it falls back to the previous one. Under a staged
    root (a URL), the checkpoints committed on the store count, by their commit's time:
    the path returned is the staging copy, which the resume downloads."""
    directories = [p / "checkpoints" for _, p in versions(root / "logs")] + [root / "checkpoints"]
    directories += [Path(also)] if also is not None else []
    written = [(t, d / "last.ckpt") for d in directories if (t := written_at(d / "last.ckpt")) is not None]
    if not written:
        return None
    return max(written, key=lambda w: w[0])[1]
