"""A small deterministic ddp job that may kill one of its workers (tests/test_faults.py).

Run as ``hookloop run --plugins ddp --devices 2 --max-restarts 1 restart_job.py OUT [KILL_AT]``.
With ``KILL_AT``, global rank 1 sends itself SIGKILL at the end of the batch that makes
``global_step == KILL_AT``, in the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0);
the elastic agent then restarts both workers, which run this script again from the top.
There is no resume code here: resuming is hookloop's job. Every rank appends the global
step of each optimizer step it takes to ``OUT/steps.rank<R>.attempt<A>``; global rank 0
saves the final weights to ``OUT/weights.pt``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import TinyClassifier, tiny_dataset, weights

# A hang must fail the test with the stacks, not leave workers behind.
faulthandler.enable()
faulthandler.dump_traceback_later(90, exit=True)
OUT = Path(sys.argv[1])
KILL_AT = int(sys.argv[2]) if len(sys.argv) > 2 else None
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Job(TinyClassifier):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        trainer = self.trainer
        # The optimizer steps each attempt of each rank took, one line per step.
        with open(OUT / f"steps.rank{trainer.global_rank}.attempt{ATTEMPT}", "a") as f:
            f.write(f"{trainer.global_step}\n")
        if KILL_AT is not None and ATTEMPT == 0 and trainer.global_rank == 1 and trainer.global_step == KILL_AT:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


# 64 samples, 2 ranks, batches of 8: 4 steps per epoch, 8 in all; last.ckpt every 2 steps.
module = Job(seed=0)
trainer = hookloop.Trainer(
    max_epochs=2, default_root_dir=str(OUT / "root"), num_sanity_val_steps=0,
    callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=2)],
)
trainer.fit(module, DataLoader(tiny_dataset(64), batch_size=8, shuffle=True))
if trainer.global_rank == 0:
    torch.save(weights(module), OUT / "weights.pt")
    print(f"done: epoch {trainer.current_epoch}, global step {trainer.global_step}", flush=True)
