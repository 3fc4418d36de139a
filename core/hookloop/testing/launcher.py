"""The launcher conformance suite (contract 2.6): :class:`LauncherConformance`.

    from hookloop.testing import LauncherConformance

    class TestMyLauncher(LauncherConformance):
        launcher = "mylauncher"          # its plugin name
        modes = ("function", "script")   # what it supports

Each test runs :mod:`hookloop.testing.launcher_job` for real under the launcher and a
strategy (``ddp`` by default), and checks what a user relies on:

* the workers really ran where the launcher said: one process per global rank, none of
  them the caller, each told its identity (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``) in agreement with what the core made of it, local
  ranks ``0..n-1`` on each node, one host per node;
* the environment: ``HOOKLOOP_WORKER=1``, attempt 0, one run token and one run directory
  for the whole job, the caller's seed forwarded (``PL_GLOBAL_SEED``), and
  ``HOOKLOOP_LAUNCHER_PID`` naming an ancestor of the worker (the process that launched,
  or the launcher's own process on the worker's node: a Ray actor);
* the result: the weights agree with the one-process reference of the same global batch
  (:func:`hookloop.testing.reference_fit` with the forwarded seed), and in function mode
  the caller's module, counters and run directory are the workers' (no second
  ``version_N``);
* restarts are decided inside the worker (``restarts = True``): rank 1 dies at a step of
  the first attempt, the launcher starts the job again with attempt 1, which resumes from
  the run's ``last.ckpt`` in the same run directory and ends bit-identical to the
  uninterrupted run; a launcher that cannot restart (``restarts = False``) refuses
  ``max_restarts`` at start with a ``ConfigurationError``;
* no orphans: after the launch, and after a SIGKILL of the process that launched, no
  process that carries the launcher's mark (``HOOKLOOP_LAUNCHER_PID``, inherited by every
  process the launch started, hookloop's or not) is left after ``reap_timeout`` seconds.

Linux only (it reads ``/proc``). See docs/plugin-authors.md, "Writing a launcher".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hookloop.distributed.ranks import LAUNCHER_ENV
from hookloop.testing.launcher_job import SEED
from hookloop.testing.reference import max_difference, reference_fit

JOB = Path(__file__).with_name("launcher_job.py")


def marked_processes(launcher_pid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process (zombies excepted) that the launch by
    ``launcher_pid`` started: its environment names ``launcher_pid`` as its launcher
    (``HOOKLOOP_LAUNCHER_PID``), or names a process so marked (a launcher inside the
    launch: ``hookloop run --launcher spawn`` runs the script, whose ``fit`` spawns)."""
    table: dict[int, tuple[str | None, str]] = {}
    prefix = f"{LAUNCHER_ENV}=".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            marks = [v[len(prefix):].decode() for v in (entry / "environ").read_bytes().split(b"\0")
                     if v.startswith(prefix)]
            if not marks or (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        table[int(entry.name)] = (marks[0], command.strip())
    launchers, found = {str(launcher_pid)}, {}
    while True:
        new = {pid: command for pid, (mark, command) in table.items()
               if mark in launchers and pid not in found}
        if not new:
            return sorted(found.items())
        found.update(new)
        launchers |= {str(pid) for pid in new}


def _kill(processes: list[tuple[int, str]]) -> None:
    for pid, _ in processes:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _clean_environ(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HOOKLOOP_TRAINER_DEFAULTS", "HOOKLOOP_WORKER", "LOCAL_RANK", "HOOKLOOP_PLUGINS",
                        LAUNCHER_ENV, "PL_GLOBAL_SEED", "RANK", "WORLD_SIZE")}
    env.update(extra or {})
    return env


class LauncherConformance:
    """What every launcher must do, checked on real processes.

    Class attributes: ``launcher`` (its plugin name, required); ``options`` (its plugin
    options); ``strategy`` (``"ddp"``); ``modes``: ``"function"`` (``fit`` in the caller
    returns the run's results: the ``spawn`` hook) and/or ``"script"`` (``hookloop run
    --launcher NAME``: every worker runs the script: ``launch_command``); ``devices`` and
    ``nodes`` (2 and 1: what the job asks for); ``restarts`` (whether it restarts failed
    workers, ``max_restarts``); ``tolerance`` (from the one-process reference, 1e-5);
    ``reap_timeout`` (s) and ``timeout`` (s per job); ``environ`` (variables the jobs need,
    e.g. a cluster address).
    """

    launcher: str = ""
    options: dict = {}
    strategy: str = "ddp"
    modes: tuple[str, ...] = ("function", "script")
    devices: int = 2
    nodes: int = 1
    restarts: bool = True
    tolerance: float = 1e-5
    reap_timeout: float = 10.0
    timeout: float = 300.0
    environ: dict[str, str] = {}
    samples, batch_size, epochs = 32, 4, 2
    crash_at = 3

    # -- running the job ------------------------------------------------------------------

    def _spec(self, out: Path, mode: str, **extra: Any) -> Path:
        if not self.launcher:
            pytest.fail(f"{type(self).__name__} must set launcher = '<name>'")
        spec = {"plugins": [self.strategy, self.launcher] if mode == "function" else [],
                "devices": self.devices, "nodes": self.nodes, "epochs": self.epochs,
                "samples": self.samples, "batch_size": self.batch_size,
                "options": {self.launcher: dict(self.options)} if self.options else {}, **extra}
        path = out / "spec.json"
        path.write_text(json.dumps(spec))
        return path

    def _command(self, out: Path, mode: str, **extra: Any) -> list[str]:
        spec = self._spec(out, mode, **extra)
        if mode == "function":
            return [sys.executable, str(JOB), str(out), str(spec)]
        options = [f"--plugin-option={self.launcher}.{k}={json.dumps(v)}" for k, v in self.options.items()]
        return [sys.executable, "-m", "hookloop", "run", "--plugins", self.strategy, "--launcher", self.launcher,
                "--devices", str(self.devices), "--nodes", str(self.nodes),
                "--max-restarts", str(extra.get("max_restarts", 0)), *options, str(JOB), str(out), str(spec)]

    def run_job(self, out: Path, mode: str, **extra: Any) -> dict[str, Any]:
        """Run the job to its end; its records, and the pid of the process that launched."""
        out.mkdir(parents=True, exist_ok=True)
        # to a file, not a pipe: a process the launch left behind would hold a pipe open
        log = out / "job.log"
        with open(log, "w") as sink:
            proc = subprocess.Popen(self._command(out, mode, **extra), cwd=out, env=_clean_environ(self.environ),
                                    stdout=sink, stderr=subprocess.STDOUT)
            try:
                proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError(f"the {mode}-mode job under {self.launcher!r} ran past {self.timeout} s:\n"
                                     f"{log.read_text()}") from None
        output = log.read_text()
        return {"returncode": proc.returncode, "output": output, "pid": proc.pid, **self._records(out)}

    def _records(self, out: Path) -> dict[str, Any]:
        identities = [json.loads(p.read_text()) for p in sorted(out.glob("identity.attempt*.rank*.json"))]
        finals = {(int(p.name.split(".")[1][7:]), int(p.name.split(".")[2][4:])): torch.load(p, weights_only=False)
                  for p in out.glob("final.attempt*.rank*.pt")}
        callers = [torch.load(p, weights_only=False) for p in out.glob("caller.*.pt")]
        caller_pid = int((out / "caller.pid").read_text()) if (out / "caller.pid").exists() else None
        return {"identities": identities, "finals": finals, "callers": callers, "caller_pid": caller_pid}

    def attempt(self, job: dict, number: int) -> list[dict]:
        """The identity records of one attempt, in global-rank order."""
        return sorted((r for r in job["identities"] if r["attempt"] == number), key=lambda r: r["global_rank"])

    def ok(self, job: dict, mode: str) -> dict:
        assert job["returncode"] == 0, f"the {mode}-mode job under {self.launcher!r} failed:\n{job['output']}"
        return job

    @pytest.fixture(scope="class")
    @classmethod
    def jobs(cls, tmp_path_factory) -> dict[str, dict]:
        """The uninterrupted job, per mode."""
        self = cls()
        return {mode: self.ok(self.run_job(tmp_path_factory.mktemp(f"launcher-{mode}"), mode), mode)
                for mode in cls.modes}

    def pytest_generate_tests(self, metafunc):
        """Each check once per mode the launcher declares (``modes``)."""
        if "mode" in metafunc.fixturenames:
            unknown = set(self.modes) - {"function", "script"}
            if unknown or not self.modes:
                raise ValueError(f"{type(self).__name__}.modes = {self.modes!r}: use 'function' and/or 'script'")
            metafunc.parametrize("mode", list(self.modes))

    # -- the checks -------------------------------------------------------------------------

    @property
    def world(self) -> int:
        return self.devices * self.nodes

    def test_workers_ran_where_the_launcher_said(self, jobs, mode):
        job = jobs[mode]
        workers = self.attempt(job, 0)
        assert [w["global_rank"] for w in workers] == list(range(self.world)), "one worker per global rank"
        assert len({w["pid"] for w in workers}) == self.world, "each rank in a process of its own"
        assert job["pid"] not in {w["pid"] for w in workers}, "the caller is not a worker"
        by_node: dict[int, list[dict]] = {}
        for w in workers:
            told = w["environ"]
            assert (told["RANK"], told["WORLD_SIZE"]) == (str(w["global_rank"]), str(self.world)), told
            assert told["LOCAL_RANK"] == str(w["local_rank"]) and w["world_size"] == self.world, told
            by_node.setdefault(w["node_rank"], []).append(w)
        for node, members in by_node.items():
            assert sorted(m["local_rank"] for m in members) == list(range(len(members))), f"node {node}"
            assert {m["environ"]["LOCAL_WORLD_SIZE"] for m in members} == {str(len(members))}, f"node {node}"
            assert len({m["host"] for m in members}) == 1, f"node {node}: one host"
            group = {m["environ"].get("GROUP_RANK") for m in members}
            assert group in ({str(node)}, {None}), f"node {node}: GROUP_RANK {group}"

    def test_every_worker_gets_the_jobs_identity_and_environment(self, jobs, mode):
        workers = self.attempt(jobs[mode], 0)
        for w in workers:
            told = w["environ"]
            assert told["HOOKLOOP_WORKER"] == "1", "HOOKLOOP_WORKER=1 in every worker"
            assert w["attempt"] == 0 and w["start_step"] == 0
            assert told["PL_GLOBAL_SEED"] == str(SEED), (
                f"the caller's seed ({SEED}) must reach every worker as PL_GLOBAL_SEED: the samplers' seed")
            mark = told[LAUNCHER_ENV]
            assert mark is not None and mark.isdigit() and int(mark) in w["ancestors"], (
                f"{LAUNCHER_ENV}={mark} must name an ancestor of the worker (pid {w['pid']}, ancestors "
                f"{w['ancestors']}): the process that launched, or the launcher's own process on the "
                f"worker's node (a Ray actor); the worker dies with it and the core honours the run's "
                f"variables only then")
        tokens = {w["environ"].get("HOOKLOOP_RUN_TOKEN") or w["environ"].get("TORCHELASTIC_RUN_ID") for w in workers}
        assert len(tokens) == 1 and None not in tokens, f"one run id for the whole job: {tokens}"
        assert len({w["log_dir"] for w in workers}) == 1, "one run directory for the whole job"

    def test_the_weights_agree_with_the_one_process_reference(self, jobs, mode):
        job = jobs[mode]
        reference = reference_fit(self.epochs, self.batch_size, self.world, n=self.samples, seed=10,
                                  sampler_seed=SEED)
        finals = [job["finals"][(0, rank)] for rank in range(self.world)]
        for rank, final in enumerate(finals):
            assert max_difference(final["final"], reference) <= self.tolerance, f"rank {rank}"

    def test_the_caller_gets_the_runs_results(self, jobs, mode):
        job = jobs[mode]
        spawned_from_script = [c["pid"] for c in job["callers"]] == [job["caller_pid"]]
        if mode == "script" and not spawned_from_script:
            # every worker ran the script: its fit returned there, with that rank's results
            workers = {w["pid"]: w for w in self.attempt(job, 0)}
            assert sorted(c["pid"] for c in job["callers"]) == sorted(workers), "fit returned in each worker"
            for caller in job["callers"]:
                rank = workers[caller["pid"]]["global_rank"]
                assert max_difference(caller["final"], job["finals"][(0, rank)]["final"]) == 0.0
            return
        # function mode, or a script run once whose fit started the workers
        (caller,) = job["callers"]
        assert caller["pid"] == (job["pid"] if mode == "function" else job["caller_pid"]), "fit returned in the caller"
        rank0 = job["finals"][(0, 0)]
        assert max_difference(caller["final"], rank0["final"]) == 0.0, "the caller's module holds the weights"
        assert caller["global_step"] == rank0["global_step"]
        assert caller["log_dir"] == self.attempt(job, 0)[0]["log_dir"] and caller["versions"] == ["version_0"], (
            "the caller's trainer.log_dir is the workers' run directory, no second version_N")

    def test_restarts_are_decided_inside_the_worker(self, jobs, mode, tmp_path):
        if not self.restarts:
            job = self.run_job(tmp_path, mode, max_restarts=1)
            assert job["returncode"] != 0 and "ConfigurationError" in job["output"], (
                f"{self.launcher} declares restarts = False: it must refuse max_restarts at start")
            assert not job["identities"], "refused before any worker started"
            return
        job = self.ok(self.run_job(tmp_path, mode, max_restarts=1, crash_at=self.crash_at), mode)
        first, second = self.attempt(job, 0), self.attempt(job, 1)
        assert len(second) == self.world, f"attempt 1 must start every rank again:\n{job['output']}"
        for w in second:
            assert w["start_step"] > 0, "attempt 1 resumed from the run's last.ckpt"
            assert w["log_dir"] == first[0]["log_dir"], "attempt 1 trains in the first attempt's run directory"
        straight = jobs[mode]["finals"][(0, 0)]["final"]
        assert max_difference(job["finals"][(1, 0)]["final"], straight) == 0.0, (
            "the restarted job ends bit-identical to the uninterrupted one")

    def test_no_process_outlives_the_launch(self, jobs, mode):
        left = self._left(jobs[mode]["pid"])
        _kill(left)  # a failing launcher's leftovers do not outlive the test either
        assert left == [], "processes of the launch are left after it ended"

    def test_no_process_outlives_a_sigkilled_launch(self, mode, tmp_path):
        """SIGKILL the process that launched once every worker trains: nothing it started
        (hookloop's processes or the launcher's own daemons) may live on."""
        command = self._command(tmp_path, mode, epochs=1000)
        proc = subprocess.Popen(command, cwd=tmp_path, env=_clean_environ(self.environ),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + self.timeout
            while len(list(tmp_path.glob("identity.attempt0.rank*.json"))) < self.world:
                assert proc.poll() is None, "the job ended before its workers started"
                assert time.monotonic() < deadline, "the workers did not start"
                time.sleep(0.2)
            before = marked_processes(proc.pid)
            assert before, f"no process carries {LAUNCHER_ENV}={proc.pid}: the launcher does not mark its processes"
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            assert self._left(proc.pid) == [], f"left after SIGKILL (before it: {before})"
        finally:
            if proc.poll() is None:
                proc.kill()
            _kill(marked_processes(proc.pid))

    def _left(self, launcher_pid: int) -> list[tuple[int, str]]:
        deadline = time.monotonic() + self.reap_timeout
        while True:
            left = marked_processes(launcher_pid)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)
