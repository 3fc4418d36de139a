"""The tiny model, data and hand-written one-process reference of tests/test_pipeline.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import hookloop

WIDTH, CLASSES, SAMPLES, BATCH, LR = 8, 4, 48, 8, 0.1
CLIP = 0.05  # gradient_clip_val of the clipping checks: below the gradients' norm and values


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, WIDTH, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g))


def blocks(seed: int = 0) -> nn.Sequential:
    """4 blocks (Linear + ReLU; the last Linear only), fp32."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(WIDTH, 16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, CLASSES)),
    )


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


class Net(hookloop.Module):
    """The blocks in ``self.blocks`` (the automatic split), the loss in ``pipeline_loss``."""

    def __init__(self, optimizer: str = "sgd", seed: int = 0):
        super().__init__()
        self.blocks = blocks(seed)
        self.optimizer_name = optimizer

    def forward(self, x):
        return self.blocks(x)

    def pipeline_loss(self, output, target):
        return F.cross_entropy(output, target)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self(x), y))

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_name, self.parameters())


class PlannedNet(Net):
    """Net with a tensor-parallel plan for hookloop-tp: blocks 0-1 and 2-3 are
    colwise/rowwise pairs (under 4 pipeline stages a pair spans two stages: the colwise
    block's output shard is what goes to the next stage)."""

    @property
    def tensor_parallel_plan(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"blocks.0.0": ColwiseParallel(), "blocks.1.0": RowwiseParallel(),
                "blocks.2.0": ColwiseParallel(), "blocks.3.0": RowwiseParallel()}


def reference(optimizer: str, steps: int, seed: int = 0, batches: list | None = None,
              clip: str | None = None) -> tuple[dict, list[float]]:
    """The same model trained by a plain loop in one process: one full-batch step per
    batch (the pipeline's micro-batches accumulate to it). ``batches``: the sample
    indices of each step (under pp x ddp the replicas' batches together, the global
    batch); default: the loader's order, ``BATCH`` at a time. ``(state_dict, losses)``."""
    model = blocks(seed)
    opt = make_optimizer(optimizer, model.parameters())
    x, y = data().tensors
    losses = []
    for step in range(steps):
        index = batches[step] if batches is not None else list(range(step * BATCH, (step + 1) * BATCH))
        xb, yb = x[index], y[index]
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return {f"blocks.{k}": v.detach().clone() for k, v in model.state_dict().items()}, losses


def indices(inputs: torch.Tensor) -> list[int]:
    """The dataset indices of a batch's input rows."""
    x = data().tensors[0]
    return [int(((x - row).abs().sum(1) == 0).nonzero()) for row in inputs]
