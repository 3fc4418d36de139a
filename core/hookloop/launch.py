"""Starting worker processes through PyTorch's elastic agent (``torch.distributed.run``).

hookloop does not spawn processes itself: the default ``launch_command`` is torchrun's,
which restarts failed workers (``--max-restarts``) and joins several machines through a
c10d rendezvous (``--nodes``, ``--node-rank``, ``--rdzv-endpoint``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Callable

from .config import DEFAULTS_ENV, TrainerConfig

WORKER_ENV = "HOOKLOOP_WORKER"


def in_worker() -> bool:
    """True inside a process that a launcher started (hookloop's, torchrun, or a plugin's)."""
    return os.environ.get(WORKER_ENV) == "1" or "LOCAL_RANK" in os.environ


def elastic_command(config: TrainerConfig, script: str, script_args: list[str]) -> list[str]:
    """The torchrun command line for ``config``; the plain interpreter for one process."""
    nproc = config.num_processes()
    if nproc == 1 and config.nodes == 1 and config.max_restarts == 0:
        return [sys.executable, script, *script_args]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if config.nodes > 1:
        cmd += [
            f"--nnodes={config.nodes}",
            f"--node-rank={config.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={config.rdzv_endpoint}",
            f"--rdzv-id={os.environ.get('HOOKLOOP_RUN_ID', 'hookloop')}",
            # node 0 hosts the rendezvous store, so two agents on one host agree.
            f"--rdzv-conf=is_host={'1' if config.node_rank == 0 else '0'}",
        ]
    else:
        cmd += ["--standalone", "--nnodes=1"]
    if config.max_restarts:
        cmd.append(f"--max-restarts={config.max_restarts}")
    return [*cmd, script, *script_args]


def is_plain_interpreter(cmd: list[str], script: str) -> bool:
    """Whether ``cmd`` runs ``script`` in one plain interpreter (no launcher around it)."""
    return len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1] == script


def run_command(cmd: list[str], defaults: dict | None = None, workers: bool = True) -> int:
    """Run a launch command and return its exit code.

    ``defaults`` (the options given to ``hookloop run``) become the Trainer defaults of
    the workers; without them the workers inherit this process's environment as is.
    ``workers=False`` for a plain interpreter: that process is not a launched worker, so
    a ``Trainer`` in it that asks for several processes starts them (through the
    strategy's launcher) instead of silently training alone.
    """
    env = dict(os.environ)
    if workers:
        env[WORKER_ENV] = "1"
    else:
        env.pop(WORKER_ENV, None)
    if defaults is not None:
        env[DEFAULTS_ENV] = json.dumps(defaults)
    proc = subprocess.Popen(cmd, env=env)
    forwarding = _forward_sigterm(proc)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    finally:
        forwarding()


def _forward_sigterm(proc: subprocess.Popen) -> Callable[[], None]:
    """Pass a SIGTERM this process receives on to the launched process (torchrun's agent,
    which passes it to every worker: each checkpoints at its next step boundary and exits
    143; README "Faults"), and keep waiting for it. Without this, a SIGTERM sent to
    ``hookloop run`` alone (a container's PID 1, a scheduler that signals the main process)
    would end it and leave the agent and the workers running unsupervised. Returns the
    function that restores the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set handlers; nothing to restore

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    return lambda: signal.signal(signal.SIGTERM, previous)
