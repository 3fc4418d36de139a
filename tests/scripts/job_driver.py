"""The worker side of a shared job (tests/jobs.py): runs battery scripts one after another.

    hookloop run --plugins ddp --devices 2 job_driver.py OUT '[["/path/a.py"], ["/path/b.py", "arg"]]'

Every worker runs each script as ``__main__`` with ``sys.argv = [script, OUT/<stem>,
args...]``, its stdout and stderr (Python's and the C level's) going to
``OUT/<stem>/{stdout,stderr}.rank<R>.log``. Between two scripts the environment,
``sys.argv``, the working directory and the default process group are put back as they
were, so a script sees the worker its own launch would have given it (a
``seed_everything`` of one script, recorded in ``PL_GLOBAL_SEED``, does not seed the next).
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import sys
from pathlib import Path


def _redirected(path: Path, fd: int) -> int:
    """Point ``fd`` at ``path``; return a duplicate of what it was."""
    saved = os.dup(fd)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)
    return saved


def run_script(script: str, args: list[str], out: Path, rank: str) -> None:
    folder = out / Path(script).stem
    folder.mkdir(parents=True, exist_ok=True)
    environ, argv, cwd, path = dict(os.environ), list(sys.argv), os.getcwd(), list(sys.path)
    sys.stdout.flush()
    sys.stderr.flush()
    # The launch's own console names the script each worker is in, so a worker that dies
    # below Python (a signal, an abort in a C++ teardown) is placed without the folders.
    print(f"job_driver: rank {rank} starts {Path(script).name}", file=sys.stderr, flush=True)
    saved = [_redirected(folder / f"stdout.rank{rank}.log", 1), _redirected(folder / f"stderr.rank{rank}.log", 2)]
    sys.argv = [script, str(folder), *args]
    finished = False
    try:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:  # a script's own sys.exit(0) ends that script, not the job
            if exc.code not in (None, 0):
                raise
        finished = True
    finally:
        faulthandler.cancel_dump_traceback_later()  # a script's own watchdog ends with it
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, dup in zip((1, 2), saved):
            os.dup2(dup, fd)
            os.close(dup)
        os.environ.clear()
        os.environ.update(environ)
        sys.argv, sys.path[:] = argv, path
        os.chdir(cwd)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if finished:
                # Every rank leaves the script before any tears the groups down: gloo aborts
                # a process whose peer closes a connection it still reads (a SIGABRT with
                # no Python trace, seen on a loaded machine).
                dist.barrier()
            dist.destroy_process_group()
        print(f"job_driver: rank {rank} done with {Path(script).name}", file=sys.stderr, flush=True)


def main() -> None:
    out, plan = Path(sys.argv[1]), json.loads(sys.argv[2])
    rank = os.environ.get("RANK", "0")
    for script, *args in plan:
        run_script(script, args, out, rank)


if __name__ == "__main__":
    main()
