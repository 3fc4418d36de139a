"""Models and data shared by the tp battery (in the workers) and tests/test_tp.py (which
trains the same models in one process with a hand-written PyTorch loop as references)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import hookloop

SEQ, DIM, CLASSES = 6, 8, 4


def data(n: int = 32, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SEQ, DIM, generator=g)
    y = (x[:, :, 0] > 0).long() + (x[:, :, 1] > 0).long()
    return TensorDataset(x, y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, 16)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(16, DIM)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Two heads; the heads are a view of -1 so each tp process computes its own. The key
    projection has no bias: its gradient is zero in exact arithmetic (softmax ignores a
    constant added to a row of scores), so Adam would turn rounding noise into full steps."""

    def __init__(self, heads: int = 2):
        super().__init__()
        self.head_dim = DIM // heads
        self.q, self.k, self.v, self.out = (nn.Linear(DIM, DIM, bias=name != "k") for name in "qkvo")

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Net(hookloop.Module):
    """A residual block (attention optional) and a replicated head: LayerNorm, the MLP,
    and the head stay whole on every process."""

    def __init__(self, attention: bool = False, optimizer: str = "sgd", seed: int = 0, lr: float = 0.1):
        super().__init__()
        torch.manual_seed(seed)
        self.optimizer_name, self.lr = optimizer, lr
        self.norm = nn.LayerNorm(DIM)
        self.attn = Attention() if attention else None
        self.mlp = MLP()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        if self.attn is not None:
            x = x + self.attn(self.norm(x))
        x = x + self.mlp(self.norm(x))
        return self.head(x)

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


def reference(attention: bool, optimizer: str, steps: int, batch_size: int = 4) -> tuple[dict, dict]:
    """The same model and batches trained by a hand-written loop in one process:
    (weights after ``steps`` steps, gradients of the last step)."""
    model = Net(attention=attention, optimizer=optimizer)
    opt = model.make_optimizer(model.parameters())
    ds = data()
    for i in range(steps):
        batch = ds[i * batch_size:(i + 1) * batch_size]
        opt.zero_grad()
        model.loss(batch).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, grads


def shuffled_order(steps: int, batch_size: int = 4) -> list:
    """The inputs of the first ``steps`` batches of ``DataLoader(data(), batch_size,
    shuffle=True)`` in one process, right after ``Net()`` is built (which seeds torch's
    generator): the order a script of one process trains on."""
    from torch.utils.data import DataLoader

    Net()
    batches = iter(DataLoader(data(), batch_size=batch_size, shuffle=True))
    return [next(batches)[0] for _ in range(steps)]


class PlannedNet(Net):
    """``Net`` with its own plan: the MLP split, and the head colwise with its output left
    a DTensor sharded on the classes, for ``loss_parallel``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        self.tensor_parallel_plan = {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
                                     "head": ColwiseParallel(use_local_output=False)}


class HookedNet(Net):
    """``Net`` that parallelizes itself in ``configure_tensor_parallel(mesh)``: only the MLP."""

    def configure_tensor_parallel(self, mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.mesh_seen = (mesh.mesh_dim_names, mesh.size())
        parallelize_module(self.mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


# -- models that tp splits wrongly (issue 33): the self-check (tp.verify) must stop them --------


class FusedAttention(nn.Module):
    """One fused projection ``qkv = nn.Linear(DIM, 3 * DIM)``, ``chunk(3, -1)`` and ``-1``
    heads, as the tp README asks of the heads: a contiguous colwise split (a plan naming
    ``qkv`` colwise) gives process 0 all of q and half of k. It runs under tp, and computes
    another function; the automatic plan leaves it whole."""

    def __init__(self, heads: int = 2):
        super().__init__()
        self.head_dim = DIM // heads
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class GlobalHeadsAttention(Attention):
    """``Attention`` whose heads are viewed with the global head count, ``view(b, t, H, -1)``
    (as most code does): under tp each process's q/k/v hold H / tp heads, so this makes H
    heads of half the size. It runs under tp, and computes another function."""

    def __init__(self, heads: int = 2):
        super().__init__(heads)
        self.n_head = heads

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.n_head, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    """Llama's gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(DIM, 16), nn.Linear(DIM, 16), nn.Linear(16, DIM)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class FusedNet(Net):
    """``FusedAttention`` under a plan of the user's that splits ``qkv`` colwise (as a
    tutorial's plan for separate projections would): the automatic plan leaves a fused
    attention whole (exact), an explicit plan is trusted, and the self-check stops it."""

    def __init__(self, **kwargs):
        super().__init__(attention=True, **kwargs)
        torch.manual_seed(3)
        self.attn = FusedAttention()
        self.tensor_parallel_plan = {"attn.qkv": "colwise", "attn.out": "rowwise",
                                     "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}


class GlobalHeadsNet(Net):
    def __init__(self, **kwargs):
        super().__init__(attention=True, **kwargs)
        torch.manual_seed(3)
        self.attn = GlobalHeadsAttention()


class UnpairedGateNet(Net):
    """A gated MLP whose plan splits up (colwise) and down (rowwise) and leaves the gate
    whole: the split forward fails inside the MLP (shapes 16 and 8)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        torch.manual_seed(3)
        self.mlp = GatedMLP()
        self.tensor_parallel_plan = {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}


def reference_of(cls, steps: int, batch_size: int = 4, **kwargs) -> dict:
    """``reference`` for any of the models above: the weights after ``steps`` SGD steps
    of a hand-written loop in one process."""
    model = cls(**kwargs)
    opt = model.make_optimizer(model.parameters())
    ds = data()
    for i in range(steps):
        opt.zero_grad()
        model.loss(ds[i * batch_size:(i + 1) * batch_size]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
