"""The cost of the checkpoint checksum: time per save and per load, with and without it.

``plain`` is what ``hookloop.atomic_save`` did before checksums: ``torch.save`` into a
temporary file, fsync, rename (``plain`` load: ``torch.load(weights_only=True)``).
``hookloop`` is ``hookloop.atomic_save`` as it is: the same, hashing the bytes as they are
written and appending the SHA-256 trailer, and keeping the replaced ``last.ckpt`` as
``last.prev.ckpt`` (``hookloop`` load: ``hookloop.safe_load``, which verifies the
checksum first). The checkpoints are a model's weights, SGD momentum and RNG state, for
three MLP sizes. Variants run in interleaved rounds; medians in ms are reported, with the
time of ``verify_checksum`` alone.

    python benchmarks/checkpoint_checksum.py [--rounds 5] [--saves 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import hookloop
from hookloop.resume import checkpoint as ckpt


def plain_save(obj, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint_of(width: int, depth: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "rng": ckpt.rng_state()}


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--saves", type=int, default=20)
    args = parser.parse_args()
    print(f"{'model':>14} {'MB':>7} {'save plain':>11} {'save hookloop':>14} {'load plain':>11} "
          f"{'load hookloop':>14} {'verify':>7}")
    for width, depth in [(16, 2), (256, 4), (1024, 4)]:
        checkpoint = checkpoint_of(width, depth)
        params = sum(t.numel() for t in checkpoint["state_dict"].values())
        times: dict[str, list[float]] = {k: [] for k in ("sp", "sh", "lp", "lh", "v")}
        with tempfile.TemporaryDirectory() as directory:
            plain, ours = Path(directory) / "plain" / "last.ckpt", Path(directory) / "last.ckpt"
            plain.parent.mkdir()
            plain_save(checkpoint, plain)
            hookloop.atomic_save(checkpoint, ours)
            for _ in range(args.rounds):
                times["sp"] += timed(lambda: plain_save(checkpoint, plain), args.saves)
                times["sh"] += timed(lambda: hookloop.atomic_save(checkpoint, ours), args.saves)
                times["lp"] += timed(lambda: torch.load(plain, weights_only=True), args.saves)
                times["lh"] += timed(lambda: hookloop.safe_load(ours), args.saves)
                times["v"] += timed(lambda: ckpt.verify_checksum(ours), args.saves)
            size = ours.stat().st_size / 1e6
        m = {k: statistics.median(v) for k, v in times.items()}
        print(f"{params / 1e6:>12.3f}M {size:>7.2f} {m['sp']:>11.2f} {m['sh']:>14.2f} {m['lp']:>11.2f} "
              f"{m['lh']:>14.2f} {m['v']:>7.2f}")


if __name__ == "__main__":
    main()
