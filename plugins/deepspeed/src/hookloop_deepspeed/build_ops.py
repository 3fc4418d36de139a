"""Compile DeepSpeed's CPU ops once, at install time, instead of inside the first run.

DeepSpeed builds its C++ ops just in time on first use (the shared-memory collectives,
CPU Adam for optimizer offload, async_io for NVMe offload): minutes on a small machine, which would land in
the first training run (or test) on a fresh machine. ``make install`` runs

    DS_ACCELERATOR=cpu python -m hookloop_deepspeed.build_ops

so they are compiled into ``~/.cache/torch_extensions`` ahead of time. On a CUDA machine
leave ``DS_ACCELERATOR`` unset; the CPU-only ops are skipped there.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import time
from pathlib import Path

#: The ops :func:`main` always compiles (DeepSpeed's builder names; async_io, built only
#: where libaio is, is not required).
OPS = ("deepspeed_shm_comm", "cpu_adam", "fused_adam")
BUILD_COMMAND = "run 'make backends' (or python -m hookloop_deepspeed.build_ops)"


def extensions_dir() -> Path:
    """Where torch's JIT extension loader (which DeepSpeed uses) puts compiled ops:
    ``$TORCH_EXTENSIONS_DIR``, else torch's default root and its ``py<ver>_<accelerator>``
    folder (torch.utils.cpp_extension's rule, computed here without creating anything)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def _prebuilt_ops() -> dict:
    """``installed_ops`` of a DeepSpeed installed with its ops compiled ahead of time
    (``DS_BUILD_OPS=1``), read from its generated file without importing deepspeed."""
    spec = importlib.util.find_spec("deepspeed")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            tree = ast.parse(Path(folder, "git_version_info_installed.py").read_text())
        except (OSError, SyntaxError):
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "installed_ops" for t in node.targets):
                return ast.literal_eval(node.value)
    return {}


def build_status() -> str | None:
    """``None`` when the CPU ops :func:`main` builds are compiled (or prebuilt into
    DeepSpeed), else the command that builds them; never imports deepspeed. The plugin's
    ``hookloop_build_status`` (shown by ``hookloop plugins``)."""
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return None  # main() prebuilds nothing there
    root, prebuilt = extensions_dir(), _prebuilt_ops()
    missing = [op for op in OPS if not prebuilt.get(op) and not (root / op / f"{op}.so").is_file()]
    return BUILD_COMMAND if missing else None


#: A build folder whose files have not changed for this long holds no live build.
STALE_LOCK_S = 600


def clear_stale_lock(folder: Path, idle_s: float = STALE_LOCK_S) -> bool:
    """Remove ``folder/lock`` when no build is behind it; return whether it was removed.

    torch's extension loader takes that lock file for a build and waits, without end, for
    it to disappear; a build that was killed (Ctrl-C, a timeout, a machine restart) leaves
    it behind, and every later build or first use of the op then hangs. A live build
    rewrites the folder's files (ninja's log, objects) at least every few minutes, so a
    lock in a folder where nothing changed for ``idle_s`` seconds is stale."""
    lock = folder / "lock"
    try:
        newest = max(p.stat().st_mtime for p in folder.iterdir())
    except (OSError, ValueError):
        return False
    if not lock.exists() or time.time() - newest < idle_s:
        return False
    age_min = (time.time() - newest) / 60
    print(f"hookloop-deepspeed: removing {lock}, left by a build that stopped "
          f"{age_min:.0f} min ago (nothing in {folder.name}/ changed since)", file=sys.stderr)
    lock.unlink(missing_ok=True)
    return True


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
    root = extensions_dir()
    for builder in builders:
        clear_stale_lock(root / builder.name)
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
