"""Models and data shared by the fsdp battery (in the workers) and tests/test_fsdp.py
(which builds the same models in one process as references)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import hookloop


def data(n: int = 64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(x, y)


class Block(nn.Module):
    """Linear -> LayerNorm -> ReLU; counts its forward calls (recomputation included)."""

    def __init__(self, i: int, o: int):
        super().__init__()
        self.fc = nn.Linear(i, o)
        self.norm = nn.LayerNorm(o)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return F.relu(self.norm(self.fc(x)))


class Net(hookloop.Module):
    """8 -> width -> width -> 3: two Blocks and a head. SGD with momentum or Adam, with a
    StepLR stepped every optimizer step. ``lazy``: the layers are made in
    ``configure_model`` (on the meta device under fsdp), else in ``__init__``."""

    def __init__(self, seed: int = 0, optimizer: str = "sgd", lazy: bool = False, width: int = 32,
                 layers: int = 2, lr: float = 0.05):
        super().__init__()
        self.seed, self.optimizer_name, self.width, self.layers, self.lazy, self.lr = seed, optimizer, width, layers, lazy, lr
        self.dtypes: list = []
        if not lazy:
            self.build()

    def build(self) -> None:
        # seeded here, not in __init__: a lazy build runs after the strategy's reset_seed
        torch.manual_seed(self.seed)
        w = self.width
        self.blocks = nn.Sequential(Block(8, w), *[Block(w, w) for _ in range(self.layers - 1)])
        self.head = nn.Linear(w, 3)

    def configure_model(self):
        if self.lazy and "blocks" not in self._modules:
            self.build()

    def forward(self, x):
        return self.head(self.blocks(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.dtypes.append(logits.dtype)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)
        self.log("val_rank", float(self.trainer.global_rank), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).float()

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr / 5)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Bare(hookloop.Module):
    """A module whose parameter has no reset_parameters(): meta-device creation cannot
    initialise it."""

    def configure_model(self):
        self.scale = nn.Parameter(torch.ones(4))

    def training_step(self, batch, batch_idx):
        return (batch[0][:, :4] * self.scale).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
