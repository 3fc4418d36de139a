"""Run a function on N real processes of one machine, as ranks of a torchrun-like job.

Each process gets the environment a launcher gives a worker (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so
a ``Trainer`` inside it finds its rank the way it would under ``hookloop run``, and
strategies initialise real process groups (gloo on CPU).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable


class ProcessError(RuntimeError):
    """A rank raised, died or timed out; the message names it and carries its traceback."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, function: Callable, args: tuple, nprocs: int, port: int, out: str, env: dict) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)  # N processes on a few cores: no oversubscription
    path = Path(out) / f"rank{rank}.pkl"
    try:
        result = {"value": function(*args)}
    except BaseException as exc:  # reported to the parent with the rank named
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    try:
        data = pickle.dumps(result)
    except Exception as exc:
        data = pickle.dumps({"error": f"rank {rank}'s result cannot be pickled: {exc}", "traceback": ""})
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def run_processes(function: Callable, nprocs: int = 2, args: tuple = (), timeout: float = 120,
                  env: dict | None = None) -> list[Any]:
    """``function(*args)`` on ``nprocs`` fresh processes; their return values in rank order.

    ``function`` must be importable by name (defined at module level), as with any
    ``spawn``-started process. An exception on any rank is raised here as
    :class:`ProcessError` naming the rank, with its traceback; a process that dies
    without reporting, or a job that runs past ``timeout`` seconds, is too, and every
    process still running is killed.
    """
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hookloop-processes-") as out:
        processes = [
            context.Process(target=_child, args=(rank, function, args, nprocs, port, out, dict(env or {})),
                            name=f"hookloop-rank{rank}")
            for rank in range(nprocs)
        ]
        for p in processes:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in processes):
                if time.monotonic() > deadline:
                    stuck = [rank for rank, p in enumerate(processes) if p.is_alive()]
                    raise ProcessError(
                        f"{function.__qualname__} on {nprocs} processes ran past {timeout:.0f} s: "
                        f"rank(s) {stuck} still running (a collective that some rank never "
                        f"reached?); they were killed", rank=stuck[0])
                failed = _first_failure(Path(out), processes)
                if failed is not None:
                    raise failed
                time.sleep(0.05)
            failed = _first_failure(Path(out), processes)
            if failed is not None:
                raise failed
            return [pickle.loads((Path(out) / f"rank{rank}.pkl").read_bytes())["value"] for rank in range(nprocs)]
        finally:
            for p in processes:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)


def _first_failure(out: Path, processes: list) -> ProcessError | None:
    for rank, p in enumerate(processes):
        path = out / f"rank{rank}.pkl"
        if path.exists():
            report = pickle.loads(path.read_bytes())
            if "error" in report:
                return ProcessError(f"rank {rank} raised {report['error']}\n{report['traceback']}", rank=rank)
        elif not p.is_alive() and p.exitcode is not None:
            return ProcessError(f"rank {rank} died with exit code {p.exitcode} before reporting (killed? a crash in C++?)",
                                rank=rank)
    return None
