"""A tiny two-block transformer for the sequence-parallel checks (tests/test_tp_sp.py and
its 2-process script tp_sp_battery.py): LayerNorm, causal attention, dropout, MLP."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import hookloop
from tp_models import CLASSES, DIM, MLP, Attention, data  # noqa: F401  (data: re-exported)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.drop = nn.Dropout(0.0)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.mlp(self.norm2(x))


class Transformer(hookloop.Module):
    """Two blocks, a final LayerNorm and a per-position head (token classification)."""

    def __init__(self, optimizer: str = "sgd", seed: int = 0, lr: float = 0.1):
        super().__init__()
        torch.manual_seed(seed)
        self.optimizer_name, self.lr = optimizer, lr
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)
        with torch.no_grad():  # norms that are not the identity at the start
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.head(self.norm(self.blocks(x)))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, CLASSES), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def make_optimizer(self, parameters):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(parameters, lr=self.lr / 10)
        return torch.optim.SGD(parameters, lr=self.lr, momentum=0.9)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


class PlannedTransformer(Transformer):
    """``Transformer`` whose own ``tensor_parallel_plan`` is sequence parallel (the automatic
    plan's, asked for by the module rather than by the tp option)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from hookloop_tp import auto_plan

        self.tensor_parallel_plan = auto_plan(self, sequence_parallel=True)


def reference(optimizer: str, steps: int, batch_size: int = 4) -> tuple[dict, dict]:
    """The same model and batches trained by a hand-written loop in one process:
    (weights after ``steps`` steps, gradients of the last step)."""
    model = Transformer(optimizer=optimizer)
    opt = model.make_optimizer(model.parameters())
    ds = data()
    for i in range(steps):
        batch = ds[i * batch_size:(i + 1) * batch_size]
        opt.zero_grad()
        model.loss(batch).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, grads
