"""A nanoGPT-shaped module and its hand-written reference loop, for the clipping checks
(issue 33): tests/test_clipping.py in one process, ddp_battery.py and fsdp_battery.py on
two. Its ``configure_optimizers`` is nanoGPT's: AdamW over two groups (weights that
decay, biases and norms that do not), so the optimizer holds the parameters in another
order than ``model.parameters()``, the order a hand-written loop clips them in.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

VOCAB, BLOCK, DIM = 32, 8, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.c_attn, self.attn_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.c_fc, self.mlp_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, 2, c // 2).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(hookloop.Module):
    """Token and position embeddings, two blocks, a final norm, a head tied to the embedding."""

    def __init__(self, seed: int = 0, optimizer: str = "adamw"):
        super().__init__()
        torch.manual_seed(seed)
        self.optimizer = optimizer
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(BLOCK, DIM)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # nanoGPT's weight tying

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return nanogpt_optimizer(self, self.optimizer)


def nanogpt_optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    """nanoGPT's ``configure_optimizers``: 2-D tensors decay, the others do not. ``"sgd"``:
    the same two groups with SGD, whose update is linear in the gradient (Adam turns a
    rounding of a near-zero gradient into a step of ``lr``: for tolerances across layouts)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))


def tokens(n: int = 32, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (n, BLOCK + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def reference_loop(model: TinyGPT, loader: DataLoader, clip: float | None, algorithm: str = "norm",
                   steps: int | None = None) -> list[float]:
    """nanoGPT's loop by hand: backward, ``clip_grad_norm_(model.parameters(), clip)``
    (or ``clip_grad_value_``), step, zero the gradients. Returns the total norms seen."""
    optimizer = nanogpt_optimizer(model)
    norms = []
    for i, batch in enumerate(loader):
        if steps is not None and i == steps:
            break
        model.loss(batch).backward()
        if clip and algorithm == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        elif clip:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def concatenated_reference(data: TensorDataset, clip: float, batch: int, world: int = 2, epochs: int = 1,
                           optimizer: str = "adamw") -> dict:
    """One process, the hand-written loop, on the batches of all ``world`` ranks put
    together: rank ``r`` of a run with ``DistributedSampler(shuffle=True, seed=0)`` takes
    ``batch`` samples per step, and the mean loss over their concatenation has the
    gradient the data-parallel average makes. Returns the weights."""
    from ddp_reference import concatenated_indices  # (tests only: the launched scripts never call this)

    model = TinyGPT(seed=0)
    optimizer = nanogpt_optimizer(model, optimizer)
    x_all, y_all = data.tensors
    for index in concatenated_indices(data, epochs, batch, world, drop_last=True):
        model.loss((x_all[index], y_all[index])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
