"""The ``ray`` launcher: hookloop's workers as Ray actors in a placement group."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hookloop
from hookloop.distributed.elastic import ELASTIC_MAX_RESTARTS

from .cluster import (
    WORKER_ENV,
    Job,
    Options,
    WorkerFailed,
    connected,
    forwarded_environment,
    run_job,
)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _check(name: str, ok: bool, what: str, value: Any) -> None:
    if not ok:
        raise hookloop.ConfigurationError(f"ray plugin option {name}={value!r} {what}")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def worker_range(value: Any) -> tuple[int | None, int | None]:
    """``(MIN, MAX)`` of ``num_workers``: ``(None, N)`` for a fixed ``N`` (or ``None``),
    ``(MIN, MAX)`` for ``(MIN, MAX)``, ``[MIN, MAX]`` or ``"MIN:MAX"`` (``(N, N)`` is a
    fixed ``N``). Refused, with the fix, when it is neither."""
    text = value.strip() if isinstance(value, str) else None
    if text is not None and text.isdigit():
        value = int(text)
    if value is None or _whole(value):
        _check("num_workers", value is None or value >= 1,
               "must be an integer >= 1, (MIN, MAX) or 'MIN:MAX' for an elastic job, or None for devices x nodes",
               value)
        return None, value
    if text is not None:
        parts = text.split(":")
        _check("num_workers", len(parts) == 2 and all(p.strip().isdigit() for p in parts),
               "must be an integer >= 1, or (MIN, MAX) / 'MIN:MAX' for an elastic job (Ray Train's "
               "ScalingConfig(num_workers=(MIN, MAX))), e.g. num_workers='1:2'", value)
        pair = tuple(int(p) for p in parts)
    else:
        _check("num_workers", isinstance(value, (tuple, list)) and len(value) == 2 and all(_whole(v) for v in value),
               "must be an integer >= 1, or (MIN, MAX) / 'MIN:MAX' for an elastic job (Ray Train's "
               "ScalingConfig(num_workers=(MIN, MAX))), e.g. num_workers=(1, 2)", value)
        pair = (value[0], value[1])
    low, high = pair
    _check("num_workers", low >= 1, f"has MIN={low}: an elastic job needs at least 1 worker, e.g. (1, {max(high, 1)})",
           value)
    _check("num_workers", low <= high, f"has MIN={low} above MAX={high}: the range is (MIN, MAX), e.g. ({high}, {low})",
           value)
    return (low, high) if low < high else (None, high)


class Ray:
    """Start the workers of a run as Ray actors, with any strategy (``plugins=["ddp",
    "ray"]``, ``hookloop run --plugins fsdp,ray script.py``).

    Options (constructor arguments, or ``--plugin-option ray.NAME=VALUE``):

    ``address``
        ``None`` (default): start a local Ray cluster for the job (stopped when it ends);
        ``"auto"``: the cluster this machine joined (``ray start``); ``"HOST:PORT"``: a
        head node's GCS; ``"ray://HOST:10001"``: Ray Client. A connection the calling
        process already made (``ray.init()`` before ``fit``) is used as it is.
    ``num_workers``
        how many workers (processes); ``None`` (default): ``devices x nodes``, as torchrun
        would start. Ray decides the nodes; each worker's local rank and node rank come
        from the node it landed on. A range, ``(MIN, MAX)`` or ``"MIN:MAX"`` (Ray Train's
        elastic ``ScalingConfig(num_workers=(MIN, MAX))``): an elastic job, on as many
        workers as the cluster can place (at least MIN); it shrinks after a lost worker or
        node and grows back when the cluster can place MAX again, resuming from
        ``last.ckpt`` each time, with the Trainer's ``elastic_batch`` policy.
    ``resources_per_worker``
        the Ray resources of one worker (default ``{"CPU": 1}``; ``{"CPU": 4, "GPU": 1}``),
        one bundle of the placement group each.
    ``placement_strategy``
        Ray's: ``"PACK"`` (default), ``"SPREAD"``, ``"STRICT_PACK"``, ``"STRICT_SPREAD"``.
    ``max_failures``
        how many times the job starts again after a lost actor or node or a failed worker
        (Ray Train's name); ``None`` (default): the Trainer's ``max_restarts``
        (``--max-restarts``), 0 unless set (an elastic job: 3, as torchrun's). Each restart
        resumes every worker from the run's ``last.ckpt``; an elastic job's growth is not a
        failure.
    ``placement_timeout``
        seconds to wait for the placement group (default 60) before the job is refused,
        naming what the cluster has.
    ``runtime_env``
        Ray's runtime environment for the job (``{"pip": [...], "working_dir": ...}``),
        given to ``ray.init``; ``None`` (default).

    The run's checkpoints must be on storage every worker can read (``default_root_dir``
    on a shared file system): checked at the start of every run.
    """

    hookloop_name = "ray"
    hookloop_role = "launcher"
    hookloop_requires = ">=2.6,<3"  # the plugin contract versions it is written for
    hookloop_autoload = False  # a launcher runs only when named
    hookloop_environment = {
        WORKER_ENV: "set in a worker a hookloop-ray actor started (the shared-storage check runs there)",
    }

    def __init__(self, address: str | None = None, num_workers: int | str | tuple | None = None,
                 resources_per_worker: dict | None = None, placement_strategy: str = "PACK",
                 max_failures: int | None = None, placement_timeout: float = 60.0, runtime_env: dict | None = None):
        if isinstance(resources_per_worker, str):  # --plugin-option ray.resources_per_worker='{"CPU": 2}'
            resources_per_worker = json.loads(resources_per_worker)
        resources_per_worker = {"CPU": 1} if resources_per_worker is None else resources_per_worker
        _check("address", address is None or isinstance(address, str) and address.strip() != "",
               "must be None (a local cluster), 'auto', 'HOST:PORT' or 'ray://HOST:PORT'", address)
        self.min_workers, num_workers = worker_range(num_workers)
        _check("resources_per_worker", isinstance(resources_per_worker, dict) and bool(resources_per_worker)
               and all(isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in resources_per_worker.items()),
               'must be a dict of Ray resources, e.g. {"CPU": 2, "GPU": 1}', resources_per_worker)
        _check("placement_strategy", placement_strategy in STRATEGIES, f"must be one of {', '.join(STRATEGIES)}",
               placement_strategy)
        _check("max_failures", max_failures is None or isinstance(max_failures, int) and not isinstance(max_failures, bool)
               and max_failures >= 0, "must be an integer >= 0, or None for the Trainer's max_restarts", max_failures)
        _check("placement_timeout", isinstance(placement_timeout, (int, float)) and placement_timeout > 0,
               "must be a number of seconds > 0", placement_timeout)
        _check("runtime_env", runtime_env is None or isinstance(runtime_env, dict), "must be a dict or None", runtime_env)
        self.address, self.num_workers = address, num_workers
        self.resources_per_worker = dict(resources_per_worker)
        self.placement_strategy, self.max_failures = placement_strategy, max_failures
        self.placement_timeout, self.runtime_env = float(placement_timeout), runtime_env

    def options(self, config: Any) -> Options:
        """The launching side's options for ``config`` (``num_workers`` resolved)."""
        workers = self.num_workers or config.num_processes() * config.nodes
        failures = self.max_failures
        if failures is None:  # the Trainer's; an elastic job's default is torchrun's elastic example's
            failures = config.max_restarts or (ELASTIC_MAX_RESTARTS if self.min_workers is not None else 0)
        return Options(address=self.address, num_workers=workers, min_workers=self.min_workers,
                       resources_per_worker=self.resources_per_worker,
                       placement_strategy=self.placement_strategy, max_failures=failures,
                       placement_timeout=self.placement_timeout, runtime_env=self.runtime_env)

    # -- 1. launching ---------------------------------------------------------------------

    @hookloop.hookimpl(tryfirst=True)
    def launch_command(self, config, script, script_args):
        """Script mode: the driver (:mod:`hookloop_ray.driver`) places the workers and runs
        ``script`` in each."""
        return [sys.executable, "-m", "hookloop_ray.driver", json.dumps(asdict(self.options(config))),
                str(Path(script).resolve()), *script_args]

    @hookloop.hookimpl(tryfirst=True)
    def spawn(self, trainer, function):
        """Function mode: run ``function(trainer)`` in the actors; the caller's trainer and
        module hold rank 0's results afterwards. ``None`` inside a worker: it trains in place."""
        if hookloop.in_worker():
            return None
        import cloudpickle

        options = self.options(trainer.config)
        try:
            payload = cloudpickle.dumps({"trainer": trainer, "function": function})
        except Exception as exc:
            raise hookloop.ConfigurationError(
                f"the ray plugin sends the trainer, the module, the dataloaders and the plugins to its "
                f"workers with cloudpickle, and they cannot be pickled: {type(exc).__name__}: {exc}. Open "
                f"files, locks and connections when first used rather than in __init__, or run the "
                f"script with `hookloop run --plugins <strategy>,ray script.py`, which pickles nothing"
            ) from None
        env = forwarded_environment()
        # the caller's import path, so the workers find the classes the payload names
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, *env.get("PYTHONPATH", "").split(os.pathsep)]))
        job = Job(args=[], env=env, cwd=os.getcwd(), payload=payload)
        with hookloop.as_launcher(reap=True), connected(options) as ray:
            try:
                report = run_job(ray, options, job)
            except WorkerFailed as failure:
                raise _worker_exception(failure) from None
        import io

        import torch

        result = torch.load(io.BytesIO(report["result"]), map_location="cpu", weights_only=False)
        return hookloop.adopt_worker_result(trainer, result)

    # -- 2. environment ---------------------------------------------------------------------

    @hookloop.hookimpl(tryfirst=True)
    def setup(self, trainer, stage):
        """In a worker an actor started: every worker must see the run's files (shared storage)."""
        if os.environ.get(WORKER_ENV) == "1":
            from .storage import check_shared_storage

            check_shared_storage(trainer)


def _worker_exception(failure: WorkerFailed) -> BaseException:
    """The failed worker's own exception, its traceback attached; else a RuntimeError."""
    import pickle

    report = failure.report or {}
    error = report.get("error")
    if error:
        return hookloop.adopt_worker_error(pickle.loads(error), f"the ray worker of {failure}",
                                           f"a ray worker failed: {failure}")
    return RuntimeError(f"a ray worker failed: {failure} (its output is above)")
