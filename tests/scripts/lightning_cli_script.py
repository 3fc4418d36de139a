"""One LightningCLI script for tests/test_lightning_cli.py, run under pytorch-lightning
2.6.6 or hookloop: ``CLI_FRAMEWORK=lightning|hookloop`` changes only the imports.

``CLI_RUN=0`` builds the objects only (``run=False``). After its sub-command (and after
building, with ``run=False``) it prints ``CONFIG=`` (the parsed model, data, seed,
optimizer and scheduler sections) and, after ``fit``, the metrics of fit and of a test
run right after as ``RESULT=``.
"""

import json
import os

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

if os.environ.get("CLI_FRAMEWORK") == "lightning":
    from pytorch_lightning import LightningDataModule, LightningModule
    from pytorch_lightning.cli import LightningCLI
else:
    from hookloop import DataModule as LightningDataModule
    from hookloop import LightningCLI
    from hookloop import Module as LightningModule


class Net(LightningModule):
    """A two-layer classifier."""

    def __init__(self, n_in: int = 4, hidden: int = 8, lr: float = 0.1, momentum: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits, y))
        self.log("test_acc", (logits.argmax(-1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


class WideNet(Net):
    """Net with a wider default hidden layer (for --model WideNet)."""

    def __init__(self, hidden: int = 16, lr: float = 0.1, scale: float = 1.0):
        super().__init__(hidden=hidden, lr=lr)


class Data(LightningDataModule):
    """Three classes of 4 features, from a fixed generator."""

    def __init__(self, batch_size: int = 8, n: int = 64, n_features: int = 4):
        super().__init__()
        self.batch_size, self.n, self.n_features = batch_size, n, n_features

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(5)
        x = torch.randn(self.n, self.n_features, generator=g)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        self.train_set = TensorDataset(x, y)
        self.val_set = TensorDataset(x[: self.n // 2], y[: self.n // 2])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


def _plain(value):
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return value


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        if not self.subclass_mode_model:  # (a class path's arguments are model.init_args.*)
            parser.link_arguments("data.n_features", "model.n_in")

    def after_fit(self):
        fit = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        test = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("test_")}
        params = torch.cat([p.detach().flatten() for p in self.model.parameters()])
        weights = [float(params.sum()), float(params.pow(2).sum())]
        log_dir = str(self.trainer.log_dir)  # Lightning's broadcasts it: read on every rank
        if self.trainer.global_rank == 0:
            print("RESULT=" + json.dumps({"fit": fit, "test": test, "weights": weights,
                                          "world_size": self.trainer.world_size,
                                          "log_dir": log_dir}), flush=True)

    def after_test(self):
        if self.trainer.global_rank == 0:
            metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
            print("TESTED=" + json.dumps({"metrics": metrics, "hidden": self.model.hparams.hidden}), flush=True)


def main():
    run = os.environ.get("CLI_RUN", "1") == "1"
    subclass = os.environ.get("CLI_SUBCLASS") == "1"
    cli = CLI(None if subclass else Net, Data, run=run, subclass_mode_model=subclass,
              trainer_defaults={"accelerator": "cpu", "enable_progress_bar": False})
    config = cli.config.get(str(cli.subcommand), cli.config) if run else cli.config
    sections = {k: _plain(config.get(k)) for k in ("model", "data", "seed_everything", "optimizer", "lr_scheduler")}
    if cli.trainer.global_rank == 0:
        print("CONFIG=" + json.dumps(sections, default=str), flush=True)


if __name__ == "__main__":
    main()
