"""The tp checks in one 2-process run (starting processes is the expensive part).

Run by tests/test_tp.py as ``hookloop run --plugins tp --devices 2 tp_battery.py OUT``.
Every rank writes ``OUT/rank<R>.pt`` with what it observed; the test compares it with
the same model trained in one process by a hand-written loop (tp_models.reference).
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hookloop  # noqa: E402
from tp_models import FusedNet, GlobalHeadsNet, HookedNet, Net, PlannedNet, UnpairedGateNet, data  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(300, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
STEPS = 4
record: dict = {}


class Probe:
    """Records the batches and gradients this rank sees, and the parameters' layouts."""

    hookloop_name, hookloop_role = "probe", "observer"

    def __init__(self, save_at: int | None = None, path: Path | None = None):
        self.save_at, self.path = save_at, path
        self.seen: dict = {"batches": [], "grads": {}, "layouts": {}}

    @hookloop.hookimpl
    def on_train_batch_start(self, trainer, batch, batch_idx):
        self.seen["batches"].append(batch[0].clone())

    @hookloop.hookimpl
    def on_before_optimizer_step(self, trainer, optimizer):
        module = trainer.module
        self.seen["grads"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                              for n, p in module.named_parameters()}
        self.seen["layouts"] = {n: (tuple(map(str, p.placements)) if hasattr(p, "placements") else "plain")
                                for n, p in module.named_parameters()}

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer, outputs, loss, batch, batch_idx):
        if self.save_at is not None and trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.path)


def fit(module, steps: int, probe: Probe, ckpt_path=None, plugins=()):
    trainer = hookloop.Trainer(max_steps=steps, plugins=[probe, *plugins], enable_checkpointing=False, logger=False,
                               enable_progress_bar=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data(), batch_size=4), ckpt_path=ckpt_path)
    return trainer


def weights(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


for attention in (False, True):
    for optimizer in ("sgd", "adam"):
        probe = Probe()
        module = Net(attention=attention, optimizer=optimizer)
        fit(module, STEPS, probe)
        record[("parity", attention, optimizer)] = {"final": weights(module), **probe.seen}

# The user's loader as it is (a tp group is one data-parallel replica): a shuffling
# loader gives every process the order one process gets (tp_models.shuffled_order).
probe = Probe()
module = Net(optimizer="sgd")
hookloop.Trainer(max_steps=STEPS, plugins=[probe], enable_checkpointing=False, logger=False, enable_progress_bar=False,
                 num_sanity_val_steps=0).fit(module, DataLoader(data(), batch_size=4, shuffle=True))
record["shuffled"] = probe.seen["batches"]

# compile beside tp (tp on the command line, compile in code): the split model compiled
# in place (aot_eager: exact), trained as one process trains the eager model.
from torch._dynamo.utils import counters  # noqa: E402

graphs = counters["stats"]["unique_graphs"]
probe = Probe()
module = Net(attention=True, optimizer="adam")
fit(module, STEPS, probe, plugins=[hookloop.plugin("compile", backend="aot_eager")])
record["compiled"] = {"final": weights(module), "graphs": counters["stats"]["unique_graphs"] - graphs, **probe.seen}

# The module's own plan, the loss computed on class-sharded logits (loss_parallel).
probe = Probe()
module = PlannedNet(attention=True, optimizer="adam")
fit(module, STEPS, probe, plugins=[hookloop.plugin("tp", loss_parallel=True)])
record["planned"] = {"final": weights(module), **probe.seen}

# The module's configure_tensor_parallel hook; after fit the module is whole again, and a
# checkpoint saved then is the core's single file.
probe = Probe()
module = HookedNet(attention=False, optimizer="sgd")
trainer = fit(module, STEPS, probe)
record["hooked"] = {"final": weights(module), "mesh": module.mesh_seen, **probe.seen,
                    "after_fit": {n: type(p).__name__ for n, p in module.named_parameters()}}
trainer.save_checkpoint(OUT / f"after_fit{RANK}.ckpt")
record["after_fit_file"] = (OUT / f"after_fit{RANK}.ckpt").is_file()
with torch.no_grad():
    record["after_fit_output"] = module(data().tensors[0][:2])

# Checkpoints: a directory saved at step 2 of 4 during the run, resumed to step 4.
ckpt = OUT / "tp.ckpt"
probe = Probe(save_at=2, path=ckpt)
fit(Net(attention=True, optimizer="adam"), 2, probe)
resumed = Net(attention=True, optimizer="adam", seed=5)  # other weights: the checkpoint's must win
fit(resumed, STEPS, Probe(), ckpt_path=ckpt)
record["resumed"] = weights(resumed)
record["ckpt_files"] = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())

# The self-check (tp.verify, on by default): a model that tp splits into another function
# stops at the start of fit, on every rank with the same error (caught here, to run on).
for name, cls in (("fused", FusedNet), ("global_heads", GlobalHeadsNet), ("unpaired_gate", UnpairedGateNet)):
    probe = Probe()
    try:
        fit(cls(), STEPS, probe)
        record[("verify", name)] = None
    except hookloop.ConfigurationError as exc:
        record[("verify", name)] = {"error": str(exc), "steps": len(probe.seen["batches"])}

# tp.verify=false: the check is what stops the wrong model (it trains, another function);
# and a correct model trains the same numbers with the check as without it.
module = GlobalHeadsNet()
fit(module, STEPS, Probe(), plugins=[hookloop.plugin("tp", verify=False)])
record["unverified_global_heads"] = weights(module)
module = Net(attention=True, optimizer="adam")
fit(module, STEPS, Probe(), plugins=[hookloop.plugin("tp", verify=False)])
record["unverified_parity"] = weights(module)

torch.save(record, OUT / f"rank{RANK}.pt")
faulthandler.cancel_dump_traceback_later()
