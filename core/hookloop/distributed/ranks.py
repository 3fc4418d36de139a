"""Lightning's rank-zero helpers: ``rank_zero_only``, ``rank_zero_info``, ``rank_zero_warn``.

``from lightning.pytorch.utilities import rank_zero_only`` becomes
``from hookloop.distributed.ranks import rank_zero_only`` (also ``from hookloop import ...``).
``rank_zero_only.rank`` is the process's global rank: read from the launcher's
environment (``RANK``, else LSF's ``JSM_NAMESPACE_RANK``, MPI's ``OMPI_COMM_WORLD_RANK`` or
``PMI_RANK``, SLURM's ``SLURM_PROCID``, else ``LOCAL_RANK``, else 0) at import, and
set by every run once its ranks are known, as Lightning does.

Also :func:`env_int` (an integer from the first of several environment variables that is
set), at the bottom of the core so that :mod:`hookloop.dist` can use it.
"""

from __future__ import annotations

import logging
import os
import warnings
from functools import wraps
from typing import Any, Callable, Mapping

from hookloop.contract.errors import ConfigurationError

log = logging.getLogger("hookloop")


def _rank_from_environment() -> int:
    # The innermost launcher first, as hookloop.distributed.environment reads them.
    for key in ("RANK", "JSM_NAMESPACE_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(key)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def rank_zero_only(fn: Callable, default: Any = None) -> Callable:
    """Decorate ``fn`` to run on global rank 0 only; other ranks get ``default``."""

    @wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if rank_zero_only.rank == 0:
            return fn(*args, **kwargs)
        return default

    return wrapped


rank_zero_only.rank = _rank_from_environment()


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.getLogger("hookloop").info(...)`` on global rank 0 only (Lightning logs
    these at info level too)."""
    log.info(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_debug(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.getLogger("hookloop").debug(...)`` on global rank 0 only."""
    log.debug(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_warn(message: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``warnings.warn(message, ...)`` on global rank 0 only."""
    warnings.warn(message, stacklevel=stacklevel, **kwargs)


__all__ = ["rank_zero_debug", "rank_zero_info", "rank_zero_only", "rank_zero_warn"]


def env_int(*names: str, default: int | None = None) -> int | None:
    """The first of the environment variables ``names`` that is set, as an int."""
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


#: Which attempt of its job this worker is (0: the first), set by a launcher that restarts
#: failed workers itself (a plugin's; torchrun's agent sets ``TORCHELASTIC_RESTART_COUNT``)
ATTEMPT_ENV = "HOOKLOOP_ATTEMPT"


def attempt(environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """This worker's attempt of its job and the variable that said so: ``HOOKLOOP_ATTEMPT``
    (any launcher's), else torchrun's ``TORCHELASTIC_RESTART_COUNT``, else ``(0, "")``. A
    later attempt (> 0) resumes ``fit`` from its run's ``last.ckpt`` and takes the run
    directory the first attempt marked; process-group keys and failure logs are per attempt."""
    env = os.environ if environ is None else environ
    for name in (ATTEMPT_ENV, "TORCHELASTIC_RESTART_COUNT"):
        value = (env.get(name) or "").strip()
        if value:
            if not value.isdigit():
                raise ConfigurationError(f"{name}={value!r} must be a whole number >= 0 (which attempt of "
                                 f"the job this worker is: 0 for the first)")
            return int(value), name
    return 0, ""


# ---------------------------------------------------------------------------------------
# Which hookloop launcher started this process
# ---------------------------------------------------------------------------------------

#: The pid of the hookloop process that started this job's processes (``hookloop run``,
#: a Trainer that re-launches its script, ``ddp_spawn``'s ``fit``); set by the launcher in
#: the environment of the processes it starts (:mod:`hookloop.launch`).
LAUNCHER_ENV = "HOOKLOOP_LAUNCHER_PID"


def parent_of(pid: int) -> int | None:
    """The parent pid of process ``pid`` (from /proc); ``None`` when /proc cannot tell."""
    try:
        from pathlib import Path

        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after the (name)


def descends_from(ancestor: int) -> bool | None:
    """Whether ``ancestor`` is this process's parent, grandparent...; ``None`` when /proc
    cannot tell."""
    pid = os.getppid()
    for _ in range(64):
        if pid == ancestor:
            return True
        if pid in (0, 1):
            return False
        parent = parent_of(pid)
        if parent is None:
            return None
        pid = parent
    return False


def launcher_pid() -> int | None:
    """The pid :data:`LAUNCHER_ENV` names, or ``None`` (unset or not a number)."""
    try:
        return int(os.environ.get(LAUNCHER_ENV, ""))
    except ValueError:
        return None


def launched_by_hookloop() -> bool:
    """Whether a hookloop launcher started this process for its job: :data:`LAUNCHER_ENV`
    names this process's parent or an ancestor (where /proc cannot tell, whether it is
    set). The launcher's private variables (``HOOKLOOP_TRAINER_DEFAULTS``,
    ``HOOKLOOP_RUN_TOKEN``) are honoured only then: inherited by any other process (a
    shell that exported them, a child of a worker started on its own) they are left
    over from another job."""
    launcher = launcher_pid()
    if launcher is None or launcher == os.getpid():
        return False
    return descends_from(launcher) is not False
