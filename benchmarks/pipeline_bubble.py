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

``--schedules`` measures hookloop-pipeline's schedules instead (GPipe, 1F1B, interleaved
1F1B, looped BFS, interleaved and ZBV zero-bubble) on ``--procs`` processes (2 or 4),
``m`` = ``--microbatches`` micro-batches, the same MLP cut into ``procs x v`` stages. For
each rank it times the compute (every ``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` of its stages) against the wall time of ``schedule.step``;
the measured bubble is ``1 - busy / wall`` (the mean over ranks, medians over interleaved
rounds), printed next to the theoretical fraction of an idle stage: ``(p - 1) / (m + p -
1)`` for GPipe and 1F1B, the same with ``(p - 1) / v`` for the interleaved ones
(Narayanan et al. 2021), 0 for the zero-bubble bound (their weight-gradient passes fill
the idle slots; Qi et al. 2023). Sends and receives that wait count as bubble.

    python benchmarks/pipeline_bubble.py --schedules [--procs 2] [--rounds 3] [--steps 8]
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
    parser.add_argument("--schedules", action="store_true", help="hookloop-pipeline's schedules, busy vs wall")
    parser.add_argument("--procs", type=int, default=2, help="--schedules: pipeline ranks (2 or 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="--schedules: micro-batches per batch")
    args = parser.parse_args()
    if args.schedules:
        if args.result is not None:
            schedules_worker(args)
            return 0
        return schedules_main(args)
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


# ---------------------------------------------------------------------------------------
# --schedules: hookloop-pipeline's schedules, each rank's busy time against the step's
# ---------------------------------------------------------------------------------------

#: --schedules: the batch (micro-batches of 64 rows at m = 8: compute, not latency, dominates)
SCHEDULE_BATCH = 512
#: schedule -> stages per rank (v)
SCHEDULE_V = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2,
              "interleaved_zero_bubble": 2, "zbv_zero_bubble": 2}


def theoretical_bubble(schedule: str, p: int, m: int) -> float:
    v = SCHEDULE_V[schedule]
    if "zero_bubble" in schedule:
        return 0.0
    if schedule == "looped_bfs":  # breadth-first: every stage's forwards, then backwards
        return (p - 1) / (m + p - 1)
    idle = (p - 1) / v
    return idle / (m + idle)


class _Timer:
    """Adds up the compute of this rank's stages and the wall time of ``schedule.step``."""

    def __init__(self):
        self.busy = self.wall = 0.0
        self._patched: list = []

    def install(self) -> None:
        from torch.distributed.pipelining import schedules, stage

        def timed(owner, name, attr):
            original = getattr(owner, name)

            def wrapper(*a, **k):
                start = time.perf_counter()
                try:
                    return original(*a, **k)
                finally:
                    setattr(self, attr, getattr(self, attr) + time.perf_counter() - start)

            self._patched.append((owner, name, original))
            setattr(owner, name, wrapper)

        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            if hasattr(stage._PipelineStageBase, name):
                timed(stage._PipelineStageBase, name, "busy")
        for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
            timed(cls, "step", "wall")


def schedule_fractions(schedule: str, m: int, steps: int, timer: _Timer) -> float:
    """This rank's busy fraction of the pipeline steps after the warm-up ones."""
    import hookloop

    class Net(hookloop.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)])

        def pipeline_loss(self, output, target):
            return F.mse_loss(output, target)

        def training_step(self, batch, batch_idx):
            return self.pipeline_loss(self.blocks(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock:
        hookloop_name, hookloop_role = "clock", "observer"

        def __init__(self):
            self.samples: list[tuple[float, float]] = []

        @hookloop.hookimpl
        def on_train_batch_start(self, batch_idx):
            timer.busy = timer.wall = 0.0

        @hookloop.hookimpl
        def on_train_batch_end(self, batch_idx):
            if batch_idx >= WARMUP:
                self.samples.append((timer.busy, timer.wall))

    torch.manual_seed(0)
    clock = Clock()
    plugin = hookloop.plugin("pipeline", schedule=schedule, microbatches=m)
    trainer = hookloop.Trainer(plugins=[plugin, clock], max_epochs=1, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False, num_sanity_val_steps=0, enable_model_summary=False)
    with contextlib.redirect_stdout(io.StringIO()):
        g = torch.Generator().manual_seed(0)
        n = SCHEDULE_BATCH * (steps + WARMUP)
        data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))
        trainer.fit(Net(), DataLoader(data, batch_size=SCHEDULE_BATCH))
    busy = sum(b for b, _ in clock.samples)
    wall = sum(w for _, w in clock.samples)
    return busy / wall


def schedules_worker(args) -> None:
    torch.set_num_threads(1)
    timer = _Timer()
    timer.install()
    names = list(SCHEDULE_V)
    results: dict[str, list[list[float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            busy = schedule_fractions(name, args.microbatches, args.steps, timer)
            gathered = [None] * int(os.environ["WORLD_SIZE"])
            import hookloop

            hookloop.init_process_group("gloo", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
            dist.all_gather_object(gathered, busy)
            dist.destroy_process_group()
            results[name].append(gathered)
    if int(os.environ["RANK"]) == 0:
        Path(args.result).write_text(json.dumps(results))


def schedules_main(args) -> int:
    p, m = args.procs, args.microbatches
    if BLOCKS % (2 * p):
        raise SystemExit(f"--procs {p}: the {BLOCKS} blocks must split into {2 * p} stages")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={p}", __file__,
               "--schedules", f"--procs={p}", f"--microbatches={m}", f"--rounds={args.rounds}",
               f"--steps={args.steps}", f"--result={result}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        results = json.loads(result.read_text())
    print(f"hookloop-pipeline, {p} processes (gloo, CPU, 1 thread each); MLP {BLOCKS} x Linear {WIDTH}; batch "
          f"{SCHEDULE_BATCH}, m = {m} micro-batches; medians of {args.rounds} interleaved rounds x {args.steps} steps")
    print(f"{'schedule':>24} {'v':>2} {'busy/wall per rank':>24} {'measured bubble':>16} {'theoretical':>12}")
    for name, rounds in results.items():
        per_rank = [statistics.median(r[i] for r in rounds) for i in range(p)]
        bubble = statistics.median(1 - sum(r) / len(r) for r in rounds)
        print(f"{name:>24} {SCHEDULE_V[name]:>2} {' '.join(f'{b:.2f}' for b in per_rank):>24} {bubble:>16.3f} "
              f"{theoretical_bubble(name, p, m):>12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
