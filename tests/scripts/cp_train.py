"""Train cp_models.CausalNet under the plugins of the command line and record what each
rank saw: ``hookloop run --plugins ddp,cp --devices 2 --mesh cp=2 cp_train.py OUT``.

Each rank writes ``OUT/rank<R>.pt``: the final weights, the batches it loaded (before
the cp plugin shards them), the local shapes inside the step, its device and the mesh.
Run by tests/gpu/test_cp_gpu.py (CUDA) and tests/test_cp.py (the refusal on the CPU; with
a second argument ``cpu-data-path``, the data path on the CPU without attention).
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
from cp_models import CausalNet, PositionNet, data  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK = int(os.environ.get("RANK", 0))
STEPS = 4


class Probe:
    hookloop_name, hookloop_role = "probe", "observer"

    def __init__(self):
        self.seen: dict = {"batches": [], "local": []}

    @hookloop.hookimpl(tryfirst=True)
    def on_train_batch_start(self, trainer, batch, batch_idx):
        self.seen["batches"].append(batch[1].detach().cpu().clone())  # whole: before cp shards it

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer, outputs, loss, batch, batch_idx):
        self.seen["local"].append((tuple(batch[0].shape), tuple(batch[1].shape)))
        mesh = trainer.device_mesh
        self.seen["mesh"] = (mesh.mesh_dim_names, tuple(mesh.shape)) if mesh is not None else None
        self.seen["device"] = str(trainer.root_device)


probe = Probe()
plugins: list = [probe]
module = CausalNet()
if len(sys.argv) > 2 and sys.argv[2] == "cpu-data-path":
    # The CPU check of everything but ring attention: a model without attention, and the
    # cp plugin with its device refusal skipped (torch has no CPU ring attention).
    from hookloop_cp import CP

    class DataPathCP(CP):
        def _check_device(self, device):
            pass

    plugins, module = [probe, "ddp", DataPathCP()], PositionNet()
trainer = hookloop.Trainer(max_steps=STEPS, plugins=plugins, enable_checkpointing=False, logger=False,
                           enable_progress_bar=False, num_sanity_val_steps=0)
trainer.fit(module, DataLoader(data(), batch_size=4))
torch.save({"final": {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}, **probe.seen},
           OUT / f"rank{RANK}.pt")
