"""One replica group of tests/test_ft.py: a hookloop run with the ft plugin (or ft and fsdp).

Run as ``hookloop run --plugins ft[,fsdp] [--devices N] ft_group.py OUT GROUP STEPS [--kill-at K]
[--wait-at W]`` with ``TORCHFT_LIGHTHOUSE`` set. The group trains ``STEPS`` steps of the job
on its fixed batch (ft_models.py); ``REPLICA_GROUP_ID`` is ``GROUP``. With N processes, rank r
takes the samples ``r::N`` of the batch (no distributed sampler: it would shuffle), so the
group's gradient is the one-process group's.

* ``--kill-at K``: the group sends itself SIGKILL in the backward of step K (its gradient
  never reaches the all-reduce: the peer's step K fails and is skipped); a group of N
  processes kills its launcher's process group (the launcher and every worker);
* ``--attempt A``: 0 for a group's first launch, 1 for its restart (which starts from
  other initial weights, so that only the recovery can make them right);
* ``--wait-at W``: at the start of step W, the group waits for ``OUT/ready.<other>.1``
  to appear (the restarted peer writes it once its Manager heartbeats to the
  Lighthouse), so the peer rejoins at step W, not sooner (or a step later: the Lighthouse
  issues the quorum at once when every member of the last one asked for it).

Rank 0 of every group writes ``OUT/ready.GROUP.A`` when its Manager exists, waits for the other
group's ``ready.OTHER.0`` at its first batch (so the first quorum has both), appends ``step committed``
per optimizer step to ``OUT/steps.GROUP``, and saves its weights to
``OUT/weights.GROUP.pt``, with the plugin's counts in ``OUT/report.GROUP.json``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ft_models import group_batch, make_net, make_optimizer  # noqa: E402

# A hang must fail the test with the stacks, not leave a process behind.
faulthandler.enable()
faulthandler.dump_traceback_later(150, exit=True)
parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("group", type=int)
parser.add_argument("steps", type=int)
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--wait-at", type=int, default=None)
parser.add_argument("--attempt", type=int, default=0)
ARGS = parser.parse_args()
OUT, GROUP, OTHER = ARGS.out, ARGS.group, 1 - ARGS.group


def wait_for(path: Path, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"group {GROUP}: {path} did not appear in {seconds} s")
        time.sleep(0.05)


def kill_group() -> None:
    """SIGKILL this process, or the whole group (its launcher and every worker: they share
    the launcher's process group) when it has several."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class Group(hookloop.Module):
    def __init__(self):
        super().__init__()
        # a restarted group starts from other weights: only the recovery makes them right
        self.net = make_net(seed=0 if ARGS.attempt == 0 else 7)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if ARGS.kill_at is not None and self.trainer.global_step == ARGS.kill_at:
            loss.register_hook(lambda grad: kill_group())
        return loss

    def on_fit_start(self):
        # The Manager heartbeats every 0.1 s from setup_environment on: after a few, the
        # Lighthouse waits for this group in the next quorum.
        time.sleep(0.3)
        if self.trainer.global_rank == 0:
            (OUT / f"ready.{GROUP}.{ARGS.attempt}").write_text(str(os.getpid()))

    def on_train_batch_start(self, batch, batch_idx):
        step = self.trainer.global_step
        if batch_idx == 0:
            wait_for(OUT / f"ready.{OTHER}.0")
        if ARGS.wait_at is not None and step == ARGS.wait_at:
            wait_for(OUT / f"ready.{OTHER}.1")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_rank != 0:
            return
        with open(OUT / f"steps.{GROUP}", "a") as f:
            f.write(f"{self.trainer.global_step}\n")

    def configure_optimizers(self):
        return make_optimizer(self.net)


WORLD, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
x, y = group_batch(GROUP)
x, y = x[RANK::WORLD], y[RANK::WORLD]
data = TensorDataset(x.repeat(ARGS.steps + 4, 1), y.repeat(ARGS.steps + 4))
module = Group()
trainer = hookloop.Trainer(max_steps=ARGS.steps, logger=False, enable_checkpointing=False,
                           enable_progress_bar=False, num_sanity_val_steps=0, use_distributed_sampler=False)
trainer.fit(module, DataLoader(data, batch_size=len(x)))
if trainer.global_rank != 0:
    sys.exit(0)
ft = next(p for p in trainer.plugins if getattr(p, "hookloop_name", None) == "ft")
torch.save({k: v.detach().clone() for k, v in module.net.state_dict().items()}, OUT / f"weights.{GROUP}.pt")
(OUT / f"report.{GROUP}.json").write_text(json.dumps(
    {"committed": ft.committed, "skipped": ft.skipped, "recoveries": ft.recoveries,
     "global_step": trainer.global_step}))
