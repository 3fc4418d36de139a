"""hookloop-ft (plugins/ft): replica groups coordinated by torchft's Manager and Lighthouse.

Real processes on the CPU: a ``torchft_lighthouse`` and two replica groups, each a
``hookloop run --plugins ft`` of tests/scripts/ft_group.py (two processes per group in the
uninterrupted run, one in the killed one), all-reducing through torchft's gloo process group. Each group trains on a fixed batch of its own every
step (tests/scripts/ft_models.py), so the references are plain PyTorch loops here:

* uninterrupted, two groups of two processes: both groups end equal, and equal to one
  process stepping on the mean loss of the two batches;
* group 1 SIGKILLed in the backward of step 2: group 0 (never restarted) skips that step
  and trains alone; restarted once group 0 has reached step 4, group 1 (other initial
  weights) joins at step R (4, or a step later: the Lighthouse issues a quorum at once when
  everyone of the last one has asked, without waiting for a newcomer) and copies the weights
  and optimizer state from group 0; both go on. Both end equal, and equal to the reference
  that steps on both batches for steps 0-1, on group 0's alone for 2..R-1, on both from R;
  the difference from the uninterrupted run is printed, with the recovery time.

Every process a test starts runs in its own session and is killed with it at the end,
also when the test fails, and no process of those sessions is left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import hookloop
from conftest import REPO, free_port

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from ft_models import group_batch, make_net, make_optimizer  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "ft_group.py"
STEPS, KILL_AT, REJOIN_AT = 8, 2, 4


def reference(phases: list[tuple[int, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """One process, plain PyTorch: ``(steps, groups)`` phases, each step on the mean loss
    of those groups' batches (what torchft's all-reduce averages), from group 0's weights."""
    net = make_net(seed=0)
    optimizer = make_optimizer(net)
    for steps, groups in phases:
        for _ in range(steps):
            loss = sum(F.cross_entropy(net(x), y) for x, y in map(group_batch, groups)) / len(groups)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _sessions_alive(sessions: list[int]) -> list[str]:
    """The processes still in ``sessions`` (process group ids), from /proc."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in sessions:
            alive.append(stat.parent.name)
    return alive


@contextmanager
def processes(out: Path):
    """``start(name, argv)`` starts a process in a new session, output in ``out/name.log``;
    on exit every session is killed, and none may have a process left."""
    started: list[subprocess.Popen] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}

    def start(name: str, argv: list, **extra: str) -> subprocess.Popen:
        with open(out / f"{name}.log", "w") as log:
            proc = subprocess.Popen([str(a) for a in argv], cwd=out, env={**env, **extra}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        deadline = time.monotonic() + 10
        while (left := _sessions_alive([p.pid for p in started])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"processes outlived the test: {left}"


def start_lighthouse(start) -> str:
    """A Lighthouse that forms a quorum of whoever is alive (``min_replicas 1``), waits up to
    10 s for a heartbeating group to join, and counts a group dead after torchft's default 5 s
    without a heartbeat. (With 1 s, a group starved of CPU on a loaded machine was counted
    dead while alive: each group formed a quorum alone at the same step, and both committed
    it, so their weights parted for good. docs/how-to/torchft.md says so.)"""
    port = free_port()
    start("lighthouse", [Path(sys.executable).parent / "torchft_lighthouse", "--min_replicas", "1",
                         "--quorum_tick_ms", "50", "--join_timeout_ms", "10000", "--bind", f"[::]:{port}"])
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            return f"http://localhost:{port}"
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError("the Lighthouse did not start listening in 60 s") from None
            time.sleep(0.2)


def start_group(start, out: Path, lighthouse: str, group: int, *args, devices: int = 1,
                plugins: str = "ft") -> subprocess.Popen:
    name = f"group{group}" + ("" if "--attempt" not in args else ".restart")
    return start(name, [sys.executable, "-m", "hookloop", "run", "--plugins", plugins, "--devices", devices,
                        "--plugin-option", "ft.timeout=20", SCRIPT, out, group, STEPS, *args],
                 TORCHFT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(group))


def finish(proc: subprocess.Popen, out: Path, name: str, timeout: float = 400) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name} hung:\n{(out / f'{name}.log').read_text()[-4000:]}") from None


def wait_for_step(steps: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Wait until the group writing ``steps`` has finished the batch that makes ``global_step == step``."""
    deadline = time.monotonic() + timeout
    while not (steps.exists() and str(step) in steps.read_text().split()):
        assert proc.poll() is None, f"the live group stopped (status {proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"the live group did not reach step {step} in {timeout} s"
        time.sleep(0.1)


def results(out: Path, group: int) -> tuple[dict, dict]:
    return torch.load(out / f"weights.{group}.pt"), json.loads((out / f"report.{group}.json").read_text())


@pytest.mark.slow
def test_two_groups_of_two_processes_average_their_gradients_like_one_process(tmp_path):
    """Slow: a Lighthouse and two 2-process hookloop runs (seven interpreters). Both groups
    end with the weights of one process stepping on the mean loss of both batches."""
    with processes(tmp_path) as start:
        lighthouse = start_lighthouse(start)
        groups = [start_group(start, tmp_path, lighthouse, g, devices=2) for g in (0, 1)]
        for g, proc in enumerate(groups):
            assert finish(proc, tmp_path, f"group{g}") == 0, (tmp_path / f"group{g}.log").read_text()[-4000:]
    (w0, r0), (w1, r1) = results(tmp_path, 0), results(tmp_path, 1)
    assert max_difference(w0, w1) == 0.0
    assert r0["committed"] == r1["committed"] == STEPS and r0["skipped"] == r1["skipped"] == 0
    assert max_difference(w0, reference([(STEPS, (0, 1))])) < 1e-6
    # init_sync: at step 0 one group copies the other's weights (identical here)
    assert [len(r0["recoveries"]), len(r1["recoveries"])] in ([1, 0], [0, 1])


@pytest.mark.slow
def test_a_killed_group_rejoins_from_a_live_peer_while_the_other_trains_on(tmp_path):
    """Slow: a Lighthouse, two hookloop runs and a restart of one (four interpreters)."""
    with processes(tmp_path) as start:
        lighthouse = start_lighthouse(start)
        survivor = start_group(start, tmp_path, lighthouse, 0, "--wait-at", REJOIN_AT)
        victim = start_group(start, tmp_path, lighthouse, 1, "--kill-at", KILL_AT)
        assert finish(victim, tmp_path, "group1") != 0  # SIGKILLed in its backward
        # restart it once group 0 has trained on alone up to REJOIN_AT (where it waits for it)
        wait_for_step(tmp_path / "steps.0", REJOIN_AT, survivor)
        restarted = start_group(start, tmp_path, lighthouse, 1, "--attempt", 1)
        assert finish(restarted, tmp_path, "group1.restart") == 0, (tmp_path / "group1.restart.log").read_text()[-4000:]
        assert finish(survivor, tmp_path, "group0") == 0, (tmp_path / "group0.log").read_text()[-4000:]
    (w0, r0), (w1, r1) = results(tmp_path, 0), results(tmp_path, 1)
    # group 0 ran once, from the start: its step KILL_AT failed with the peer and was skipped
    assert (tmp_path / "ready.0.0").exists() and not (tmp_path / "ready.0.1").exists()
    assert r0["committed"] == STEPS and r0["skipped"] >= 1, r0
    # the restarted group recovered once (at step R >= REJOIN_AT) and trained the rest with group 0
    [(rejoined, seconds)] = r1["recoveries"]
    assert REJOIN_AT <= rejoined < STEPS, r1
    assert r1["committed"] == STEPS - rejoined and r1["global_step"] == STEPS, r1
    assert max_difference(w0, w1) == 0.0
    expected = reference([(KILL_AT, (0, 1)), (rejoined - KILL_AT, (0,)), (STEPS - rejoined, (0, 1))])
    assert max_difference(w0, expected) < 1e-6
    uninterrupted = max_difference(w0, reference([(STEPS, (0, 1))]))
    print(f"\nft: group 0 committed {r0['committed']} steps ({r0['skipped']} skipped), "
          f"{rejoined - KILL_AT} of them alone; group 1 committed {KILL_AT}, was killed, and restarted "
          f"committed {r1['committed']}, recovered at step {rejoined} in {seconds} s; "
          f"max |weights - uninterrupted run| = {uninterrupted:.3g}")
    assert uninterrupted > 1e-4  # steps alone saw half the batch: not the uninterrupted run


# ---------------------------------------------------------------------------------------
# Sharded replica groups (HSDP): --plugins ft,fsdp, two groups of two FSDP2 shards
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_hsdp_two_sharded_groups_average_their_gradients_like_one_process(tmp_path):
    """Slow: a Lighthouse and two 2-process ``--plugins ft,fsdp`` runs (seven interpreters,
    about 15 s on two shared cores: under the full tier's 40 s). fsdp shards each group's model over its
    two processes; the shards' gradients are averaged over the groups by torchft. Both
    groups end with the weights of one process stepping on the mean loss of both batches."""
    started = time.monotonic()
    with processes(tmp_path) as start:
        lighthouse = start_lighthouse(start)
        groups = [start_group(start, tmp_path, lighthouse, g, devices=2, plugins="ft,fsdp") for g in (0, 1)]
        for g, proc in enumerate(groups):
            assert finish(proc, tmp_path, f"group{g}") == 0, (tmp_path / f"group{g}.log").read_text()[-4000:]
    (w0, r0), (w1, r1) = results(tmp_path, 0), results(tmp_path, 1)
    assert max_difference(w0, w1) == 0.0
    assert r0["committed"] == r1["committed"] == STEPS and r0["skipped"] == r1["skipped"] == 0
    difference = max_difference(w0, reference([(STEPS, (0, 1))]))
    assert difference < 1e-6
    assert [len(r0["recoveries"]), len(r1["recoveries"])] in ([1, 0], [0, 1])
    print(f"\nft,fsdp uninterrupted: 2 groups x 2 shards, {STEPS} steps each, max |weights - one process| = "
          f"{difference:.3g}, {time.monotonic() - started:.0f} s")


@pytest.mark.slow
def test_hsdp_a_killed_sharded_group_rejoins_from_the_live_group_while_it_trains_on(tmp_path):
    """Slow: a Lighthouse, two 2-process ``--plugins ft,fsdp`` runs and a restart of one
    (ten interpreters, about 30 s on two shared cores: under the full tier's 40 s). Group 1 (its launcher and both
    shards) is SIGKILLed in the backward of step 2; group 0 is never restarted; group 1,
    restarted from other weights, copies each shard's weights and momentum from the
    process of equal rank in group 0 (same shard layout)."""
    with processes(tmp_path) as start:
        lighthouse = start_lighthouse(start)
        survivor = start_group(start, tmp_path, lighthouse, 0, "--wait-at", REJOIN_AT, devices=2, plugins="ft,fsdp")
        victim = start_group(start, tmp_path, lighthouse, 1, "--kill-at", KILL_AT, devices=2, plugins="ft,fsdp")
        assert finish(victim, tmp_path, "group1") != 0  # the group SIGKILLed in its backward
        wait_for_step(tmp_path / "steps.0", REJOIN_AT, survivor)
        restarted = start_group(start, tmp_path, lighthouse, 1, "--attempt", 1, devices=2, plugins="ft,fsdp")
        assert finish(restarted, tmp_path, "group1.restart") == 0, (tmp_path / "group1.restart.log").read_text()[-4000:]
        assert finish(survivor, tmp_path, "group0") == 0, (tmp_path / "group0.log").read_text()[-4000:]
    (w0, r0), (w1, r1) = results(tmp_path, 0), results(tmp_path, 1)
    assert (tmp_path / "ready.0.0").exists() and not (tmp_path / "ready.0.1").exists()
    assert r0["committed"] == STEPS and r0["skipped"] >= 1, r0
    [(rejoined, seconds)] = r1["recoveries"]
    assert REJOIN_AT <= rejoined < STEPS, r1
    assert r1["committed"] == STEPS - rejoined and r1["global_step"] == STEPS, r1
    assert max_difference(w0, w1) == 0.0
    expected = reference([(KILL_AT, (0, 1)), (rejoined - KILL_AT, (0,)), (STEPS - rejoined, (0, 1))])
    assert max_difference(w0, expected) < 1e-6
    uninterrupted = max_difference(w0, reference([(STEPS, (0, 1))]))
    print(f"\nft,fsdp: group 0 committed {r0['committed']} steps ({r0['skipped']} skipped), "
          f"{rejoined - KILL_AT} of them alone; group 1 committed {KILL_AT}, was killed, and restarted "
          f"committed {r1['committed']}, recovered at step {rejoined} in {seconds} s; "
          f"max |weights - uninterrupted run| = {uninterrupted:.3g}")
    assert uninterrupted > 1e-4


# ---------------------------------------------------------------------------------------
# Errors at start (in process: no Lighthouse, no launch)
# ---------------------------------------------------------------------------------------


def _fit_ft(**options):
    from hookloop.testing import TinyClassifier, tiny_dataset
    from torch.utils.data import DataLoader

    trainer = hookloop.Trainer(plugins=[hookloop.plugin("ft", **options)], max_steps=1, logger=False,
                               enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(TinyClassifier(), DataLoader(tiny_dataset(16), batch_size=8))


def test_a_run_without_a_lighthouse_is_refused_saying_how_to_start_one(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(hookloop.ConfigurationError) as info:
        _fit_ft()
    message = str(info.value)
    assert "ft.lighthouse" in message and "TORCHFT_LIGHTHOUSE" in message and "torchft_lighthouse" in message


def test_a_run_without_torchft_is_refused_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # what an uninstalled package does
    with pytest.raises(hookloop.MissingDependencyError, match="pip install hookloop-ft torchft==0.2.0"):
        _fit_ft(lighthouse="http://localhost:1")


def test_a_group_of_several_processes_without_a_launcher_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(hookloop.ConfigurationError, match="MASTER_ADDR / MASTER_PORT are not set"):
        _fit_ft(lighthouse="http://localhost:1")


@pytest.mark.parametrize("option", [{"min_replica_size": 0}, {"timeout": -1}, {"async_quorum": "yes"},
                                    {"lighthouse": ""}])
def test_bad_options_are_refused_when_the_plugin_is_made(option):
    with pytest.raises(hookloop.ConfigurationError, match=f"ft option {next(iter(option))}="):
        hookloop.plugin("ft", **option)
