"""ddp + fp16 mixed precision on 2 GPUs (NCCL), next to torch's own DDP + GradScaler loop.

    hookloop run --plugins ddp --devices 2 tests/scripts/gpu_ddp_amp.py OUT

Run by tests/gpu/test_gpu.py. Every rank trains the hand-written loop in a process group
of its own, then hookloop with precision="16-mixed", and writes OUT/rank<R>.pt with both
results and what the hookloop run saw.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import hookloop  # noqa: E402
from gpu_check_model import Net, data  # noqa: E402

# A hang must fail the test with the stacks, not leave workers holding the GPUs.
faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)
OUT = Path(sys.argv[1])
RANK, WORLD, LOCAL = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
DEVICE = torch.device("cuda", LOCAL)
DATA = data()
EPOCHS, BATCH = 3, 32  # 256 / 2 ranks / 32 = 4 steps per epoch
# A scale too large for fp16 at first, growing back every 3 steps: some steps are skipped.
SCALER = {"init_scale": 2.0**20, "growth_interval": 3}
record: dict = {}


def state(module) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def raw_ddp_amp():
    """PyTorch's documented DDP + autocast + GradScaler recipe; returns (weights, scale, skipped)."""
    module = Net().to(DEVICE)
    model = DistributedDataParallel(module, device_ids=[LOCAL])
    optimizer = module.configure_optimizers()
    scaler = torch.amp.GradScaler("cuda", **SCALER)
    sampler = DistributedSampler(DATA, num_replicas=WORLD, rank=RANK, shuffle=True, seed=0)
    skipped = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(DATA, batch_size=BATCH, sampler=sampler):
            x, y = x.to(DEVICE), y.to(DEVICE)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            # Counted from the gradients themselves, not from the scaler's bookkeeping.
            skipped += not all(torch.isfinite(p.grad).all() for p in module.parameters())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return state(module), scaler.get_scale(), skipped


torch.cuda.set_device(DEVICE)
dist.init_process_group("nccl")
record["raw"], record["raw_scale"], record["raw_skipped"] = raw_ddp_amp()
gc.collect()  # the wrapper's reducer holds the group: release it before the group goes
dist.destroy_process_group()


class Seen:
    """Records the process group while it exists (teardown destroys it)."""

    hookloop_name, hookloop_role = "seen", "observer"

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        record["backend"] = dist.get_backend()
        record["root_device"] = str(trainer.root_device)
        record["world_size"] = trainer.world_size


trainer = hookloop.Trainer(plugins=["ddp", Seen()], precision="16-mixed", max_epochs=EPOCHS,
                           enable_checkpointing=False, plugin_options={"amp": SCALER})
module = Net()
trainer.fit(module, DataLoader(DATA, batch_size=BATCH, shuffle=True))
amp = next(p for p in trainer.plugins if p.hookloop_name == "amp")
record["hookloop"] = state(module)
record["scale"], record["skipped"] = amp.scaler.get_scale(), amp.skipped_steps
record["steps"] = trainer.global_step
record["forwards"] = sorted({(device, on, str(dtype)) for device, _, on, dtype in module.seen})
torch.save(record, OUT / f"rank{RANK}.pt")
