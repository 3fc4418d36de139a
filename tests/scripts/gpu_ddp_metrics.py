"""self.log reduced across 2 GPUs (NCCL) by hookloop-ddp: each rank writes what it reports.

    hookloop run --plugins ddp --devices 2 tests/scripts/gpu_ddp_metrics.py OUT EPOCHS BATCH VAL_BATCH N_TRAIN N_VAL

Run by tests/gpu/test_gpu_metrics.py, which computes the reference on the CPU. Every rank
writes OUT/rank<R>.pt: callback_metrics after fit and after validate, its device and
process-group backend, and the trained weights.
"""

from __future__ import annotations

import faulthandler
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import hookloop  # noqa: E402
from gpu_check_model import MetricsNet, data  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)
OUT = Path(sys.argv[1])
EPOCHS, BATCH, VAL_BATCH, N_TRAIN, N_VAL = (int(a) for a in sys.argv[2:7])
record: dict = {}


class Seen:
    """Records the process group while it exists (teardown destroys it)."""

    hookloop_name, hookloop_role = "seen", "observer"

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        record["backend"] = dist.get_backend()
        record["root_device"] = str(trainer.root_device)
        record["world_size"] = trainer.world_size


trainer = hookloop.Trainer(plugins=["ddp", Seen()], max_epochs=EPOCHS, enable_checkpointing=False)
module = MetricsNet()
val = DataLoader(data(N_VAL, seed=2), batch_size=VAL_BATCH)
trainer.fit(module, DataLoader(data(N_TRAIN, seed=1), batch_size=BATCH, shuffle=True), val)
record["fit_metrics"] = dict(trainer.callback_metrics)
trainer.validate(module, val)
# Read back from callback_metrics: what validate() returns is being changed to one dict
# per dataloader.
record["validate_metrics"] = dict(trainer.callback_metrics)
record["weights"] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
torch.save(record, OUT / f"rank{trainer.global_rank}.pt")
