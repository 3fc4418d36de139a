"""Where a worker learns its place in the job: torchrun's variables, SLURM's, or none.

torchrun (``hookloop run``, ``python -m torch.distributed.run``) and ``ddp_spawn`` set
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node),
``MASTER_ADDR`` and ``MASTER_PORT``. A SLURM job step (``srun``) sets ``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID`` and the node list, from which the
rendezvous address is derived. Without either, the process is a world of one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import hookloop


@dataclass(frozen=True)
class ClusterEnvironment:
    """This process's ranks and the address of the rendezvous, as the launcher set them."""

    world_size: int
    global_rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    source: str  # "torchrun", "slurm" or "single"

    @classmethod
    def detect(cls) -> "ClusterEnvironment":
        """Read the environment of this process (torchrun first, then SLURM)."""
        env = os.environ
        if "RANK" in env and "WORLD_SIZE" in env:
            world = hookloop.env_int("WORLD_SIZE")
            return cls(
                world_size=world,
                global_rank=hookloop.env_int("RANK"),
                local_rank=hookloop.env_int("LOCAL_RANK", default=0),
                local_world_size=hookloop.env_int("LOCAL_WORLD_SIZE", default=world),
                node_rank=hookloop.env_int("GROUP_RANK", "NODE_RANK", default=0),
                master_addr=env.get("MASTER_ADDR"),
                master_port=hookloop.env_int("MASTER_PORT"),
                source="torchrun",
            )
        ntasks = hookloop.env_int("SLURM_NTASKS", default=1)
        if "SLURM_PROCID" in env and ntasks > 1:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
            job_id = hookloop.env_int("SLURM_JOB_ID", default=0)
            return cls(
                world_size=ntasks,
                global_rank=hookloop.env_int("SLURM_PROCID"),
                local_rank=hookloop.env_int("SLURM_LOCALID", default=0),
                local_world_size=_leading_int(env.get("SLURM_NTASKS_PER_NODE"), ntasks),
                node_rank=hookloop.env_int("SLURM_NODEID", default=0),
                master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
                # Every task of a job derives the same port from the job id.
                master_port=hookloop.env_int("MASTER_PORT", default=10000 + job_id % 20000),
                source="slurm",
            )
        return cls(1, 0, 0, 1, 0, env.get("MASTER_ADDR"), hookloop.env_int("MASTER_PORT"), "single")


def _leading_int(text: str | None, default: int) -> int:
    # SLURM writes tasks per node as "2" or "2(x3)".
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match else default


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"node[07-09,12],gpu1"`` -> ``"node07"``."""
    first = re.match(r"([^,\[]+)(\[([^\]]*)\])?", nodelist.strip())
    if first is None:
        return nodelist
    prefix, ranges = first.group(1), first.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]
