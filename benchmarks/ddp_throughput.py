"""Training throughput of hookloop's ``ddp`` strategy against a hand-written DDP loop.

Two processes (gloo, CPU), one run: in the same workers, the same MLP (256 -> 512 ->
512 -> 10, SGD with momentum) trains on the same data (DistributedSampler, batch 64 per
rank) through

* a hand-written loop around ``DistributedDataParallel`` (the reference: ``raw``),
* ``hookloop.Trainer(plugins=["ddp"])``.

Each variant trains ``--epochs`` epochs per round, the first epoch of a round being the
warm-up; the two variants of a round run back to back (in alternating order), so their
ratio sees the same machine. The median steps/s of each variant and the median of the
per-round ratios are reported; the last line is ``hookloop/raw <ratio>``.

    python benchmarks/ddp_throughput.py [--rounds 9] [--epochs 3] [--samples 16384]

``--agreement`` measures instead what the SIGTERM agreement (``hookloop.faults``) costs
per step, at a small step (batch 64 per rank, ~2 ms) and a medium one (batch 512):
hookloop's ddp with the agreement ``off``, ``blocking`` (what it was before issue 17: the
strategy's all-reduce of the flag, waited on at every boundary) and ``async`` (the
default: started at a boundary, read at the next agreement, on a gloo side group; since
issue 33 every ``stop_check_every_n_steps`` = 16 boundaries: benchmarks/agreement.py
compares that with an agreement at every step).
The three run back to back in a rotating order each round; reported are the median
ms/step and the medians of the per-round step-time ratios to ``off``.

    python benchmarks/ddp_throughput.py --agreement [--rounds 7] [--epochs 2] [--steps 64]
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

BATCH = 64


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 256, generator=g)
    return TensorDataset(x, (x[:, :10].argmax(-1)))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def raw_round(data: TensorDataset, epochs: int) -> float:
    """Steps/s of epochs 2.. of a hand-written DDP loop."""
    model = nn.parallel.DistributedDataParallel(make_net())
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
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    return steps / (time.perf_counter() - start)


def hookloop_round(data: TensorDataset, epochs: int, strategy: str = "ddp", batch: int = BATCH) -> float:
    """Steps/s of epochs 2.. of ``hookloop.Trainer(plugins=[strategy])`` (also used by
    sharded_throughput.py)."""
    import hookloop

    class Net(hookloop.Module):
        def __init__(self):
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock:
        """Reads the time at epoch boundaries only: nothing runs per step."""

        hookloop_name, hookloop_role = "clock", "observer"

        def __init__(self):
            self.start = self.end = 0.0
            self.steps_at_start = 0
            self.steps = 0

        @hookloop.hookimpl
        def on_train_epoch_start(self, trainer, epoch):
            if epoch == 1:
                self.start, self.steps_at_start = time.perf_counter(), trainer.global_step

        @hookloop.hookimpl
        def on_fit_end(self, trainer):
            self.end, self.steps = time.perf_counter(), trainer.global_step - self.steps_at_start

    clock = Clock()
    trainer = hookloop.Trainer(plugins=[strategy, clock], max_epochs=epochs, enable_checkpointing=False)
    trainer.fit(Net(), DataLoader(data, batch_size=batch, shuffle=True))
    return clock.steps / (clock.end - clock.start)


AGREEMENTS = ("off", "blocking", "async")


def _blocking_agreed(self, trainer) -> bool:
    """The agreement as it was: the strategy's all-reduce of the flag, waited on (and
    read with ``.item()``) at every optimizer-step boundary."""
    self._flag.fill_(1.0 if self.requested else 0.0)
    return bool(trainer.reduce(self._flag, "max").item())


def use_agreement(kind: str) -> None:
    """Make ``hookloop.distributed.faults.Preemption.agreed`` the ``kind`` of :data:`AGREEMENTS`."""
    from hookloop.distributed import faults

    cls = faults.Preemption
    if "_bench_async" not in cls.__dict__:
        cls._bench_async = cls.agreed
    cls.agreed = {"off": lambda self, trainer: False, "blocking": _blocking_agreed, "async": cls._bench_async}[kind]


def agreement_worker(args) -> dict:
    results: dict[str, list[float]] = {}
    for batch in (BATCH, 512):
        data = make_data(2 * batch * args.steps)  # --steps steps per epoch and rank
        for r in range(args.rounds):
            order = AGREEMENTS[r % 3:] + AGREEMENTS[:r % 3]
            for kind in order:
                use_agreement(kind)
                results.setdefault(f"{batch}/{kind}", []).append(hookloop_round(data, args.epochs, batch=batch))
    use_agreement("async")
    return results


def report_agreement(results: dict, args) -> None:
    print(f"2 processes (gloo, CPU), MLP 256-512-512-10, hookloop ddp, {args.steps} steps/epoch/rank, "
          f"{args.epochs - 1} timed epoch(s) x {args.rounds} rounds; SIGTERM agreement per optimizer step")
    for batch in (BATCH, 512):
        ms = {kind: [1000 / v for v in results[f"{batch}/{kind}"]] for kind in AGREEMENTS}
        line = ", ".join(f"{kind} {statistics.median(ms[kind]):.3f}" for kind in AGREEMENTS)
        print(f"batch {batch}/rank: ms/step (median) {line}")
        for kind in ("blocking", "async"):
            ratios = [k / o for k, o in zip(ms[kind], ms["off"])]
            print(f"  {kind}/off step time {statistics.median(ratios):.3f} "
                  f"(rounds: {', '.join(f'{q:.3f}' for q in ratios)})")


def worker(args) -> None:
    # One process group for the whole run, made the way a hand-written script makes it;
    # the ddp plugin uses a group that exists (and leaves it to its owner).
    dist.init_process_group("gloo")
    if args.agreement:
        results = agreement_worker(args)
        if dist.get_rank() == 0:
            Path(args.result).write_text(json.dumps(results))
        dist.destroy_process_group()
        return
    data = make_data(args.samples)
    results: dict[str, list[float]] = {"raw": [], "hookloop": []}
    for r in range(args.rounds):
        order = ("raw", "hookloop") if r % 2 == 0 else ("hookloop", "raw")
        for name in order:
            run = raw_round if name == "raw" else hookloop_round
            results[name].append(run(data, args.epochs))
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 9 (--agreement: 7)")
    parser.add_argument("--epochs", type=int, default=None, help="default 3 (--agreement: 2)")
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--agreement", action="store_true", help="the SIGTERM agreement's cost per step")
    parser.add_argument("--steps", type=int, default=64, help="with --agreement: steps per epoch and rank")
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rounds = args.rounds or (7 if args.agreement else 9)
    args.epochs = args.epochs or (2 if args.agreement else 3)
    if args.result is not None:  # inside a worker
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               f"--rounds={args.rounds}", f"--epochs={args.epochs}", f"--samples={args.samples}", f"--result={result}",
               f"--steps={args.steps}", *(["--agreement"] if args.agreement else [])]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        results = json.loads(result.read_text())
    if args.agreement:
        report_agreement(results, args)
        return 0
    steps = args.samples // 2 // BATCH * (args.epochs - 1)
    print(f"2 processes (gloo, CPU), MLP 256-512-512-10, batch {BATCH}/rank, {steps} timed steps x {args.rounds} rounds")
    for name, values in results.items():
        print(f"{name:>9}: {statistics.median(values):8.1f} steps/s (median; rounds: {', '.join(f'{v:.1f}' for v in values)})")
    # The two variants of a round run back to back: their ratio sees the same machine.
    ratios = [h / r for h, r in zip(results["hookloop"], results["raw"])]
    print(f"per-round hookloop/raw: {', '.join(f'{q:.3f}' for q in ratios)}")
    print(f"hookloop/raw {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
