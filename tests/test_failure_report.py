"""A worker's failure is reported once (issue 22, item 1; README "When a worker fails").

Real 2-process gloo jobs whose module raises in ``configure_optimizers``: the console
gets one summary (the first failing rank, its host, the exception's type and message, the
paths of the tracebacks), a one-line note for the ranks the agent stopped after it, no
traceback and no torch ``ChildFailedError`` report; the tracebacks are in the logs named.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, finish_job, start_hookloop_run

SCRIPT = REPO / "tests" / "scripts" / "failing_job.py"
MESSAGE = "ValueError: optimizer offload refuses SGD: use torch.optim.Adam"


def console_lines(stdout: str, stderr: str) -> list[str]:
    # torchrun's own OMP_NUM_THREADS notice is not the failure's business
    return [line for line in (stdout + stderr).splitlines() if "OMP_NUM_THREADS" not in line
            and not re.fullmatch(r"W\d+ [\d:.]+ \d+ torch/distributed/run.py:\d+\] \**", line)]


def check_report(lines: list[str], failing: list[int], world: int = 2) -> None:
    """``failing``: the ranks that raise; every other rank is stopped by the agent. A rank
    that would raise too may be stopped before it does (the agent does not wait for it)."""
    text = "\n".join(lines)
    assert "Traceback" not in text, text
    assert "ChildFailedError" not in text and "error_file" not in text, text
    assert sum(MESSAGE in line for line in lines) == 1, text
    first = [line for line in lines if "failed first" in line]
    assert len(first) == 1, text
    assert re.search(r"hookloop: rank (\d+) of failing_job.py failed first \(host [^)]+\): " + re.escape(MESSAGE), first[0]), text
    rank = int(re.search(r"rank (\d+)", first[0]).group(1))
    assert rank in failing
    same = [line for line in lines if "raised the same error" in line]
    raised = [rank]
    if same:
        assert len(same) == 1 and re.fullmatch(r"hookloop: ranks? ([\d, ]+) raised the same error", same[0]), text
        raised += [int(r) for r in re.fullmatch(r"hookloop: ranks? ([\d, ]+) raised the same error", same[0]).group(1).split(", ")]
    assert set(raised) <= set(failing)
    stopped = [r for r in range(world) if r not in raised]
    if stopped:
        assert [line for line in lines if "then stopped" in line] == \
            [f"hookloop: then stopped: rank{'s' if len(stopped) > 1 else ''} {', '.join(f'{r} (SIGTERM)' for r in stopped)}"], text
    else:
        assert "then stopped" not in text
    logs = [Path(line.split("traceback: ", 1)[1]) for line in lines if line.startswith("hookloop: traceback: ")]
    assert sorted(p.name for p in logs) == [f"rank{r}.log" for r in sorted(raised)], text
    for log in logs:
        content = log.read_text()
        assert "Traceback (most recent call last)" in content and MESSAGE in content
        assert "configure_optimizers" in content
    # every rank's output beside the tracebacks (attempt_<N>/rank<R>/stdout.log, stderr.log)
    output = [line for line in lines if line.startswith("hookloop: every rank's output: ")]
    assert len(output) == 1 and output[0].split(": ", 2)[2].split(" (")[0] == str(logs[0].parent), text
    # nothing else: the report is these lines
    assert len(lines) == 1 + bool(same) + len(logs) + bool(stopped) + 1, text


@pytest.mark.slow
def test_hookloop_run_reports_rank_1s_failure_once(tmp_path):
    proc = start_hookloop_run(["--plugins", "ddp", "--devices", "2", "--accelerator", "cpu",
                               "--default-root-dir", tmp_path, SCRIPT, tmp_path, "one"], cwd=tmp_path)
    stdout, stderr = finish_job(proc, timeout=120, succeed=False)
    assert proc.returncode == 1  # the ValueError's exit status, not a signal's
    lines = console_lines(stdout, stderr)
    check_report(lines, failing=[1])
    logs = [line for line in lines if "traceback:" in line]
    assert logs[0].split("traceback: ")[1].startswith(str(tmp_path / "logs" / "failures"))
    # each rank's stdout and stderr are in the folder the summary names (their content:
    # tests/test_failure_once_torchrun.py)
    folder = Path(logs[0].split("traceback: ")[1]).parent
    for rank in (0, 1):
        for name in ("stdout.log", "stderr.log"):
            assert (folder / "attempt_0" / f"rank{rank}" / name).is_file()


@pytest.mark.slow
def test_a_scripts_own_relaunch_reports_an_error_of_every_rank_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), "all", "--devices", "2"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = finish_job(proc, timeout=120, succeed=False)
    assert proc.returncode == 1
    check_report(console_lines(stdout, stderr), failing=[0, 1])
