"""The module and run the logger tests use (tests/test_loggers.py).

``Counting`` logs numbers a test can work out by hand: per training step its
``batch_idx`` (``batch_idx``) and the number of processes (``procs``, summed across
ranks); per epoch the epoch number (``epoch_number``, an epoch mean); per validation a
constant (``val_const``), per test another (``test_const``). Run as a script
(``hookloop run --plugins ddp,tensorboard,mlflow --devices 2 loggers_run.py ROOT``) it
trains in ``ROOT`` and writes ``ROOT/rank0.json``: rank 0's run directory, world size and
final ``callback_metrics``.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

SAMPLES, BATCH, EPOCHS = 16, 4, 2
VAL_CONST, TEST_CONST = 3.5, -2.0


class Counting(hookloop.Module):
    """A linear regression that logs hand-computable metrics."""

    def __init__(self, lr: float = 0.05, fail_at_epoch: int | None = None):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.hparams.fail_at_epoch == self.current_epoch:
            raise RuntimeError("planned failure")
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.log("batch_idx", float(batch_idx))
        self.log("procs", 1.0, sync_dist=True, reduce_fx="sum")
        self.log("epoch_number", float(self.current_epoch), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_const", VAL_CONST)

    def test_step(self, batch, batch_idx):
        self.log("test_const", TEST_CONST)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def loaders():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 3, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    return DataLoader(data, batch_size=BATCH), DataLoader(data, batch_size=BATCH)


def fit(root, plugins, **module_args) -> hookloop.Trainer:
    trainer = hookloop.Trainer(max_epochs=EPOCHS, log_every_n_steps=1, default_root_dir=root,
                               enable_progress_bar=False, plugins=plugins)
    trainer.fit(Counting(**module_args), *loaders())
    return trainer


if __name__ == "__main__":
    trainer = fit(sys.argv[1], [])
    if trainer.is_global_zero:
        with open(f"{sys.argv[1]}/rank0.json", "w") as f:
            json.dump({"log_dir": str(trainer.log_dir), "world_size": trainer.world_size,
                       "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}, f)
