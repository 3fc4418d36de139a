"""Preemption and hung collectives: what ``fit`` does when the job is told to stop, or when
a rank stops making progress.

Preemption
    SIGTERM (what SLURM, Kubernetes and torch's elastic agent send before killing) sets a
    flag. One process reads its flag at every optimizer-step boundary. Several processes
    agree on it off the critical path, at scheduled optimizer-step boundaries only
    (``Trainer(stop_check_every_n_steps=...)``): each rank starts an all-reduce (MAX) of
    ``[SIGTERM, -, -, stop vote, seconds per step]`` without waiting, on a gloo side
    group (a CPU tensor), and reads the one it started at the agreement before, long
    finished; at the boundaries between, nothing is done (no collective, no host read).
    The schedule: an int K, every K-th boundary of the fit; ``"auto"`` (the default,
    :data:`DEFAULT_STOP_CHECK_EVERY_N_STEPS`), the next agreement K boundaries after
    this one with K = ``AGREEMENT_SECONDS / pace`` (between 1 and :data:`AUTO_MAX_STEPS`),
    the pace being the slowest rank's seconds per step read in the agreement itself, so
    every rank takes the same K: about one agreement a second of steps, K = 1 while no
    pace is known (the first two boundaries) and for steps of a second or more. Every
    rank reads the same value at the same boundary, so **every rank stops at the same
    optimizer step, after writing the checkpoint first**: a SIGTERM that reached any rank
    between two agreements is read at the agreement after the next, so the run stops K
    to 2K optimizer steps after the step in which the signal came (auto: about 2 s, or 2
    steps of a second or more; K = 1: at the boundary after that step's, as before issue
    33), well within the grace period between SIGTERM and SIGKILL (SLURM's
    ``KillWait``, Kubernetes' ``terminationGracePeriodSeconds``, often 30 s; a fixed K
    must keep 2K steps and the checkpoint within it). The boundary that stops the run
    writes ``last.ckpt`` of this run through ``trainer.save_checkpoint`` (every rank),
    global rank 0 asks SLURM to requeue the job when ``requeue_on_preemption`` is set,
    and every rank exits with :data:`PREEMPTED_EXIT_CODE`, a failure that the elastic
    agent restarts (while restarts remain); the restarted workers resume from that
    checkpoint. A SIGTERM that the run has not agreed on when training ends lets ``fit``
    complete and goes to the previous handler after it.

Rank-agreed flags of the step (``nan_guard``)
    A plugin that must act on every rank at the same step on something one rank saw (a
    NaN loss) folds its flag into the same all-reduce: :meth:`Preemption.agree_now`,
    called before the optimizer step, all-reduces ``[SIGTERM, flag, rank, stop vote]``
    (MAX) and waits for it; the loop's :meth:`Preemption.agreed` at that boundary then
    reads its SIGTERM part instead of starting its own. While such a plugin is enabled,
    every boundary is an agreement and it is blocking (a wait for the slowest rank, and
    a read of the loss, a device sync on GPUs; a SIGTERM stops at the boundary where it
    came): only the runs that enable it pay.

Stop votes (``max_time``)
    A stop that one rank decides for all (the ``Timer`` behind ``max_time``: rank 0's
    clock) rides the same all-reduce: a plugin with a ``stop_vote(trainer) -> bool``
    method votes in every agreement, and :meth:`Preemption.agree_stop`, called at a step
    boundary after the optimizer step, returns the vote agreed at this boundary (the
    votes given K boundaries before, or :meth:`agree_now`'s of this boundary; False at
    the boundaries between): so ``max_time`` stops every rank at the same step, at most
    2K optimizer steps after rank 0's clock said the time was up.

Hung collectives
    The process group's timeout (``Trainer(process_group_timeout=...)``, default per
    backend: :data:`DEFAULT_TIMEOUTS`) bounds every collective. When one fails, the
    surviving ranks raise :class:`~hookloop.contract.errors.CollectiveTimeoutError` naming the
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

from hookloop.engine.settings import DEFAULT_STOP_CHECK_EVERY_N_STEPS  # noqa: F401  (the schedule's default)

#: ``stop_check_every_n_steps="auto"``: the ranks agree about this often (seconds of the
#: slowest rank's steps between two agreements), so a stop comes about 2x this after the signal
AGREEMENT_SECONDS = 1.0
#: ... and at least every this many optimizer steps (the tiniest steps)
AUTO_MAX_STEPS = 1000

# What a failed collective is and how it is reported, and the timeouts, moved to
# hookloop.dist with the process groups; they stay importable from here.
from hookloop.distributed.collectives import (  # noqa: F401
    DEFAULT_TIMEOUTS,
    census,
    collective_failure_error,
    cpu_process_group,
    default_process_group_timeout,
    describe_collective,
    is_collective_failure,
)

#: The exit status of a worker that stopped for a SIGTERM after writing its checkpoint:
#: 128 + SIGTERM, what a shell reports for a process that SIGTERM ended. Non-zero, so the
#: elastic agent treats it as a failure and restarts the workers while restarts remain.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


# ---------------------------------------------------------------------------------------
# Preemption
# ---------------------------------------------------------------------------------------


class Preemption:
    """SIGTERM during ``fit``: a flag set by the handler, agreed on at step boundaries.

    Installed by :meth:`install` only in the main thread (Python runs signal handlers
    there, and only there can they be set); :meth:`uninstall` puts the previous handler
    back. A SIGTERM that arrives after the last step boundary (training was complete) is
    handed to that previous handler once ``fit`` is over.

    With several processes the ranks agree at every ``stop_check_every_n_steps``-th
    optimizer-step boundary of the ``fit`` (K, counted from the fit's first boundary):
    the all-reduce started at boundary m*K is read at boundary (m + 1)*K, and nothing is
    done at the boundaries between (no collective, no read).
    """

    def __init__(self) -> None:
        self.requested = False  # this rank received SIGTERM
        self.acted = False  # the run stopped for it
        self.installed = False
        self.every: int | str = DEFAULT_STOP_CHECK_EVERY_N_STEPS  # the Trainer's stop_check_every_n_steps
        self.boundaries = 0  # optimizer-step boundaries of this fit so far (the agreement's schedule)
        self.next_agreement = 1  # the boundary of the next agreement (every rank computes the same)
        self.agreements: list[int] = []  # the boundaries where this fit agreed (the schedule, for tests/benchmarks)
        self._last = (0, 0.0)  # (boundary, perf_counter) of the last agreement (the fit's start: prepare)
        self._previous: Any = None
        self._flag: Any = None  # the tensor the ranks all-reduce, made once
        self._group: Any = None  # its process group (gloo); None: the strategy's reduce
        self._pending: Any = None  # the all-reduce started at the last agreement boundary
        self._settled: tuple[bool, bool] | None = None  # this boundary's (SIGTERM, stop vote), once agreed
        self._votes: list = []  # the plugins' stop_vote methods (prepare)

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

        self.every = getattr(trainer.config, "stop_check_every_n_steps", DEFAULT_STOP_CHECK_EVERY_N_STEPS)
        self.next_agreement = 1 if self.every == "auto" else self.every
        self._last = (self.boundaries, time.perf_counter())
        # [SIGTERM, a plugin's flag (agree_now), 1 + the global rank that raised it, a stop vote,
        #  seconds per optimizer step since the last agreement (auto: the next K, from the slowest rank's)]
        self._flag = torch.zeros(5)  # on the CPU: reading it never waits for a device
        self._votes = [vote for vote in (getattr(p, "stop_vote", None) for p in trainer.plugin_manager.get_plugins())
                       if callable(vote)]
        if (trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() == trainer.world_size):
            self._group = cpu_process_group()

    def _fill(self, trainer, flag: float = 0.0) -> None:
        self._flag[0] = 1.0 if self.requested else 0.0
        self._flag[1] = float(flag)
        self._flag[2] = float(trainer.global_rank + 1) if flag else 0.0
        self._flag[3] = 1.0 if any(vote(trainer) for vote in self._votes) else 0.0
        boundary, then = self._last
        now = time.perf_counter()
        self._flag[4] = (now - then) / max(self.boundaries - boundary, 1)
        self._last = (self.boundaries, now)
        self.agreements.append(self.boundaries)

    def _schedule(self, seconds_per_step: float | None) -> None:
        """The next agreement's boundary, K after this one: the fixed K, or (``auto``) the
        steps that make :data:`AGREEMENT_SECONDS` at the slowest rank's pace of the steps
        before the agreement just read (every rank read the same number: the same K),
        between 1 and :data:`AUTO_MAX_STEPS`; 1 until a pace is known."""
        if self.every != "auto":
            k = int(self.every)
        elif not seconds_per_step or seconds_per_step <= 0:
            k = 1
        else:
            k = max(1, min(AUTO_MAX_STEPS, int(AGREEMENT_SECONDS / seconds_per_step)))
        self.next_agreement = self.boundaries + k

    def _boundary(self, trainer) -> tuple[bool, bool]:
        """This optimizer-step boundary's agreement, done once per boundary (by whichever of
        :meth:`agree_stop` and :meth:`agreed` comes first; :meth:`agreed`, the loop's call,
        ends the boundary): ``(SIGTERM, stop vote)`` as every rank reads it here. Off the
        schedule (a boundary that is not a multiple of K): nothing, ``(False, False)``."""
        if self._settled is not None:
            return self._settled
        if self._flag is None:
            self.prepare(trainer)
        self.boundaries += 1
        if self.boundaries < self.next_agreement:
            self._settled = (False, False)  # no collective, no read
            return self._settled
        if self._group is None:  # not torch.distributed (horovod): the strategy's reduce, blocking
            self._fill(trainer)
            sigterm, _, _, stop, pace = trainer.reduce(self._flag, "max").tolist()
            self._settled = (bool(sigterm), bool(stop))
            self._schedule(pace)
            return self._settled
        import torch.distributed as dist

        sigterm = stop = 0.0
        pace = None
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()  # started K boundaries ago: finished unless a rank lags behind
            sigterm, _, _, stop, pace = self._flag.tolist()
        self._settled = (bool(sigterm), bool(stop))
        if sigterm:
            return self._settled  # nothing new is started: stop() leaves no collective behind
        self._fill(trainer)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._schedule(pace)
        return self._settled

    def agreed(self, trainer) -> bool:
        """Whether the ranks agree to stop for a SIGTERM; called by every rank at every
        optimizer-step boundary (with several processes). At each agreement boundary of the
        schedule (``Trainer(stop_check_every_n_steps=...)``), with ``torch.distributed``, the
        all-reduce (MAX) of this rank's flag is started here without waiting, on a gloo
        side group (a CPU tensor: no device sync under NCCL), and the one started at the
        agreement before, long finished, is read: every rank reads the same value at the
        same boundary, so all stop together, at the first agreement boundary after the one
        where the first rank had the flag (K to 2K boundaries after the signal). At the
        other boundaries: nothing (no collective, no read). Without torch.distributed
        (horovod), the strategy's ``reduce`` of the flag at each agreement boundary (a wait)."""
        if trainer.world_size == 1:
            return self.requested
        sigterm, _ = self._boundary(trainer)
        self._settled = None  # the boundary is over
        return sigterm

    def agree_now(self, trainer, flag: float) -> tuple[float, int]:
        """Agree now, before this boundary's optimizer step, on this rank's ``flag`` (a
        number >= 0; 0: nothing to report) together with the SIGTERM flag and the stop
        votes, in one blocking all-reduce (MAX) of ``[SIGTERM, flag, 1 + rank if flag,
        vote]``: the largest flag of any rank and the highest global rank that raised it
        (-1: none). Every rank must call it at the same boundary, whatever the schedule
        (a plugin that calls it at every step, nan_guard, makes every boundary an
        agreement, blocking). :meth:`agreed` and :meth:`agree_stop` at this boundary then
        return the SIGTERM verdict and the vote of this same collective (none of their
        own: one collective per step)."""
        if trainer.world_size == 1:  # (the loop reads the SIGTERM flag itself)
            return float(flag), (trainer.global_rank if flag else -1)
        import torch.distributed as dist

        if self._flag is None:
            self.prepare(trainer)
        if self._settled is None:
            self.boundaries += 1
        earlier = (False, False)
        pending, self._pending = self._pending, None
        if pending is not None:  # an asynchronous agreement of an earlier boundary
            pending.wait()
            sigterm, _, _, stop, _ = self._flag.tolist()
            earlier = (bool(sigterm), bool(stop))
        self._fill(trainer, flag)
        if self._group is None:
            out = trainer.reduce(self._flag, "max")
        else:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
            out = self._flag
        sigterm, agreed, rank, stop, pace = out.tolist()
        self._settled = (earlier[0] or bool(sigterm), earlier[1] or bool(stop))
        self._schedule(pace)  # the asynchronous schedule goes on from here (nothing pending now)
        return agreed, int(rank) - 1

    def agree_stop(self, trainer) -> bool:
        """At an optimizer-step boundary, after the optimizer step (``on_train_batch_end``),
        on every rank: whether the ranks agreed that some rank's ``stop_vote`` said stop.
        It is the vote read at this boundary's agreement (:meth:`agree_now`'s, or the
        asynchronous one of :meth:`agreed`'s schedule: the votes given K boundaries ago;
        False at the boundaries between): no collective of its own."""
        if trainer.world_size == 1:
            return any(vote(trainer) for vote in self._votes)
        return self._boundary(trainer)[1]

    def finish(self) -> None:
        """At the end of a ``fit`` that ran to completion, on every rank: wait for the last
        agreement's all-reduce (every rank started it), so no collective outlives the run."""
        pending, self._pending = self._pending, None
        self._settled = None
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
