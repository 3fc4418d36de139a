"""The run the W&B tests use (tests/test_wandb.py).

``hookloop run [--plugins ddp,wandb --devices 2] [--max-restarts 1] wandb_job.py ROOT
[--epochs N] [--crash-at STEP] [--ckpt-path PATH] [--log-model VALUE]``: a linear
regression over 16 samples in batches of 4 (tests/scripts/loggers_run.py's data), logging per step the loss and ``mark`` =
100 * epoch + batch_idx (a number worked out by hand), per validation ``val_const``.
With ``--crash-at`` the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) raises in the
training step that would make ``global_step`` STEP + 1 (steps 1..STEP are logged).
Rank 0 writes ``ROOT/rank0.json``: its run directory and world size.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn
from torch.nn import functional as F

import hookloop
from loggers_run import BATCH, SAMPLES, VAL_CONST, loaders  # noqa: F401  the logger tests' data (tests/scripts)


class Job(hookloop.Module):
    def __init__(self, lr: float = 0.05, crash_at: int | None = None):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.hparams.crash_at is not None and attempt == 0 and self.global_step == self.hparams.crash_at:
            raise RuntimeError("planned crash")
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.log("mark", float(100 * self.current_epoch + batch_idx))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_const", VAL_CONST)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def fit(root, plugins=("wandb",), epochs=2, crash_at=None, ckpt_path=None, **trainer_args) -> hookloop.Trainer:
    trainer = hookloop.Trainer(max_epochs=epochs, log_every_n_steps=1, default_root_dir=root,
                               enable_progress_bar=False, enable_model_summary=False, plugins=list(plugins),
                               **trainer_args)
    trainer.fit(Job(crash_at=crash_at), *loaders(), ckpt_path=ckpt_path)
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--ckpt-path")
    args = parser.parse_args()
    trainer = fit(args.root, plugins=(), epochs=args.epochs, crash_at=args.crash_at, ckpt_path=args.ckpt_path)
    if trainer.is_global_zero:
        with open(os.path.join(args.root, "rank0.json"), "w") as f:
            json.dump({"log_dir": str(trainer.log_dir), "world_size": trainer.world_size}, f)
