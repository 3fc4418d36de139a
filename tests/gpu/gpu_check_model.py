"""The model and data of tests/gpu/run_gpu_checks.py, importable by its subprocess scripts."""

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
