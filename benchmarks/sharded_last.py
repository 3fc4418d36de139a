"""What installing a sharded ``last.ckpt`` directory costs (issue 19, item 4).

The checkpoint observer writes a top-k checkpoint directory (DeepSpeed's or FSDP's
shards), then makes ``last.ckpt`` a copy of it. Three ways, on a directory of ``--mib``
MiB in ``--files`` files (page cache warm, as right after the save), median of
``--rounds``:

* ``copy, rmtree, rename``: the former scheme (not atomic: a kill between the last two
  leaves no checkpoint);
* ``atomic_copy_tree (copy)``: ``hookloop.atomic_copy_tree`` where the file system has
  no hard links: a full copy, fsynced, then the old directory renamed to
  ``last.prev.ckpt`` and the new one into place;
* ``atomic_copy_tree (hard links)``: the same with hard links (the default): no bytes
  copied; the fsync flushes the shards' own pages (what the writer left dirty);
* the same once the shards are on disk already: the cost of the links and renames alone.

    python benchmarks/sharded_last.py [--mib 200] [--files 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import hookloop
from hookloop.resume import checkpoint as ckpt


def make_source(root: Path, mib: int, files: int, step: int) -> Path:
    source = root / f"epoch=0-step={step}.ckpt"
    tag = source / f"global_step{step}"
    tag.mkdir(parents=True)
    chunk = os.urandom(1 << 20)
    for i in range(files):
        with open(tag / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt", "wb") as f:
            for _ in range(max(1, mib // files)):
                f.write(chunk)
    (tag / ".hookloop-complete").write_text(tag.name)
    (source / "latest").write_text(tag.name)
    return source


def old_scheme(source: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    if dst.exists():
        shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def no_links(src, dst):
    shutil.copy2(src, dst)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ways = {
        "copy, rmtree, rename (former)": lambda s, d: old_scheme(s, d),
        "atomic_copy_tree (copy)": None,
        "atomic_copy_tree (hard links)": lambda s, d: hookloop.atomic_copy_tree(s, d),
        "  the same, shards already flushed": "flushed",
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        root = Path(tmp)
        for r in range(args.rounds):
            for name, way in ways.items():
                case = root / f"{r}-{len(times[name])}-{name.split()[0]}"
                dst = case / "checkpoints" / "last.ckpt"
                old = make_source(case, args.mib, args.files, 2)
                hookloop.atomic_copy_tree(old, dst)  # a last.ckpt to replace
                source = make_source(case, args.mib, args.files, 4)
                if way == "flushed":  # what is left once the writer's pages are on disk
                    ckpt._fsync_tree(source)
                start = time.perf_counter()
                if way == "flushed":
                    hookloop.atomic_copy_tree(source, dst)
                elif way is None:
                    real, ckpt._link_or_copy = ckpt._link_or_copy, no_links
                    try:
                        hookloop.atomic_copy_tree(source, dst)
                    finally:
                        ckpt._link_or_copy = real
                else:
                    way(source, dst)
                times[name].append(time.perf_counter() - start)
                shutil.rmtree(case)
    print(f"last.ckpt from a {args.mib} MiB sharded directory ({args.files} files), median of {args.rounds}:")
    for name, values in times.items():
        print(f"  {name:36s} {statistics.median(values) * 1000:9.1f} ms")


if __name__ == "__main__":
    main()
