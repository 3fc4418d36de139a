"""What the per-step stop agreement costs (issue 33, item 5), on the tiny step under ddp.

Two processes (``hookloop run --plugins ddp --devices 2``, gloo, CPU), one run: in the
same workers, the tiny model of benchmarks/loop_overhead.py (Linear 32 -> 64 -> ReLU ->
Linear 2, batch 32 per rank, SGD; about 1.5 ms a step) trains ``--steps`` steps through

* ``raw``: a hand-written loop around ``DistributedDataParallel`` (the reference);
* ``every step``: ``hookloop.Trainer(stop_check_every_n_steps=1)``: the agreement on
  SIGTERM and ``max_time`` at every optimizer step (an all-reduce started at each
  boundary and read, ``.tolist()`` of a CPU tensor, at the next: what every run paid
  before issue 33);
* ``default``: ``hookloop.Trainer()``: the agreement's default schedule,
  ``stop_check_every_n_steps="auto"`` (about once a second of steps: at boundaries 1 and
  2, then every ``int(1 s / pace)`` steps; nothing at the other boundaries);
* ``stubbed``: ``Preemption.agreed`` replaced by ``lambda: False`` (no agreement at all:
  the floor).

The variants run back to back in a rotating order each round, so drift of the machine hits
them alike; the first ``--warmup`` steps of each fit are not timed. Reported: the median
ms/step of each variant, its best round (on shared cores the least disturbed one says
more than the median), and the median of the per-round ratios to ``stubbed`` and to
``raw``; then, counted (not timed) by the ``ledger`` observer on every step of one more fit
per hookloop variant, the core's collectives and host reads (``.item``/``.tolist``) per
step, on rank 0.

    python benchmarks/agreement.py [--rounds 5] [--steps 400] [--warmup 50]
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
from loop_overhead import HookloopModule, make_net  # noqa: E402  (benchmarks/: the same tiny model)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("raw", "every step", "default", "stubbed")
BATCH = 32


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def raw_round(data: TensorDataset, steps: int, warmup: int) -> float:
    """ms/step of steps ``warmup``.. of a hand-written DDP loop."""
    model = nn.parallel.DistributedDataParallel(make_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    done, start = 0, 0.0
    for x, y in loader:
        if done == warmup:
            start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done += 1
        if done == steps:
            break
    return (time.perf_counter() - start) * 1000 / (steps - warmup)


def hookloop_round(data: TensorDataset, steps: int, warmup: int, variant: str, root: str, ledger=None) -> float:
    """ms/step of steps ``warmup``.. of ``hookloop.Trainer`` (plugins from ``hookloop run``)."""
    import hookloop
    from hookloop.distributed import faults

    class Clock:
        """Reads the time twice per fit: at the start of step ``warmup`` and at the end."""

        hookloop_name, hookloop_role = "clock", "observer"

        def __init__(self):
            self.start = self.end = 0.0

        @hookloop.hookimpl
        def on_train_batch_start(self, trainer):
            if trainer.global_step == warmup and not self.start:
                self.start = time.perf_counter()

        @hookloop.hookimpl
        def on_train_end(self):
            self.end = time.perf_counter()

    options = {"stop_check_every_n_steps": 1} if variant == "every step" else {}
    if "stop_check_every_n_steps" not in hookloop.TrainerConfig.__dataclass_fields__:
        options = {}  # before issue 33: the agreement ran at every step
    agreed = faults.Preemption.agreed
    if variant == "stubbed":
        faults.Preemption.agreed = lambda self, trainer: False
    clock = Clock()
    try:
        trainer = hookloop.Trainer(plugins=[clock] + ([ledger] if ledger is not None else []), max_steps=steps,
                                   enable_checkpointing=False, logger=False, enable_progress_bar=False,
                                   enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                                   **options)
        trainer.fit(HookloopModule(), DataLoader(data, batch_size=BATCH, shuffle=True))
    finally:
        faults.Preemption.agreed = agreed
    return (clock.end - clock.start) * 1000 / (steps - warmup)


def worker(args) -> None:
    # The process group made the way a hand-written script makes it; the ddp plugin uses it.
    dist.init_process_group("gloo")
    import hookloop

    data = make_data(2 * BATCH * args.steps)  # one epoch holds the fit's steps
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            for variant in VARIANTS[r % 4:] + VARIANTS[:r % 4]:
                if variant == "raw":
                    times[variant].append(raw_round(data, args.steps, args.warmup))
                else:
                    times[variant].append(hookloop_round(data, args.steps, args.warmup, variant, root))
        counts = {}
        for variant in VARIANTS[1:]:
            ledger = hookloop.Ledger(print_table=False, count_every=1)
            hookloop_round(data, 66, 1, variant, root, ledger=ledger)
            core = ledger.rows["core (outside hooks)"]
            counts[variant] = {"collectives": core["collectives/step"], "syncs": core["syncs/step"],
                               "counted": ledger._counted}
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"times": times, "counts": counts}))
    dist.destroy_process_group()


def report(results: dict, args) -> None:
    times, counts = results["times"], results["counts"]
    print(f"2 processes (hookloop run --plugins ddp --devices 2, gloo, CPU), Linear 32-64-2, batch {BATCH}/rank, "
          f"{args.steps - args.warmup} timed steps x {args.rounds} rounds (rank 0)")
    print(f"{'variant':<12}{'ms/step':>9}{'best':>8}{'/stubbed':>10}{'/raw':>8}{'core collectives/step':>23}"
          f"{'core syncs/step':>17}")
    for variant in VARIANTS:
        ms = statistics.median(times[variant])
        to_stub = statistics.median(t / s for t, s in zip(times[variant], times["stubbed"]))
        to_raw = statistics.median(t / s for t, s in zip(times[variant], times["raw"]))
        c = counts.get(variant)
        cols = (f"{c['collectives']:>23.3f}{c['syncs']:>17.3f}" if c else f"{'-':>23}{'-':>17}")
        print(f"{variant:<12}{ms:>9.3f}{min(times[variant]):>8.3f}{to_stub:>10.3f}{to_raw:>8.3f}{cols}")
    print("per round (ms/step): " + "; ".join(f"{v} " + ", ".join(f"{t:.3f}" for t in times[v]) for v in VARIANTS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.result is not None:  # inside a worker
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "hookloop", "run", "--plugins", "ddp", "--devices", "2", __file__,
               f"--rounds={args.rounds}", f"--steps={args.steps}", f"--warmup={args.warmup}", f"--result={result}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
        subprocess.run(cmd, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
        results = json.loads(result.read_text())
    report(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
