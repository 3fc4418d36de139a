"""A ddp job with PowerSGD whose worker may be killed (tests/test_resume_launch.py).

``hookloop run --devices 2 --max-restarts 1 [--plugins ddp --plugin-option ...]
powersgd_resume_job.py OUT [AT] [--subclass]``: a 4-layer MLP (two 32x32 weights), 64
samples, 2 ranks, batches of 8: 4 steps an epoch, 12 in all; ``last.ckpt`` every 2 steps.
With ``AT``, global rank 1 SIGKILLs itself after step ``AT`` in the first attempt; the
agent restarts both workers, which resume from the newest checkpoint (no resume code
here). ``--subclass``: the strategy is a third party's subclass of ``ddp``, named in code
(``Trainer(plugins=[Strategy(comm_hook="powersgd", ...)])``). Global rank 0 saves the
final weights to ``OUT/weights.pt``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import TinyClassifier, tiny_dataset, weights
from hookloop_ddp import DDP

faulthandler.dump_traceback_later(150, exit=True)  # a hang fails the test, leaves nothing behind
OUT = Path(sys.argv[1])
AT = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else None
FAULTY = AT is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class ThirdPartyDDP(DDP):
    """What a plugin author writes to ship a strategy of their own on top of ddp."""

    hookloop_name = "third_party_ddp"


class Deep(TinyClassifier):
    def __init__(self):
        super().__init__(seed=0)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        trainer = self.trainer
        if FAULTY and trainer.global_rank == 1 and trainer.global_step == AT:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    plugins = [ThirdPartyDDP(comm_hook="powersgd", powersgd_start_iter=2)] if "--subclass" in sys.argv else []
    module = Deep()
    trainer = hookloop.Trainer(max_epochs=3, default_root_dir=str(OUT / "root"), num_sanity_val_steps=0,
                               enable_progress_bar=False, enable_model_summary=False, plugins=plugins,
                               callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=2)])
    trainer.fit(module, DataLoader(tiny_dataset(64), batch_size=8, shuffle=True))
    if trainer.global_rank == 0:
        torch.save(weights(module), OUT / "weights.pt")
        print(f"done: global step {trainer.global_step}", flush=True)
