"""A 2-process ddp job whose ranks draw different random numbers (tests/test_resume_rank_state.py).

Run as ``hookloop run --plugins ddp --devices 2 --max-restarts 2 rank_state_job.py OUT
[--kill-at-batch B [--kills N]]``.

Each rank seeds torch, Python and NumPy with its own seed in ``setup``, so the ranks'
dropout masks and their Python/NumPy draws (which scale the loss) differ. 96 samples,
batches of 8 per rank, ``accumulate_grad_batches=2``: 6 batches and 3 optimizer steps per
epoch, 2 epochs; ``ModelCheckpoint(every_n_train_steps=2)``.

With ``--kill-at-batch B``, in each of the first ``N`` attempts (default 1), global rank 1
sends itself SIGKILL at the start of epoch 0's batch ``B`` (no save is under way then).

There is no resume code here: the restarted workers resume by themselves. Every rank
appends ``epoch batch_idx torch python numpy`` (one draw of each generator, at each
batch's start) to ``OUT/draws.rank<R>.attempt<A>``; global rank 0 saves the final weights
to ``OUT/weights.pt``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import TinyClassifier, tiny_dataset, weights

# A hang must fail the test with the stacks, not leave workers behind.
faulthandler.enable()
faulthandler.dump_traceback_later(120, exit=True)
parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--kill-at-batch", type=int)
parser.add_argument("--kills", type=int, default=1)
ARGS = parser.parse_args()
OUT = ARGS.out
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Job(TinyClassifier):
    def __init__(self):
        super().__init__(seed=0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))

    def setup(self, stage):
        seed = 1000 + self.trainer.global_rank  # per-rank streams
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        scale = 1 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        return F.cross_entropy(self(x), y) * scale

    def on_train_batch_start(self, batch, batch_idx):
        trainer = self.trainer
        draws = f"{torch.rand(1).item()!r} {random.random()!r} {float(np.random.rand())!r}"
        with open(OUT / f"draws.rank{trainer.global_rank}.attempt{ATTEMPT}", "a") as f:
            f.write(f"{trainer.current_epoch} {batch_idx} {draws}\n")
        if (ARGS.kill_at_batch is not None and ATTEMPT < ARGS.kills and trainer.global_rank == 1
                and trainer.current_epoch == 0 and batch_idx == ARGS.kill_at_batch):
            die()


module = Job()
trainer = hookloop.Trainer(
    max_epochs=2, default_root_dir=str(OUT / "root"), num_sanity_val_steps=0, accumulate_grad_batches=2,
    callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=2)],
)
trainer.fit(module, DataLoader(tiny_dataset(96), batch_size=8, shuffle=True))
if trainer.global_rank == 0:
    torch.save(weights(module), OUT / "weights.pt")
    print(f"done: epoch {trainer.current_epoch}, global step {trainer.global_step}", flush=True)
