"""HYBRID_SHARD on two nodes: run by tests/test_fsdp_multinode.py as two elastic agents
(``hookloop run --plugins fsdp --devices 2 --nodes 2 --node-rank R --rdzv-endpoint ...``)
of two processes each. Each rank writes ``OUT/rank<R>.pt``."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hookloop  # noqa: E402
from fsdp_models import Net, data  # noqa: E402

faulthandler.dump_traceback_later(240, exit=True)
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
seen: dict = {}


class Probe:
    hookloop_name, hookloop_role = "probe", "observer"

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        module = trainer.module
        seen.update(
            global_rank=trainer.global_rank, world_size=trainer.world_size, node_rank=trainer.node_rank,
            mesh=tuple(trainer.strategy.mesh.shape), mesh_dims=trainer.strategy.mesh.mesh_dim_names,
            placements={n: str(p.placements) for n, p in module.named_parameters()},
            local_shapes={n: tuple(p.to_local().shape) for n, p in module.named_parameters()},
            final={k: v.clone() for k, v in module.state_dict().items()},  # gathered: state_dict_type="full"
            steps=trainer.global_step,
        )


plugin = hookloop.plugin("fsdp", sharding_strategy="HYBRID_SHARD", auto_wrap_policy={"Block"})
trainer = hookloop.Trainer(plugins=[plugin, Probe()], max_epochs=2, enable_checkpointing=False,
                           num_sanity_val_steps=0)
trainer.fit(Net(seed=RANK), DataLoader(data(), batch_size=4))
torch.save(seen, OUT / f"rank{RANK}.pt")
