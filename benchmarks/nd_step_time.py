"""Step time of examples/gpt.py under each N-D layout through hookloop, next to the same
parallelisation written by hand (benchmarks/handwritten_nd.py, torchtitan-style).

    python benchmarks/nd_step_time.py [--layouts one,ddp,fsdp,tp,fsdp_tp] [--rounds 3] [--steps 8]

In one run, interleaved rounds: for each round, for each layout, ``hookloop run`` of
nd_memory.py's worker (the example's module, its datamodule, ``Trainer``) then the
hand-written script under ``torch.distributed.run`` with the same processes, model, data
order (``DistributedSampler``, seed 0), batch and optimizer. A step's time is from the
end of one optimizer step to the end of the next (the data fetch and the loop's hooks
included), rank 0's, the first ``--warmup`` steps dropped; the figure is the median
over every round's timed steps. ``hookloop/hand-written`` is in throughput terms
(hand-written median step time / hookloop's): the issue asks >= 0.98. Start-up (the
launch, the process group, wrapping the model) is not in the step time.

On a shared CPU machine the spread between rounds is large (+-20 % for one layout):
read the medians with the per-round spread printed beside them, and the second table:
the work of a step (rank 0's CPU time and its Python calls in one steady-state step,
benchmarks/stepwork.py), which says whether a difference is the code's or the machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nd_memory  # noqa: E402
from nd_memory import LABELS, LAYOUTS, add_model_args, launch, run_hookloop  # noqa: E402
from stepwork import COUNTED_STEP  # noqa: E402

HAND = Path(__file__).resolve().parent / "handwritten_nd.py"


def run_hand(layout: str, out: Path, steps: int, args) -> list[dict]:
    _, procs, _ = LAYOUTS[layout]
    out.mkdir(parents=True, exist_ok=True)
    script = [str(HAND), "--layout", layout, "--out", str(out), "--steps", str(steps), *nd_memory.model_argv(args)]
    if procs == 1:
        launch([sys.executable, *script])
    else:
        launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
                *script])
    return [json.loads((out / f"hand_rank{r}.json").read_text()) for r in range(procs)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="one,ddp,fsdp,tp,fsdp_tp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    add_model_args(p)
    args = p.parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    for x in layouts:
        if x not in LAYOUTS:
            p.error(f"unknown layout {x!r}; known: {', '.join(LAYOUTS)}")
    base = Path(tempfile.mkdtemp(prefix="hookloop-nd-step-time-"))
    total = args.warmup + args.steps + 1  # hookloop's first interval starts at the end of step 1
    sides = [(x, side) for x in layouts for side in ("hookloop", "hand")]
    times: dict = {k: [] for k in sides}
    cpu: dict = {k: [] for k in sides}
    calls: dict = {k: [] for k in sides}
    per_round: dict = {k: [] for k in sides}
    for r in range(args.rounds):
        for x in layouts:
            hook_record = run_hookloop(x, base / f"r{r}-{x}-hookloop", total, args)[0]
            hand_record = run_hand(x, base / f"r{r}-{x}-hand", total, args)[0]
            hook, hand = hook_record["times"][-args.steps:], hand_record["times"][-args.steps:]
            for side, record in (("hookloop", hook_record), ("hand", hand_record)):
                t = record["times"][-args.steps:]
                times[(x, side)] += t
                cpu[(x, side)] += record["cpu"][-args.steps:]
                calls[(x, side)].append(record["calls"])
                per_round[(x, side)].append(statistics.median(t))
            print(f"round {r + 1}: {LABELS[x]:<14} hookloop {statistics.median(hook) * 1e3:8.1f} ms   "
                  f"hand-written {statistics.median(hand) * 1e3:8.1f} ms   (torch threads per process: "
                  f"{hook_record['threads']}, {hand_record['threads']})", flush=True)
    print()
    print(f"examples/gpt.py: {args.layers} blocks, d={args.dim}, {args.heads} heads, seq {args.seq}, batch "
          f"{args.batch_size} per replica; {args.rounds} interleaved rounds x {args.steps} steps; median step time "
          f"(per-round medians min-max)")
    print(f"{'layout':<16}{'hookloop ms':>28}{'hand-written ms':>28}{'hookloop/hand-written':>24}")
    for x in layouts:
        cells = []
        for side in ("hookloop", "hand"):
            m = statistics.median(times[(x, side)])
            lo, hi = min(per_round[(x, side)]), max(per_round[(x, side)])
            cells.append(f"{m * 1e3:8.1f} ({lo * 1e3:6.1f}-{hi * 1e3:6.1f})")
        ratio = statistics.median(times[(x, "hand")]) / statistics.median(times[(x, "hookloop")])
        print(f"{LABELS[x]:<16}{cells[0]:>28}{cells[1]:>28}{ratio:>24.3f}")
    print()
    print("The work of a step on rank 0 (stepwork.py): the process's CPU time (median over the same steps) and "
          f"the Python calls of one steady-state step (step {COUNTED_STEP}, median over rounds); "
          "ratios hand-written/hookloop, as above")
    print(f"{'layout':<16}{'CPU ms hookloop':>17}{'hand':>10}{'ratio':>8}{'calls hookloop':>17}{'hand':>10}{'ratio':>8}")
    for x in layouts:
        c = [statistics.median(cpu[(x, side)]) for side in ("hookloop", "hand")]
        n = [statistics.median(calls[(x, side)]) for side in ("hookloop", "hand")]
        print(f"{LABELS[x]:<16}{c[0] * 1e3:>17.1f}{c[1] * 1e3:>10.1f}{c[1] / c[0]:>8.3f}"
              f"{n[0]:>17.0f}{n[1]:>10.0f}{n[1] / n[0]:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
