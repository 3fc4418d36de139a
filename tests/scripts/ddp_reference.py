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
    samplers = [DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0) for r in range(world)]
    x_all, y_all = data.tensors
    for epoch in range(epochs):
        orders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for i in range(math.ceil(len(orders[0]) / batch)):
            index = torch.tensor([j for order in orders for j in order[i * batch : (i + 1) * batch]])
            F.cross_entropy(module(x_all[index]), y_all[index]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return state_of(module)
