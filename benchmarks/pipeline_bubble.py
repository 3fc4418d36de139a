"""Pipeline step time against GPipe's bubble bound, for chunks = 1, 2, 4, 8.

hookloop-fairscale's ``ddp_sequential`` on 2 processes (gloo, CPU, one thread each): an
MLP of 8 x (Linear 512 -> 512, ReLU) split into 2 equal stages, batch 64. With ``S``
stages and ``m`` micro-batches, GPipe leaves each stage idle for a fraction

    bubble = (S - 1) / (m + S - 1)

of a step, so the best step time is ``(T1 / S) / (1 - bubble)``, where ``T1`` is the
time of the same step in one process (measured here too, on rank 0 with one thread,
while rank 1 waits). For each ``chunks`` the table prints the measured step time, the
bubble bound, that best time, and measured / best (1.00 = the bound is met; above it:
the cost of sending activations and of smaller matrix products per micro-batch).

Rounds are interleaved (every round runs every ``chunks``, in a rotating order) and the
medians are printed, beside the same pipeline written by hand with
``torch.distributed.pipelining`` (``raw pipelining``: what hookloop adds is the ratio).
``pipe`` (fairscale's Pipe in one process) runs its partitions
in one worker thread per device, so two ``"cpu"`` partitions share one thread: it shows
no overlap on the CPU and is not timed here.

    python benchmarks/pipeline_bubble.py [--rounds 5] [--steps 12]
"""

from __future__ import annotations

import argparse
import contextlib
import io
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
from torch.utils.data import DataLoader, TensorDataset

WIDTH, BLOCKS, BATCH, STAGES, WARMUP = 512, 8, 64, 2, 3
CHUNKS = (1, 2, 4, 8)


def make_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(BLOCKS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def make_data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = BATCH * steps
    return TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))


def single_process_step_time(steps: int) -> float:
    """Median seconds of one optimizer step of the whole model, in one process."""
    layers = make_layers()
    optimizer = torch.optim.SGD(layers.parameters(), lr=0.01)
    times = []
    for x, y in DataLoader(make_data(steps + WARMUP), batch_size=BATCH):
        start = time.perf_counter()
        F.mse_loss(layers(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def pipeline_step_time(chunks: int, steps: int) -> float:
    """Median seconds of one step of ``ddp_sequential`` with ``chunks`` micro-batches."""
    import hookloop

    class Net(hookloop.Module):
        def __init__(self):
            super().__init__()
            self.sequential_module = make_layers()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.sequential_module(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock:
        hookloop_name, hookloop_role = "clock", "observer"

        def __init__(self):
            self.times: list[float] = []
            self.start = 0.0

        @hookloop.hookimpl
        def on_train_batch_start(self):
            self.start = time.perf_counter()

        @hookloop.hookimpl
        def on_train_batch_end(self):
            self.times.append(time.perf_counter() - self.start)

    clock = Clock()
    half = BLOCKS  # layers per stage: BLOCKS x (Linear, ReLU) split in two
    strategy = hookloop.plugin("ddp_sequential", balance=[half, half], chunks=chunks)
    trainer = hookloop.Trainer(plugins=[strategy, clock], max_epochs=1, enable_checkpointing=False,
                               num_sanity_val_steps=0)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(Net(), DataLoader(make_data(steps + WARMUP), batch_size=BATCH))
    return statistics.median(clock.times[WARMUP:])


def raw_pipeline_step_time(chunks: int, steps: int) -> float:
    """The same pipeline written by hand with torch.distributed.pipelining (no hookloop)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank = dist.get_rank()
    layers = list(make_layers())
    stage_layers = nn.Sequential(*(layers[:len(layers) // 2] if rank == 0 else layers[len(layers) // 2:]))
    optimizer = torch.optim.SGD(stage_layers.parameters(), lr=0.01)
    schedule = ScheduleGPipe(PipelineStage(stage_layers, rank, STAGES, torch.device("cpu")), chunks,
                             loss_fn=F.mse_loss)
    times = []
    for x, y in DataLoader(make_data(steps + WARMUP), batch_size=BATCH):
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def worker(args) -> None:
    torch.set_num_threads(1)  # one core per stage, as torchrun's default
    import hookloop

    results: dict[str, list[float]] = {str(c): [] for c in CHUNKS}
    results.update({f"raw{c}": [] for c in CHUNKS})
    results["single"] = []
    for r in range(args.rounds):
        order = CHUNKS[r % len(CHUNKS):] + CHUNKS[: r % len(CHUNKS)]
        for chunks in order:
            results[str(chunks)].append(pipeline_step_time(chunks, args.steps))
        # A group of its own each round, with fresh keys in torchrun's store (hookloop's helper).
        hookloop.init_process_group("gloo", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        for chunks in order:
            results[f"raw{chunks}"].append(raw_pipeline_step_time(chunks, args.steps))
        if dist.get_rank() == 0:
            results["single"].append(single_process_step_time(args.steps))
        dist.barrier()
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        Path(args.result).write_text(json.dumps(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.result is not None:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={STAGES}", __file__,
               f"--rounds={args.rounds}", f"--steps={args.steps}", f"--result={result}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        results = json.loads(result.read_text())
    single = statistics.median(results["single"])
    print(f"ddp_sequential, {STAGES} stages on {STAGES} processes (gloo, CPU, 1 thread each); MLP {BLOCKS} x "
          f"Linear {WIDTH}; batch {BATCH}; medians of {args.rounds} interleaved rounds x {args.steps} steps")
    print(f"one process, whole model: T1 = {single * 1e3:.1f} ms/step; perfect {STAGES}-way split: "
          f"{single / STAGES * 1e3:.1f} ms")
    print(f"{'chunks':>6} {'measured ms':>12} {'bubble bound':>13} {'best ms':>9} {'measured/best':>14} "
          f"{'T1/measured':>12} {'raw pipelining ms':>18} {'hookloop/raw':>13}")
    for chunks in CHUNKS:
        measured = statistics.median(results[str(chunks)])
        raw = statistics.median(results[f"raw{chunks}"])
        ratio = statistics.median(h / w for h, w in zip(results[str(chunks)], results[f"raw{chunks}"]))
        bubble = (STAGES - 1) / (chunks + STAGES - 1)
        best = single / STAGES / (1 - bubble)
        print(f"{chunks:>6} {measured * 1e3:>12.1f} {bubble:>13.3f} {best * 1e3:>9.1f} {measured / best:>14.2f} "
              f"{single / measured:>12.2f} {raw * 1e3:>18.1f} {ratio:>13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
