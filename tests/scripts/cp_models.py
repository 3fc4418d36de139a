"""A tiny causal attention model for hookloop-cp (tests/test_cp.py, tests/gpu/test_cp_gpu.py
and their script cp_train.py): token features in, a class per position out."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import hookloop

SEQ, DIM, HEADS, CLASSES = 8, 8, 2, 4  # SEQ: a multiple of 2 x cp for cp = 1, 2, 4


def data(n: int = 32, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SEQ, DIM, generator=g)
    y = (x[:, :, 0] > 0).long() + (x.cumsum(1)[:, :, 1] > 0).long()  # depends on the earlier positions
    return TensorDataset(x, y)


class CausalNet(hookloop.Module):
    def __init__(self, seed: int = 0, lr: float = 0.1):
        super().__init__()
        torch.manual_seed(seed)
        self.lr = lr
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.out(y.transpose(1, 2).reshape(b, t, DIM)))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, CLASSES), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class PositionNet(CausalNet):
    """``CausalNet`` without its attention: every position computed alone (LayerNorm,
    Linear layers). The CPU check of the cp plugin's data path (tests/test_cp.py)."""

    def forward(self, x):
        return self.head(x + self.out(self.qkv(self.norm(x))[..., :DIM]))


def reference(steps: int, device: str = "cpu", batch_size: int = 4, model_class=CausalNet) -> dict:
    """The same model and batches trained by a hand-written loop in one process."""
    model = model_class().to(device)
    opt = model.configure_optimizers()
    x, y = data().tensors
    for i in range(steps):
        batch = (x[i * batch_size:(i + 1) * batch_size].to(device), y[i * batch_size:(i + 1) * batch_size].to(device))
        opt.zero_grad()
        model.loss(batch).backward()
        opt.step()
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
