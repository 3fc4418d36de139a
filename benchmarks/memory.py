"""What one rank holds under ddp and each ZeRO stage, beside ZeRO's theoretical limits.

One run, 2 processes on the CPU (torchrun, gloo): the same MLP of ~4.2 M parameters
(4 x Linear 1024->1024), Adam, a few optimizer steps so that Adam's state exists, then
per rank

* Adam state: the two moments (``exp_avg``, ``exp_avg_sq``);
* master copy: the fp32 copy of the weights that DeepSpeed's ZeRO optimizer steps;
* parameters: what the rank holds of the model's weights,

each beside its limit for N parameters on W ranks (fp32, 4 bytes an element):

=====================  ===============  ================  ===============
strategy               Adam state       master copy       parameters
=====================  ===============  ================  ===============
ddp, ZeRO stage 0      8N               0 (the weights)   4N
ZeRO stage 1, 2        8N / W           4N / W            4N
ZeRO stage 3           8N / W           4N / W            4N / W
=====================  ===============  ================  ===============

The ratio column is measured / limit (1.00 = at the limit). The first line of the table
is hookloop ``ddp`` when hookloop-ddp is installed.

    python benchmarks/memory.py [--devices 2] [--steps 3]

The script re-launches itself on ``--devices`` processes through the Trainer (torchrun).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

WIDTH, LAYERS = 1024, 4


class MLP(hookloop.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Probe:
    """Observer: this rank's bytes at the end of training, while the engine still exists."""

    hookloop_name = "memory_probe"
    hookloop_role = "observer"

    def __init__(self):
        self.reports: list[dict] | None = None

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        from hookloop_deepspeed.memory import memory_report

        # Gathered here, while the strategy's process group still exists (a run's group is
        # destroyed when fit returns).
        self.reports = trainer.all_gather_object(memory_report(trainer))


def measure(strategy, devices: int, steps: int) -> tuple[list[dict], int]:
    probe = Probe()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16 * devices * steps, WIDTH, generator=g), torch.randn(16 * devices * steps, WIDTH, generator=g))
    trainer = hookloop.Trainer(plugins=[strategy, probe], devices=devices, max_steps=steps, enable_checkpointing=False)
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        trainer.fit(MLP(), DataLoader(data, batch_size=16, shuffle=True))
    return probe.reports, trainer.world_size


def limits(stage: int | None, n: int, world: int) -> dict[str, float]:
    sharded = stage is not None and stage >= 1
    return {
        "optimizer_state_bytes": 8 * n / world if sharded else 8 * n,
        "master_weight_bytes": 4 * n / world if sharded else 0,
        "parameter_bytes": 4 * n / world if stage == 3 else 4 * n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from hookloop_deepspeed import DeepSpeedStrategy

    runs: list[tuple[str, object, int | None]] = [
        (f"deepspeed stage {stage}", DeepSpeedStrategy(stage=stage), stage) for stage in (0, 1, 2, 3)
    ]
    # ddp last: it adopts the process group DeepSpeed left (it destroys only its own).
    if "ddp" in hookloop.installed_plugins():
        runs.append(("ddp", "ddp", None))
    rows = []
    for label, strategy, stage in runs:
        reports, world = measure(strategy, args.devices, args.steps)
        rows.append((label, stage, reports, world))
    # FSDP rows (hookloop-fsdp, benchmarks/fsdp_rows.py): measured in every rank, printed last.
    fsdp = None
    if "fsdp" in hookloop.installed_plugins():
        import fsdp_rows

        fsdp = fsdp_rows.measure(args.devices, args.steps, MLP)
    # ddp_sharded rows (hookloop-fairscale, benchmarks/sharded_rows.py): measured in every rank.
    import sharded_rows

    sharded = sharded_rows.measure(args.devices, args.steps, MLP, WIDTH)
    if os.environ.get("RANK", "0") != "0":
        return
    # ddp first in the table: the baseline.
    rows.sort(key=lambda r: (r[1] is not None, r[1] or 0))
    n = rows[0][2][0]["parameter_count"]
    mb = 2**20
    print(f"model: {n / 1e6:.2f} M parameters (fp32, {4 * n / mb:.1f} MiB); Adam; {rows[0][3]} ranks; "
          f"per rank, the largest of the ranks")
    header = f"{'strategy':<20}" + "".join(f"{c:>34}" for c in ("Adam state MiB (limit, ratio)", "master copy MiB (limit, ratio)", "parameters MiB (limit, ratio)"))
    print(header)
    for label, stage, reports, world in rows:
        limit = limits(stage, n, world)
        cells = []
        for key in ("optimizer_state_bytes", "master_weight_bytes", "parameter_bytes"):
            measured = max(r[key] for r in reports)
            ratio = f"{measured / limit[key]:.3f}" if limit[key] else ("-" if measured == 0 else "inf")
            cells.append(f"{measured / mb:8.2f} ({limit[key] / mb:6.2f}, {ratio:>5})")
        print(f"{label:<20}" + "".join(f"{c:>34}" for c in cells))
    sharded_rows.print_rows(sharded)  # in the table: its limits (8N/W, 0, 4N) and OSS's greedy split
    ddp = next((r for r in rows if r[1] is None), None)
    stage3 = next(r for r in rows if r[1] == 3)
    if ddp is not None:
        total = lambda rep: rep["optimizer_state_bytes"] + rep["master_weight_bytes"] + rep["parameter_bytes"]  # noqa: E731
        print(f"stage3/ddp bytes per rank (state + master + parameters) {max(map(total, stage3[2])) / max(map(total, ddp[2])):.2f}")
    if fsdp is not None:
        fsdp_rows.report(fsdp)  # its own table: FSDP's limits, measured from local shards; step time vs ddp


if __name__ == "__main__":
    sys.exit(main())
