"""A small MLP for hookloop-float8 (tests/test_float8.py, tests/gpu/test_float8_gpu.py):
its hidden layers' dimensions are multiples of 16 (float8 matmuls), its head's are not."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import hookloop


def data(n: int = 64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


class MLP(hookloop.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 3)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def reference(steps: int, device: str, batch_size: int = 16) -> dict:
    """torchao's own conversion (fc1, fc2) and a hand-written loop on ``device``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = MLP().to(device)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda m, fqn: fqn in ("fc1", "fc2"))
    opt = model.configure_optimizers()
    x, y = data().tensors
    for i in range(steps):
        opt.zero_grad()
        model.training_step((x[i * batch_size:(i + 1) * batch_size].to(device),
                             y[i * batch_size:(i + 1) * batch_size].to(device)), i).backward()
        opt.step()
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
