"""The ``ledger`` observer's table for a small model, and what the ledger costs.

* ``observers``: one process, the default observers (progress, csv, checkpoint, model
  summary) and the throughput monitor, with the ledger: its table.
* ``ddp``, ``fsdp``, ``deepspeed_stage_2``: the same under ``hookloop run --plugins
  STRATEGY --devices 2`` (gloo, CPU): rank 0's table.
* overhead: one process, the default observers, ledger off and on in interleaved rounds
  (the order alternates); a step's time is taken by a clock plugin present in both runs
  (first to last ``on_train_batch_end``, the warm-up step left out). Reported: the median
  ms/step of each and the median of the per-round ratios on/off.

    python benchmarks/ledger.py [--rounds 7] [--steps 200] [--skip-strategies]

Model: Linear 64 -> 256 -> ReLU -> 256 -> ReLU -> 10, batch 32, SGD.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hookloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_overhead import LoggingModule  # noqa: E402  (benchmarks/)


class MLP(LoggingModule):
    """loop_overhead.py's module that logs its loss every step (cross-entropy, SGD lr 0.01)
    on a wider net."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def data(steps: int, batch: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    n = steps * batch
    return DataLoader(TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)),
                      batch_size=batch)


class Clock:
    """Times from the first to the last ``on_train_batch_end``."""

    hookloop_name = "clock"
    hookloop_role = "observer"

    def __init__(self):
        self.first = self.last = None
        self.n = 0

    @hookloop.hookimpl
    def on_train_batch_end(self):
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.n += 1

    def ms_per_step(self) -> float:
        return (self.last - self.first) / (self.n - 1) * 1000


def fit(root: Path, steps: int, ledger: bool, quiet: bool = True) -> tuple[float, hookloop.Ledger | None]:
    clock = Clock()
    the_ledger = hookloop.Ledger(print_table=not quiet) if ledger else None
    plugins = [clock, "throughput"] + ([the_ledger] if the_ledger else [])
    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(root), plugins=plugins)
    out = io.StringIO() if quiet else contextlib.nullcontext()
    with (contextlib.redirect_stdout(out) if quiet else contextlib.nullcontext()), \
            (contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext()):
        trainer.fit(MLP(), data(steps))
    return clock.ms_per_step(), the_ledger


def worker(out: str, steps: int) -> None:
    """Inside ``hookloop run --plugins STRATEGY --devices 2``: rank 0 prints the table."""
    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=out, enable_progress_bar=False,
                               plugins=[hookloop.Ledger(), "throughput"])
    trainer.fit(MLP(), data(steps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip-strategies", action="store_true")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="hookloop-ledger-"))
    torch.set_num_threads(1)
    print("== observers (1 process): default observers + throughput, ledger on", flush=True)
    fit(tmp / "table", args.steps, ledger=True, quiet=False)
    off, on, ratios = [], [], []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        times = {}
        for with_ledger in order:
            times[with_ledger], _ = fit(tmp / f"r{r}{int(with_ledger)}", args.steps, with_ledger)
        off.append(times[False])
        on.append(times[True])
        ratios.append(times[True] / times[False])
    print(f"\n== overhead, {args.rounds} interleaved rounds of {args.steps} steps: ledger off "
          f"{statistics.median(off):.3f} ms/step, on {statistics.median(on):.3f} ms/step, "
          f"on/off {statistics.median(ratios):.3f} (median of per-round ratios)", flush=True)
    if args.skip_strategies:
        return 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    for strategy in ("ddp", "fsdp", "deepspeed_stage_2"):
        print(f"\n== {strategy} (2 processes, gloo, CPU)", flush=True)
        cmd = [sys.executable, "-m", "hookloop", "run", "--plugins", strategy, "--devices", "2", __file__,
               "--worker", str(tmp / strategy), "--steps", str(args.steps // 2)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        lines = proc.stdout.splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("hookloop ledger:")), None)
        if proc.returncode != 0 or start is None:
            print(f"failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", flush=True)
            continue
        end = next(i for i in range(start, len(lines)) if lines[i].startswith("total step"))
        print("\n".join(lines[start:end + 1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
