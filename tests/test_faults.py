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
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import hookloop
from hookloop import helpers, rundir
from conftest import REPO, TinyModule, state_of, tiny_data

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
    monkeypatch.setattr(helpers, "_GROUP_GENERATION", itertools.count())  # a new process counts from 0
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


def fit(root, restart: int, max_steps: int | None = None, ckpt_path=None, module=None):
    """One attempt of the run ``job`` in a fresh process: the agent's environment, and
    this process's run counter at 0 (as in a newly started script)."""
    os.environ["TORCHELASTIC_RUN_ID"] = "job"
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    rundir._runs_in_process = 0
    module = module or TinyModule(seed=0)
    trainer = hookloop.Trainer(max_epochs=2, max_steps=max_steps, default_root_dir=str(root),
                               callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=2)])
    trainer.fit(module, DataLoader(tiny_data(64), batch_size=16, shuffle=True), ckpt_path=ckpt_path)
    return module, trainer


@pytest.fixture
def agent_env(monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.setenv(key, "")  # restored afterwards
    monkeypatch.setattr(rundir, "_runs_in_process", 0)


def test_a_restarted_fit_resumes_from_this_runs_last_checkpoint(tmp_path, capsys, agent_env):
    torch.manual_seed(3)
    straight, _ = fit(tmp_path / "straight", restart=0)
    torch.manual_seed(3)
    fit(tmp_path / "root", restart=0, max_steps=3)  # "fails" after step 3; last.ckpt at step 2
    capsys.readouterr()
    torch.manual_seed(99)  # the restarted process's own seeding must not matter
    resumed, trainer = fit(tmp_path / "root", restart=1, module=TinyModule(seed=7))
    out = capsys.readouterr().out
    last = tmp_path / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert "hookloop: restart 1 of this run (TORCHELASTIC_RESTART_COUNT=1): resumed from " in out
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


def start_job(out, *args):
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    env.pop("LOCAL_RANK", None)
    return subprocess.Popen(
        [sys.executable, "-m", "hookloop", "run", "--plugins", "ddp", "--devices", "2", "--max-restarts", "1",
         str(SCRIPT), str(out), *args],
        cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc, timeout=150):
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the job hung:\n{stdout}\n{stderr}") from None
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{stdout}\n{stderr}"
    return stdout


def steps(out, rank: int, attempt: int) -> list[int]:
    path = out / f"steps.rank{rank}.attempt{attempt}"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_a_worker_killed_mid_epoch_is_restarted_and_the_run_resumes_bit_identical(tmp_path):
    started = time.monotonic()
    # 8 steps in 2 epochs of 4, last.ckpt every 2 steps; rank 1 dies at the end of step 3.
    killed = start_job(tmp_path / "killed", "3")
    straight = start_job(tmp_path / "straight")
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
