"""Workers never outlive their launcher (issue 19, scenario 8).

``hookloop run`` -> torchrun's elastic agent -> workers (each in a session of its own);
``hookloop run`` -> the script -> ``ddp_spawn``'s workers. A SIGKILL to ``hookloop run``
(a test's or a scheduler's timeout), or a SIGTERM and then a SIGKILL to a hung job, must
leave no process of the job behind. The wait below is a deadline (the processes go in
well under a second once their parent is gone), not a timing assertion.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO

SCRIPT = REPO / "tests" / "scripts" / "orphan_job.py"
DEADLINE = 20.0  # seconds the killed job's processes get to go


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def start(args: list, out: Path) -> subprocess.Popen:
    """``python -m hookloop run ARGS``, a new job (no launcher variable of this process
    reaches it), output to ``out/log.txt``: a pipe would be held open by leaked workers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    env.pop("LOCAL_RANK", None)
    with open(out / "log.txt", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "hookloop", "run", *map(str, args)], cwd=out, env=env,
                                stdout=log, stderr=subprocess.STDOUT)


def job_processes(proc: subprocess.Popen, out: Path) -> set[int]:
    """Once both workers took a step: their pids, their parents' (the agent, or the script
    that spawned them) and the script's, less ``hookloop run``'s own."""
    deadline = time.monotonic() + 240
    files = [out / "pid.rank0", out / "pid.rank1"]
    while not all(f.exists() for f in files):
        assert proc.poll() is None, f"the job ended early ({proc.returncode}):\n{(out / 'log.txt').read_text()}"
        assert time.monotonic() < deadline, f"the workers never started:\n{(out / 'log.txt').read_text()}"
        time.sleep(0.2)
    pids = set()
    for f in [*files, out / "pid.main"]:
        pids.update(int(p) for p in f.read_text().split())
    pids.discard(proc.pid)
    assert len(pids) >= 3, pids  # two workers and at least the process that started them
    return pids


def survivors(pids: set[int]) -> list[int]:
    deadline = time.monotonic() + DEADLINE
    while (left := sorted(p for p in pids if alive(p))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill_and_check(proc: subprocess.Popen, out: Path, term_first: bool = False) -> None:
    pids = job_processes(proc, out)
    try:
        if term_first:  # a hung job killed from outside: SIGTERM, then SIGKILL
            proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
        proc.kill()
        proc.wait()
        left = survivors(pids)
        assert not left, (f"{len(left)} process(es) of the job outlived `hookloop run` by {DEADLINE:g} s: "
                          f"{left} (of {sorted(pids)})")
    finally:
        for pid in pids:  # the job's own processes, by id, whatever the outcome
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_a_sigkilled_launcher_leaves_no_worker_behind(tmp_path, strategy):
    kill_and_check(start(["--plugins", strategy, "--devices", "2", SCRIPT, tmp_path], tmp_path), tmp_path)


@pytest.mark.slow
def test_a_hung_job_killed_from_outside_leaves_no_process_behind(tmp_path):
    proc = start(["--plugins", "ddp", "--devices", "2", SCRIPT, tmp_path, "--hang"], tmp_path)
    kill_and_check(proc, tmp_path, term_first=True)


# ---------------------------------------------------------------------------------------
# PowerSGD: a killed and restarted run is bit-identical to an uninterrupted one
# ---------------------------------------------------------------------------------------

POWERSGD = REPO / "tests" / "scripts" / "powersgd_resume_job.py"
BUILTIN = ["--plugins", "ddp", "--plugin-option", 'ddp.comm_hook="powersgd"', "--plugin-option", "ddp.powersgd_start_iter=2"]


def powersgd_run(out: Path, strategy: list, kill_at: int | None = None) -> dict:
    out.mkdir()
    args = [*strategy, "--devices", "2", "--max-restarts", "1", POWERSGD, out]
    proc = start([*args, *([str(kill_at)] if kill_at is not None else []), *(["--subclass"] if not strategy else [])], out)
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{log}"
    if kill_at is not None:
        # the launcher's summary of the failed attempt (docs/how-to/failures.md)
        assert "failed first (host " in log and "it was stopped by SIGKILL" in log, f"the worker was not killed:\n{log}"
    return torch.load(out / "weights.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted_powersgd(tmp_path_factory):
    return powersgd_run(tmp_path_factory.mktemp("powersgd") / "reference", BUILTIN)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    "subclass",  # the case; the built-in by name runs the same code, in the full suite
    pytest.param("ddp", marks=pytest.mark.full),
])
def test_powersgd_killed_and_restarted_is_bit_identical(tmp_path, uninterrupted_powersgd, strategy):
    # Killed after step 7 of 12, resumed from step 6's checkpoint (mid-epoch), where PowerSGD
    # (from step 2) has error feedback and warm-start matrices; the resumed wrapper's first
    # step must use the bucket layout the uninterrupted run had then.
    resumed = powersgd_run(tmp_path / "killed", BUILTIN if strategy == "ddp" else [], kill_at=7)
    diff = {k: (resumed[k] - uninterrupted_powersgd[k]).abs().max().item() for k in resumed}
    assert all(torch.equal(resumed[k], uninterrupted_powersgd[k]) for k in resumed), diff
