"""hookloop-ray's elastic worker counts (``num_workers="1:2"``, issue 36 item 4), on a real
Ray cluster.

The launching test starts a ``ray.cluster_utils.Cluster`` of two simulated nodes of one CPU
each and runs tests/scripts/elastic_job.py (tests/test_elastic.py's job: 12 steps of a
global batch of 8, ``last.ckpt`` every step) under ``hookloop run --plugins ddp,ray`` with
``ray.num_workers=1:2``: the worker on node 1 waits at step 3 while the test removes node
1 (``cluster.remove_node``); the job goes on with 1 worker from step 3's checkpoint,
holds at step 6 until the test adds a node back, and the launcher, seeing that 2 workers
can be placed again, stops it at the step boundary (SIGTERM) and grows back to 2 workers,
which finish. With ``elastic_batch='global'`` the final weights equal a one-process loop
over the same global batches. A function-mode fit with a range on a local cluster that
holds MAX runs on MAX. The rest checks the option's ranges and a worker's batch plan in
process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hookloop
from conftest import REPO

ray = pytest.importorskip("ray")
pytest.importorskip("hookloop_ray")

SCRIPT = REPO / "tests" / "scripts" / "elastic_job.py"


# -- the option ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("1:2", (1, 2)), ((1, 3), (1, 3)), ([2, 4], (2, 4)), ("2", (None, 2)), (2, (None, 2)), ((2, 2), (None, 2)),
    (None, (None, None)),
])
def test_num_workers_takes_a_range(value, expected):
    plugin = hookloop.plugin("ray", num_workers=value)
    assert (plugin.min_workers, plugin.num_workers) == expected


@pytest.mark.parametrize("value, message", [
    ("2:1", "has MIN=2 above MAX=1: the range is (MIN, MAX), e.g. (1, 2)"),
    ((0, 2), "has MIN=0: an elastic job needs at least 1 worker"),
    ("1:2:3", "or (MIN, MAX) / 'MIN:MAX' for an elastic job"),
    ((1, 2, 3), "or (MIN, MAX) / 'MIN:MAX' for an elastic job"),
    ("a:b", "or (MIN, MAX) / 'MIN:MAX' for an elastic job"),
    (0, "must be an integer >= 1"),
    (True, "or (MIN, MAX) / 'MIN:MAX' for an elastic job"),
])
def test_bad_worker_ranges_are_refused_with_the_fix(value, message):
    with pytest.raises(hookloop.ConfigurationError, match=f"ray plugin option num_workers=.*{_escaped(message)}"):
        hookloop.plugin("ray", num_workers=value)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_an_elastic_job_restarts_three_times_unless_told():
    config = hookloop.TrainerConfig()
    config.validate()
    assert hookloop.plugin("ray", num_workers="1:2").options(config).max_failures == 3
    assert hookloop.plugin("ray", num_workers="1:2", max_failures=1).options(config).max_failures == 1
    assert hookloop.plugin("ray", num_workers=2).options(config).max_failures == 0


def test_a_malformed_worker_range_in_a_worker_names_the_variable():
    from hookloop.distributed.elastic import elastic_range

    config = hookloop.TrainerConfig()
    config.validate()
    assert elastic_range(config, "1:2") == (1, 2, "worker")
    assert elastic_range(config, "2:2") is None and elastic_range(config, None) is None
    with pytest.raises(hookloop.ConfigurationError, match="HOOKLOOP_ELASTIC_WORKERS='2:1' must be 'MIN:MAX'"):
        elastic_range(config, "2:1")


@pytest.mark.parametrize("policy, accumulate, line", [
    ("global", 2, "elastic_batch='global' (the global batch is kept, the accumulation follows the world size): "
                  "global batch 8 = 4 per device x 1 data-parallel process x 2 accumulated batches"),
    ("per-device", 1, "elastic_batch='per-device' (each process's batch is kept, the global batch follows the "
                      "world size): global batch 4 = 4 per device x 1 data-parallel process x 1 accumulated batch"),
])
def test_a_worker_of_an_elastic_ray_job_plans_its_batch_by_the_policy(monkeypatch, tmp_path, capsys, policy,
                                                                      accumulate, line):
    """The one worker left of a 1:2 job, as hookloop-ray starts it: the launcher's variable,
    not the Trainer's nodes, makes the job elastic (the worker's launcher is this process's
    parent, as an actor is its worker's)."""
    from test_elastic import _fit_alone_in_an_elastic_job

    monkeypatch.setenv("HOOKLOOP_ELASTIC_WORKERS", "1:2")
    monkeypatch.setenv("HOOKLOOP_LAUNCHER_PID", str(os.getppid()))
    trainer = _fit_alone_in_an_elastic_job(monkeypatch, tmp_path, elastic_batch=policy)
    assert (trainer.config.min_nodes, trainer.accumulate_grad_batches, trainer.global_step) == (None, accumulate, 2)
    assert f"hookloop: elastic job on 1 of 1:2 workers, {line}" in capsys.readouterr().out


def test_a_worker_range_whose_sizes_cannot_split_the_global_batch_is_refused_in_workers(monkeypatch, tmp_path):
    from test_elastic import _fit_alone_in_an_elastic_job

    # 4 per device on 3 workers: 12 samples a step, which 2 workers (8 a batch) cannot split
    monkeypatch.setenv("HOOKLOOP_ELASTIC_WORKERS", "1:3")
    monkeypatch.setenv("HOOKLOOP_LAUNCHER_PID", str(os.getppid()))
    with pytest.raises(hookloop.ConfigurationError,
                       match=r"global batch of 12 samples on 1 to 3 workers.*on 2 workers \(8 samples.*a worker range"):
        _fit_alone_in_an_elastic_job(monkeypatch, tmp_path)


def test_the_variable_is_ignored_outside_a_launched_worker(monkeypatch, tmp_path, capsys):
    from test_elastic import _fit_alone_in_an_elastic_job

    monkeypatch.setenv("HOOKLOOP_ELASTIC_WORKERS", "1:2")  # left over in a shell: no launcher above
    monkeypatch.delenv("HOOKLOOP_LAUNCHER_PID", raising=False)
    trainer = _fit_alone_in_an_elastic_job(monkeypatch, tmp_path)
    assert trainer.accumulate_grad_batches == 1
    assert "elastic job" not in capsys.readouterr().out


# -- the launched job ---------------------------------------------------------------------


def _steps(out: Path) -> list[tuple]:
    rows = []
    for path in sorted(out.glob("steps.*")):
        rows += [tuple(int(v) if v.isdigit() else v for v in line.split()) for line in path.read_text().splitlines()]
    return rows


def _raylet_of(pid: int) -> int:
    """The raylet above ``pid`` (a worker process: its actor's parent)."""
    while pid > 1:
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("no raylet above the leaving worker")


@pytest.mark.full
def test_a_job_loses_a_node_goes_on_with_one_worker_and_grows_back(tmp_path):
    """A two-node Ray cluster and a job launched on it, which loses a node and gets one
    back: full, because it starts Ray's daemons and three attempts' interpreters (about
    60 s on two cores)."""
    from ray.cluster_utils import Cluster

    from test_elastic import _reference

    out = tmp_path / "out"
    out.mkdir()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    log = open(tmp_path / "job.log", "w")
    job = None
    try:
        node1 = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_", "RAY_"))}
        started = time.monotonic()
        job = subprocess.Popen(
            [sys.executable, "-m", "hookloop", "run", "--plugins", "ddp,ray",
             "--plugin-option", f"ray.address={cluster.address}", "--plugin-option", "ray.num_workers=1:2",
             "--plugin-option", "ray.max_failures=1", str(SCRIPT), str(out),
             "ELASTIC_LEAVE_AT=3", "ELASTIC_LEAVE_RANK=1", "ELASTIC_HOLD_AT=6"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)

        def wait_for(predicate, what: str, timeout: float) -> float:
            deadline = time.monotonic() + timeout
            while not predicate():
                assert job.poll() is None and time.monotonic() < deadline, \
                    f"waiting for {what}:\n{(tmp_path / 'job.log').read_text()[-6000:]}"
                time.sleep(0.1)
            return time.monotonic()

        wait_for(lambda: (out / "leaving").exists() and (out / "leaving").read_text().endswith("\n"),
                 "rank 1 to reach step 3", 120)
        leaving = int((out / "leaving").read_text())
        assert _raylet_of(leaving) == node1.all_processes["raylet"][0].process.pid  # rank 1 is on node 1
        cluster.remove_node(node1)
        removed = time.monotonic()
        shrunk = wait_for(lambda: any(row[1] == 1 for row in _steps(out)), "the job to go on with 1 worker", 120)
        cluster.add_node(num_cpus=1)
        added = time.monotonic()
        room = wait_for(lambda: "can place 2 workers again" in (tmp_path / "job.log").read_text(),
                        "the launcher to see room for 2 workers", 120)
        grown = wait_for(lambda: any(row[1] == 2 and row[2] > 1 for row in _steps(out)), "the job to grow back", 120)
        assert job.wait(timeout=120) == 0, (tmp_path / "job.log").read_text()[-6000:]
        finished = time.monotonic()
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait()
        log.close()
        cluster.shutdown()

    text = (tmp_path / "job.log").read_text()
    by_world: dict = {}
    for step, world, attempt, accumulate, _ in _steps(out):
        by_world.setdefault((world, attempt, accumulate), set()).add(step)
    print(f"\nsteps by (world, attempt, accumulation): {sorted((k, sorted(v)) for k, v in by_world.items())}; "
          f"shrink: {shrunk - removed:.1f} s from remove_node to the first step on 1 worker; grow: "
          f"{grown - added:.1f} s from add_node's return to the first step on 2 workers ({room - added:.1f} s "
          f"until the launcher saw room for 2); {finished - started:.1f} s in all")
    assert by_world[(2, 0, 2)] == {1, 2, 3}  # both workers, accumulation 2
    assert by_world[(1, 1, 4)] == {4, 5, 6}  # one worker from step 3's checkpoint, accumulation 4
    assert by_world[(2, 2, 2)] == set(range(7, 13))  # grown back from step 6's checkpoint
    assert "hookloop: elastic job on 2 of 1:2 workers, elastic_batch='global'" in text
    assert "hookloop: elastic job on 1 of 1:2 workers, elastic_batch='global' (the global batch is kept, the " \
           "accumulation follows the world size): global batch 8 = 2 per device x 1 data-parallel process x 4 " \
           "accumulated batches" in text
    assert "attempt 1 on 1 of 1:2 workers" in text and "attempt 2 on 2 of 1:2 workers" in text
    assert "to grow back (not a failure)" in text and "(1 of max_failures=1)" in text

    final = torch.load(out / "weights.pt")
    reference = _reference()
    difference = max(float((final[k] - reference[k]).abs().max()) for k in reference)
    print(f"final weights vs one process over the same global batches: {difference:.3g}")
    assert difference < 1e-5


@pytest.mark.full
def test_function_mode_with_a_range_runs_on_max_where_the_cluster_holds_it(tmp_path):
    """Trainer(plugins=["ddp", ray(num_workers="1:2")]).fit() in a plain process, on a local
    cluster that holds 2 workers: 2 workers, the plan stated. Full: a local Ray cluster
    and two interpreters (about 30 s)."""
    script = REPO / "tests" / "scripts" / "ray_job.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_", "RAY_"))}
    env["PYTHONPATH"] = str(REPO / "tests" / "scripts")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), "--plugins", "ddp,ray", "--ray-option",
                           "num_workers=1:2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert "hookloop-ray: attempt 0 on 2 of 1:2 workers" in text
    assert "hookloop: elastic job on 2 of 1:2 workers, elastic_batch='global'" in text
    assert "global batch 16 = 8 per device x 2 data-parallel processes x 1 accumulated batch" in text
    assert sorted(p.name for p in tmp_path.glob("place.rank*")) == ["place.rank0", "place.rank1"]
    assert (tmp_path / "weights.pt").exists()
