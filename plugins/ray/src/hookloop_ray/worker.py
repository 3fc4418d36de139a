"""The worker side: the Ray actor, and the worker process it starts.

Each actor (:class:`Worker`) holds one bundle of the placement group and starts one worker
process, ``python -m hookloop_ray.worker``, with the worker's place in its environment and
``HOOKLOOP_LAUNCHER_PID`` naming the actor: the worker dies with the actor (a killed actor,
a lost node, ``ray.kill``), and honours the job's run token and ``hookloop run``'s options
because its launcher is its parent (docs/environment.md). A process of its own per attempt
also gives each attempt a fresh interpreter (no process group, CUDA context or module
state left from a failed one), as torchrun's restarts do.

The worker process runs the user's script (``--script``, through :mod:`runpy`, as
``python script.py`` would) or the pickled ``function(trainer)`` (``--payload``). Rank 0
of function mode writes ``hookloop.worker_result`` to ``--result``; a worker that fails
writes its exception and traceback to ``--error``, which the actor returns.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


class Worker:
    """One Ray actor of the job (made remote by :mod:`hookloop_ray.cluster`)."""

    def where(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "address": ray.util.get_node_ip_address(),
                "gpu_ids": [int(g) for g in ray.get_gpu_ids()]}

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    process: subprocess.Popen | None = None

    def stop(self) -> None:
        """SIGTERM to the running worker process (an elastic job grows back): hookloop
        saves ``last.ckpt`` at the next step boundary and exits 143. Runs beside
        :meth:`run` (the actor has two threads)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def run(self, args: list[str], env: dict[str, str], cwd: str, payload: bytes | None) -> dict:
        """Start the worker process, wait for it, and report how it ended."""
        with tempfile.TemporaryDirectory(prefix="hookloop-ray-") as tmp:
            files = {name: str(Path(tmp) / name) for name in ("payload", "result", "error")}
            command = [sys.executable, "-m", "hookloop_ray.worker", "--error", files["error"]]
            if payload is not None:
                Path(files["payload"]).write_bytes(payload)
                command += ["--payload", files["payload"], "--result", files["result"]]
            environ = {**os.environ, **env, "HOOKLOOP_LAUNCHER_PID": str(os.getpid())}
            process = self.process = subprocess.Popen([*command, *args], env=environ,
                                                      cwd=cwd if os.path.isdir(cwd) else None)
            returncode = process.wait()
            report: dict[str, Any] = {"returncode": returncode, "pid": process.pid, "error": None, "result": None}
            if os.path.exists(files["error"]):
                report["error"] = Path(files["error"]).read_bytes()
            if returncode == 0 and os.path.exists(files["result"]):
                report["result"] = Path(files["result"]).read_bytes()
            return report


# ---------------------------------------------------------------------------------------
# The worker process: python -m hookloop_ray.worker --error E (--payload P --result R | SCRIPT ARGS...)
# ---------------------------------------------------------------------------------------


def _write_error(path: str, exc: BaseException) -> None:
    from hookloop.distributed.results import worker_error

    with open(path, "wb") as f:
        pickle.dump({**worker_error(exc), "rank": os.environ.get("RANK")}, f)


def _run_function(payload: str, result: str) -> None:
    import cloudpickle

    import hookloop

    job = cloudpickle.loads(Path(payload).read_bytes())
    trainer, function = job["trainer"], job["function"]
    value = function(trainer)
    if trainer.global_rank == 0:
        hookloop.atomic_save(hookloop.worker_result(trainer, value), Path(result))


def _run_script(script: str, args: list[str]) -> None:
    import runpy

    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str]) -> int:
    error = argv[argv.index("--error") + 1]
    rest = argv[argv.index("--error") + 2:]
    import hookloop  # noqa: F401  (dies with the actor from here on: die_with_launcher)

    try:
        if rest[:1] == ["--payload"]:
            _run_function(rest[1], rest[3])
        else:
            _run_script(rest[0], rest[1:])
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _write_error(error, exc)
        raise
    except BaseException as exc:
        _write_error(error, exc)
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
