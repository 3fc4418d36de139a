"""Elastic membership (``hookloop run --nodes MIN:MAX``, issue 36 item 4).

The launching test runs two torchrun agents on localhost as two nodes of a ``1:2`` job
(one process each, gloo): node b is SIGKILLed with its agent mid-run, node a goes on
alone from the last checkpoint, node b is started again and the job grows back to two
and finishes. The rest checks the settings, the command and the batch policy in process.
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
import torch.nn.functional as F

from conftest import REPO, free_port
from hookloop.contract.errors import ConfigurationError
from hookloop.distributed.elastic import plan_batch
from hookloop.distributed.launch import elastic_command
from hookloop.engine.settings import TrainerConfig

SCRIPT = REPO / "tests" / "scripts" / "elastic_job.py"


def config(**settings) -> TrainerConfig:
    made = TrainerConfig(**settings)
    made.validate()
    return made


# -- settings and the command -----------------------------------------------------------


def test_a_node_range_becomes_torchruns_elastic_command():
    made = config(nodes="1:2", plugins=["ddp"], rdzv_endpoint="node0:29400", rdzv_conf="join_timeout=30,last_call_timeout=2")
    assert (made.min_nodes, made.nodes, made.max_restarts, made.elastic_batch) == (1, 2, 3, "global")
    cmd = elastic_command(made, "train.py", ["--x"])
    assert cmd[3:10] == ["--nproc-per-node=1", "--nnodes=1:2", "--node-rank=0", "--rdzv-backend=c10d",
                         "--rdzv-endpoint=node0:29400", "--rdzv-id=hookloop",
                         "--rdzv-conf=is_host=1,join_timeout=30,last_call_timeout=2"]
    assert cmd[10:] == ["--max-restarts=3", "train.py", "--x"]
    # the restarts given win, 0 too; a fixed job keeps torchrun's default (none)
    assert "--max-restarts=1" in elastic_command(config(nodes="1:2", rdzv_endpoint="h:1", max_restarts=1), "t.py", [])
    assert not [a for a in elastic_command(config(nodes="1:2", rdzv_endpoint="h:1", max_restarts=0), "t.py", [])
                if a.startswith("--max-restarts")]
    assert config(nodes=2).max_restarts == 0 and config(nodes=2).min_nodes is None


def test_a_range_of_one_size_is_a_fixed_job_and_a_validated_config_validates_again():
    assert (config(nodes="2:2").nodes, config(nodes="2:2").min_nodes) == (2, None)
    assert config(nodes="3").nodes == 3
    made = config(nodes="1:3", elastic_batch="per_device")
    assert made.elastic_batch == "per-device"
    made.validate()
    assert (made.min_nodes, made.nodes) == (1, 3)


@pytest.mark.parametrize("nodes, message", [
    ("2:1", "MIN (2) is more than MAX (1)"),
    ("0:2", "MIN must be at least 1"),
    ("a:b", "or 'MIN:MAX' for an elastic job"),
    ("1:2:3", "or 'MIN:MAX' for an elastic job"),
    (0, "must be an integer >= 1"),
])
def test_bad_node_ranges_are_refused_with_the_fix(nodes, message):
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(nodes=nodes)


def test_bad_policy_and_rendezvous_options_are_refused():
    with pytest.raises(ConfigurationError, match="'global' .* or 'per-device'"):
        config(nodes="1:2", elastic_batch="fixed")
    with pytest.raises(ConfigurationError, match="is not KEY=VALUE"):
        config(nodes="1:2", rdzv_conf="join_timeout")
    with pytest.raises(ConfigurationError, match="sets is_host"):
        config(nodes="1:2", rdzv_conf="is_host=1")
    with pytest.raises(ConfigurationError, match="contradict"):
        config(nodes="1:2", elastic_batch="per-device", global_batch_size=16)
    with pytest.raises(ConfigurationError, match="rendezvous endpoint"):
        elastic_command(config(nodes="1:2"), "t.py", [])


def test_the_cli_refuses_a_bad_range_before_starting_anything(tmp_path, capsys):
    from hookloop.tools.cli import main

    script = tmp_path / "t.py"
    script.write_text("")
    code = main(["run", "--plugins", "ddp", "--nodes", "2:1", "--rdzv-endpoint", "h:1", str(script)])
    assert code == 2
    assert "hookloop: error: nodes='2:1': MIN (2) is more than MAX (1)" in capsys.readouterr().err


# -- the batch policy ---------------------------------------------------------------------


def test_global_policy_keeps_the_global_batch_of_the_full_job():
    # 2 per device, 1 process per node, accumulation 2 on 2 nodes: 8 samples a step
    full = plan_batch("global", 2, 2, 2, (1, 2), 2, None)
    alone = plan_batch("global", 2, 1, 1, (1, 2), 2, None)
    assert (full.accumulate, full.global_batch) == (2, 8)
    assert (alone.accumulate, alone.global_batch) == (4, 8)
    assert plan_batch("global", 2, 3, 3, (1, 4), 1, 24).accumulate == 4
    assert alone.describe() == "8 = 2 per device x 1 data-parallel process x 4 accumulated batches"


def test_per_device_policy_keeps_each_process_batch():
    alone = plan_batch("per-device", 2, 1, 1, (1, 2), 2, None)
    assert (alone.accumulate, alone.global_batch) == (2, 4)


def test_global_policy_refuses_a_batch_some_node_count_cannot_split():
    # 1:3 nodes, 2 per device, accumulation 1 on 3 nodes: 6 samples, not a multiple of 4
    with pytest.raises(ConfigurationError, match=r"on 2 nodes \(4 samples per batch\).*multiple of 12"):
        plan_batch("global", 2, 3, 3, (1, 3), 1, None)
    with pytest.raises(ConfigurationError, match="needs the training loader's batch size"):
        plan_batch("global", None, 1, 1, (1, 2), 1, None)


def _fit_alone_in_an_elastic_job(monkeypatch, tmp_path, **settings):
    """``fit`` in this process as the one worker of an elastic job on 1 of its nodes
    (torchrun's variables for a world of one, as after losing the others)."""
    import hookloop
    from torch.utils.data import DataLoader

    from conftest import TinyModule, tiny_data

    for name, value in dict(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                            GROUP_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    trainer = hookloop.Trainer(plugins=["ddp"], max_steps=2, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False, enable_model_summary=False,
                               default_root_dir=str(tmp_path), **settings)
    trainer.fit(TinyModule(), DataLoader(tiny_data(32), batch_size=4))
    return trainer


@pytest.mark.parametrize("policy, accumulate, line", [
    ("global", 2, "elastic_batch='global' (the global batch is kept, the accumulation follows the world size): "
                  "global batch 8 = 4 per device x 1 data-parallel process x 2 accumulated batches"),
    ("per-device", 1, "elastic_batch='per-device' (each process's batch is kept, the global batch follows the "
                      "world size): global batch 4 = 4 per device x 1 data-parallel process x 1 accumulated batch"),
])
def test_fit_states_the_policy_and_sets_the_accumulation(monkeypatch, tmp_path, capsys, policy, accumulate, line):
    trainer = _fit_alone_in_an_elastic_job(monkeypatch, tmp_path, nodes="1:2", elastic_batch=policy)
    assert (trainer.accumulate_grad_batches, trainer.global_step) == (accumulate, 2)
    assert f"hookloop: elastic job on 1 of 1:2 nodes, {line}" in capsys.readouterr().out


def test_fit_refuses_a_global_batch_that_a_smaller_world_cannot_split(monkeypatch, tmp_path):
    # 4 per device on 3 nodes: 12 samples a step, which 2 nodes (8 a batch) cannot split
    with pytest.raises(ConfigurationError, match=r"global batch of 12 samples on 1 to 3 nodes.*on 2 nodes \(8 samples"):
        _fit_alone_in_an_elastic_job(monkeypatch, tmp_path, nodes="1:3")


# -- the launched job ---------------------------------------------------------------------


def _reference(steps: int = 12, batch: int = 8) -> dict:
    """The one-process loop over the script's global batches (SGD, lr 0.1, momentum 0.9)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch * steps, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    for s in range(steps):
        loss = F.cross_entropy(net(x[s * batch:(s + 1) * batch]), y[s * batch:(s + 1) * batch])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def _wait_for(predicate, what: str, timeout: float, nodes: list) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(_outputs(nodes)))
        time.sleep(0.1)


def _outputs(nodes: list) -> list[str]:
    found = []
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        found.append(node.communicate()[0])
    return found


def _steps(out: Path) -> list[tuple[int, int, int, int, str]]:
    rows = []
    for path in sorted(out.glob("steps.*")):
        rows += [tuple(int(v) if v.isdigit() else v for v in line.split()) for line in path.read_text().splitlines()]
    return rows


@pytest.mark.slow
def test_a_job_loses_a_node_goes_on_alone_and_grows_back(tmp_path):
    """Launches two torchrun agents (two nodes on localhost), kills one with its worker
    and starts it again: slow because every start imports torch (about 40 s in all)."""
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKLOOP_", "TORCHELASTIC_"))
           and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(HOOKLOOP_RUN_ID=f"elastic-{os.getpid()}", ELASTIC_HOLD_AT="6")

    def node(rank: int, name: str, **extra) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "hookloop", "run", "--plugins", "ddp", "--nodes", "1:2", "--node-rank", str(rank),
             "--rdzv-endpoint", endpoint, "--rdzv-conf",
             "join_timeout=60,last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=5",
             str(SCRIPT), str(out)],
            cwd=tmp_path, env={**env, "ELASTIC_NODE": name, **extra}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    started = time.monotonic()
    nodes = [node(0, "a"), node(1, "b", ELASTIC_LEAVE_AT="3")]
    _wait_for(lambda: (out / "leaving").exists(), "node b to reach step 3", 120, nodes)
    os.killpg(nodes[1].pid, signal.SIGKILL)  # node b, its agent and its worker
    killed = time.monotonic()
    nodes[1].wait()
    alone = lambda: any(row[1] == 1 for row in _steps(out))  # noqa: E731
    _wait_for(alone, "node a to train alone", 90, nodes)
    shrunk = time.monotonic()
    nodes.append(node(1, "b"))
    regrown = lambda: any(row[1] == 2 and row[2] > 1 for row in _steps(out))  # noqa: E731
    _wait_for(regrown, "the job to grow back to 2", 120, nodes)
    grown = time.monotonic()
    for n in (nodes[0], nodes[2]):
        try:
            n.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
    outputs = _outputs(nodes)
    assert nodes[0].returncode == 0 and nodes[2].returncode == 0, "\n".join(outputs)

    rows = _steps(out)
    by_world: dict = {}
    for step, world, attempt, accumulate, name in rows:
        by_world.setdefault((world, attempt, accumulate), set()).add(step)
    print(f"steps by (world, attempt, accumulation): {sorted((k, sorted(v)) for k, v in by_world.items())}; "
          f"shrink {shrunk - killed:.1f} s after the kill, grow {grown - shrunk:.1f} s after node b restarted, "
          f"{grown - started:.1f} s in all")
    assert by_world[(2, 0, 2)] == {1, 2, 3}  # both nodes, accumulation 2
    assert by_world[(1, 1, 4)] == {4, 5, 6}  # node a alone from step 3's checkpoint, accumulation 4
    assert by_world[(2, 2, 2)] == set(range(7, 13))  # grown back from step 6's checkpoint
    assert sorted(name for step, world, attempt, _, name in rows if attempt == 2) == ["a"] * 6 + ["b"] * 6
    log = outputs[0]
    assert "elastic_batch='global'" in log
    assert "resuming a checkpoint of 2 processes on 1: effective batch size 8 (2 per device x 2 processes x 2 " \
           "accumulated batches) -> 8 (2 per device x 1 process x 4 accumulated batches) (elastic_batch='global')" in log
    assert "resuming a checkpoint of 1 processes on 2" in log

    final = torch.load(out / "weights.pt")
    reference = _reference()
    difference = max(float((final[k] - reference[k]).abs().max()) for k in reference)
    print(f"final weights vs one process over the same global batches: {difference:.3g}")
    assert difference < 1e-5
    time.sleep(0.5)
    leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftover, leftover
