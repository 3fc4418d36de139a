"""The ddp_sharded rows of benchmarks/memory.py (hookloop-fairscale's OSS + ShardedDataParallel).

memory.py calls :func:`measure` in every rank (after its own runs, on the same MLP and
Adam) and :func:`print_rows` on rank 0, inside its table, with the same columns: Adam
state, master copy and parameters per rank, each next to its limit for N parameters on
W ranks (fp32, 4 bytes an element):

=============  ============  ============  ===========
strategy       Adam state    master copy   parameters
=============  ============  ============  ===========
ddp_sharded    8N / W        0             4N
=============  ============  ============  ===========

OSS keeps no master copy (the optimizer steps the fp32 weights themselves) and every rank
keeps all the weights (like ZeRO stage 1). It gives whole parameters to ranks (each to
the rank with the fewest elements so far), so a rank's share of the Adam state is
``8 x its elements``, which :func:`print_rows` sets beside the even split ``8N / W``: on
memory.py's MLP (four 1024 x 1024 weights, four 1024 biases, in that order) the greedy
split is exactly even; one weight much larger than the rest would not be.
"""

from __future__ import annotations

import contextlib
import io

import torch
from torch.utils.data import DataLoader, TensorDataset

import hookloop


class ShardedProbe:
    """Observer: this rank's bytes at the end of training, while OSS still holds them."""

    hookloop_name = "sharded_memory_probe"
    hookloop_role = "observer"

    def __init__(self):
        self.report: dict | None = None

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        optimizer = trainer.optimizer  # hookloop_fairscale's ShardedOptimizer (fairscale OSS)
        self.report = {
            "optimizer_state_bytes": optimizer.local_state_bytes(),
            "master_weight_bytes": 0,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in trainer.module.parameters()),
            "parameter_count": sum(p.numel() for p in trainer.module.parameters()),
            "partition": optimizer.partition_numels(),
        }


def measure(devices: int, steps: int, module_class, width: int) -> list[dict] | None:
    """Every rank's report of a ``ddp_sharded`` run (call in every rank); ``None`` when
    hookloop-fairscale is not installed."""
    if "ddp_sharded" not in hookloop.installed_plugins():
        return None
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:  # the gather below needs a group after the run; ddp_sharded adopts this one
        dist.init_process_group("gloo")
    probe = ShardedProbe()
    g = torch.Generator().manual_seed(0)
    n = 16 * devices * steps
    data = TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g))
    trainer = hookloop.Trainer(plugins=["ddp_sharded", probe], devices=devices, max_steps=steps,
                               enable_checkpointing=False)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(module_class(), DataLoader(data, batch_size=16, shuffle=True))
    reports = [None] * trainer.world_size
    dist.all_gather_object(reports, probe.report)
    if own_group:
        dist.destroy_process_group()
    return reports


def print_rows(reports: list[dict] | None, cell_width: int = 34) -> None:
    """The ddp_sharded row in memory.py's format (rank 0), and the greedy partition."""
    if not reports:
        return
    world, n, mb = len(reports), reports[0]["parameter_count"], 2**20
    limits = {"optimizer_state_bytes": 8 * n / world, "master_weight_bytes": 0, "parameter_bytes": 4 * n}
    cells = []
    for key in ("optimizer_state_bytes", "master_weight_bytes", "parameter_bytes"):
        measured = max(r[key] for r in reports)
        ratio = f"{measured / limits[key]:.3f}" if limits[key] else ("-" if measured == 0 else "inf")
        cells.append(f"{measured / mb:8.2f} ({limits[key] / mb:6.2f}, {ratio:>5})")
    print(f"{'ddp_sharded':<20}" + "".join(f"{c:>{cell_width}}" for c in cells))
    partition = reports[0]["partition"]
    shares = ", ".join(f"rank {r} {e} ({e / (n / world):.3f} x)" for r, e in enumerate(partition))
    print(f"{'':<20}ddp_sharded: Adam state by whole parameters, elements per rank (x N/{world}): {shares}; "
          f"measured bytes per rank {[r['optimizer_state_bytes'] for r in reports]}")


def main() -> None:
    """Alone: ``python benchmarks/sharded_rows.py [--devices 2] [--steps 3]`` prints the
    ddp_sharded row beside ddp's (Adam state 8N, master 0, parameters 4N)."""
    import argparse
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from memory import MLP, WIDTH, limits, measure as measure_ddp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    import torch.distributed as dist

    if not dist.is_initialized() and "RANK" in os.environ:
        dist.init_process_group("gloo")  # kept for both runs: memory.measure gathers after its fit
    ddp, world = measure_ddp("ddp", args.devices, args.steps)
    sharded = measure(args.devices, args.steps, MLP, WIDTH)
    if os.environ.get("RANK", "0") != "0":
        return
    n, mb = ddp[0]["parameter_count"], 2**20
    print(f"model: {n / 1e6:.2f} M parameters (fp32, {4 * n / mb:.1f} MiB); Adam; {world} ranks; per rank, the "
          f"largest of the ranks")
    print(f"{'strategy':<20}" + "".join(f"{c:>34}" for c in ("Adam state MiB (limit, ratio)",
                                                              "master copy MiB (limit, ratio)",
                                                              "parameters MiB (limit, ratio)")))
    limit = limits(None, n, world)
    cells = []
    for key in ("optimizer_state_bytes", "master_weight_bytes", "parameter_bytes"):
        measured = max(r[key] for r in ddp)
        ratio = f"{measured / limit[key]:.3f}" if limit[key] else ("-" if measured == 0 else "inf")
        cells.append(f"{measured / mb:8.2f} ({limit[key] / mb:6.2f}, {ratio:>5})")
    print(f"{'ddp':<20}" + "".join(f"{c:>34}" for c in cells))
    print_rows(sharded)


if __name__ == "__main__":
    main()
