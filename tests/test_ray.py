"""hookloop-ray (plugins/ray): the workers of a run as Ray actors, on a real Ray cluster.

One cluster per module: ``ray.cluster_utils.Cluster`` with two simulated nodes of one CPU
each (custom resources ``node0``/``node1``), shut down at the end. The job is
tests/scripts/ray_job.py (2 workers, 8 steps, ``last.ckpt`` every 2); its reference is
the same job under torchrun (``hookloop run --plugins ddp --devices 2``), run once.

* function mode (``Trainer(plugins=["ddp", "ray"]).fit()`` in a plain process) and script
  mode (``hookloop run --plugins ddp,ray``), one worker per node: weights equal to the
  reference's bit for bit, and each worker had the place its node gives it;
* an actor SIGKILLed mid-step (script mode) and one SIGKILLed inside the save of
  ``last.ckpt`` (function mode), ``max_failures=1``: the job restarts from the last
  checkpoint and ends bit-identical to the reference; the steps lost and the recovery time
  are printed;
* a SIGKILLed ``hookloop run --plugins ddp,ray`` with a local cluster leaves no process;
* ``fsdp`` under ``ray`` equals ``fsdp`` under torchrun;
* errors in the user's words: resources the cluster lacks, an address nothing answers
  at, Ray not installed, a failed worker's exception and traceback.

Every test starts interpreters and a Ray cluster (seconds each): marked slow. The default
tier keeps the two parity runs (about 30 s with the cluster and the reference); the
faults, the SIGKILL, fsdp and the errors are full (tests/tiers.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import hookloop
from conftest import REPO

ray = pytest.importorskip("ray")
pytest.importorskip("hookloop_ray")

SCRIPT = REPO / "tests" / "scripts" / "ray_job.py"
sys.path.insert(0, str(REPO / "tests" / "scripts"))  # ray_models: the in-process fits' module
pytestmark = pytest.mark.slow


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_", "RAY_"))}
    return {**env, "PYTHONPATH": str(REPO / "tests" / "scripts"), **extra}


def run(argv: list, out: Path, name: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.run([str(a) for a in argv], cwd=out, env=clean_env(**env), stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{name} exited {proc.returncode}:\n{(out / f'{name}.log').read_text()[-5000:]}")
    return proc


def hookloop_run(*args) -> list:
    return [sys.executable, "-m", "hookloop", "run", *args]


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def steps(out: Path) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """``(rank, attempt) -> [(step, time)]`` from the job's step files."""
    found = {}
    for path in out.glob("steps.rank*.attempt*"):
        rank, attempt = (int(part[len(word):]) for part, word in zip(path.name.split(".")[1:], ("rank", "attempt"), strict=True))
        found[rank, attempt] = [(int(s), float(t)) for s, t in (line.split() for line in path.read_text().split("\n") if line)]
    return found


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of two simulated nodes, one CPU each, for the whole module."""
    from ray.cluster_utils import Cluster

    started = time.monotonic()
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node0": 1}})
    try:
        made.add_node(num_cpus=1, resources={"node1": 1})
        made.wait_for_nodes()
        print(f"\nray cluster of 2 nodes started in {time.monotonic() - started:.1f} s")
        yield made
    finally:
        if ray.is_initialized():
            ray.shutdown()
        made.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The job under torchrun: 2 processes of the ddp plugin."""
    out = tmp_path_factory.mktemp("ray-reference")
    run(hookloop_run("--plugins", "ddp", "--devices", "2", SCRIPT, out), out, "torchrun")
    return torch.load(out / "weights.pt")


def places(out: Path) -> list[dict]:
    return [dict(line.split("=", 1) for line in p.read_text().split()) for p in sorted(out.glob("place.rank*"))]


def test_function_mode_on_two_nodes_equals_ddp_under_torchrun(cluster, reference, tmp_path):
    """Trainer(plugins=["ddp", "ray"], nodes=2).fit() from a plain process, as Ray Train runs."""
    run([sys.executable, SCRIPT, tmp_path, "--plugins", "ddp,ray", "--ray-option", f"address={cluster.address}",
         "--nodes", "2"], tmp_path, "function")
    assert max_difference(torch.load(tmp_path / "weights.pt"), reference) == 0.0
    assert [(p["RANK"], p["GROUP_RANK"], p["LOCAL_RANK"], p["LOCAL_WORLD_SIZE"], p["WORLD_SIZE"]) for p in places(tmp_path)] \
        == [("0", "0", "0", "1", "2"), ("1", "1", "0", "1", "2")]
    assert {p["HOOKLOOP_ATTEMPT"] for p in places(tmp_path)} == {"0"}
    assert len({p["HOOKLOOP_RUN_TOKEN"] for p in places(tmp_path)}) == 1
    assert (tmp_path / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt").exists()
    assert not (tmp_path / "root" / "logs" / "version_1").exists()  # one run directory, adopted by the caller


def test_script_mode_on_two_nodes_equals_ddp_under_torchrun(cluster, reference, tmp_path):
    """hookloop run --plugins ddp,ray --nodes 2 script.py, as torchrun runs."""
    run(hookloop_run("--plugins", "ddp,ray", "--nodes", "2", "--plugin-option", f"ray.address={cluster.address}",
                     SCRIPT, tmp_path), tmp_path, "script")
    assert max_difference(torch.load(tmp_path / "weights.pt"), reference) == 0.0
    assert sorted(p["GROUP_RANK"] for p in places(tmp_path)) == ["0", "1"]
    assert {p["HOOKLOOP_TRAINER_DEFAULTS_SET"] for p in places(tmp_path)} == {"1"}  # hookloop run's options arrived


def recovery(out: Path) -> tuple[int, int, float]:
    """(last step attempt 0 reached, first step attempt 1 took, seconds between them)."""
    found = steps(out)
    first = [s for (rank, a), s in found.items() if a == 0]
    again = [s for (rank, a), s in found.items() if a == 1]
    reached = max(step for s in first for step, _ in s)
    resumed = min(step for s in again for step, _ in s)
    seconds = min(t for s in again for _, t in s) - max(t for s in first for _, t in s)
    return reached, resumed, seconds


@pytest.mark.full
def test_an_actor_killed_mid_step_restarts_from_the_last_checkpoint(cluster, reference, tmp_path):
    """Rank 1's actor SIGKILLed after its backward of step 3 (script mode, max_failures=1)."""
    run(hookloop_run("--plugins", "ddp,ray", "--nodes", "2", "--plugin-option", f"ray.address={cluster.address}",
                     "--plugin-option", "ray.max_failures=1", SCRIPT, tmp_path, "--fault", "step", "--at", "3"),
        tmp_path, "killed-mid-step")
    reached, resumed, seconds = recovery(tmp_path)
    print(f"\nkilled mid-step 3: attempt 0 reached step {reached}, attempt 1 resumed at step {resumed} "
          f"({reached - resumed + 1} step(s) trained again), {seconds:.1f} s from the last step to the next")
    assert resumed == 3  # killed in step 4 (rank 0 may have finished it); last.ckpt was at global_step 2
    assert max_difference(torch.load(tmp_path / "weights.pt"), reference) == 0.0


@pytest.mark.full
def test_an_actor_killed_mid_save_restarts_from_the_last_checkpoint(cluster, reference, tmp_path):
    """Rank 0's actor SIGKILLed inside the save of last.ckpt at step 4 (function mode, max_failures=1)."""
    run([sys.executable, SCRIPT, tmp_path, "--plugins", "ddp,ray", "--ray-option", f"address={cluster.address}",
         "--ray-option", "max_failures=1", "--nodes", "2", "--fault", "save", "--at", "4"], tmp_path, "killed-mid-save")
    reached, resumed, seconds = recovery(tmp_path)
    print(f"\nkilled saving step 4: attempt 0 reached step {reached}, attempt 1 resumed at step {resumed} "
          f"({reached - resumed + 1} step(s) trained again), {seconds:.1f} s from the last step to the next")
    assert max_difference(torch.load(tmp_path / "weights.pt"), reference) == 0.0


def marked(mark: str) -> list[str]:
    """The live processes whose environment carries the test's mark."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"RAY36_MARK={mark}".encode() in environ.read_bytes().split(b"\0"):
                stat = (environ.parent / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(f"{environ.parent.name} {stat.split(' ', 2)[1]}")
        except OSError:
            continue
    return found


@pytest.mark.full
def test_a_sigkilled_hookloop_run_leaves_no_process(tmp_path):
    """A local cluster (address None): hookloop run SIGKILLed mid-training; within seconds no
    process of its launch is left (Ray's daemons included)."""
    mark = uuid.uuid4().hex
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([str(a) for a in hookloop_run("--plugins", "ddp,ray", "--devices", "2", SCRIPT, tmp_path,
                                                          "--slow", "2")],
                            cwd=tmp_path, env=clean_env(RAY36_MARK=mark), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("steps.rank1.attempt0")):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-4000:]
            time.sleep(0.2)
        running = marked(mark)
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while (left := marked(mark)) and time.monotonic() < killed + 30:
            time.sleep(0.2)
        print(f"\n{len(running)} processes while training; none left {time.monotonic() - killed:.1f} s after the SIGKILL")
        assert not left, f"left after the SIGKILL: {left}"
    finally:
        for entry in marked(mark):
            os.kill(int(entry.split()[0]), signal.SIGKILL)


@pytest.mark.full
def test_fsdp_under_ray_equals_fsdp_under_torchrun(cluster, tmp_path):
    """The launcher composes with another strategy: fsdp's own run is the reference."""
    run(hookloop_run("--plugins", "fsdp", "--devices", "2", SCRIPT, tmp_path / "torchrun"), tmp_path, "fsdp")
    run(hookloop_run("--plugins", "fsdp,ray", "--nodes", "2", "--plugin-option", f"ray.address={cluster.address}",
                     SCRIPT, tmp_path / "ray"), tmp_path, "fsdp-ray")
    assert max_difference(torch.load(tmp_path / "ray" / "weights.pt"), torch.load(tmp_path / "torchrun" / "weights.pt")) == 0.0


# -- errors in the user's words ------------------------------------------------------------


@pytest.mark.full
def test_errors_name_what_the_cluster_lacks_and_an_unreachable_address(cluster, tmp_path):
    from ray_models import Failing

    def fit(**options):
        trainer = hookloop.Trainer(plugins=["ddp", hookloop.plugin("ray", **options)], devices=2, max_steps=1,
                                   default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False)
        trainer.fit(Failing(seed=0, fail=False))

    with pytest.raises(hookloop.ConfigurationError, match=r"no node has GPU=1 for one worker; the cluster has: .*'CPU': 1\.0"):
        fit(address=cluster.address, resources_per_worker={"CPU": 1, "GPU": 1})
    with pytest.raises(hookloop.ConfigurationError, match=r"STRICT_SPREAD.*2 node\(s\) can hold a worker"):
        fit(address=cluster.address, num_workers=3, placement_strategy="STRICT_SPREAD")
    started = time.monotonic()
    with pytest.raises(hookloop.ConfigurationError, match=r"cannot reach a Ray cluster at address='127\.0\.0\.1:9'"):
        fit(address="127.0.0.1:9")
    assert time.monotonic() - started < 30


@pytest.mark.full
def test_a_failed_worker_s_exception_comes_back_with_its_traceback(cluster, tmp_path):
    from ray_models import Failing, WorkerError

    trainer = hookloop.Trainer(plugins=["ddp", hookloop.plugin("ray", address=cluster.address)], nodes=2,
                               max_steps=2, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False)
    with pytest.raises(WorkerError, match="failing on purpose at step 1") as caught:
        trainer.fit(Failing(seed=0, fail=True))
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "raised in the ray worker of rank" in notes and "training_step" in notes


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    from hookloop_ray.cluster import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where Ray is not installed
    with pytest.raises(hookloop.ConfigurationError, match=r"needs Ray, which is not installed here .*pip install 'ray==2\.60\.0'"):
        import_ray()


# -- the launcher conformance kit ------------------------------------------------------------

from hookloop.testing import LauncherConformance  # noqa: E402


@pytest.mark.full
class TestRayLauncherConformance(LauncherConformance):
    """The kit's checks on ray, both modes, each job on a local Ray cluster of its own
    (address None): placement, identity, results, restarts, no orphans."""

    launcher = "ray"

