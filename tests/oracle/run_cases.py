"""Run oracle cases under one framework and write their observations as JSON.

    python run_cases.py --framework lightning --mode one --out obs.json [--cases a,b]
    python -m torch.distributed.run --standalone --nproc-per-node 2 run_cases.py --mode ddp ...

Under ddp every rank runs every case; global rank 0 writes the file. A case that raises
is recorded as ``{"error": "Type: message"}`` so the comparison names it instead of
losing the other cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import CASES  # noqa: E402
from frameworks import load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", required=True, choices=("lightning", "hookloop"))
    parser.add_argument("--mode", required=True, choices=("one", "ddp"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="")
    parser.add_argument("--root", default="")
    args = parser.parse_args()
    fw = load(args.framework)
    names = [n for n in (args.cases.split(",") if args.cases else CASES) if args.mode in CASES[n][1]]
    ddp = args.mode == "ddp"
    root = args.root or tempfile.mkdtemp(prefix=f"oracle-{args.framework}-")
    results = {}
    for name in names:
        case_root = os.path.join(root, args.mode, name)
        try:
            results[name] = CASES[name][0](fw, case_root, ddp)
        except Exception as exc:  # recorded, compared, reported by the test
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(results, default=float))
    if ddp:
        _leave_process_group()


def _leave_process_group() -> None:
    """Both ranks leave the process group together before the interpreter exits. A rank
    that exits with its gloo group alive while the other still works can abort in torch's
    teardown ("terminate called without an active exception", SIGABRT, seen under load
    with Lightning's ddp runs), which torchrun reports as the job failing."""
    import gc

    import torch.distributed as dist

    gc.collect()  # the cases' DDP wrappers go while the group they hold still exists
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
