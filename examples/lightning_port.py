"""A module written for PyTorch Lightning, run by hookloop with only its imports changed.

    python examples/lightning_port.py                 # one process
    python examples/lightning_port.py --devices 2     # ddp: the script re-launches itself on 2 processes

Everything below the imports is Lightning 2.x code: a LightningDataModule
(prepare_data, setup, the four loaders), a LightningModule with validation, test and
predict steps, module hooks, ``self.log``/``log_dict``, ``save_hyperparameters``, a
``ReduceLROnPlateau`` monitoring a validation metric, and ``Trainer(strategy="ddp")``
with ``fit``, ``save_checkpoint``, ``validate``, ``test``, ``predict`` and
``load_from_checkpoint``. One difference shows in the output: under ddp, Lightning's
``predict`` returns each rank's share, hookloop's every sample once, in dataset order.
tests/test_examples.py runs it under one process and under ddp.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

# Under Lightning:
#   from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from hookloop import DataModule as LightningDataModule
from hookloop import Module as LightningModule
from hookloop import Trainer, seed_everything


class DigitsDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 64):
        super().__init__()
        self.save_hyperparameters()

    def prepare_data(self):
        # once per node: sklearn ships the data, nothing to download
        from sklearn.datasets import load_digits

        load_digits()

    def setup(self, stage):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        data = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))
        self.train_set, self.val_set, self.test_set = random_split(
            data, [1300, 200, 297], generator=torch.Generator().manual_seed(0)
        )

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=256)

    def predict_dataloader(self):
        return DataLoader(self.test_set, batch_size=100)


class DigitsClassifier(LightningModule):
    def __init__(self, hidden: int = 128, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.epochs_seen = 0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def on_train_epoch_end(self):
        self.epochs_seen += 1
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log_dict(
            {"val_loss": F.cross_entropy(logits, y), "val_acc": (logits.argmax(-1) == y).float().mean()},
            sync_dist=True,
        )

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).argmax(-1)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-epochs", type=int, default=12)
    parser.add_argument("--root", default="lightning_port_logs")
    args = parser.parse_args(argv)

    seed_everything(0)
    dm = DigitsDataModule()
    model = DigitsClassifier()
    trainer = Trainer(
        max_epochs=args.max_epochs,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        default_root_dir=args.root,
    )
    trainer.fit(model, datamodule=dm)
    # ReduceLROnPlateau's, logged in on_train_epoch_end: read after fit (each validate/test/
    # predict starts with empty callback_metrics, as in Lightning)
    lr = trainer.callback_metrics["lr"]
    trainer.save_checkpoint(f"{args.root}/final.ckpt")  # every rank calls it; rank 0 writes
    val = trainer.validate(model, datamodule=dm, verbose=False)[0]
    test = trainer.test(model, datamodule=dm, verbose=False)[0]
    predictions = torch.cat(trainer.predict(model, datamodule=dm))
    summary = {
        "world_size": trainer.world_size,
        "val_acc": val["val_acc"],
        "test_acc": test["test_acc"],
        "predictions": len(predictions),
        "lr": lr,
        "epochs_seen": model.epochs_seen,
    }
    if trainer.global_rank == 0:
        restored = DigitsClassifier.load_from_checkpoint(f"{args.root}/final.ckpt")
        summary["restored_hidden"] = restored.hparams.hidden
        summary["restored_equal"] = all(
            torch.equal(a, b) for a, b in zip(restored.state_dict().values(), model.state_dict().values()))
        print(f"lightning_port: val_acc {summary['val_acc']:.4f}  test_acc {summary['test_acc']:.4f}  "
              f"{summary['predictions']} predictions  lr {summary['lr']:.4g}  world {summary['world_size']}")
    return summary


if __name__ == "__main__":
    main()
