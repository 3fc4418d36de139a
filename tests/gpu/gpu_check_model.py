"""The model and data of the GPU tests (tests/gpu), importable by their subprocess scripts."""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import hookloop


def data(n=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(x, y)


class Net(hookloop.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3))
        self.seen = []
        self.lock = threading.Lock()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        with self.lock:  # DataParallel replicas run this concurrently
            self.seen.append((str(x.device), len(x), torch.is_autocast_enabled("cuda"), logits.dtype))
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class MetricsNet(Net):
    """Net whose steps log what the metric-reduction tests read back.

    ``train_loss``: an epoch mean, reduced across ranks. ``x0_mean``: a per-step value,
    logged by every DataParallel replica. ``val_acc``: a validation mean, ``val_max``: a
    validation max, both reduced across ranks. ``x0_mean`` and ``val_max`` depend on the
    data only, so their references need no model.
    """

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        # on_step=False: in training_step Lightning's default is on_step=True, and with
        # on_epoch=True as well the metric would be forked into train_loss_step/_epoch.
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("x0_mean", batch[0][:, 0].mean())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)
        self.log("val_max", x.abs().max(), sync_dist=True, reduce_op="max")
