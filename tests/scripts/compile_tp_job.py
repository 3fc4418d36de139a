"""compile_in_place on a tensor-parallel MLP (DTensor ColwiseParallel/RowwiseParallel on
2 gloo processes), against the same MLP trained whole and eagerly in each process.

Run by tests/test_compile.py through torchrun: hookloop-compile's in-place compile
composes with ``parallelize_module`` (the transform tp applies before compile). Writes
``OUT/rank<R>.pt``: the largest difference of the gathered weights from the eager ones,
the parameter names, and the graphs Dynamo compiled.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F

from hookloop_compile import compile_in_place


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


dist.init_process_group("gloo")
try:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    eager, parallel = MLP(), MLP()
    parallel.load_state_dict(eager.state_dict())
    parallelize_module(parallel, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    compile_in_place(parallel, {"backend": "aot_eager"})
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, parallel)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        for model, optimizer in zip((eager, parallel), optimizers):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    gathered = {k: v.full_tensor() for k, v in parallel.state_dict().items()}
    from torch._dynamo.utils import counters

    torch.save({"diff": max(float((gathered[k] - v).abs().max()) for k, v in eager.state_dict().items()),
                "names": list(gathered), "graphs": counters["stats"]["unique_graphs"]},
               Path(sys.argv[1]) / f"rank{os.environ['RANK']}.pt")
finally:
    dist.destroy_process_group()
