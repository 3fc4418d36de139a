"""Preemption and hung collectives: what ``fit`` does when the job is told to stop, or when
a rank stops making progress.

Preemption
    SIGTERM (what SLURM, Kubernetes and torch's elastic agent send before killing) sets a
    flag; at every optimizer-step boundary the ranks agree on it (the flag itself for one
    process; for several, an all-reduce MAX of one number, started at a boundary without
    waiting and read at the next, so a rank that had it before boundary k stops every rank
    at boundary k + 1: one optimizer step later than a blocking agreement, which cost a
    wait for the slowest rank at every step), and the first boundary where the ranks
    agree on it ends the run on every rank: ``last.ckpt`` of this run
    is written through ``trainer.save_checkpoint``, global rank 0 asks SLURM to requeue
    the job when ``requeue_on_preemption`` is set, and every rank exits with
    :data:`PREEMPTED_EXIT_CODE`, a failure that the elastic agent restarts (while
    restarts remain); the restarted workers resume from that checkpoint.

Hung collectives
    The process group's timeout (``Trainer(process_group_timeout=...)``, default per
    backend: :data:`DEFAULT_TIMEOUTS`) bounds every collective. When one fails, the
    surviving ranks raise :class:`~hookloop.errors.CollectiveTimeoutError` naming the
    collective and the ranks that did not report in the process group's store (the
    suspects), and exit non-zero, so the agent restarts the workers.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: Seconds a collective may wait, per backend, when neither the Trainer nor the strategy
#: says: NCCL as torch (10 minutes); gloo (CPU) 5 minutes, where torch waits 30.
DEFAULT_TIMEOUTS = {"gloo": 300.0, "nccl": 600.0}

#: The exit status of a worker that stopped for a SIGTERM after writing its checkpoint:
#: 128 + SIGTERM, what a shell reports for a process that SIGTERM ended. Non-zero, so the
#: elastic agent treats it as a failure and restarts the workers while restarts remain.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


def default_process_group_timeout(backend: str | None) -> float | None:
    """The timeout (seconds) for a process group of ``backend`` when nobody chose one:
    :data:`DEFAULT_TIMEOUTS`, the longest of a per-device list (``"cpu:gloo,cuda:nccl"``),
    ``None`` (torch's own default) for other backends."""
    if not backend:
        return None
    found = [DEFAULT_TIMEOUTS.get(part.split(":")[-1].strip().lower()) for part in str(backend).split(",")]
    found = [t for t in found if t is not None]
    return max(found) if found else None


# ---------------------------------------------------------------------------------------
# Preemption
# ---------------------------------------------------------------------------------------


class Preemption:
    """SIGTERM during ``fit``: a flag set by the handler, agreed on at step boundaries.

    Installed by :meth:`install` only in the main thread (Python runs signal handlers
    there, and only there can they be set); :meth:`uninstall` puts the previous handler
    back. A SIGTERM that arrives after the last step boundary (training was complete) is
    handed to that previous handler once ``fit`` is over.
    """

    def __init__(self) -> None:
        self.requested = False  # this rank received SIGTERM
        self.acted = False  # the run stopped for it
        self.installed = False
        self._previous: Any = None
        self._flag: Any = None  # the tensor the ranks all-reduce, made once
        self._group: Any = None  # its process group (gloo); None: the strategy's reduce
        self._pending: Any = None  # the all-reduce started at the last boundary

    def _handler(self, signum, frame) -> None:
        self.requested = True  # nothing else here: the loop acts at the next step boundary

    def install(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)
            self.installed = True
        return self

    def uninstall(self, pass_on: bool = True) -> None:
        """Put the previous SIGTERM handler back; with ``pass_on``, hand it a SIGTERM that
        came too late to stop training (after its last step boundary)."""
        if not self.installed:
            return
        self.installed = False
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        if pass_on and self.requested and not self.acted:
            signal.raise_signal(signal.SIGTERM)

    def prepare(self, trainer) -> None:
        """Before the first step, on every rank: the flag, and its process group (made
        here, where the ranks are together, not at a boundary, where they need not be)."""
        import torch
        import torch.distributed as dist

        self._flag = torch.zeros(1)
        if (trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() == trainer.world_size):
            from .helpers import cpu_process_group

            self._group = cpu_process_group()

    def agreed(self, trainer) -> bool:
        """Whether the ranks agree to stop; called by every rank at every optimizer-step
        boundary. With ``torch.distributed``, the all-reduce (MAX) of this rank's flag is
        started here without waiting, on a gloo side group (no device sync under NCCL),
        and the one started at the previous boundary, long finished, is read: every rank
        reads the same value at the same boundary, so all stop together, one boundary
        after the one where the first rank had the flag. Without it (horovod), the
        strategy's ``reduce`` of the flag, at every boundary (a wait per step)."""
        if trainer.world_size == 1:
            return self.requested
        import torch.distributed as dist

        if self._flag is None:
            self.prepare(trainer)
        if self._group is None:
            self._flag.fill_(1.0 if self.requested else 0.0)
            return bool(trainer.reduce(self._flag, "max").item())
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()  # started one boundary ago: finished unless a rank lags behind
            if self._flag.item():
                return True  # nothing new is started: stop() leaves no collective behind
        self._flag.fill_(1.0 if self.requested else 0.0)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return False

    def finish(self) -> None:
        """At the end of a ``fit`` that ran to completion, on every rank: wait for the last
        boundary's all-reduce (every rank started it), so no collective outlives the run."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def stop(self, trainer) -> None:
        """Write this run's ``last.ckpt`` (every rank: saving is collective), requeue the
        SLURM job if asked, and exit with :data:`PREEMPTED_EXIT_CODE`."""
        self.acted = True
        if self.requested:
            print(f"hookloop: global rank {trainer.global_rank} received SIGTERM", file=sys.stderr, flush=True)
        path = preemption_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        where = f"epoch {trainer.current_epoch}, global step {trainer.global_step} (batch {trainer.batch_idx} of the epoch)"
        trainer.print(f"hookloop: preempted (SIGTERM): stopped at the optimizer-step boundary after {where}; "
                      f"checkpoint written to {path}; exiting with status {PREEMPTED_EXIT_CODE}: the elastic agent "
                      f"restarts the workers while restarts remain (hookloop run --max-restarts) and they resume "
                      f"from it; a job that was stopped as a whole resumes when run again with ckpt_path='last'",
                      flush=True)
        if trainer.global_rank == 0 and trainer.config.requeue_on_preemption:
            requeue_slurm_job()
        raise SystemExit(PREEMPTED_EXIT_CODE)


def preemption_checkpoint_path(trainer) -> Path:
    """Where a preempted run writes its checkpoint: ``last.ckpt`` in this run's
    ``checkpoints/`` (the checkpoint observer's ``resume_dir``, also with
    ``ModelCheckpoint(dirpath=...)``): where a restarted worker (``resume_after_restart``)
    and ``ckpt_path="last"`` look."""
    own = getattr(trainer.checkpoint_callback, "resume_dir", None)
    return (Path(own) if own is not None else Path(trainer.log_dir) / "checkpoints") / "last.ckpt"


def slurm_requeue_command(job_id: str | None = None) -> list[str] | None:
    """``scontrol requeue <job id>`` for this SLURM job (``SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID``
    for an array task, else ``SLURM_JOB_ID``), or ``None`` outside SLURM."""
    if job_id is None:
        array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
        job_id = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID")
    return ["scontrol", "requeue", str(job_id)] if job_id else None


def requeue_slurm_job() -> bool:
    """Run :func:`slurm_requeue_command`; say what happened. True when SLURM accepted it."""
    cmd = slurm_requeue_command()
    if cmd is None:
        print("hookloop: requeue_on_preemption is set but this is not a SLURM job (no SLURM_JOB_ID): "
              "nothing to requeue", flush=True)
        return False
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"hookloop: could not requeue the SLURM job: `{shlex.join(cmd)}` failed ({exc}); requeue it "
              f"yourself or resubmit it (it resumes with ckpt_path='last')", file=sys.stderr, flush=True)
        return False
    if done.returncode != 0:
        print(f"hookloop: `{shlex.join(cmd)}` exited with status {done.returncode}: "
              f"{(done.stderr or done.stdout).strip()} (is the job requeueable? sbatch --requeue)",
              file=sys.stderr, flush=True)
        return False
    print(f"hookloop: requeued the SLURM job: `{shlex.join(cmd)}`", flush=True)
    return True


# ---------------------------------------------------------------------------------------
# Hung or broken collectives
# ---------------------------------------------------------------------------------------

# torch.distributed functions, as they appear in a traceback, and what to call them.
_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
                "gather", "gather_object", "scatter", "scatter_object_list", "reduce_scatter", "barrier",
                "all_to_all", "send", "recv", "monitored_barrier")
_TIMEOUT_WORDS = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe", "connection refused")


def is_collective_failure(exc: BaseException) -> bool:
    """A torch.distributed error of a collective that timed out or lost a peer."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(word in text for word in _TIMEOUT_WORDS) and _distributed_in_traceback(exc)


def _distributed_in_traceback(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return any(_frame_kind(frame) is not None for frame in _frames(exc))


def _frames(exc: BaseException) -> list:
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _frame_kind(frame) -> str | None:
    path = frame.f_code.co_filename.replace("\\", "/")
    name = frame.f_code.co_name
    if path.endswith("torch/distributed/distributed_c10d.py") and name in _COLLECTIVES:
        return name
    if name in ("backward", "run_backward", "_engine_run_backward") and "/torch/" in path:
        return "backward"
    if name == "agreed" and path.endswith("hookloop/faults.py"):
        return "agreement"  # the wait for the preemption check's asynchronous all_reduce
    return None


def describe_collective(exc: BaseException) -> str:
    """Which collective failed, read from the traceback: torch.distributed's function, and
    where hookloop called it from (a named barrier, the preemption check...)."""
    frames = _frames(exc)
    kinds = [(frame, kind) for frame in frames if (kind := _frame_kind(frame)) is not None]
    if not kinds:
        return "a collective"
    if any(kind == "agreement" for _, kind in kinds):
        return "all_reduce of the preemption check (the SIGTERM flag, at an optimizer-step boundary)"
    frame, kind = kinds[-1]
    if kind == "backward":
        return ("the all_reduce of the gradients in backward (DistributedDataParallel's reducer, or the "
                "strategy's gradient synchronisation)")
    caller = None
    for f in frames:
        if f is frame:
            break
        path = f.f_code.co_filename.replace("\\", "/")
        if "/hookloop" in path and "/torch/" not in path:
            caller = f
    where = ""
    if caller is not None:
        name = caller.f_code.co_name
        label = caller.f_locals.get("name") if name == "barrier" else None
        if name == "agreed":
            where = " of the preemption check (the SIGTERM flag, at an optimizer-step boundary)"
        elif label:
            where = f" {label!r}"
        else:
            where = f" (called from hookloop's {name})"
    return f"{kind}{where}"


def census(trainer, grace: float) -> tuple[list[int], list[int]] | None:
    """After a failed collective: each surviving rank reports in the process group's store
    and waits up to ``grace`` seconds for the others. Returns ``(reported, missing)``, or
    ``None`` when the store cannot be reached (its host may be the rank that failed)."""
    from . import helpers

    store = helpers._GROUP_STORE
    world, rank = trainer.world_size, trainer.global_rank
    if store is None or world <= 1:
        return None
    try:
        store.set(f"hookloop/census/{rank}", str(trainer.global_step))
        deadline = time.monotonic() + grace
        while True:
            reported = [r for r in range(world) if store.check([f"hookloop/census/{r}"])]
            if len(reported) == world or time.monotonic() >= deadline:
                return reported, [r for r in range(world) if r not in reported]
            time.sleep(0.2)
    except Exception:  # the store went with the failure: nothing can be known
        return None


def collective_failure_error(trainer, exc: BaseException):
    """The :class:`CollectiveTimeoutError` that explains ``exc``, a failed collective; or
    ``None`` when ``exc`` is something else."""
    from .errors import CollectiveTimeoutError

    if trainer.world_size <= 1 or not is_collective_failure(exc):
        return None
    from . import helpers

    timeout = helpers._GROUP_TIMEOUT
    grace = min(5.0, (timeout or 10.0) / 2)
    found = census(trainer, grace)
    if found is None:
        suspects = ("Which rank failed cannot be known: the process group's store could not be reached "
                    "(it lives in the elastic agent, or on global rank 0, which may be the one that failed)")
    elif found[1]:
        missing = found[1]
        suspects = (f"Suspected rank(s): {', '.join(map(str, missing))} (did not report within {grace:g} s after the "
                    f"failure: stopped, dead, or stuck outside the collective; ranks {found[0]} reported)")
    else:
        suspects = ("Every rank reported after the failure, so none is stuck now: a rank was slower than the "
                    "timeout, or the network between them failed")
    limit = f"{timeout:g} s" if timeout else "torch's default"
    return CollectiveTimeoutError(
        f"global rank {trainer.global_rank}: {describe_collective(exc)} failed after global step "
        f"{trainer.global_step} (process-group timeout {limit}): {(str(exc).strip().splitlines() or [type(exc).__name__])[-1]}. "
        f"{suspects}. This process exits so that the elastic agent restarts the workers (hookloop run "
        f"--max-restarts N), which resume from this run's last.ckpt. If a rank is legitimately that slow "
        f"(rank-0-only work such as prepare_data or a large checkpoint), raise the timeout: "
        f"Trainer(process_group_timeout=SECONDS) or hookloop run --process-group-timeout SECONDS"
    )
