"""The launched jobs of the suite, declared once (the table torchtitan keeps of its runs).

A multi-process launch is the most expensive thing a test does (every process imports
torch, joins a process group, tears it down). A :class:`Job` names one launch: the
plugins, devices, mesh and ``hookloop run`` options, and the *battery* scripts
(tests/scripts/) that its workers run one after the other, each into its own folder.
The session-scoped ``jobs`` fixture (conftest.py) runs a job the first time a test asks
for it and hands every later test the same :class:`JobRun`: the folders, each script's
console output per rank, and the launch's own output.

    def test_something(jobs):
        run = jobs.run("ddp")
        ranks = run.ranks("observers_battery")    # OUT/observers_battery/rank<R>.pt
        assert "early stopping" in run.stdout("observers_battery")

Tests that need a launch of their own (a fault, a kill, a restart, a timing, an option
under test) keep it; a test that only observes an ordinary run reads a job's outputs.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS / "scripts"
DRIVER = SCRIPTS / "job_driver.py"


@dataclass(frozen=True)
class Job:
    """One ``hookloop run`` launch. ``scripts``: (script under tests/scripts, its extra
    arguments...) tuples, run in this order by every worker, each as ``script OUT/<stem>
    args...``; ``options``: more ``hookloop run`` arguments; ``env``: more environment."""

    name: str
    scripts: tuple
    plugins: str = "ddp"
    devices: int = 2
    options: tuple = ()
    env: tuple = ()
    timeout: int = 600

    def command(self, out: Path) -> list[str]:
        plan = [[str(SCRIPTS / s[0]), *map(str, s[1:])] for s in self.scripts]
        return [sys.executable, "-m", "hookloop", "run", "--plugins", self.plugins, "--devices", str(self.devices),
                *self.options, str(DRIVER), str(out), json.dumps(plan)]


#: Every shared launch of the suite. A script's folder is named after it (without .py).
JOBS = {job.name: job for job in [
    Job("ddp", scripts=(
        ("ddp_battery.py",), ("observers_battery.py",), ("limits_battery.py",),
        ("lightning_battery.py",),  # test_lightning_ddp.py
        ("loggers_run.py",),  # test_loggers.py: tensorboard and mlflow on rank 0 only
        ("monitor_ddp.py",),  # test_monitor.py: device_stats and throughput
        ("ledger_collectives.py",),  # test_ledger.py
        ("profiler_ddp.py",),  # test_profiler.py
        ("torchmetrics_ddp.py",),  # test_torchmetrics.py (and pytorch-lightning's ddp, the reference)
        ("bars_timer_ddp.py",),  # test_bars_summary.py
        ("all_gather_ddp.py",),  # test_lightning_names.py
        ("sync_dist_ddp.py",),  # test_defects_metrics.py (and pytorch-lightning's ddp, the reference)
        ("logger_objects_ddp.py",),  # test_logger_objects.py
        ("tuner_job.py",),  # test_tuner.py
        ("amp_ddp_digits.py", 10),  # test_amp.py: 10 epochs of digits, fp32 then bf16-mixed
    )),
    # Large allocations straight from the OS and back, so the peak resident size measures
    # the tensors alive at the peak (not malloc's cache): test_fsdp's memory checks.
    Job("fsdp", scripts=(("fsdp_battery.py",),), plugins="fsdp", env=(("MALLOC_MMAP_THRESHOLD_", "65536"),)),
    Job("tp", scripts=(("tp_battery.py",),  # test_tp.py
                       ("tp_sp_battery.py",),  # test_tp_sp.py: sequence parallel
                       ("tp_plan_battery.py",)), plugins="tp"),  # test_tp_plan.py: nanoGPT, Hugging Face Llama
    Job("ddp_sharded", scripts=(("fairscale_sharded_battery.py",),), plugins="ddp_sharded"),
    Job("ddp_sequential", scripts=(("fairscale_sequential_battery.py",),), plugins="ddp_sequential"),
]}


class JobFailed(AssertionError):
    pass


@dataclass
class JobRun:
    job: Job
    out: Path
    returncode: int
    launch_stdout: str
    launch_stderr: str
    seconds: float

    def dir(self, script: str) -> Path:
        """The folder the script wrote into (its ``sys.argv[1]``)."""
        return self.out / Path(script).stem

    def ranks(self, script: str, name: str = "rank{rank}.pt") -> list:
        """``torch.load`` of each rank's record file in the script's folder."""
        return [torch.load(self.dir(script) / name.format(rank=r), weights_only=False) for r in range(self.job.devices)]

    def _console(self, script: str, stream: str) -> str:
        return "".join((self.dir(script) / f"{stream}.rank{r}.log").read_text() for r in range(self.job.devices)
                       if (self.dir(script) / f"{stream}.rank{r}.log").is_file())

    def stdout(self, script: str) -> str:
        """What the script printed on every rank (rank 0's, then rank 1's, ...)."""
        return self._console(script, "stdout")

    def stderr(self, script: str) -> str:
        return self._console(script, "stderr")


class Registry:
    """Runs each job at most once per pytest session (the ``jobs`` fixture). ``base`` is
    shared by the workers of a pytest-xdist session: the first worker to ask launches the
    job under a file lock, and the others read what it left (``job.json``, the folders)."""

    def __init__(self, base: Path):
        self.base = base
        self.base.mkdir(parents=True, exist_ok=True)
        self.done: dict[str, JobRun | JobFailed] = {}

    def run(self, name: str) -> JobRun:
        if name not in self.done:
            self.done[name] = self._once(JOBS[name])
        result = self.done[name]
        if isinstance(result, JobFailed):
            raise result
        return result

    def _once(self, job: Job) -> JobRun | JobFailed:
        record = self.base / job.name / "job.json"
        with open(self.base / f"{job.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker launching it: wait for its record
            if not record.is_file():
                result = self._launch(job)
                fields = ({"failed": str(result)} if isinstance(result, JobFailed) else
                          {"returncode": result.returncode, "launch_stdout": result.launch_stdout,
                           "launch_stderr": result.launch_stderr, "seconds": result.seconds})
                record.write_text(json.dumps(fields))
        fields = json.loads(record.read_text())
        if "failed" in fields:
            return JobFailed(fields["failed"])
        return JobRun(job, record.parent, **fields)

    def _launch(self, job: Job) -> JobRun | JobFailed:
        out = self.base / job.name
        out.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_", "PL_"))}
        env.pop("LOCAL_RANK", None)
        env.update(dict(job.env))
        start = time.perf_counter()
        try:
            proc = subprocess.run(job.command(out), cwd=out, env=env, capture_output=True, text=True,
                                  timeout=job.timeout)
        except subprocess.TimeoutExpired as exc:
            return JobFailed(f"job {job.name!r} hung past {job.timeout} s:\n{exc.stdout}\n{exc.stderr}")
        run = JobRun(job, out, proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)
        if proc.returncode != 0:
            return JobFailed(f"job {job.name!r} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
                             f"{_script_logs(job, out)}")
        return run


def _script_logs(job: Job, out: Path, tail: int = 3000) -> str:
    """The end of every script's stderr per rank, for a failed job's message: the folders
    live in pytest's temporary directory, which a later session rotates away."""
    parts = []
    for script, *_ in job.scripts:
        for rank in range(job.devices):
            log = out / Path(script).stem / f"stderr.rank{rank}.log"
            if log.is_file() and log.stat().st_size:
                parts.append(f"\n--- {Path(script).stem} rank {rank} stderr (end) ---\n{log.read_text()[-tail:]}")
    return "".join(parts)


def begin_battery() -> tuple[Path, int]:
    """The preamble of a battery script, in a job or launched on its own: a hang fails with
    every thread's stack after 240 s, and the output folder (``sys.argv[1]``) becomes the
    working directory, as a launch of its own had it (the job driver puts it back).
    Returns ``(OUT, RANK)``."""
    import faulthandler

    faulthandler.enable()
    faulthandler.dump_traceback_later(240, exit=True)
    out = Path(sys.argv[1])
    os.chdir(out)
    return out, int(os.environ["RANK"])
