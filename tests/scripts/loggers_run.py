"""The module and run the logger tests use (tests/test_loggers.py).

``Counting`` logs numbers a test can work out by hand: per training step its
``batch_idx`` (``batch_idx``) and the number of processes (``procs``, summed across
ranks); per epoch the epoch number (``epoch_number``, an epoch mean); per validation a
constant (``val_const``), per test another (``test_const``). Run as a script in the
shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2 loggers_run.py
ROOT``) it trains in ``ROOT`` (also its working directory) with the ``tensorboard`` and
``mlflow`` plugins, MLflow's runs in experiment ``ddp`` of ``ROOT/mlflow.db``
(``MLFLOW_TRACKING_URI``), and writes ``ROOT/rank0.json``: rank 0's run directory, world
size and final ``callback_metrics``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

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


def fit(root, plugins, plugin_options: dict | None = None, **module_args) -> hookloop.Trainer:
    options = {} if plugin_options is None else {"plugin_options": plugin_options}
    trainer = hookloop.Trainer(max_epochs=EPOCHS, log_every_n_steps=1, default_root_dir=root,
                               enable_progress_bar=False, plugins=plugins, **options)
    trainer.fit(Counting(**module_args), *loaders())
    return trainer


if __name__ == "__main__":
    # What `hookloop run --plugins ddp,tensorboard,mlflow --plugin-option
    # mlflow.experiment_name=ddp` with MLFLOW_TRACKING_URI set would give: the plugins and
    # their option in code, the variable here (the job driver puts the environment back).
    root = Path(sys.argv[1])
    os.chdir(root)  # so "rank 1 wrote nothing anywhere" covers the working directory too
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    trainer = fit(str(root), ["tensorboard", "mlflow"], plugin_options={"mlflow": {"experiment_name": "ddp"}})
    if trainer.is_global_zero:
        with open(root / "rank0.json", "w") as f:
            json.dump({"log_dir": str(trainer.log_dir), "world_size": trainer.world_size,
                       "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}, f)
