"""Runs for tests/test_mesh.py, started as ``hookloop run ... mesh_run.py KIND OUT``.

``fsdp``: hookloop-fsdp on the core's mesh (``--mesh dp_shard=2``): full-batch SGD steps
on a tiny MLP; every rank writes the trained weights and what the mesh was.
``probe``: two mesh plugins defined here (``ShardProbe``, a ddp subclass claiming
``dp_shard``; ``TpProbe``, an extension claiming ``tp``) on ``--mesh dp_shard=2,tp=2``;
each records the sub-mesh it received: names, shape and the ranks of its group.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hookloop  # noqa: E402
from hookloop_ddp import DDP  # noqa: E402
from mesh_models import MLP, STEPS, data  # noqa: E402

KIND, OUT = sys.argv[1], Path(sys.argv[2])
RANK = int(os.environ.get("RANK", "0"))
record: dict = {}


def described(mesh) -> dict:
    return {"names": tuple(mesh.mesh_dim_names), "shape": tuple(mesh.shape),
            "ranks": sorted(dist.get_process_group_ranks(mesh.get_group())) if mesh.ndim == 1 else None}


class MeshSeen:
    """Records the mesh ``on_device_mesh`` hands every plugin."""

    hookloop_name, hookloop_role, hookloop_requires = "mesh_seen", "observer", ">=2,<3"

    @hookloop.hookimpl
    def on_device_mesh(self, trainer, mesh):
        record["mesh"] = {"names": tuple(mesh.mesh_dim_names), "shape": tuple(mesh.shape),
                          "is_trainers": mesh is trainer.device_mesh}

    @hookloop.hookimpl
    def on_train_start(self, trainer):
        fsdp = next((p for p in trainer.plugins if getattr(p, "hookloop_name", "") == "fsdp"), None)
        if fsdp is not None:  # the mesh fully_shard ran on
            record["fsdp_mesh"] = {"names": tuple(fsdp.mesh.mesh_dim_names), "shape": tuple(fsdp.mesh.shape),
                                   "from_core": fsdp.mesh == trainer.device_mesh["dp_shard"]}


class ShardProbe(DDP):
    """A test-only data-parallel plugin on ``dp_shard``: ddp's launcher and process group,
    DistributedDataParallel over its sub-mesh's group."""

    hookloop_name = "shard_probe"
    hookloop_mesh_dims = ("dp_shard",)

    @hookloop.hookimpl
    def on_device_mesh(self, trainer, mesh):
        record["shard_probe"] = described(hookloop.submesh(trainer, self))

    @hookloop.hookimpl
    def wrap_model(self, trainer, model):
        wrapped = super().wrap_model(trainer, model)
        record["ddp_group"] = sorted(dist.get_process_group_ranks(wrapped.process_group))
        return wrapped


class TpProbe:
    """A test-only extension on ``tp``: it takes its sub-mesh and leaves the model alone."""

    hookloop_name, hookloop_role, hookloop_requires = "tp_probe", "extension", ">=2,<3"
    hookloop_mesh_dims = ("tp",)

    @hookloop.hookimpl
    def on_device_mesh(self, trainer, mesh):
        record["tp_probe"] = described(hookloop.submesh(trainer, self))


if KIND == "fsdp":
    trainer = hookloop.Trainer(plugins=[MeshSeen()], max_steps=STEPS, enable_checkpointing=False,
                               logger=False, enable_progress_bar=False, enable_model_summary=False,
                               num_sanity_val_steps=0)
    module = MLP()
    trainer.fit(module, DataLoader(data(), batch_size=8))
    record["weights"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
else:
    trainer = hookloop.Trainer(plugins=[TpProbe(), ShardProbe(), MeshSeen()], max_steps=1,
                               enable_checkpointing=False, logger=False, enable_progress_bar=False,
                               enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(MLP(), DataLoader(data(), batch_size=4))
record["rank"] = dist.get_rank() if dist.is_initialized() else RANK
torch.save(record, OUT / f"rank{RANK}.pt")
