"""Compile DeepSpeed's CPU ops once, at install time, instead of inside the first run.

DeepSpeed builds its C++ ops just in time on first use (the shared-memory collectives,
CPU Adam for optimizer offload, async_io for NVMe offload): minutes on a small machine, which would land in
the first training run (or test) on a fresh machine. ``make install`` runs

    DS_ACCELERATOR=cpu python -m hookloop_deepspeed.build_ops

so they are compiled into ``~/.cache/torch_extensions`` ahead of time. On a CUDA machine
leave ``DS_ACCELERATOR`` unset; the CPU-only ops are skipped there.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if os.environ["DS_ACCELERATOR"] != "cpu":
        print("hookloop-deepspeed: not a CPU accelerator; nothing to prebuild")
        return 0
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder

    builders = [ShareMemCommBuilder(), CPUAdamBuilder(), FusedAdamBuilder()]
    # async_io (NVMe offload) links libaio; without it the op cannot build, and a run that
    # asks for NVMe offload stops at start saying so.
    if AsyncIOBuilder().is_compatible(verbose=False):
        builders.append(AsyncIOBuilder())
    else:
        print("hookloop-deepspeed: no libaio, skipping async_io (NVMe offload): apt-get install libaio-dev")
    for builder in builders:
        start = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as exc:  # a missing op is not fatal: DeepSpeed falls back or says so at use
            print(f"hookloop-deepspeed: could not build {builder.name}: {exc}", file=sys.stderr)
            continue
        print(f"hookloop-deepspeed: {builder.name} ready ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
