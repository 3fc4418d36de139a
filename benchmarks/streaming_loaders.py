"""Data-loading throughput of each stateful/streaming loader under ``hookloop.Trainer``
against the same loader in a plain PyTorch loop doing the same work (issue 37, item 4).

    .venv/bin/python benchmarks/streaming_loaders.py [--samples 8192] [--epochs 2] [--repeats 3]

One process, ``num_workers=2``, batch 32, a Linear(8, 3) model and SGD (loading dominates).
For each loader (torchdata ``StatefulDataLoader`` over a map-style dataset, a Hugging Face
``datasets`` stream of local parquet files in a ``StatefulDataLoader``, LitData's
``StreamingDataset`` in its ``StreamingDataLoader``) the plain loop and the hookloop run
alternate, ``--repeats`` times each, in one run; printed: samples/s (best of the repeats),
their ratio, and how many times hookloop called the loader's ``state_dict()``
(``enable_checkpointing=False``: a sized loader's state is taken only when a checkpoint is
written; an unsized stream's before each read-ahead).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import hookloop
from hookloop.testing import streaming

BATCH = 32


class Linear(hookloop.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 3)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make(kind: str, n: int, data: Path):
    return streaming.train_loader(kind, n=n, batch_size=BATCH, rank=0, world_size=1, noise=0.1,
                                  persistent_workers=True, data_dir=data)


def plain(loader, epochs: int) -> tuple[float, int]:
    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples, start = 0, time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            x, y, _ = batch
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            samples += len(y)
    return samples / (time.perf_counter() - start), 0


def under_hookloop(loader, epochs: int, root: str) -> tuple[float, int]:
    calls = [0]
    own = loader.state_dict

    def counted():
        calls[0] += 1
        return own()

    loader.state_dict = counted
    samples = [0]

    class Count(hookloop.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            samples[0] += len(batch[1])

    module = Linear()
    trainer = hookloop.Trainer(max_epochs=epochs, enable_progress_bar=False, enable_checkpointing=False,
                               enable_model_summary=False, logger=False, default_root_dir=root,
                               num_sanity_val_steps=0, callbacks=[Count()])
    start = time.perf_counter()
    trainer.fit(module, loader)
    elapsed = time.perf_counter() - start
    return samples[0] / elapsed, calls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    # hookloop runs torch on one thread per process (OMP_NUM_THREADS=1); the plain loop too,
    # or it competes with its own loader workers for the cores
    torch.set_num_threads(1)
    print(f"{args.samples} samples x {args.epochs} epochs, batch {BATCH}, num_workers=2, best of {args.repeats}")
    print(f"{'loader':<16} {'plain samples/s':>16} {'hookloop samples/s':>19} {'hookloop/plain':>15} "
          f"{'state_dict() calls':>19} {'steps':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("stateful", "hf_streaming", "litdata"):
            best_plain = best_hook = 0.0
            calls = 0
            for r in range(args.repeats):  # alternating, the plain loop first on even repeats
                for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                    if which == 0:
                        best_plain = max(best_plain, plain(make(kind, args.samples, Path(tmp)), args.epochs)[0])
                    else:
                        rate, calls = under_hookloop(make(kind, args.samples, Path(tmp)), args.epochs,
                                                     f"{tmp}/run{kind}{r}")
                        best_hook = max(best_hook, rate)
            steps = args.epochs * (args.samples // BATCH)
            print(f"{kind:<16} {best_plain:>16.0f} {best_hook:>19.0f} {best_hook / best_plain:>15.2f} "
                  f"{calls:>19} {steps:>6}", flush=True)


if __name__ == "__main__":
    main()
