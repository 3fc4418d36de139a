"""``hookloop devices SPEC [--auto-select]``: how SPEC is read, and what this machine has.

SPEC is read as you would write it in Python, ``gpus=SPEC``: ``3`` is the int 3 (the
first three GPUs), ``'"3"'`` the string "3" (GPU 3), ``"[1, 3]"`` a list, ``None`` the
CPU. Text that is not a Python literal (``1,3`` typed bare, ``auto``) is a string.
"""

from __future__ import annotations

import argparse
import ast
import sys
from typing import Any, Callable

import hookloop

from .inventory import Machine, read_machine
from .parse import describe, parse_gpus
from .select import is_free, select_gpus


def read_spec(text: str) -> Any:
    """The Python value a user means by SPEC on the command line."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    if value is None or isinstance(value, (int, str, list)):
        return value
    return text  # "1, 3" parses as a tuple; the user typed the string form


def main(argv: list[str] | None = None, machine: Callable[[], Machine] | None = None) -> int:
    """Entry point of ``hookloop devices``; returns the exit status (2 on a bad SPEC)."""
    parser = argparse.ArgumentParser(
        prog="hookloop devices",
        description=(
            "Show how a gpus/devices SPEC is interpreted (Lightning's 'Select GPU devices' "
            "table) and which GPUs this machine has, before launching a run."
        ),
        epilog="Examples: hookloop devices 2 --auto-select; hookloop devices '\"1, 3\"'; hookloop devices -1",
    )
    parser.add_argument("spec", help="3 (first 3 GPUs), -1 (all), [1,3], '\"3\"' (GPU 3), None or 0 (CPU)")
    parser.add_argument("--auto-select", action="store_true", help="pick free GPUs for an int SPEC (auto_select_gpus)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    spec = read_spec(args.spec)
    found = (machine or read_machine)()

    if found.gpus:
        print(f"this machine: {len(found.gpus)} GPU(s) visible (from {found.source})")
        for position, gpu in enumerate(found.gpus):
            free = "free" if gpu.processes is not None and is_free(gpu) else "busy" if gpu.processes else "?"
            nvml = f" (nvidia-smi {gpu.index})" if gpu.index != position else ""
            print(f"  [{position}]{nvml} {gpu.describe()}: {free}")
    else:
        print(f"this machine: no GPU ({found.note or 'none found'})")

    try:
        parsed = parse_gpus(spec, len(found.gpus))
        print(f"gpus={spec!r} ({type(spec).__name__}) -> {parsed}: {describe(spec, parsed)}")
        chosen = select_gpus(spec, found.gpus, auto_select=args.auto_select)
    except hookloop.ConfigurationError as exc:
        print(f"hookloop devices: error: {exc}", file=sys.stderr)
        return 2
    if chosen is None:
        print("selection: the CPU (no GPU is used)")
        return 0
    how = "auto-selected free GPUs" if args.auto_select and isinstance(spec, int) else "selection"
    indices = ",".join(str(g.index) for g in chosen)
    print(f"{how}: {[found.gpus.index(g) for g in chosen]} -> CUDA_VISIBLE_DEVICES={indices}")
    for rank, gpu in enumerate(chosen):
        print(f"  local rank {rank} -> cuda:{rank} = {gpu.name} (nvidia-smi {gpu.index})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
