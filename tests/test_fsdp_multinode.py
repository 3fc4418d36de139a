"""HYBRID_SHARD on two nodes on localhost: two elastic agents with two processes each
(c10d rendezvous, as on two machines). The default mesh replicates across the nodes and
shards within each: a (2 nodes, 2 processes) mesh of (Replicate(), Shard(0)) parameters.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DistributedSampler, default_collate

from conftest import REPO, free_port, run_nodes

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from fsdp_models import Net, data  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "fsdp_multinode.py"


def reference(epochs: int = 2, batch: int = 16, ranks: int = 4) -> dict:
    """One process, by hand: the four ranks' batches of 4 together are the blocks of 16;
    each rank's share is a ``DistributedSampler(shuffle=True, seed=0)`` set to the epoch
    (a training loader is shuffled under several processes, as in Lightning)."""
    module = Net(seed=0)  # rank 0's weights: every rank starts from them
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    dataset = data()
    samplers = [DistributedSampler(dataset, num_replicas=ranks, rank=r, shuffle=True, seed=0) for r in range(ranks)]
    per_rank = batch // ranks
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        orders = [list(sampler) for sampler in samplers]
        for i in range(len(orders[0]) // per_rank):
            block = [j for order in orders for j in order[i * per_rank:(i + 1) * per_rank]]
            x, y = default_collate([dataset[j] for j in block])
            F.cross_entropy(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.full  # two simulated nodes of 2 processes (~30 s)
def test_hybrid_shard_on_two_nodes(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HOOKLOOP_") and k not in ("LOCAL_RANK", "RANK", "PL_GLOBAL_SEED")}
    env["HOOKLOOP_RUN_ID"] = f"fsdp-hybrid-{os.getpid()}"
    run_nodes([[sys.executable, "-m", "hookloop", "run", "--plugins", "fsdp", "--devices", "2", "--nodes", "2",
                "--node-rank", str(node), "--rdzv-endpoint", endpoint, str(SCRIPT), str(tmp_path)] for node in (0, 1)],
              cwd=tmp_path, env=env)

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert [(r["global_rank"], r["world_size"], r["node_rank"]) for r in ranks] == [(0, 4, 0), (1, 4, 0), (2, 4, 1), (3, 4, 1)]
    expected = reference()
    for r, record in enumerate(ranks):
        assert record["mesh"] == (2, 2) and record["mesh_dims"] == ("dp_replicate", "dp_shard")  # the core's mesh (hookloop.mesh)
        assert set(record["placements"].values()) == {"(Replicate(), Shard(dim=0))"}
        # sharded within the node (2 ways), replicated across the nodes
        assert record["local_shapes"]["head.weight"] == ((2, 32), (1, 32))[r % 2]
        assert record["local_shapes"]["blocks.1.fc.weight"] == (16, 32)
        assert record["steps"] == 8
        assert max(float((record["final"][k] - v).abs().max()) for k, v in expected.items()) <= 1e-5
