"""Script mode: ``hookloop run --plugins ddp,ray train.py`` runs this driver.

``python -m hookloop_ray.driver OPTIONS_JSON SCRIPT ARGS...`` connects to Ray (or starts a
local cluster), places the workers, runs ``SCRIPT ARGS`` in each (as ``python SCRIPT
ARGS`` would, with the worker's place in its environment) and exits with the job's status:
0, or 1 after printing the failed worker's traceback. ``hookloop run``'s options reach the
workers (``HOOKLOOP_TRAINER_DEFAULTS``, forwarded with the caller's other hookloop
variables). Everything this started ends with it, also when it is SIGKILLed
(``hookloop.as_launcher(reap=True)``).
"""

from __future__ import annotations

import json
import os
import pickle
import sys

import hookloop

from .cluster import Job, Options, WorkerFailed, connected, forwarded_environment, run_job


def main(argv: list[str]) -> int:
    options = Options(**json.loads(argv[0]))
    script, args = argv[1], argv[2:]
    job = Job(args=[script, *args], env=forwarded_environment(), cwd=os.getcwd())
    try:
        with hookloop.as_launcher(reap=True), connected(options) as ray:
            run_job(ray, options, job)
    except WorkerFailed as failure:
        print(f"hookloop-ray: {script} failed: {failure}", file=sys.stderr, flush=True)
        error = (failure.report or {}).get("error")
        if error:
            print(pickle.loads(error)["traceback"], file=sys.stderr, flush=True)
        return 1
    except hookloop.ConfigurationError as exc:
        print(f"hookloop-ray: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
