"""Data defects of issue 17 §2: the distributed sampler's seed, the order of gathered
predictions, DataModules by duck type.

Multi-process checks run on 2 real processes (gloo, CPU) through
``hookloop.testing.run_processes``; each compares with a reference computed here:
``DistributedSampler``'s own order, or a single-process prediction.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import hookloop
from hookloop.testing import run_processes

WORLD = 2


class Numbers(Dataset):
    """Sample ``i`` is ``(tensor([i.]), i)``: a prediction says which sample it was."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i


class Records(hookloop.Module):
    """Records the sample indices each epoch trains on; predicts ``3 * x + 1`` and the index."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def on_train_epoch_start(self):
        self.seen.append([])

    def training_step(self, batch, batch_idx):
        x, index = batch
        self.seen[-1] += index.tolist()
        return self.layer(x).sum()

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, index = batch
        return {"y": 3 * x + 1, "index": index}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(root: str, **kwargs) -> hookloop.Trainer:
    kwargs.setdefault("plugins", ["ddp"])
    return hookloop.Trainer(accelerator="cpu", enable_checkpointing=False, num_sanity_val_steps=0,
                            default_root_dir=root, **kwargs)


# ---------------------------------------------------------------------------------------
# 8. The DistributedSampler's seed is the one seed_everything set
# ---------------------------------------------------------------------------------------


def _train_orders(seeds: list, epochs: int, n: int) -> dict:
    """Rank's training order per epoch, for each seed of ``seeds`` (one fit each)."""
    orders = {}
    for seed in seeds:
        hookloop.seed_everything(seed)
        module = Records()
        with tempfile.TemporaryDirectory() as root:
            _trainer(root, max_epochs=epochs).fit(module, DataLoader(Numbers(n), batch_size=3, shuffle=True))
        orders[seed] = module.seen
    return orders


def test_ddp_sampler_uses_the_seed_of_seed_everything():
    n, epochs, seeds = 14, 2, [1, 2]
    ranks = run_processes(_train_orders, nprocs=WORLD, args=(seeds, epochs, n), timeout=240)
    for rank, orders in enumerate(ranks):
        for seed in seeds:
            for epoch in range(epochs):
                # What Lightning builds: DistributedSampler(seed=int(PL_GLOBAL_SEED)).
                expected = DistributedSampler(Numbers(n), num_replicas=WORLD, rank=rank, shuffle=True, seed=seed)
                expected.set_epoch(epoch)
                assert orders[seed][epoch] == list(expected), (rank, seed, epoch)
        assert orders[1] != orders[2]


def test_seed_everything_records_the_seed_for_the_samplers(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored (to unset) after the test
    monkeypatch.delenv("PL_GLOBAL_SEED")
    loader = DataLoader(Numbers(10), batch_size=2, shuffle=True)
    assert hookloop.distributed_sampler(loader, 2, 0, training=True).seed == 0  # nothing set: 0, as Lightning
    hookloop.seed_everything(7)
    assert os.environ["PL_GLOBAL_SEED"] == "7"
    for sampler in (hookloop.distributed_sampler(loader, 2, 1, training=True),
                    hookloop.distributed_sampler(DataLoader(Numbers(10), sampler=[3, 1, 2]), 2, 1, training=True)):
        assert sampler.seed == 7
    # An explicit seed (ddp's sampler_seed option) still wins.
    assert hookloop.distributed_sampler(loader, 2, 0, training=True, seed=3).seed == 3
