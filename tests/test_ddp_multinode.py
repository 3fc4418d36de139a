"""Two nodes on localhost: two elastic agents with one process each, c10d rendezvous.

For ``ddp`` and for ``ddp2`` (DataParallel inside a node, DDP across nodes: on a CPU
there is no GPU to split over inside the node, so this checks its cross-node path; the
in-node DataParallel path is checked on GPUs in tests/gpu).

Node 0 is started by ``hookloop run --nodes 2 --node-rank 0 --rdzv-endpoint ...``; node 1
by ``python script.py`` with ``Trainer(plugins=["ddp"], nodes=2, node_rank=1, ...)``,
which re-launches itself through the same agent command (the in-code path, tested once).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, free_port, max_abs_diff, run_nodes, tiny_data

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from ddp_reference import concatenated_batches_run  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "ddp_multinode.py"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ddp2"])
def test_two_nodes_on_localhost(tmp_path, strategy):
    endpoint = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_") and k not in ("LOCAL_RANK", "RANK")}
    env["HOOKLOOP_RUN_ID"] = f"ddp-test-{os.getpid()}"
    commands = [
        [sys.executable, "-m", "hookloop", "run", "--plugins", strategy, "--devices", "1", "--nodes", "2",
         "--node-rank", "0", "--rdzv-endpoint", endpoint, str(SCRIPT), str(tmp_path)],
        [sys.executable, str(SCRIPT), str(tmp_path), "--relaunch", "1", endpoint, strategy],
    ]
    run_nodes(commands, cwd=tmp_path, env=env)

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert sorted((r["global_rank"], r["world_size"]) for r in ranks) == [(0, 2), (1, 2)]
    assert sorted(r["node_rank"] for r in ranks) == [0, 1]
    assert sorted(r["relaunched"] for r in ranks) == [False, True]  # one worker per path
    reference = concatenated_batches_run(tiny_data(96), epochs=2, batch=8, seed=10)  # rank 0's seed
    for record in ranks:
        assert max_abs_diff(record["state"], reference) <= 1e-5
    assert max_abs_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0
    assert {r["strategy"] for r in ranks} == {"DDP2" if strategy == "ddp2" else "DDP"}
    assert [r["step_ends"] for r in ranks] == [12, 12]  # 96 / 2 nodes / 8 = 6 steps x 2 epochs


@pytest.mark.slow
def test_ddp2_on_one_node_trains_in_the_launching_process(tmp_path):
    """ddp2 starts one process per node: on one node that is the process running the
    script, whatever devices says (no second interpreter)."""
    script = tmp_path / "one_node.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "import hookloop\n"
        "from conftest import TinyModule, tiny_data\n"
        "from torch.utils.data import DataLoader\n"
        "t = hookloop.Trainer(plugins=['ddp2'], devices=2, max_epochs=1, enable_checkpointing=False)\n"
        "t.fit(TinyModule(), DataLoader(tiny_data(32), batch_size=8))\n"
        "print('TRAINED', os.getpid(), t.world_size, t.global_step)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    pid, world, steps = stdout.split("TRAINED ")[1].split()
    assert (int(pid), world, steps) == (proc.pid, "1", "4")
