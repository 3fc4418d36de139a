"""Rank 0's peak memory while a model is set up under hookloop-fsdp: created on the meta
device and sharded before it is materialised (``configure_model``, the default), versus
built normally on every rank and then sharded (``meta_init=False``).

Each measurement is a fresh 2-process launch (a process's peak resident size only
grows, so runs cannot share one), alternating normal / meta for ``--rounds`` rounds;
the peak is Linux's VmHWM from ``setup`` (reset through /proc/self/clear_refs) to
``on_fit_start``, over the resident size at ``setup``, with malloc returning large
blocks to the system when freed (``MALLOC_MMAP_THRESHOLD_``) and a one-layer fit first
(imports and one-time set-up), so that it measures the tensors alive at the peak. Prints each, the medians, and meta/normal.

    python benchmarks/fsdp_init_memory.py [--layers 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTH = 1024


def child(variant: str, layers: int, out: Path) -> None:
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import hookloop

    class Deep(hookloop.Module):
        def __init__(self, layers: int):
            super().__init__()
            self.layers = layers

        def configure_model(self):
            self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(self.layers)])

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class SetupPeak:
        hookloop_name, hookloop_role = "setup_peak", "observer"

        @hookloop.hookimpl
        def setup(self):
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.before = _status("VmRSS")

        @hookloop.hookimpl
        def on_fit_start(self, trainer):
            if trainer.global_rank == 0:
                out.write_text(json.dumps({"peak_kib": _status("VmHWM") - self.before,
                                           "parameters": sum(p.numel() for p in trainer.module.parameters())}))

    loader = DataLoader(TensorDataset(torch.randn(8, WIDTH)), batch_size=4)
    for warm_up, depth in ((True, 1), (False, layers)):
        # The first fit of a process imports and sets up what every later one reuses (tens
        # of MiB): a one-layer run first, so the measured set-up holds the model's tensors.
        plugin = hookloop.plugin("fsdp", auto_wrap_policy={nn.Linear}, meta_init=variant == "meta")
        probe = [] if warm_up else [SetupPeak()]
        trainer = hookloop.Trainer(plugins=[plugin, *probe], max_steps=1, enable_checkpointing=False,
                                   num_sanity_val_steps=0, default_root_dir=str(out.parent))
        trainer.fit(Deep(depth), loader)
        del trainer


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.layers, Path(args.child[1]))
        return 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    peaks: dict[str, list[float]] = {"normal": [], "meta": []}
    parameters = 0
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for variant in ("normal", "meta"):
                out = Path(tmp) / f"{variant}{round_}.json"
                subprocess.run([sys.executable, "-m", "hookloop", "run", "--plugins", "fsdp", "--devices", "2", __file__,
                                "--layers", str(args.layers), "--child", variant, str(out)],
                               env=env, check=True, capture_output=True, text=True)
                result = json.loads(out.read_text())
                parameters = result["parameters"]
                peaks[variant].append(result["peak_kib"] / 1024)
                print(f"round {round_} {variant:>6}: rank 0 set-up peak {peaks[variant][-1]:7.1f} MiB", flush=True)
    model = parameters * 4 / 2**20
    normal, meta = statistics.median(peaks["normal"]), statistics.median(peaks["meta"])
    print(f"model {parameters / 1e6:.1f} M parameters = {model:.1f} MiB fp32; 2 ranks (a rank's shard: {model / 2:.1f} MiB)")
    print(f"rank 0 set-up peak, median: built normally {normal:.1f} MiB ({normal / model:.2f} x model), "
          f"meta device {meta:.1f} MiB ({meta / model:.2f} x model)")
    print(f"meta/normal set-up peak {meta / normal:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
