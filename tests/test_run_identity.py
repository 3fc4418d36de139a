"""Run identity (issue 32, defects 2 and 3): a run directory belongs to one job.

Unrelated jobs under the same ``default_root_dir`` never share a ``version_N``: two 2-node
jobs that torchrun gives the same run id (``--rdzv-id``, ``hookloop`` without a job id),
and two scripts started by a process that had itself run a fit. A restarted attempt of a
job still takes its own directory (the newest one marked with its id), which the restart
tests of tests/test_faults.py, tests/test_checkpoint_integrity.py and tests/test_cli.py
check for one node. The tests that launch real jobs are marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hookloop
import hookloop.tools.cli
from conftest import REPO, free_port, run_nodes

JOB = REPO / "tests" / "scripts" / "run_identity_job.py"


def clean_env(**extra: str) -> dict:
    """A new job's environment: no hookloop or launcher variable of this process."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOOKLOOP_", "TORCHELASTIC_", "SLURM_")) and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def two_node_job(root: Path, out: Path, seed: int, **env: str) -> str:
    """A 2-node job on this machine (one process per node, c10d rendezvous on localhost),
    started as two `hookloop run --node-rank R` with no job id; the nodes' output."""
    endpoint = f"127.0.0.1:{free_port()}"
    extra = ["--max-restarts", "1"] if env else []
    commands = [[sys.executable, "-m", "hookloop", "run", "--plugins", "ddp", "--devices", "1", "--nodes", "2",
                 "--node-rank", str(node), "--rdzv-endpoint", endpoint, *extra, str(JOB), str(root), str(out), str(seed)]
                for node in (0, 1)]
    return "\n".join(run_nodes(commands, cwd=root.parent, env=clean_env(**env)))


def weights_of(path: Path) -> dict:
    return hookloop.safe_load(path)["state_dict"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_dir(out: Path) -> Path:
    return Path(json.loads((out / "run.json").read_text())["log_dir"])


@pytest.mark.slow
def test_two_multi_node_jobs_with_the_same_root_get_a_directory_each(tmp_path):
    root = tmp_path / "runs"
    two_node_job(root, tmp_path / "a", seed=1)
    # The second job: its ranks die in the first attempt, and the restarted attempt
    # resumes in the second job's directory (the newest one marked with torchrun's run
    # id "hookloop", which both jobs have), not the first job's.
    output = two_node_job(root, tmp_path / "b", seed=2, CRASH_FIRST_ATTEMPT="1")
    logs = root / "logs"
    assert run_dir(tmp_path / "a") == logs / "version_0"
    assert run_dir(tmp_path / "b") == logs / "version_1"
    assert json.loads((tmp_path / "b" / "run.json").read_text())["attempt"] == 1
    assert f"resumed from {logs / 'version_1' / 'checkpoints' / 'last.ckpt'} at epoch " in output
    # Nothing of the first job was replaced.
    assert same(weights_of(logs / "version_0" / "checkpoints" / "last.ckpt"), torch.load(tmp_path / "a" / "final.pt"))
    assert same(weights_of(logs / "version_1" / "checkpoints" / "last.ckpt"), torch.load(tmp_path / "b" / "final.pt"))


PARENT = """
import subprocess, sys
sys.path.insert(0, {tests!r})
import hookloop
import hookloop.cli
from conftest import TinyModule, tiny_data
from torch.utils.data import DataLoader

root = sys.argv[1]
trainer = hookloop.Trainer(max_epochs=1, default_root_dir=root, enable_progress_bar=False)
trainer.fit(TinyModule(), DataLoader(tiny_data(16), batch_size=8))
print("PARENT", trainer.log_dir, flush=True)
for seed in (1, 2):  # two separate scripts, each a job of its own
    subprocess.run([sys.executable, {job!r}, root, f"{{root}}-child{{seed}}", str(seed)], check=True)
"""


@pytest.mark.slow
def test_scripts_started_by_a_process_that_fitted_get_a_directory_each(tmp_path):
    parent = tmp_path / "parent.py"
    parent.write_text(PARENT.format(tests=str(REPO / "tests"), job=str(JOB)))
    root = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(parent), str(root)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = root / "logs"
    assert f"PARENT {logs / 'version_0'}" in proc.stdout
    children = [Path(f"{root}-child{seed}") for seed in (1, 2)]
    assert [run_dir(c) for c in children] == [logs / "version_1", logs / "version_2"]
    for child, version in zip(children, ("version_1", "version_2")):
        assert same(weights_of(logs / version / "checkpoints" / "last.ckpt"), torch.load(child / "final.pt"))
        rows = (logs / version / "metrics.csv").read_text().splitlines()
        assert len(rows) == len(set(rows))  # one run's rows, none appended by another
    assert hookloop.safe_load(logs / "version_0" / "checkpoints" / "last.ckpt")["loop"]["global_step"] == 2


def rdzv_id(**config) -> str:
    cmd = hookloop.elastic_command(hookloop.TrainerConfig(plugins=["ddp"], nodes=2, rdzv_endpoint="host:29400",
                                                          **config), "train.py", [])
    (found,) = [a.split("=", 1)[1] for a in cmd if a.startswith("--rdzv-id=")]
    return found


def test_the_rendezvous_id_of_several_nodes_is_the_jobs_id(monkeypatch):
    for name in ("HOOKLOOP_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "PBS_JOBID",
                 "LSB_JOBID", "FLUX_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert rdzv_id() == "hookloop"  # no job id known: the shared default (a first attempt claims anew)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert rdzv_id() == "slurm-4242"
    monkeypatch.setenv("HOOKLOOP_RUN_ID", "exp-7")  # the user's (hookloop run --run-id) wins
    assert rdzv_id() == "exp-7"


@pytest.mark.slow  # hookloop run starts the script
def test_run_id_option_names_the_job_for_the_processes_it_starts(tmp_path, monkeypatch):
    """``hookloop run --run-id ID``: the script it starts sees ``HOOKLOOP_RUN_ID=ID``."""
    monkeypatch.delenv("HOOKLOOP_RUN_ID", raising=False)
    script = tmp_path / "report.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ.get('HOOKLOOP_RUN_ID', ''))\n")
    out = tmp_path / "seen.txt"
    assert hookloop.tools.cli.main(["run", "--run-id", "exp-7", str(script), str(out)]) == 0
    assert out.read_text() == "exp-7"
