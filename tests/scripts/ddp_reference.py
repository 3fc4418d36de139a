"""References for the ddp tests, computed in one process with plain PyTorch."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F
from torch.utils.data import DistributedSampler, TensorDataset

from conftest import TinyModule, state_of


def concatenated_batches_run(
    data: TensorDataset, epochs: int, batch: int, world: int = 2, momentum: float = 0.9, seed: int = 0
) -> dict:
    """One process trains on the batches of all ``world`` ranks put together.

    Rank ``r`` of a DDP run with ``DistributedSampler(shuffle=True, seed=0)`` takes
    ``batch`` samples per step; the mean loss over their concatenation has the gradient
    that DDP's all-reduce averages, so the weights must agree to rounding.
    """
    module = TinyModule(seed=seed, momentum=momentum)  # rank 0's initial weights
    optimizer = module.configure_optimizers()
    x_all, y_all = data.tensors
    for index in concatenated_indices(data, epochs, batch, world):
        F.cross_entropy(module(x_all[index]), y_all[index]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return state_of(module)


def concatenated_indices(data: TensorDataset, epochs: int, batch: int, world: int = 2, drop_last: bool = False):
    """The sample indices of each step of a ``world``-rank run with
    ``DistributedSampler(shuffle=True, seed=0)`` and ``batch`` samples per rank and step,
    the ranks' batches put together (rank 0's first); ``drop_last``: no short last step."""
    samplers = [DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0) for r in range(world)]
    for epoch in range(epochs):
        orders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        steps = len(orders[0]) // batch if drop_last else math.ceil(len(orders[0]) / batch)
        for i in range(steps):
            yield torch.tensor([j for order in orders for j in order[i * batch : (i + 1) * batch]])
