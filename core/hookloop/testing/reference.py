"""A tiny model, a tiny data set and the hand-written PyTorch loop a plugin is held to."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import hookloop


def tiny_dataset(n: int = 64, features: int = 8, seed: int = 1) -> "IndexedDataset":
    """``n`` samples of ``features`` inputs and a 3-class label, deterministic from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return IndexedDataset(x, y)


class IndexedDataset(Dataset):
    """``(x, y, index)`` samples, so a step can record which samples it saw."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class TinyClassifier(hookloop.Module):
    """Linear 8 -> 16 -> ReLU -> 3, SGD with momentum; records the sample indices it
    trains and validates on (``seen_train``, ``seen_val``) and logs ``val_acc``."""

    def __init__(self, seed: int = 0, lr: float = 0.1, momentum: float = 0.9):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.lr, self.momentum = lr, momentum
        self.seen_train: list[int] = []
        self.seen_val: list[int] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen_train += index.tolist()
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen_val += index.tolist()
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state as plain CPU float tensors (a DTensor, e.g. FSDP's sharded state:
    this rank's shard)."""
    return {k: local_tensor(v).detach().float().cpu().clone() for k, v in module.state_dict().items()}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``, or this rank's shard of it when it is a DTensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def reference_fit(epochs: int, batch_size: int, world_size: int = 1, accumulate: int = 1, n: int = 64,
                  seed: int = 0, sampler_seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights a data-parallel run of ``world_size`` ranks must reach, computed in one
    process by hand. One process iterates the (unshuffled) loader; under ``W > 1`` ranks
    each training loader is sharded by ``DistributedSampler(shuffle=True, seed=sampler_seed)``
    with ``set_epoch(epoch)`` (as in Lightning, even for an unshuffled loader), so the
    ranks' batch ``j`` together are the union of each rank's ``j``-th ``batch_size``
    indices, and averaging the ranks' gradients is the gradient of that union's mean loss."""
    module = TinyClassifier(seed=seed)
    optimizer = module.configure_optimizers()
    data = tiny_dataset(n)
    samplers = [DistributedSampler(data, num_replicas=world_size, rank=r, shuffle=True, seed=sampler_seed)
                for r in range(world_size)]
    steps = math.ceil(len(samplers[0]) / batch_size) if world_size > 1 else math.ceil(n / batch_size)
    for epoch in range(epochs):
        if world_size > 1:
            for sampler in samplers:
                sampler.set_epoch(epoch)
            orders = [list(sampler) for sampler in samplers]
            blocks = [[j for order in orders for j in order[i * batch_size:(i + 1) * batch_size]] for i in range(steps)]
        else:
            blocks = [list(range(n))[i * batch_size:(i + 1) * batch_size] for i in range(steps)]
        for i, block in enumerate(blocks):
            x, y, _ = data[torch.tensor(block)]
            (F.cross_entropy(module(x), y) / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == steps:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return weights(module)
