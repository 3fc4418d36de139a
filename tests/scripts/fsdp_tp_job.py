"""fsdp x tp (and HSDP x tp, and the layouts a checkpoint resumes on) in one launch.

Run by tests/test_fsdp_tp.py as ``hookloop run --plugins ... --devices 4 --mesh ...
fsdp_tp_job.py OUT MODE`` (or plain ``python``: mode ``hsdp``). Every rank writes ``OUT/<MODE>.rank<R>.pt`` with what it
saw; the test compares it with the same model and batches trained by a hand-written
one-process loop (fsdp_tp_reference in the test). Modes:

* ``2x2`` (``--plugins fsdp,tp --mesh dp_shard=2,tp=2``): SGD with fsdp's default
  ``state_dict_type="full"`` (the module whole again after fit), then Adam with
  ``"sharded"``, saving a DCP checkpoint at step 2 (``OUT/2x2.ckpt``) and going on;
  Adam with two micro-batches a step and gradients clipped by norm (``clipped``);
* ``4x1`` (``--plugins fsdp --mesh dp_shard=4``): resumes ``OUT/2x2.ckpt``, saves
  ``OUT/4x1.ckpt`` at step 4 and goes on;
* ``hsdp``: run as ``python fsdp_tp_job.py OUT hsdp`` (the Trainer path: the first
  ``Trainer(plugins=[fsdp HYBRID_SHARD, "tp"], devices=N, mesh=...)`` re-launches the
  script on N processes), the mesh from the environment variable ``HSDP_MESH``: SGD and Adam.
"""

from __future__ import annotations

import faulthandler
import math
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hookloop  # noqa: E402
from tp_models import GlobalHeadsNet, Net, data  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)  # a hang fails with the stacks
OUT, MODE = Path(sys.argv[1]), sys.argv[2]
STEPS = 6
SAMPLES = 8  # full-batch steps: every layout's global batch is the whole data set, whatever its order
GLOBAL_BATCH = 8


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().cpu()


class Probe:
    """At the end of training (process group alive): the full weights, the full
    optimizer state by parameter name, the parameters' layouts, the batches seen."""

    hookloop_name, hookloop_role = "probe", "observer"

    def __init__(self, save_at: int | None = None, path: Path | None = None):
        self.save_at, self.path = save_at, path
        self.seen: dict = {"batches": []}

    @hookloop.hookimpl
    def on_train_batch_start(self, trainer, batch, batch_idx):
        self.seen["batches"].append(batch[0].clone())

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer, outputs, loss, batch, batch_idx):
        if self.save_at is not None and trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.path)

    @hookloop.hookimpl
    def on_train_end(self, trainer):
        module, optimizer = trainer.module, trainer.optimizers[0]
        self.seen["weights"] = {n: full(p) for n, p in module.named_parameters()}
        self.seen["optimizer"] = {n: {k: full(v) for k, v in optimizer.state[p].items() if k != "step"}
                                  for n, p in module.named_parameters() if p in optimizer.state}
        self.seen["layouts"] = {n: (tuple(map(str, p.placements)), tuple(p.device_mesh.mesh_dim_names))
                                if hasattr(p, "placements") else "plain" for n, p in module.named_parameters()}
        self.seen["global_step"] = trainer.global_step
        mesh = trainer.device_mesh
        self.seen["mesh"] = (tuple(mesh.mesh_dim_names), tuple(mesh.shape))


def fit(module, plugins, probe, per_rank_batch, ckpt_path=None, **kwargs):
    trainer = hookloop.Trainer(max_steps=STEPS, plugins=[probe, *plugins], enable_checkpointing=False, logger=False,
                               enable_progress_bar=False, num_sanity_val_steps=0, **kwargs)
    trainer.fit(module, DataLoader(data(SAMPLES), batch_size=per_rank_batch), ckpt_path=ckpt_path)
    return trainer


record: dict = {}
if MODE == "2x2":
    probe = Probe()
    module = Net(attention=True, optimizer="sgd")
    fit(module, [], probe, GLOBAL_BATCH // 2)
    record["sgd"] = {**probe.seen, "after_fit": {k: v.detach().clone() for k, v in module.state_dict().items()},
                     "after_fit_types": sorted({type(p).__name__ for p in module.parameters()})}
    probe = Probe(save_at=2, path=OUT / "2x2.ckpt")
    module = Net(attention=True, optimizer="adam")
    fit(module, [], probe, GLOBAL_BATCH // 2, plugin_options={"fsdp": {"state_dict_type": "sharded"}})
    record["adam"] = probe.seen
    # two micro-batches a step (fsdp's no-sync accumulation), the gradients clipped by norm
    probe = Probe()
    module = Net(attention=True, optimizer="adam")
    fit(module, [], probe, GLOBAL_BATCH // 4, accumulate_grad_batches=2, gradient_clip_val=0.05)
    record["clipped"] = probe.seen
    # tp's self-check beside fsdp: an attention viewing its heads with the global head count
    # stops at the start of fit, on every rank (issue 33)
    try:
        fit(GlobalHeadsNet(), [], Probe(), GLOBAL_BATCH // 2)
        record["global_heads"] = None
    except hookloop.ConfigurationError as exc:
        record["global_heads"] = str(exc)
elif MODE == "4x1":
    probe = Probe(save_at=4, path=OUT / "4x1.ckpt")
    module = Net(attention=True, optimizer="adam", seed=5)  # other weights: the checkpoint's must win
    fit(module, [], probe, GLOBAL_BATCH // 4, ckpt_path=OUT / "2x2.ckpt",
        plugin_options={"fsdp": {"state_dict_type": "sharded"}})
    record["adam"] = probe.seen
elif MODE == "hsdp":
    sizes = dict(part.split("=") for part in os.environ["HSDP_MESH"].split(","))
    sizes = {k: int(v) for k, v in sizes.items()}
    replicas = sizes["dp_replicate"] * sizes["dp_shard"]
    for optimizer in ("sgd", "adam"):
        probe = Probe()
        module = Net(attention=True, optimizer=optimizer)
        plugins = [hookloop.plugin("fsdp", sharding_strategy="HYBRID_SHARD", state_dict_type="sharded"), "tp"]
        fit(module, plugins, probe, GLOBAL_BATCH // replicas, devices=math.prod(sizes.values()), mesh=sizes)
        record[optimizer] = probe.seen
torch.save(record, OUT / f"{MODE}.rank{os.environ['RANK']}.pt")
