"""The GPT example parallelised by hand, torchtitan-style: the reference of nd_step_time.py.

No hookloop in the loop: ``init_device_mesh``, ``parallelize_module`` on each block's
attention and MLP (the plan hookloop-tp's automatic plan makes: q/k/v colwise, out
rowwise, fc1 colwise, fc2 rowwise), ``fully_shard`` on each block then the root (FSDP2),
``DistributedDataParallel`` for ddp, a ``DistributedSampler`` over the data-parallel
ranks, and a plain loop (zero_grad, forward, loss, backward, step). It uses the
example's model and data classes (examples/gpt.py), so both sides train the same thing.

    python -m torch.distributed.run --nproc-per-node 4 benchmarks/handwritten_nd.py \\
        --layout fsdp_tp --out DIR [--layers 4 --dim 256 --heads 8 --seq 128 --batch-size 8 --steps 8]

Each rank writes ``DIR/hand_rank<R>.json``: its step times (seconds, from the end of one
optimizer step to the end of the next: the data fetch included, as for hookloop).
Layouts: ``one`` (no process group), ``ddp``, ``fsdp``, ``tp``, ``fsdp_tp``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402  (examples/gpt.py)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stepwork import StepWork  # noqa: E402

LAYOUTS = ("one", "ddp", "fsdp", "tp", "fsdp_tp")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=LAYOUTS, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="per data-parallel replica")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def tensor_parallel(model, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(block.attn, tp_mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                 "v_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
        parallelize_module(block.mlp, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def fully_shard_blocks(model, dp_mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    layout = args.layout
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    data = gpt.TextDataModule(seq=args.seq, batch_size=args.batch_size)
    data.setup("fit")
    model = gpt.GPT(len(data.vocab), layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq,
                    lr=args.lr, seed=0)
    dp_size, dp_rank = 1, 0
    if layout != "one":
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        if layout == "fsdp_tp":
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
            dp_mesh, tp_mesh = mesh["dp_shard"], mesh["tp"]
        else:
            name = {"ddp": "dp_replicate", "fsdp": "dp_shard", "tp": "tp"}[layout]
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(name,))
            dp_mesh = tp_mesh = mesh
        if layout in ("tp", "fsdp_tp"):
            tensor_parallel(model, tp_mesh)
        if layout in ("fsdp", "fsdp_tp"):
            fully_shard_blocks(model, dp_mesh)
        if layout == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        if layout != "tp":
            dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if dp_size > 1:
        sampler = DistributedSampler(data.train, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    else:
        sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    work, losses = StepWork(), []
    work.tick(0)
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        work.tick(step + 1)
        losses.append(float(loss.detach()))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"hand_rank{rank}.json").write_text(json.dumps({**work.record(), "losses": losses, "threads": torch.get_num_threads()}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
