"""A slow job whose workers record their process ids (tests/test_resume_launch.py).

``hookloop run --plugins ddp|ddp_spawn --devices 2 orphan_job.py OUT [--hang]``: every
worker writes ``OUT/pid.rank<R>`` ("PID PARENT") at its first step, then trains slowly
(0.2 s a step, for minutes) so that the test can kill the launcher while the workers run.
``--hang``: once it wrote its pid, global rank 0 sleeps for good (a hung job: rank 1
then waits in the gradients' all_reduce). A SIGTERM only sets hookloop's preemption flag,
which a hung rank never reads. The script's own process writes ``OUT/pid.main``.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from pathlib import Path

from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import TinyClassifier, tiny_dataset

# A safety net, not the tested behaviour: a leaked worker still ends after 3 minutes.
faulthandler.dump_traceback_later(180, exit=True)


class Slow(TinyClassifier):
    def __init__(self, out: str, hang: bool):
        super().__init__(seed=0)
        self.out, self.hang = out, hang

    def on_train_batch_end(self, outputs, batch, batch_idx):
        trainer = self.trainer
        mine = Path(self.out) / f"pid.rank{trainer.global_rank}"
        if not mine.exists():
            tmp = mine.with_name(mine.name + ".tmp")
            tmp.write_text(f"{os.getpid()} {os.getppid()}\n")
            tmp.rename(mine)
        if self.hang and trainer.global_rank == 0:
            while True:
                time.sleep(1)
        time.sleep(0.2)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    (out / "pid.main").write_text(f"{os.getpid()} {os.getppid()}\n")
    module = Slow(str(out), hang="--hang" in sys.argv)
    trainer = hookloop.Trainer(max_epochs=1000, default_root_dir=str(out / "root"), num_sanity_val_steps=0,
                               enable_checkpointing=False, enable_progress_bar=False, logger=False)
    trainer.fit(module, DataLoader(tiny_dataset(64), batch_size=8))
