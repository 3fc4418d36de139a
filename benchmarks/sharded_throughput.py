"""Training throughput of ``ddp_sharded`` beside ``ddp`` and raw DDP, in one run.

A sibling of ``ddp_throughput.py``: two processes (gloo, CPU), the same MLP (256 -> 512
-> 512 -> 10, SGD with momentum), the same data (DistributedSampler, batch 64 per rank),
trained in the same workers through

* ``raw``: a hand-written loop around ``DistributedDataParallel`` (the reference),
* ``raw_sharded``: a hand-written loop around fairscale's ``OSS`` + ``ShardedDataParallel``,
* ``hookloop.Trainer(plugins=["ddp"])``,
* ``hookloop.Trainer(plugins=["ddp_sharded"])``.

Each variant trains ``--epochs`` epochs per round, the first being the warm-up; the
variants of a round run back to back, in an order that rotates from round to round, so
their ratios see the same machine. The median steps/s of each variant and the medians of
the per-round ratios are printed; the last line is ``ddp_sharded/ddp <ratio>``.

    python benchmarks/sharded_throughput.py [--rounds 7] [--epochs 3] [--samples 8192]

On the CPU with two processes sharding saves memory (see memory.py), not time: OSS adds
a broadcast of the updated parameters after every step to DDP's gradient reduction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_throughput import BATCH, hookloop_round, make_data, make_net  # noqa: E402  the same model, data, clock

VARIANTS = ("raw", "raw_sharded", "ddp", "ddp_sharded")


def raw_round(data: TensorDataset, epochs: int, sharded: bool) -> float:
    """Steps/s of epochs 2.. of a hand-written loop (DDP, or fairscale's OSS + ShardedDDP)."""
    net = make_net()
    if sharded:
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS

        optimizer = OSS(net.parameters(), optim=torch.optim.SGD, lr=0.01, momentum=0.9)
        model = ShardedDataParallel(net, optimizer)
    else:
        model = nn.parallel.DistributedDataParallel(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    steps, start = 0, None
    for epoch in range(epochs):
        if epoch == 1:
            start, steps = time.perf_counter(), 0
        sampler.set_epoch(epoch)
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            if sharded:
                model.zero_grad(set_to_none=True)
            else:
                optimizer.zero_grad(set_to_none=True)
            steps += 1
    return steps / (time.perf_counter() - start)


def worker(args) -> None:
    # One process group for the whole run; the strategies use a group that exists.
    dist.init_process_group("gloo")
    data = make_data(args.samples)
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        for name in order:
            if name.startswith("raw"):
                value = raw_round(data, args.epochs, sharded=name == "raw_sharded")
            else:
                value = hookloop_round(data, args.epochs, name)
            results[name].append(value)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.result is not None:  # inside a worker
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               f"--rounds={args.rounds}", f"--epochs={args.epochs}", f"--samples={args.samples}", f"--result={result}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        results = json.loads(result.read_text())
    steps = args.samples // 2 // BATCH * (args.epochs - 1)
    print(f"2 processes (gloo, CPU), MLP 256-512-512-10, batch {BATCH}/rank, {steps} timed steps x {args.rounds} rounds")
    for name, values in results.items():
        print(f"{name:>12}: {statistics.median(values):8.1f} steps/s (median; rounds: {', '.join(f'{v:.1f}' for v in values)})")

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(results[a], results[b]))

    print(f"raw_sharded/raw {ratio('raw_sharded', 'raw'):.3f}  (fairscale's own cost, hand-written)")
    print(f"ddp/raw {ratio('ddp', 'raw'):.3f}  ddp_sharded/raw_sharded {ratio('ddp_sharded', 'raw_sharded'):.3f}  (hookloop's cost)")
    print(f"ddp_sharded/ddp {ratio('ddp_sharded', 'ddp'):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
