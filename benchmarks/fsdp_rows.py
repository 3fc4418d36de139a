"""The FSDP rows of benchmarks/memory.py: what one rank holds under hookloop-fsdp's
FULL_SHARD, SHARD_GRAD_OP and NO_SHARD beside ddp, each next to its per-rank limit, and
step time against ddp on the same model.

memory.py calls :func:`measure` (in every rank, before its own rank-0 printing) and
:func:`report` (rank 0). Alone: ``python benchmarks/fsdp_rows.py [--devices 2]``.

What a rank holds is measured from its local shards (a DTensor's ``numel()`` is the
whole tensor's), with ``hookloop_fsdp.memory_report``; for N parameters on W ranks in
fp32 (4 bytes an element), the limits are:

=================  ==========  ==========  =====================  ==========
strategy           Adam state  parameters  parameters in a step   gradients
=================  ==========  ==========  =====================  ==========
ddp, NO_SHARD      8N          4N          4N                     4N
SHARD_GRAD_OP      8N / W      4N / W      4N (kept gathered)     4N / W
FULL_SHARD         8N / W      4N / W      4N / W (+ one unit)    4N / W
=================  ==========  ==========  =====================  ==========

"parameters" is what a rank keeps between steps, "in a step" what it holds between
forward and backward (units are the model's Linear layers, gathered one at a time),
"gradients" at the optimizer step. FSDP keeps no separate master copy: the optimizer
steps the sharded fp32 weights themselves. Step time: median of interleaved rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hookloop

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
# The runs' logs go here, not into the checkout.
RUN_DIR = os.path.join(tempfile.gettempdir(), "hookloop-fsdp-benchmark")
KEYS = ("optimizer_state_bytes", "parameter_bytes", "step_parameter_bytes", "gradient_bytes")


class Probe:
    """Observer: this rank's bytes and step times (the first steps are warm-up)."""

    hookloop_name = "fsdp_memory_probe"
    hookloop_role = "observer"

    def __init__(self):
        self.report: dict[str, int] = {}
        self.times: list[float] = []
        self._start = 0.0

    @hookloop.hookimpl
    def on_train_batch_start(self):
        self._start = time.perf_counter()

    @hookloop.hookimpl
    def on_before_backward(self, trainer):
        from hookloop_fsdp.memory import parameter_bytes

        self.report.setdefault("step_parameter_bytes", parameter_bytes(trainer.module))

    @hookloop.hookimpl
    def on_before_optimizer_step(self, trainer):
        from hookloop_fsdp.memory import gradient_bytes

        self.report.setdefault("gradient_bytes", gradient_bytes(trainer.module))

    @hookloop.hookimpl
    def on_train_batch_end(self):
        self.times.append(time.perf_counter() - self._start)

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        from hookloop_fsdp import memory_report

        report = memory_report(trainer)
        self.report.update(optimizer_state_bytes=report["optimizer_state_bytes"],
                           parameter_bytes=report["parameter_bytes"], parameter_count=report["parameter_count"])


def _strategy(label: str):
    if label == "ddp":
        return "ddp"
    return hookloop.plugin("fsdp", sharding_strategy=label, auto_wrap_policy={nn.Linear})


def _fit(label: str, model_class, devices: int, steps: int) -> tuple[Probe, int]:
    import torch.distributed as dist

    probe = Probe()
    g = torch.Generator().manual_seed(0)
    width = model_class().net[0].in_features
    data = TensorDataset(torch.randn(16 * devices * steps, width, generator=g), torch.randn(16 * devices * steps, width, generator=g))
    trainer = hookloop.Trainer(plugins=[_strategy(label), probe], devices=devices, max_steps=steps,
                               enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=RUN_DIR)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(model_class(), DataLoader(data, batch_size=16, shuffle=True))
    assert not dist.is_initialized() or label == "ddp"
    return probe, trainer.world_size


def measure(devices: int, steps: int, model_class, rounds: int = 5, timed_steps: int = 8) -> dict[str, Any]:
    """Every rank: the bytes of each strategy (one run each), then interleaved timing
    rounds (ddp, FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, ddp, ...). Returns the reports
    of every rank, gathered, and each strategy's step times on this rank."""
    labels = ("ddp", *STRATEGIES)
    reports: dict[str, list[dict]] = {}
    world = 1
    for label in labels:
        probe, world = _fit(label, model_class, devices, steps)
        reports[label] = _gather(probe.report, world)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(rounds):
        for label in labels:
            probe, _ = _fit(label, model_class, devices, timed_steps + 2)
            times[label] += probe.times[2:]
    return {"reports": reports, "times": times, "world": world}


def _gather(report: dict, world: int) -> list[dict]:
    """Every rank's report, through the process group a run left, or one made for it."""
    import torch.distributed as dist

    if world == 1:
        return [report]
    made = not dist.is_initialized()
    if made:
        hookloop.init_process_group("gloo", int(os.environ["RANK"]), world)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, report)
    if made:
        hookloop.release_process_group()
    return gathered


def limits(label: str, n: int, world: int) -> dict[str, float]:
    sharded = label in ("FULL_SHARD", "SHARD_GRAD_OP")
    return {
        "optimizer_state_bytes": 8 * n / world if sharded else 8 * n,
        "parameter_bytes": 4 * n / world if sharded else 4 * n,
        "step_parameter_bytes": 4 * n / world if label == "FULL_SHARD" else 4 * n,
        "gradient_bytes": 4 * n / world if sharded else 4 * n,
    }


def report(results: dict[str, Any]) -> None:
    """Rank 0: the FSDP table and the step-time rows."""
    reports, times, world = results["reports"], results["times"], results["world"]
    n = reports["ddp"][0]["parameter_count"]
    mb = 2**20
    print()
    print(f"hookloop-fsdp: {n / 1e6:.2f} M parameters, Adam, {world} ranks; per rank, the largest of the ranks; "
          f"measured (limit, ratio)")
    columns = ("Adam state MiB", "parameters MiB", "params in a step MiB", "gradients MiB")
    print(f"{'strategy':<20}" + "".join(f"{c + ' (limit, ratio)':>38}" for c in columns))
    for label in ("ddp", *STRATEGIES):
        limit = limits(label, n, world)
        cells = []
        for key in KEYS:
            measured = max(r[key] for r in reports[label])
            cells.append(f"{measured / mb:8.2f} ({limit[key] / mb:6.2f}, {measured / limit[key]:5.3f})")
        print(f"{'fsdp ' + label if label != 'ddp' else 'ddp':<20}" + "".join(f"{c:>38}" for c in cells))
    base = statistics.median(times["ddp"])
    print(f"{'step time (median)':<20}" + "".join(
        f"{label}: {statistics.median(times[label]) * 1e3:.1f} ms   " for label in ("ddp", *STRATEGIES)))
    for label in STRATEGIES:
        print(f"fsdp {label}/ddp step time {statistics.median(times[label]) / base:.2f}")


def main() -> int:
    from torch.nn import functional as F

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    class MLP(hookloop.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    results = measure(args.devices, args.steps, MLP)
    if os.environ.get("RANK", "0") == "0":
        report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
