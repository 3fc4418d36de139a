"""The model and data of the ft tests (tests/test_ft.py, ft_group.py): cheap to import.

Each replica group trains on one fixed batch of its own, every step, so a group's batch
does not depend on where its loader is (a restarted group's loader starts again from the
top) and the reference is one batch per group per step.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH = 8
LR, MOMENTUM = 0.1, 0.9


def make_net(seed: int = 0) -> nn.Sequential:
    """Linear 8 -> 16 -> ReLU -> 3, deterministic from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def group_batch(group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica group ``group``'s fixed batch: ``BATCH`` samples of its own."""
    g = torch.Generator().manual_seed(100 + group)
    x = torch.randn(BATCH, 8, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def make_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
