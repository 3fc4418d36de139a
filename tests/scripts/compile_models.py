"""Models, data and the hand-written eager loop shared by tests/test_compile.py (one
process) and tests/scripts/compile_job.py (the workers of a 2-process run)."""

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
    """Linear -> LayerNorm -> tanh."""

    def __init__(self, i: int, o: int):
        super().__init__()
        self.fc = nn.Linear(i, o)
        self.norm = nn.LayerNorm(o)

    def forward(self, x):
        return torch.tanh(self.norm(self.fc(x)))


class Net(hookloop.Module):
    """8 -> 16 -> 16 -> 3: two Blocks and a head, SGD with momentum. ``graph_break``:
    forward reads a value on the host (``.item()``), which Dynamo cannot trace."""

    def __init__(self, seed: int = 0, graph_break: bool = False, lr: float = 0.1):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.Sequential(Block(8, 16), Block(16, 16))
        self.head = nn.Linear(16, 3)
        self.graph_break, self.lr = graph_break, lr

    def forward(self, x):
        h = self.blocks(x)
        if self.graph_break and h.abs().sum().item() < 0:  # never true: only the break matters
            h = -h
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def eager_reference(module: Net, loader, epochs: int) -> dict:
    """The hand-written eager PyTorch loop; returns the final weights. ``loader`` is
    iterated once per epoch, or is a function of the epoch giving its batches."""
    opt = module.configure_optimizers()
    for epoch in range(epochs):
        for x, y in (loader(epoch) if callable(loader) else loader):
            F.cross_entropy(module(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def data_parallel_batches(dataset, world: int, per_rank: int, seed: int = 0):
    """The global batches of a ``world``-process data-parallel epoch, as a function of
    the epoch: step k's batch is every rank's k-th batch of ``DistributedSampler``
    (shuffled with ``seed``, as hookloop's strategies shard a training loader) together;
    with equal shares, the mean loss over it is the mean of the ranks' means."""
    from torch.utils.data import DistributedSampler

    def batches(epoch: int):
        shares = []
        for rank in range(world):
            sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
        steps = -(-len(shares[0]) // per_rank)
        for k in range(steps):
            idx = [i for share in shares for i in share[k * per_rank:(k + 1) * per_rank]]
            yield dataset[idx]

    return batches


class Encoder(hookloop.Module):
    """Two of torch's own ``nn.TransformerEncoderLayer`` (d_model 8, no dropout) over
    sequences of 4 tokens, mean-pooled into a 3-way head: blocks whose ``forward`` is
    torch's code, which Dynamo does not start a frame in."""

    def __init__(self, seed: int = 0, lr: float = 0.05):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(*[nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
                                      for _ in range(2)])
        self.head = nn.Linear(8, 3)
        self.lr = lr

    def forward(self, x):
        return self.head(self.layers(x.view(x.shape[0], 1, 8).expand(-1, 4, -1)).mean(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
