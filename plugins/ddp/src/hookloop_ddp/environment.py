"""Where a worker learns its place in the job: torchrun's variables, SLURM's, or none.

torchrun (``hookloop run``, ``python -m torch.distributed.run``) and ``ddp_spawn`` set
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node),
``MASTER_ADDR`` and ``MASTER_PORT``. A SLURM job step (``srun``) sets ``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID`` and the node list, from which the
rendezvous address is derived (its first host, as ``scontrol show hostnames`` expands it, or
:func:`expand_hostlist` where ``scontrol`` is not installed). Without either, the process is
a world of one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
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
            variable = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
            nodelist = env.get(variable) or "127.0.0.1"
            job_id = hookloop.env_int("SLURM_JOB_ID", default=0)
            return cls(
                world_size=ntasks,
                global_rank=hookloop.env_int("SLURM_PROCID"),
                local_rank=hookloop.env_int("SLURM_LOCALID", default=0),
                local_world_size=_leading_int(env.get("SLURM_NTASKS_PER_NODE"), ntasks),
                node_rank=hookloop.env_int("SLURM_NODEID", default=0),
                master_addr=env.get("MASTER_ADDR") or first_host(nodelist, variable),
                # Every task of a job derives the same port from the job id.
                master_port=hookloop.env_int("MASTER_PORT", default=10000 + job_id % 20000),
                source="slurm",
            )
        return cls(1, 0, 0, 1, 0, env.get("MASTER_ADDR"), hookloop.env_int("MASTER_PORT"), "single")


def _leading_int(text: str | None, default: int) -> int:
    # SLURM writes tasks per node as "2" or "2(x3)".
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match else default


def first_host(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> str:
    """The first host of a SLURM node list: ``"n[1-3]-ib,gpu1"`` -> ``"n1-ib"``.

    Asks ``scontrol show hostnames`` where it is installed, as SLURM's own expansion is the
    one every task of the job agrees on; otherwise (or if it fails) parses the list with
    :func:`expand_hostlist`. ``variable`` names where the list came from, for the error a
    malformed list raises.
    """
    host = _scontrol_first_host(nodelist)
    if host is not None:
        return host
    # The whole list is checked, so a typo later in it is reported, not silently ignored;
    # only the first host is generated, so a list of a million nodes costs nothing.
    return next(_iter_hosts(_parse_hostlist(nodelist, variable)))


def expand_hostlist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Every host of a SLURM node list, in SLURM's order, without asking SLURM.

    Understands SLURM's hostlist syntax: names separated by commas (``a,b,c``), bracket
    ranges and lists (``node[1-3,7]``), zero padding to the width of a range's lower bound
    (``node[007-010]``), text after the brackets (``n[1-3]-ib``) and several bracket groups
    in one name, expanded as their cartesian product with the last group varying fastest
    (``rack[1-2]-node[01-02]`` -> ``rack1-node01, rack1-node02, rack2-node01, ...``).
    Raises :class:`hookloop.ConfigurationError`, naming ``variable`` and the list, for an
    empty list, unbalanced or nested brackets, and ranges that are empty, not numbers or
    going down.
    """
    return list(_iter_hosts(_parse_hostlist(nodelist, variable)))


def _scontrol_first_host(nodelist: str) -> str | None:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # scontrol on a machine without a reachable slurm.conf exits non-zero; the parser
    # still knows the syntax, so it answers instead.
    if done.returncode != 0:
        return None
    return next((line.strip() for line in done.stdout.splitlines() if line.strip()), None)


# One name of a node list: literal text and bracket groups, each group a list of
# (low, high, width) ranges.
_Name = list[str | list[tuple[int, int, int]]]


def _parse_hostlist(nodelist: str, variable: str) -> list[_Name]:
    def bad(why: str) -> hookloop.ConfigurationError:
        return hookloop.ConfigurationError(
            f"{variable}={nodelist!r} is not a SLURM node list: {why}. Expected names separated by "
            f"commas such as 'node[01-04,7]-ib,gpu1'; `scontrol show hostnames` shows how SLURM reads "
            f"the list, or set MASTER_ADDR to the rendezvous host to skip reading it.")

    names: list[_Name] = []
    name: _Name = []
    text, group, depth = "", "", 0
    for position, char in enumerate(nodelist):
        if char == "[":
            if depth:
                raise bad(f"'[' inside brackets at position {position}")
            depth, group = 1, ""
            if text:
                name.append(text)
                text = ""
        elif char == "]":
            if not depth:
                raise bad(f"unbalanced ']' at position {position}")
            depth = 0
            name.append(_parse_ranges(group, bad))
        elif depth:
            group += char
        elif char == "," or char.isspace():  # SLURM also separates names by whitespace
            if text:
                name.append(text)
                text = ""
            if name:
                names.append(name)
                name = []
        else:
            text += char
    if depth:
        raise bad("unbalanced '[', a ']' is missing")
    if text:
        name.append(text)
    if name:
        names.append(name)
    if not names:
        raise bad("no host in it")
    return names


def _parse_ranges(group: str, bad: Callable[[str], Exception]) -> list[tuple[int, int, int]]:
    ranges = []
    for item in group.split(","):
        if not item:
            raise bad(f"empty range in '[{group}]'")
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise bad(f"'{item}' in '[{group}]' is not a number or a range of numbers such as 1-4")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise bad(f"range '{item}' in '[{group}]' goes down")
        # SLURM pads every number of a range to the width of its written lower bound.
        ranges.append((first, last, len(low)))
    return ranges


def _iter_hosts(names: list[_Name]) -> Iterator[str]:
    for name in names:
        yield from _expand_name(name, 0, "")


def _expand_name(name: _Name, index: int, head: str) -> Iterator[str]:
    if index == len(name):
        yield head
        return
    part = name[index]
    if isinstance(part, str):
        yield from _expand_name(name, index + 1, head + part)
        return
    for first, last, width in part:
        for number in range(first, last + 1):
            yield from _expand_name(name, index + 1, f"{head}{number:0{width}d}")
