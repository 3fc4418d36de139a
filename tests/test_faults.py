"""Fault tolerance: `hookloop run --max-restarts K` restarts failed workers, and a restart
continues the run instead of starting over.

* The process-group keys in the elastic agent's store are new in every restart, so a
  restarted rank never reads a dead attempt's addresses (``hookloop.init_process_group``).
* ``fit`` in a restarted worker resumes from this run's ``last.ckpt`` with no code in the
  script (``loops.resume_after_restart``); an explicit ``ckpt_path`` still wins.
* End to end: one of two ddp workers is killed with SIGKILL mid-epoch; the job still
  succeeds, and its weights are bit-identical to a run that was never interrupted.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import hookloop
from hookloop.distributed import collectives as hookloop_dist
from hookloop.resume import rundir
from conftest import REPO, TinyModule, finish_job, start_hookloop_run, state_of, tiny_data

SCRIPT = REPO / "tests" / "scripts" / "restart_job.py"


# ---------------------------------------------------------------------------------------
# The process group's keys in the agent's store
# ---------------------------------------------------------------------------------------


@pytest.fixture
def agent_store(monkeypatch):
    """A TCPStore standing for the elastic agent's, which the workers' rendezvous joins as
    clients (``TORCHELASTIC_USE_AGENT_STORE``), as under torchrun."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    return store


def group_store(monkeypatch, rank: int, restart: int, run_id: str = "job") -> dist.Store:
    """The store ``hookloop.init_process_group`` gives torch's process group in a newly
    started worker of global rank ``rank`` (of 2) in attempt ``restart`` of run ``run_id``."""
    monkeypatch.setattr(hookloop_dist, "_GROUP_GENERATION", itertools.count())  # a new process counts from 0
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    made = {}
    monkeypatch.setattr(dist, "init_process_group", lambda store, rank, world_size, **kw: made.update(store=store))
    hookloop.init_process_group("gloo", rank, 2, timeout=30)
    return made["store"]


def test_process_group_keys_are_shared_by_an_attempt_and_new_in_every_restart(monkeypatch, agent_store):
    first = [group_store(monkeypatch, rank, restart=0) for rank in (0, 1)]
    first[0].set("rank0_address", "first attempt")
    # The ranks of one attempt meet under the same keys...
    assert first[1].get("rank0_address") == b"first attempt"
    # ...and the restarted workers (whose group counter starts again at 0) under new
    # ones: the first attempt's addresses, of dead processes, are out of their sight.
    restarted = [group_store(monkeypatch, rank, restart=1) for rank in (0, 1)]
    assert not restarted[1].check(["rank0_address"])
    restarted[0].set("rank0_address", "second attempt")
    assert restarted[1].get("rank0_address") == b"second attempt"
    # Another run sharing the store (same restart count) has keys of its own too.
    assert not group_store(monkeypatch, 1, restart=0, run_id="other job").check(["rank0_address"])


# ---------------------------------------------------------------------------------------
# fit in a restarted worker, in one process
# ---------------------------------------------------------------------------------------


#: the variables a launcher names the job and the attempt with: torchrun's agent, or any
#: other launcher (hookloop's documented names: docs/environment.md)
LAUNCHERS = {"torchrun": ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"),
             "other": ("HOOKLOOP_RUN_ID", "HOOKLOOP_ATTEMPT")}


def fit(root, restart: int, max_steps: int | None = None, ckpt_path=None, module=None, launcher="torchrun"):
    """One attempt of the run ``job`` in a fresh process: the launcher's environment, and
    this process's run counter at 0 (as in a newly started script)."""
    run_id, attempt = LAUNCHERS[launcher]
    os.environ[run_id] = "job"
    os.environ[attempt] = str(restart)
    rundir._runs_in_process = 0
    module = module or TinyModule(seed=0)
    trainer = hookloop.Trainer(max_epochs=2, max_steps=max_steps, default_root_dir=str(root),
                               callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=2)])
    trainer.fit(module, DataLoader(tiny_data(64), batch_size=16, shuffle=True), ckpt_path=ckpt_path)
    return module, trainer


@pytest.fixture
def agent_env(monkeypatch):
    for key in (*LAUNCHERS["torchrun"], *LAUNCHERS["other"]):
        monkeypatch.setenv(key, "")  # restored afterwards
    monkeypatch.setattr(rundir, "_runs_in_process", 0)


@pytest.mark.parametrize("launcher", ["torchrun", "other"])
def test_a_restarted_fit_resumes_from_this_runs_last_checkpoint(tmp_path, capsys, agent_env, launcher):
    """torchrun's restart count, or HOOKLOOP_ATTEMPT that any other launcher sets (issue 36:
    the core read only torchrun's names)."""
    torch.manual_seed(3)
    straight, _ = fit(tmp_path / "straight", restart=0, launcher=launcher)
    torch.manual_seed(3)
    fit(tmp_path / "root", restart=0, max_steps=3, launcher=launcher)  # "fails" after step 3; last.ckpt at step 2
    capsys.readouterr()
    torch.manual_seed(99)  # the restarted process's own seeding must not matter
    resumed, trainer = fit(tmp_path / "root", restart=1, module=TinyModule(seed=7), launcher=launcher)
    out = capsys.readouterr().out
    last = tmp_path / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    variable = LAUNCHERS[launcher][1]
    assert f"hookloop: restart 1 of this run ({variable}=1): resumed from " in out
    assert f"from {last} at epoch 0, global step 3" in out  # max_steps wrote where it stopped
    assert trainer.log_dir == last.parents[1] and trainer.global_step == 8
    a, b = state_of(straight), state_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_restart_before_any_checkpoint_starts_from_scratch(tmp_path, capsys, agent_env):
    module, trainer = fit(tmp_path, restart=1)
    out = capsys.readouterr().out
    assert "restart 1 of this run (TORCHELASTIC_RESTART_COUNT=1): no last.ckpt under" in out
    assert "yet, starting from scratch" in out and trainer.global_step == 8


class Counting(TinyModule):
    def __init__(self):
        super().__init__(seed=0)
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)


def test_explicit_ckpt_path_wins_over_the_restart_resume(tmp_path, capsys, agent_env):
    _, first = fit(tmp_path / "elsewhere", restart=0, max_steps=2)
    chosen = first.log_dir / "checkpoints" / "last.ckpt"
    fit(tmp_path / "root", restart=0, max_steps=6)  # this run's last.ckpt: step 6
    capsys.readouterr()
    module, trainer = fit(tmp_path / "root", restart=1, ckpt_path=chosen, module=Counting())
    assert "resumed from" not in capsys.readouterr().out
    assert module.steps == 6 and trainer.global_step == 8  # from step 2 of the chosen one


# ---------------------------------------------------------------------------------------
# End to end: a worker killed under `hookloop run --max-restarts 1`
# ---------------------------------------------------------------------------------------


def start_job(out, *args, strategy="ddp"):
    out.mkdir()
    return start_hookloop_run(["--plugins", strategy, "--devices", "2", "--max-restarts", "1", SCRIPT, out, *args], out)


def finish(proc, timeout=150, stderr_too=False, status=0):
    stdout, stderr = finish_job(proc, timeout, succeed=status == 0)
    return (stdout, stderr) if stderr_too else stdout


def steps(out, rank: int, attempt: int, rerun: int = 0) -> list[int]:
    path = out / f"steps.{f'run{rerun}.' if rerun else ''}rank{rank}.attempt{attempt}"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


# DeepSpeed's launcher is torchrun too, and its last.ckpt a directory of shards: the same
# restart resumes it. horovod is refused with --max-restarts (horovodrun never restarts a
# worker; docs/errors.md L07).
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("deepspeed_stage_2", marks=pytest.mark.full)])
def test_a_worker_killed_mid_epoch_is_restarted_and_the_run_resumes_bit_identical(tmp_path, strategy):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("hookloop_deepspeed")
    started = time.monotonic()
    # 8 steps in 2 epochs of 4, last.ckpt every 2 steps; rank 1 dies at the end of step 3.
    killed = start_job(tmp_path / "killed", "3", strategy=strategy)
    straight = start_job(tmp_path / "straight", strategy=strategy)
    killed_out, straight_out = finish(killed), finish(straight)
    print(f"both jobs: {time.monotonic() - started:.1f}s")

    killed_dir = tmp_path / "killed"
    assert steps(killed_dir, 1, 0) == [1, 2, 3]  # the kill happened where meant
    assert steps(killed_dir, 0, 0)[:3] == [1, 2, 3]
    # Both restarted workers continued after the step-2 checkpoint, with no resume code.
    assert steps(killed_dir, 0, 1) == steps(killed_dir, 1, 1) == [3, 4, 5, 6, 7, 8]
    last = killed_dir / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert (f"hookloop: restart 1 of this run (TORCHELASTIC_RESTART_COUNT=1): resumed from {last} "
            f"at epoch 0, global step 2") in killed_out
    assert killed_out.count("resumed from") == 1  # said by global rank 0 only
    assert "resumed from" not in straight_out and steps(tmp_path / "straight", 0, 1) == []

    resumed = torch.load(killed_dir / "weights.pt")
    reference = torch.load(tmp_path / "straight" / "weights.pt")
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)


# ---------------------------------------------------------------------------------------
# Preemption (SIGTERM) and hung ranks, end to end: the same job, uninterrupted, is the
# reference of every faulted run below.
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final weights of the uninterrupted job (8 steps)."""
    out = tmp_path_factory.mktemp("reference") / "straight"
    finish(start_job(out))
    assert steps(out, 0, 0) == steps(out, 1, 0) == list(range(1, 9))
    return torch.load(out / "weights.pt")


def assert_same_weights(out, reference):
    resumed = torch.load(out / "weights.pt")
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)


@pytest.mark.slow
def test_sigterm_to_a_worker_checkpoints_at_the_next_step_boundary_and_the_restart_resumes_exactly(tmp_path, reference):
    started = time.monotonic()
    out = tmp_path / "term"
    # Global rank 1 receives SIGTERM at the end of step 3 (in on_train_batch_end); the
    # ranks agree every 2 steps (stop_check_every_n_steps=2).
    stdout, stderr = finish(start_job(out, "3", "--fault", "term", "--stop-every", "2"), stderr_too=True)
    print(f"SIGTERM to a worker, whole job: {time.monotonic() - started:.1f}s")
    last = out / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    # The agreements are at boundaries 2, 4, 6, 8, each reading the one before. Rank 1's
    # flag (set during step 3) went into boundary 4's all-reduce, read at boundary 6
    # (across the epoch's end): both ranks stopped there, neither took step 7...
    assert steps(out, 0, 0) == steps(out, 1, 0) == [1, 2, 3, 4, 5, 6]
    assert "hookloop: global rank 1 received SIGTERM" in stderr
    assert ("hookloop: preempted (SIGTERM): stopped at the optimizer-step boundary after epoch 1, global step 6 "
            f"(batch 2 of the epoch); checkpoint written to {last}; exiting with status 143") in stdout
    # ...and the restarted workers continued from that checkpoint, not from step 4's.
    assert f"resumed from {last} at epoch 1, global step 6" in stdout
    assert steps(out, 0, 1) == steps(out, 1, 1) == [7, 8]
    assert_same_weights(out, reference)


# term-agent: global rank 0 sends SIGTERM to its parent, the elastic agent; term-launcher:
# to the agent's parent, `hookloop run` (a container's PID 1), which passes it on to the
# agent (before it did, `hookloop run` died alone and the job ran on, all 8 steps).
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["term-agent", "term-launcher"])
def test_sigterm_to_the_agent_ends_the_job_with_a_checkpoint_and_a_rerun_resumes_exactly(tmp_path, reference, fault):
    started = time.monotonic()
    out = tmp_path / "agent"
    # SIGTERM at the end of step 3; the agent forwards it to both workers and exits. Later
    # steps take 0.5 s each, so the forwarded signal lands inside the run; the ranks agree
    # at every step (stop_check_every_n_steps=1), so they stop within the 8 steps.
    stdout, stderr = finish(start_job(out, "3", "--fault", fault, "--slow", "0.5", "--stop-every", "1"),
                            stderr_too=True, status="failure")
    first = time.monotonic() - started
    assert "Received 15 death signal, shutting down workers" in stderr  # the agent's own log
    stopped = steps(out, 0, 0)
    assert stopped == steps(out, 1, 0) and 3 <= len(stopped) < 8 and stopped == list(range(1, len(stopped) + 1))
    n = stopped[-1]
    last = out / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"stopped at the optimizer-step boundary after epoch {(n - 1) // 4}, global step {n} " in stdout
    assert torch.load(last, weights_only=False)["loop"]["global_step"] == n
    assert steps(out, 0, 1) == []  # the agent itself was stopped: no restart
    # The same command again (what a requeued job runs), with ckpt_path="last".
    finish(start_job_again(out, "--rerun", "1", "--ckpt-last"))
    print(f"SIGTERM ({fault}): stopped after step {n}; first job {first:.1f}s, "
          f"both {time.monotonic() - started:.1f}s")
    assert steps(out, 0, 0, rerun=1) == steps(out, 1, 0, rerun=1) == list(range(n + 1, 9))
    assert_same_weights(out, reference)


@pytest.mark.slow
def test_a_stopped_rank_fails_the_others_within_the_timeout_and_the_restart_resumes_exactly(tmp_path, reference):
    started = time.monotonic()
    out = tmp_path / "stopped"
    # Global rank 1 SIGSTOPs itself before step 4; rank 0 waits in step 4's gradient
    # all-reduce until the 5 s process-group timeout.
    stdout, stderr = finish(start_job(out, "3", "--fault", "stop", "--timeout", "5"), stderr_too=True)
    print(f"SIGSTOP of a worker, whole job: {time.monotonic() - started:.1f}s")
    assert ("CollectiveTimeoutError: global rank 0: the all_reduce of the gradients in backward "
            "(DistributedDataParallel's reducer, or the strategy's gradient synchronisation) failed after "
            "global step 3 (process-group timeout 5 s)") in stderr
    assert "Suspected rank(s): 1 (did not report" in stderr
    # The agent could not SIGTERM the stopped process; its SIGKILL did end it (the
    # launcher's summary of the failed attempt, docs/how-to/failures.md).
    assert re.search(r"^hookloop: then stopped: rank 1 \(SIGKILL\)\n"
                     r"hookloop: every rank's output: \S+ \(attempt_<N>/rank<R>/stdout\.log, stderr\.log\)\n"
                     r"hookloop: restarting the workers \(1 restart left\)$", stderr, flags=re.M), stderr
    last = out / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"resumed from {last} at epoch 0, global step 2" in stdout
    assert steps(out, 1, 0) == [1, 2, 3]
    assert steps(out, 0, 1) == steps(out, 1, 1) == [3, 4, 5, 6, 7, 8]
    assert_same_weights(out, reference)


def start_job_again(out, *args):
    """The job's command run again in the same folder (a requeued or resubmitted job)."""
    return start_hookloop_run(["--plugins", "ddp", "--devices", "2", "--max-restarts", "1", SCRIPT, out, *args], out)


# ---------------------------------------------------------------------------------------
# Preemption in one process: the flag alone, SLURM's requeue, a late SIGTERM
# ---------------------------------------------------------------------------------------


class SignalsAt(TinyModule):
    """Sends this process SIGTERM at the end of the batch that makes ``global_step == at``
    (or in ``on_train_end`` with ``at="end"``); records the steps it trains."""

    def __init__(self, at):
        super().__init__(seed=0)
        self.at, self.steps = at, []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.steps.append(self.trainer.global_step)
        if self.trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self):
        if self.at == "end":
            os.kill(os.getpid(), signal.SIGTERM)


def one_process_fit(root, module, ckpt_path=None, **options):
    trainer = hookloop.Trainer(max_epochs=2, default_root_dir=str(root), enable_progress_bar=False, **options)
    torch.manual_seed(3)
    trainer.fit(module, DataLoader(tiny_data(64), batch_size=16, shuffle=True), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """An ``scontrol`` executable first on PATH that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.args"
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {record}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record


@pytest.mark.slow
def test_sigterm_in_one_process_checkpoints_requeues_the_slurm_job_and_a_rerun_resumes_exactly(
        tmp_path, agent_env, monkeypatch, fake_scontrol, capsys):
    straight = SignalsAt(None)
    one_process_fit(tmp_path / "straight", straight)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    preempted = SignalsAt(3)
    with pytest.raises(SystemExit) as stopped:
        one_process_fit(tmp_path / "root", preempted, requeue_on_preemption=True)
    assert stopped.value.code == hookloop.distributed.faults.PREEMPTED_EXIT_CODE == 143
    assert signal.getsignal(signal.SIGTERM) is before  # fit put the previous handler back
    assert preempted.steps == [1, 2, 3]
    out = capsys.readouterr().out
    assert "stopped at the optimizer-step boundary after epoch 0, global step 3" in out
    assert "hookloop: requeued the SLURM job: `scontrol requeue 4242`" in out
    assert fake_scontrol.read_text() == "requeue 4242\n"
    # A new process (run id) of the same job: ckpt_path="last" finds the checkpoint.
    monkeypatch.setattr(rundir, "_runs_in_process", 0)
    monkeypatch.setenv(rundir.RUN_ID_ENV, "the requeued job")
    resumed = SignalsAt(None)
    one_process_fit(tmp_path / "root", resumed, ckpt_path="last")
    assert resumed.steps == [4, 5, 6, 7, 8]
    a, b = state_of(straight), state_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_requeue_command_names_the_job_or_the_array_task(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert hookloop.distributed.faults.slurm_requeue_command() == ["scontrol", "requeue", "77"]
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert hookloop.distributed.faults.slurm_requeue_command() == ["scontrol", "requeue", "70_3"]
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key)
    assert hookloop.distributed.faults.slurm_requeue_command() is None


def test_a_sigterm_after_the_last_step_goes_to_the_handler_from_before_fit(tmp_path, agent_env):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        module = SignalsAt("end")
        trainer = one_process_fit(tmp_path, module)  # no SystemExit: training was complete
        assert module.steps == list(range(1, 9)) and trainer.global_step == 8
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_process_group_timeout_is_checked_and_defaults_per_backend():
    assert hookloop.distributed.faults.default_process_group_timeout("gloo") == 300
    assert hookloop.distributed.faults.default_process_group_timeout("nccl") == 600
    assert hookloop.distributed.faults.default_process_group_timeout("cpu:gloo,cuda:nccl") == 600
    assert hookloop.distributed.faults.default_process_group_timeout("mpi") is None  # torch's own
    assert hookloop.Trainer(process_group_timeout=12.5).config.process_group_timeout == 12.5
    for bad in (0, -1, "10", True):
        with pytest.raises(hookloop.ConfigurationError, match="process_group_timeout=.* must be a number of seconds"):
            hookloop.Trainer(process_group_timeout=bad)


def test_stop_check_every_n_steps_defaults_to_auto_and_is_checked():
    assert hookloop.Trainer().config.stop_check_every_n_steps == "auto" == hookloop.distributed.faults.DEFAULT_STOP_CHECK_EVERY_N_STEPS
    assert hookloop.Trainer(stop_check_every_n_steps=1).config.stop_check_every_n_steps == 1
    for bad in (0, -2, 2.0, True, "4", "Auto", None):
        with pytest.raises(hookloop.ConfigurationError,
                           match=r"stop_check_every_n_steps=.* must be 'auto' or a whole number of optimizer steps "
                                 r">= 1: how often the processes agree on stopping for a SIGTERM or max_time"):
            hookloop.Trainer(stop_check_every_n_steps=bad)


class _Plugins:
    def __init__(self, plugins):
        self.plugins = plugins

    def get_plugins(self):
        return self.plugins


class _Vote:
    """A plugin whose ``stop_vote`` says stop from boundary ``at`` on (rank 0's clock)."""

    def __init__(self, preemption, at):
        self.preemption, self.at = preemption, at

    def stop_vote(self, trainer):
        return self.preemption.boundaries >= self.at


@pytest.mark.parametrize("every", [1, 4])
def test_the_stop_agreement_runs_every_k_boundaries_and_stops_at_the_one_after_the_signal(monkeypatch, tmp_path,
                                                                                          every):
    # The schedule of Preemption, in one process of a real gloo group standing for one of
    # two ranks: the all-reduces (counted) happen at boundaries K, 2K, ... only, and a
    # SIGTERM seen between agreement boundaries (m - 1)K and mK stops at (m + 1)K (K = 1:
    # the boundary after the next, the behaviour before issue 33); a stop vote as well.
    from types import SimpleNamespace

    started = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: (started.append(k.get("async_op")), all_reduce(*a, **k))[1])
    monkeypatch.setattr(hookloop.distributed.faults, "cpu_process_group", lambda: None)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for signal_at, vote_at in ((5, None), (None, 5)):
            started.clear()
            preemption = hookloop.distributed.faults.Preemption()
            plugins = [_Vote(preemption, vote_at)] if vote_at else []
            trainer = SimpleNamespace(world_size=2, global_rank=0, plugin_manager=_Plugins(plugins),
                                      config=SimpleNamespace(stop_check_every_n_steps=every))
            preemption.prepare(trainer)
            preemption._group = dist.group.WORLD  # the side group of a real 2-rank run
            collectives, stop = [], None
            for boundary in range(1, 40):
                if boundary == signal_at:
                    preemption.requested = True  # SIGTERM during this step, before its boundary
                before = len(started)
                voted = preemption.agree_stop(trainer)
                if preemption.agreed(trainer) or voted:
                    stop = boundary
                if len(started) > before:
                    collectives.append(boundary)
                if stop:
                    break
            preemption.finish()
            expected = {1: 6, 4: 12}[every]  # the flag enters the agreement at 5 (K=1) or 8 (K=4)
            assert stop == expected, (signal_at, vote_at, stop)
            assert set(started) == {True}  # every one asynchronous, none waited on at once
            # an all-reduce at each agreement boundary but the SIGTERM's last (nothing left pending)
            last = expected if signal_at is None else expected - every
            assert collectives == list(range(every, last + 1, every))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pace", [1 / 512, 0.25, 2.5], ids=["2ms", "250ms", "2.5s"])  # exact in binary
def test_the_auto_schedule_agrees_about_once_a_second_of_the_slowest_ranks_steps(monkeypatch, tmp_path, pace):
    # stop_check_every_n_steps="auto": the agreement carries each rank's seconds per step
    # since the last one (MAX: the slowest rank's), and every rank takes the same next K
    # from the number it read, int(AGREEMENT_SECONDS / pace) between 1 and AUTO_MAX_STEPS:
    # 1 at the first boundaries (no pace known), then ~1 s of steps; a SIGTERM then stops
    # the run within about 2 s (2 steps for steps of a second or more). A clock advancing
    # `pace` per step stands for the steps; a real 1-process gloo group for the all-reduce.
    from types import SimpleNamespace

    clock = [1024.0]
    monkeypatch.setattr(hookloop.distributed.faults.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(hookloop.distributed.faults, "cpu_process_group", lambda: None)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        preemption = hookloop.distributed.faults.Preemption()
        trainer = SimpleNamespace(world_size=2, global_rank=0, plugin_manager=_Plugins([]),
                                  config=SimpleNamespace(stop_check_every_n_steps="auto"))
        preemption.prepare(trainer)
        preemption._group = dist.group.WORLD
        k = max(1, min(hookloop.distributed.faults.AUTO_MAX_STEPS, int(hookloop.distributed.faults.AGREEMENT_SECONDS / pace)))
        signal_at, stop = 2 + 2 * k + 1, None
        for boundary in range(1, 2 + 4 * k + 3):
            clock[0] += pace
            if boundary == signal_at:
                preemption.requested = True
            if preemption.agreed(trainer):
                stop = boundary
                break
        preemption.finish()
        # agreements at 1 and 2 (K = 1 while no pace is known), then every K
        assert preemption.agreements == [1, 2, *range(2 + k, signal_at + k, k)][:len(preemption.agreements)]
        assert preemption.agreements[-1] == stop - k
        # the flag entered the first agreement at or after the signal, read K steps later
        assert stop == 2 + k * (-(-(signal_at - 2) // k) + 1)
        assert (stop - signal_at) * pace <= 2 * max(hookloop.distributed.faults.AGREEMENT_SECONDS, pace)
    finally:
        dist.destroy_process_group()


def test_a_failed_wait_for_the_stop_agreement_is_named_whichever_call_reached_the_boundary_first():
    # The wait for the agreement's all-reduce is in Preemption._boundary, reached from the
    # loop's agreed() or from max_time's agree_stop(): a collective failure there names the
    # preemption check either way (it said "a collective" when reached from agree_stop).
    from types import SimpleNamespace

    class FailedWork:
        def wait(self):
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    trainer = SimpleNamespace(world_size=2, global_rank=0, plugin_manager=_Plugins([]),
                              config=SimpleNamespace(stop_check_every_n_steps=2))
    for call in ("agreed", "agree_stop"):
        preemption = hookloop.distributed.faults.Preemption()
        preemption.prepare(trainer)
        preemption._group, preemption._pending, preemption.boundaries = object(), FailedWork(), 1
        with pytest.raises(RuntimeError) as failed:
            getattr(preemption, call)(trainer)
        assert hookloop.distributed.faults.describe_collective(failed.value) == (
            "all_reduce of the preemption check (the SIGTERM flag, at an optimizer-step boundary)"), call


def test_hookloop_run_passes_stop_check_every_n_steps_and_refuses_a_bad_one_before_launching(
        tmp_path, monkeypatch, capsys):
    from hookloop.tools import cli

    script = tmp_path / "train.py"
    script.write_text("import hookloop\n")
    given = {}
    monkeypatch.setattr(cli, "run_command", lambda cmd, settings, workers=True: given.update(settings) or 0)
    assert cli.main(["run", "--stop-check-every-n-steps", "4", str(script)]) == 0
    assert given["stop_check_every_n_steps"] == 4  # the workers' Trainer defaults (HOOKLOOP_TRAINER_DEFAULTS)
    assert cli.main(["run", "--stop-check-every-n-steps", "0", str(script)]) == 2
    assert "stop_check_every_n_steps=0 must be 'auto' or a whole number of optimizer steps >= 1" in (
        capsys.readouterr().err)
    assert cli.main(["run", "--stop-check-every-n-steps", "auto", str(script)]) == 0
    assert given["stop_check_every_n_steps"] == "auto"


def test_the_attempt_is_hookloops_variable_first_then_torchruns():
    from hookloop.distributed.ranks import attempt

    assert attempt({}) == (0, "")
    assert attempt({"TORCHELASTIC_RESTART_COUNT": "2"}) == (2, "TORCHELASTIC_RESTART_COUNT")
    assert attempt({"HOOKLOOP_ATTEMPT": "1", "TORCHELASTIC_RESTART_COUNT": "2"}) == (1, "HOOKLOOP_ATTEMPT")
    with pytest.raises(hookloop.ConfigurationError, match=r"HOOKLOOP_ATTEMPT='x' must be a whole number"):
        attempt({"HOOKLOOP_ATTEMPT": "x"})
