"""The tiny model and data of tests/test_mesh.py and tests/scripts/mesh_run.py, and the
steps the tests' small classifiers share (:class:`Classifies`: tests/scripts/powersgd_gloo_job.py,
tests/test_averaging.py and its Lightning script)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import hookloop

STEPS, LR = 4, 0.2


def data(n: int = 16, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def build(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


class Classifies:
    """``forward`` through ``self.net`` and a cross-entropy ``training_step`` over ``(x, y)``
    batches: mixed into a ``hookloop.Module`` (or a ``pl.LightningModule``) before it."""

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)


class MLP(Classifies, hookloop.Module):
    def __init__(self):
        super().__init__()
        self.net = build()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)
