"""The training stall per checkpoint: to local disk and to an S3 server, sync and async.

A ~200 MiB model (3 x Linear(4096, 4096), plain SGD: the checkpoint is the weights,
~200 MiB) trains ``--steps`` steps under ``hookloop.Trainer`` with
``ModelCheckpoint(every_n_train_steps=--every, save_top_k=0)`` (one file per save, the
resume ``last.ckpt``), its root either a local directory or ``s3://`` on a moto server
started on 127.0.0.1 (``hookloop.testing.s3``; s3fs is the client), with and without
``async_save=True``. The stall of a save is the interval between the starts of the two
batches around it minus the median interval without a save. The four variants run in
interleaved rounds in one process; the medians are printed side by side, with their
ratios to local sync. An async save waits for the previous one's write and upload: with
saves closer together than an upload takes, that wait is the stall; ``--compute-s``
spaces them out (each step sleeps), to show the stall of the snapshot alone.

    python benchmarks/checkpoint_stall.py [--rounds 2] [--steps 16] [--every 4] [--width 4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import hookloop
from hookloop.resume import storage
from hookloop.testing.s3 import s3_server


class Big(hookloop.Module):
    def __init__(self, width: int, compute_s: float = 0.0):
        super().__init__()
        self.compute_s = compute_s
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if self.compute_s:
            time.sleep(self.compute_s)  # a heavier model's step, without its memory
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


class BatchClock(hookloop.Callback):
    def __init__(self):
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())


def run(root: str, width: int, steps: int, every: int, async_save: bool,
        compute_s: float) -> tuple[float, float, float]:
    """One fit: (median stall per save, median step without a save, the wait at the end) in s."""
    clock = BatchClock()
    data = TensorDataset(torch.randn(steps * 4, width))
    trainer = hookloop.Trainer(
        default_root_dir=root, max_epochs=1, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, log_every_n_steps=steps,
        callbacks=[clock, hookloop.ModelCheckpoint(every_n_train_steps=every, save_top_k=0, async_save=async_save)])
    trainer.fit(Big(width, compute_s), DataLoader(data, batch_size=4))
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)]
    # the save of step k (every k-th optimizer step) runs at the end of batch k-1 (0-based)
    saved = {i for i in range(len(gaps)) if (i + 1) % every == 0}
    plain = statistics.median(g for i, g in enumerate(gaps) if i not in saved)
    stalls = [gaps[i] - plain for i in sorted(saved)]
    # the end of fit waits for the last save (and, async, its background upload)
    last_step = plain  # the last batch's own time, estimated
    return statistics.median(stalls), plain, end - clock.starts[-1] - last_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--compute-s", type=float, default=0.0,
                        help="seconds each step sleeps: time between saves for an async upload to finish")
    args = parser.parse_args()
    mib = 3 * (args.width * args.width + args.width) * 4 / 2**20
    print(f"model: 3 x Linear({args.width}, {args.width}), {mib:.0f} MiB of weights; {args.steps} steps, "
          f"a save every {args.every}; {args.compute_s} s of extra compute per step; {args.rounds} interleaved "
          f"rounds; medians")
    results: dict[str, list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, s3_server() as server:
        os.environ[storage.STAGING_ENV] = str(Path(tmp) / "staging")
        variants = {"local sync": (lambda r: str(Path(tmp) / f"local-{r}"), False),
                    "local async": (lambda r: str(Path(tmp) / f"local-async-{r}"), True),
                    "s3 sync": (lambda r: server.url(f"s3-{r}"), False),
                    "s3 async": (lambda r: server.url(f"s3-async-{r}"), True)}
        for r in range(args.rounds):
            for name, (root, async_save) in variants.items():
                results.setdefault(name, []).append(
                    run(root(r), args.width, args.steps, args.every, async_save, args.compute_s))
                print(f"  round {r}: {name}: stall {results[name][-1][0]:.2f} s", flush=True)
    base = statistics.median(s for s, _, _ in results["local sync"])
    print(f"\n{'variant':<12} {'stall/save s':>13} {'x local sync':>13} {'step s':>8} {'end wait s':>11}")
    for name, rows in results.items():
        stall = statistics.median(s for s, _, _ in rows)
        step = statistics.median(p for _, p, _ in rows)
        wait = statistics.median(w for _, _, w in rows)
        print(f"{name:<12} {stall:>13.2f} {stall / base:>13.2f} {step:>8.2f} {wait:>11.2f}")


if __name__ == "__main__":
    main()
