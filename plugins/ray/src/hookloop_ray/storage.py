"""The shared-storage check: every worker must see the files of the run.

A restart resumes every worker from the run's ``last.ckpt``, which rank 0 writes under
``default_root_dir``; ranks read the same run directory. On a cluster that means storage
every node mounts at the same path (NFS, a parallel file system, a cloud bucket mounted
with FUSE). At the start of every run (the plugin's ``setup``), global rank 0 writes a
file named after the job under ``default_root_dir``, and every worker looks for it; the
run stops at once, on every rank, when a worker cannot see it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import hookloop


def check_shared_storage(trainer) -> None:
    """Refuse the run when a worker cannot read what global rank 0 wrote under the root."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    root = Path(trainer.default_root_dir).resolve()
    token = os.environ.get("HOOKLOOP_RUN_TOKEN", "run")
    probe = root / f".hookloop-ray-shared-{token}-{os.environ.get('HOOKLOOP_ATTEMPT', '0')}"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_text(socket.gethostname())
    dist.barrier()
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (probe.exists(), socket.gethostname()))
    dist.barrier()
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    blind = sorted({host for ok, host in seen if not ok})
    if blind:
        raise hookloop.ConfigurationError(
            f"the ray plugin's workers on {', '.join(blind)} cannot see {probe.name}, which rank 0 wrote "
            f"under default_root_dir={str(root)!r}: the run's checkpoints must be on storage every node "
            f"reads at the same path, or a restart cannot resume. Set default_root_dir (--default-root-dir) "
            f"to a directory on a shared file system (NFS, a parallel file system, a mounted bucket)")
