"""Under the user's OWN ``torchrun`` (issue 22, item 1; docs/how-to/failures.md).

Real ``python -m torch.distributed.run --nproc-per-node 2`` jobs (gloo, CPU):

* a ``Trainer`` configuration error, raised alike by every rank, is printed in full by
  global rank 0 alone; rank 1 prints one line; torchrun's own ``ChildFailedError`` report
  names the message (the workers write its error file) instead of "To enable traceback";
* an exception that only rank 1 raises (in its ``training_step``) keeps rank 1's full
  traceback on the console.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import finish_job

FULL = pytest.mark.full  # one more 2-process job (~25 s on 2 busy cores)

SCRIPT = '''
import os, sys
from torch.utils.data import DataLoader
import hookloop
from hookloop.testing import TinyClassifier, tiny_dataset

class RankOneFails(TinyClassifier):
    def configure_optimizers(self):
        if sys.argv[1] == "setup":  # a refusal after the process group exists (as DeepSpeed's of SGD)
            raise hookloop.ConfigurationError("optimizer offload refuses SGD: use torch.optim.Adam")
        return super().configure_optimizers()

    def training_step(self, batch, batch_idx):
        if os.environ["RANK"] == "1":
            raise RuntimeError("rank 1 alone: a bad batch")
        return super().training_step(batch, batch_idx)

if sys.argv[1] == "config-on-rank-1":  # marked, but rank 0 does not raise it
    if os.environ["RANK"] == "1":
        hookloop.Trainer(max_steps=2, default_root_dir=sys.argv[2], gradient_clip_val=0)
    sys.exit(0)
if sys.argv[1] == "config-late-rank-1":  # rank 1 behind (a loaded machine): it raises after rank 0 exited
    if os.environ["RANK"] == "1":
        import time
        time.sleep(3)
    hookloop.Trainer(max_steps=2, default_root_dir=sys.argv[2], gradient_clip_val=0)
if sys.argv[1] == "config":
    hookloop.Trainer(max_steps=2, default_root_dir=sys.argv[2], gradient_clip_val=0)
trainer = hookloop.Trainer(max_steps=2, default_root_dir=sys.argv[2], enable_progress_bar=False,
                           plugins=["ddp"], accelerator="cpu", enable_checkpointing=False)
trainer.fit(RankOneFails(), DataLoader(tiny_dataset(), batch_size=4))
'''

CONFIG_ERROR = ("hookloop.contract.errors.ConfigurationError: gradient_clip_val=0 must be a finite number > 0 (the largest "
                "gradient norm, or value, to keep), or None for no clipping")
SETUP_ERROR = "hookloop.contract.errors.ConfigurationError: optimizer offload refuses SGD: use torch.optim.Adam"
USER_ERROR = "RuntimeError: rank 1 alone: a bad batch"


def torchrun(tmp_path: Path, which: str) -> list[str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             str(script), which, str(tmp_path)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = finish_job(proc, timeout=240, succeed=False)
    assert proc.returncode == 1, (stdout, stderr)  # nothing swallowed: torchrun fails
    # torch.distributed's own excepthook prefixes a traceback with "[rankN]: " once the
    # process group exists
    return [re.sub(r"^\[rank\d+\]: ", "", line) for line in (stdout + stderr).splitlines()]


def report(lines: list[str]) -> tuple[list[str], list[str]]:
    """The workers' lines, and torchrun's ``ChildFailedError`` report (from its banner)."""
    start = next(i for i, line in enumerate(lines) if line.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError"))
    return lines[:start], lines[start:]


def root_cause(torch_report: list[str]) -> list[str]:
    start = next(i for i, line in enumerate(torch_report) if line.startswith("Root Cause"))
    return torch_report[start:]


@pytest.mark.slow
def test_a_configuration_error_is_printed_by_rank_0_alone(tmp_path):
    check_once(torchrun(tmp_path, "config"), CONFIG_ERROR, in_module=True)


@pytest.mark.slow
def test_rank_1_raising_the_same_error_late_still_prints_its_line(tmp_path):
    # A fresh-clone CI run lost rank 1's line: rank 0 exited once its traceback was out, and
    # the agent stopped rank 1 (SIGTERM, "exitcode -15") before rank 1 had printed. Rank 0
    # now waits for the other ranks to have printed (at most SAME_ERROR_ACK_WAIT_S).
    check_once(torchrun(tmp_path, "config-late-rank-1"), CONFIG_ERROR, in_module=True)


@FULL
def test_a_configuration_error_after_the_process_group_is_printed_by_rank_0_alone(tmp_path):
    # torch.distributed's own excepthook now wraps hookloop's (it prefixes "[rankN]: ")
    check_once(torchrun(tmp_path, "setup"), SETUP_ERROR, in_module=False)


@FULL
def test_a_marked_error_that_rank_0_does_not_confirm_keeps_rank_1s_traceback(tmp_path):
    # rank 1 waits SAME_ERROR_WAIT_S (30 s) for rank 0's confirmation, then prints its own
    check_own_traceback(torchrun(tmp_path, "config-on-rank-1"), CONFIG_ERROR)


def check_own_traceback(lines: list[str], error: str) -> tuple[list[str], list[str]]:
    """The one rank that raised ``error`` printed it itself (once), and no rank printed
    the one-line note; returns :func:`report`'s split."""
    text = "\n".join(lines)
    workers, torch_report = report(lines)
    assert [line for line in workers if line == error] == [error], text
    assert "the same" not in text, text
    return workers, torch_report


def check_once(lines: list[str], error: str, in_module: bool) -> None:
    text = "\n".join(lines)
    workers, torch_report = report(lines)
    # the message once, as the last line of the one traceback (rank 0's)
    assert [line for line in lines if line == error] == [error], text
    if in_module:
        assert sum(bool(re.fullmatch(r'  File ".*job\.py", line \d+, in <module>', line)) for line in lines) == 1, text
    else:
        assert sum(bool(re.fullmatch(r'  File ".*job\.py", line \d+, in configure_optimizers', line)) for line in lines) == 1, text
    # two tracebacks in all: rank 0's and torchrun's own (the agent raising ChildFailedError)
    assert sum(line == "Traceback (most recent call last):" for line in lines) == 2, text
    assert sum(line == "Traceback (most recent call last):" for line in workers) == 2, text
    assert [line for line in lines if "the same" in line] == \
        ["hookloop: rank 1: the same ConfigurationError as rank 0 (printed there)"], text
    # torchrun's report names the message: the error files are there
    assert "To enable traceback" not in text, text
    assert f"  traceback : {error}" in root_cause(torch_report), text
    assert re.search(r"error_file: \S+error\.json", "\n".join(root_cause(torch_report))), text


@FULL
def test_an_error_of_rank_1_alone_keeps_its_traceback(tmp_path):
    lines = torchrun(tmp_path, "user")
    text = "\n".join(lines)
    workers, torch_report = check_own_traceback(lines, USER_ERROR)
    at = workers.index(USER_ERROR)
    tb = max(i for i, line in enumerate(workers[:at]) if line == "Traceback (most recent call last):")
    assert any("in training_step" in line for line in workers[tb:at]), text
    root = "\n".join(root_cause(torch_report))
    assert "rank      : 1 (local_rank: 1)" in root and f"traceback : {USER_ERROR}" in root, text


# -- every rank's output in the run's failure directory (hookloop run) ------------------

MARKERS = '''
import os, sys
import hookloop
rank = os.environ["RANK"]
for i in range(3):
    print(f"marker: rank {rank} stdout line {i}")
print(f"marker: rank {rank} stderr", file=sys.stderr)
if rank == "1" and sys.argv[1] == "fail":
    raise RuntimeError("rank 1 fails after its markers")
'''


def hookloop_run(tmp_path: Path, which: str, succeed: bool) -> list[str]:
    from conftest import start_hookloop_run

    script = tmp_path / "markers.py"
    script.write_text(MARKERS)
    proc = start_hookloop_run(["--plugins", "ddp", "--devices", "2", "--accelerator", "cpu",
                               "--default-root-dir", tmp_path, script, which], cwd=tmp_path)
    stdout, stderr = finish_job(proc, timeout=240, succeed=succeed)
    return stdout.splitlines(), stderr.splitlines()


def expected(rank: int) -> tuple[list[str], list[str]]:
    return [f"marker: rank {rank} stdout line {i}" for i in range(3)], [f"marker: rank {rank} stderr"]


@FULL  # the default tier checks the same files in test_failure_report's hookloop run
def test_hookloop_run_keeps_every_ranks_output_and_the_summary_names_it(tmp_path):
    stdout, stderr = hookloop_run(tmp_path, "fail", succeed=False)
    text = "\n".join(stdout + stderr)
    # the console still shows each rank's lines, in order, on their own stream
    for rank in (0, 1):
        out, err = expected(rank)
        assert [line for line in stdout if line.startswith(f"marker: rank {rank} ")] == out, text
        assert [line for line in stderr if line.startswith(f"marker: rank {rank} ")] == err, text
    named = [line for line in stderr if line.startswith("hookloop: every rank's output: ")]
    assert len(named) == 1, text
    folder = Path(named[0].split(": ", 2)[2].split(" (", 1)[0])
    assert folder.parent == tmp_path / "logs" / "failures", text
    traceback_log = [line.split("traceback: ", 1)[1] for line in stderr if line.startswith("hookloop: traceback: ")]
    assert traceback_log == [str(folder / "rank1.log")], text
    # each rank's files hold its lines, and nothing of the other rank
    for rank in (0, 1):
        out, err = expected(rank)
        where = folder / "attempt_0" / f"rank{rank}"
        assert [line for line in (where / "stdout.log").read_text().splitlines() if line.startswith("marker:")] == out
        assert [line for line in (where / "stderr.log").read_text().splitlines() if line.startswith("marker:")] == err
    assert "Traceback" not in text  # on the console the summary stands for it
    assert "RuntimeError: rank 1 fails after its markers" in (folder / "rank1.log").read_text()


@FULL
def test_a_successful_hookloop_run_leaves_no_failure_directory(tmp_path):
    stdout, stderr = hookloop_run(tmp_path, "succeed", succeed=True)
    for rank in (0, 1):
        out, err = expected(rank)
        assert [line for line in stdout if line.startswith(f"marker: rank {rank} ")] == out
        assert [line for line in stderr if line.startswith(f"marker: rank {rank} ")] == err
    assert not (tmp_path / "logs" / "failures").exists()
    # no failure report: hookloop's only line is the documented OMP_NUM_THREADS one
    assert not any("hookloop: " in line and "OMP_NUM_THREADS" not in line for line in stderr), stderr
