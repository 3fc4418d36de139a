"""PowerSGD on gloo with several gradient buckets (tests/test_powersgd_gloo.py).

Run as ``hookloop run --plugins ddp --devices 2 powersgd_gloo_job.py OUT``. For each
case (several buckets; several buckets with ``find_unused_parameters=True`` and a layer
that never gets a gradient), a hand-written torch DDP loop with torch's ``powerSGD_hook``
(each bucket's future waited for in the hook, so it cannot deadlock) and the same settings
is the reference; then hookloop trains the same model with ``DDP(comm_hook="powersgd")``.
Every rank writes ``OUT/rank<R>.pt``. ``powersgd_gloo_job.py OUT stall``: rank 1 stops
mid-run while rank 0 is in the hook (the timeout must still end the job).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import tiny_data  # noqa: E402
from hookloop_ddp import DDP  # noqa: E402
from mesh_models import Classifies  # noqa: E402  (tests/scripts, this script's folder)

faulthandler.enable()
faulthandler.dump_traceback_later(150, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
DATA = tiny_data(96)
EPOCHS, BATCH, CAP, START = 2, 8, 0.002, 2  # 2 KB buckets: every weight matrix its own
record: dict = {}


class Wide(Classifies, hookloop.Module):
    """8 -> 32 -> 32 -> 3 (SGD with momentum); ``spare``: a layer the forward never uses."""

    def __init__(self, spare: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
        self.spare = nn.Linear(32, 32) if spare else None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def state(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def reference(spare: bool) -> tuple[dict, int]:
    module = Wide(spare)
    model = DistributedDataParallel(module, bucket_cap_mb=CAP, find_unused_parameters=spare)
    buckets: set = set()

    def waited(state, bucket):
        buckets.add(bucket.index())
        result = powersgd.powerSGD_hook(state, bucket).wait()
        done = torch.futures.Future()
        done.set_result(result)
        return done

    model.register_comm_hook(powersgd.PowerSGDState(None, start_powerSGD_iter=START), waited)
    optimizer = module.configure_optimizers()
    sampler = DistributedSampler(DATA, num_replicas=WORLD, rank=RANK, shuffle=True, seed=0)
    loader = DataLoader(DATA, batch_size=BATCH, sampler=sampler)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return state(module), len(buckets)


if sys.argv[2:] == ["stall"]:
    # Global rank 1 stops for 40 s before its 5th backward (PowerSGD compresses from the
    # 3rd step); rank 0 waits inside the hook, in PowerSGD's first all-reduce, which must
    # fail at the 5 s process-group timeout.
    class Stalling(Wide):
        def training_step(self, batch, batch_idx):
            if RANK == 1 and batch_idx == 4:
                import time

                time.sleep(40)
            return super().training_step(batch, batch_idx)

    plugin = DDP(comm_hook="powersgd", powersgd_start_iter=START, bucket_cap_mb=CAP)
    hookloop.Trainer(max_epochs=1, plugins=[plugin], enable_checkpointing=False, enable_progress_bar=False,
                     default_root_dir=str(OUT / "stall"), process_group_timeout=5).fit(
        Stalling(), DataLoader(DATA, batch_size=BATCH, shuffle=True))
    sys.exit(0)

dist.init_process_group("gloo")
record["raw"], record["buckets"] = reference(spare=False)
record["raw_spare"], record["buckets_spare"] = reference(spare=True)
gc.collect()
dist.destroy_process_group()

for name, spare in (("hookloop", False), ("hookloop_spare", True)):
    module = Wide(spare)
    plugin = DDP(comm_hook="powersgd", powersgd_start_iter=START, bucket_cap_mb=CAP, find_unused_parameters=spare)

    class Iterations:
        """PowerSGD's iteration count at the end of training (teardown drops the state)."""

        hookloop_name, hookloop_role = "iterations", "observer"

        @hookloop.hookimpl
        def on_train_end(self, trainer, plugin=plugin, name=name):
            record[name + "_iter"] = int(plugin.comm_hook_state.state.iter)

    trainer = hookloop.Trainer(max_epochs=EPOCHS, plugins=[plugin, Iterations()], enable_checkpointing=False,
                               enable_progress_bar=False, default_root_dir=str(OUT / name), process_group_timeout=60)
    trainer.fit(module, DataLoader(DATA, batch_size=BATCH, shuffle=True))
    record[name] = state(module)

torch.save(record, OUT / f"rank{RANK}.pt")
