"""The built-in observers under 2 processes, in one run (starting processes is what costs).

Run by tests/test_observers_ddp.py as ``hookloop run --plugins ddp --devices 2
observers_battery.py OUT``. Each rank logs values of its own (no ``sync_dist``) so that a
decision taken by any rank but rank 0 would show; every rank writes ``OUT/rank<R>.pt``
with what it saw, and the test compares it with values worked out by hand.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])

# Rank 0 stops improving after epoch 1 (patience 0: stops at the end of epoch 2); rank 1's
# values improve every epoch, so had rank 1 decided, it would train all 5 epochs.
VALUES = {0: [5.0, 3.0, 4.0, 1.0, 2.0], 1: [9.0, 8.0, 7.0, 6.0, 5.0]}


class RankValues(TinyModule):
    def __init__(self):
        super().__init__()
        self.epochs_trained: list[int] = []

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.tensor(VALUES[RANK][self.current_epoch]))
        self.log("shared", torch.tensor(float(RANK + 1)), sync_dist=True)  # mean over ranks: 1.5

    def on_train_epoch_end(self):
        self.epochs_trained.append(self.current_epoch)


module = RankValues()
checkpoint = hookloop.ModelCheckpoint(monitor="val_loss", save_top_k=2, filename="{epoch}-{val_loss:.1f}")
stopper = hookloop.EarlyStopping(monitor="val_loss", patience=0)
trainer = hookloop.Trainer(max_epochs=5, log_every_n_steps=2, default_root_dir=str(OUT / "root"),
                           callbacks=[checkpoint, stopper])
# 64 samples, 2 ranks, batches of 8: 4 steps per epoch
trainer.fit(module, DataLoader(tiny_data(64), batch_size=8), DataLoader(tiny_data(32, seed=3), batch_size=8))
torch.save({
    "log_dir": str(trainer.log_dir),
    "epochs_trained": module.epochs_trained,
    "global_step": trainer.global_step,
    "stopped_epoch": stopper.stopped_epoch,
    "best_model_path": checkpoint.best_model_path,
    "best_k_models": dict(checkpoint.best_k_models),
    "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    "files": sorted(p.name for p in (Path(trainer.log_dir) / "checkpoints").iterdir()),
}, OUT / f"rank{RANK}.pt")
