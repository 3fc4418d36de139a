"""The launching side: connect to Ray, place the workers, give each its place, restart.

Both launch modes end here (:func:`run_job`): ``hookloop run --plugins ddp,ray script.py``
(the driver, :mod:`hookloop_ray.driver`) and ``Trainer(plugins=["ddp", "ray"]).fit()``
(the ``spawn`` hook). The workers are Ray actors (:class:`hookloop_ray.worker.Worker`) in
one placement group; each actor starts its worker process and reports how it ended.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import hookloop
from hookloop.distributed.elastic import WORKERS_ENV

#: an elastic job's worker range, "MIN:MAX", in every worker: the core plans the batch by
#: the Trainer's elastic_batch policy for it (docs/environment.md)
ELASTIC_ENV = WORKERS_ENV

#: the variables of the caller's environment that reach every worker (hookloop's own
#: settings, the samplers' seed, where Python finds the user's code); the worker's place
#: and the launcher's private variables are set per worker (:func:`worker_environment`)
FORWARDED_PREFIXES = ("HOOKLOOP_", "PL_", "TORCH_", "NCCL_", "GLOO_")
FORWARDED = ("PYTHONPATH", "OMP_NUM_THREADS")
#: set per worker, never forwarded from the caller
PER_WORKER = ("HOOKLOOP_WORKER", "HOOKLOOP_ATTEMPT", "HOOKLOOP_RUN_TOKEN", "HOOKLOOP_LAUNCHER_PID",
              "HOOKLOOP_RAY_WORKER", ELASTIC_ENV)
#: marks a process a Ray actor of hookloop-ray started (the shared-storage check runs there)
WORKER_ENV = "HOOKLOOP_RAY_WORKER"
#: how long an elastic job tries to place more than MIN workers before it tries fewer
#: (MIN itself waits placement_timeout)
PROBE_SECONDS = 2.0


def import_ray() -> Any:
    """``ray``, or a :class:`hookloop.ConfigurationError` saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise hookloop.ConfigurationError(
            f"the ray plugin needs Ray, which is not installed here ({exc}): pip install "
            f"'ray==2.60.0' torch==<your torch version> (pin torch beside it so pip keeps yours), "
            f"or leave 'ray' out of plugins=[...] / --plugins to launch with torchrun"
        ) from None
    return ray


@dataclass
class Options:
    """The plugin's options, as the launching side needs them (plain data: the driver
    receives them as JSON)."""

    address: str | None = None
    #: the most workers (MAX of an elastic job)
    num_workers: int = 1
    #: the fewest workers of an elastic job (``num_workers=(MIN, MAX)``); None: a fixed count
    min_workers: int | None = None
    resources_per_worker: dict = field(default_factory=lambda: {"CPU": 1})
    placement_strategy: str = "PACK"
    max_failures: int = 0
    placement_timeout: float = 60.0
    runtime_env: dict | None = None


@dataclass
class Job:
    """What every worker runs: ``python -m hookloop_ray.worker ARGS`` in ``cwd`` with
    ``env`` added to the actor's environment (plus its place), and ``payload`` (the
    pickled trainer and function, in function mode)."""

    args: list[str]
    env: dict[str, str]
    cwd: str
    payload: bytes | None = None


def forwarded_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's variables every worker gets (:data:`FORWARDED_PREFIXES`, :data:`FORWARDED`)."""
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in environ.items()
            if (k.startswith(FORWARDED_PREFIXES) or k in FORWARDED) and k not in PER_WORKER}


# ---------------------------------------------------------------------------------------
# Connecting
# ---------------------------------------------------------------------------------------


def _host_port(address: str) -> tuple[str, int] | None:
    rest = address.split("://", 1)[1] if "://" in address else address
    host, _, port = rest.rstrip("/").rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse an address nothing answers at, at once (``ray.init`` retries for minutes)."""
    target = _host_port(address)
    if target is None:
        return  # "auto": ray.init finds the cluster or says it found none, quickly
    try:
        socket.create_connection(target, timeout=timeout).close()
    except OSError as exc:
        raise hookloop.ConfigurationError(
            f"the ray plugin cannot reach a Ray cluster at address={address!r} ({exc}): start one "
            f"there (`ray start --head --port {target[1]}` on {target[0]}), give the head's "
            f"address (ray.address=HOST:PORT, 'auto' for the cluster this machine joined, "
            f"'ray://HOST:10001' for Ray Client), or address=None to start a local cluster"
        ) from None


@contextlib.contextmanager
def connected(options: Options) -> Iterator[Any]:
    """Ray, connected to ``options.address`` or to a local cluster started for this job
    (sized for it: a local cluster has as many CPUs as the workers ask for, at least the
    machine's). What this started is stopped on the way out; a connection the caller
    already had (``ray.init`` before ``fit``) is used and left as it was."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    kwargs: dict[str, Any] = {"log_to_driver": True, "include_dashboard": False,
                              "runtime_env": options.runtime_env}
    if options.address is None:
        cpus = float(options.resources_per_worker.get("CPU", 0)) * options.num_workers
        kwargs["address"] = "local"  # a new cluster, even where one runs (ray.init() would join it)
        kwargs["num_cpus"] = max(os.cpu_count() or 1, int(-(-cpus // 1)))
    else:
        check_reachable(options.address)
        kwargs["address"] = options.address
    try:
        ray.init(**kwargs)
    except ConnectionError as exc:
        raise hookloop.ConfigurationError(
            f"the ray plugin could not connect to Ray at address={options.address!r}: {exc}. Start a "
            f"cluster (`ray start --head`), give its address, or address=None for a local one"
        ) from None
    try:
        yield ray
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------
# Placing
# ---------------------------------------------------------------------------------------


def _fits(bundle: dict, node: dict) -> bool:
    return all(node.get(name, 0) >= amount for name, amount in bundle.items() if amount)


def _describe_nodes(nodes: list[dict]) -> str:
    shown = []
    for node in nodes:
        res = {k: v for k, v in node["Resources"].items()
               if not k.startswith(("node:", "memory", "object_store_memory"))}
        shown.append(f"{node['NodeManagerAddress']} {res}")
    return "; ".join(shown) or "no live node"


def _capacity(nodes: list[dict], bundle: dict) -> int:
    """How many bundles the nodes hold in all (their total resources)."""
    return sum(min(int(node["Resources"].get(k, 0) // v) for k, v in bundle.items() if v)
               for node in nodes if _fits(bundle, node["Resources"]))


def check_resources(ray: Any, options: Options, n: int | None = None) -> None:
    """Refuse at once what the cluster can never hold (``n`` workers, default
    ``num_workers``), naming what it has."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    bundle, n = options.resources_per_worker, options.num_workers if n is None else n
    fitting = [node for node in nodes if _fits(bundle, node["Resources"])]
    asked = f"num_workers={n} x resources_per_worker={bundle}"
    has = f"the cluster has: {_describe_nodes(nodes)}"
    if not fitting:
        missing = sorted({k for k, v in bundle.items() if v and not any(node["Resources"].get(k, 0) >= v for node in nodes)})
        raise hookloop.ConfigurationError(
            f"the ray plugin cannot place {asked}: no node has {', '.join(f'{k}={bundle[k]}' for k in missing)} "
            f"for one worker; {has}. Ask for less per worker (ray.resources_per_worker), or add nodes "
            f"that have it")
    capacity = _capacity(nodes, bundle)
    strict_spread = options.placement_strategy == "STRICT_SPREAD"
    if strict_spread and len(fitting) < n:
        raise hookloop.ConfigurationError(
            f"the ray plugin cannot place {asked} with placement_strategy='STRICT_SPREAD' (one worker "
            f"per node): {len(fitting)} node(s) can hold a worker; {has}. Use 'SPREAD' or 'PACK', or "
            f"fewer workers")
    if capacity < n:
        raise hookloop.ConfigurationError(
            f"the ray plugin cannot place {asked}: the cluster holds {capacity} such worker(s) in all; "
            f"{has}. Use fewer workers (ray.num_workers), less per worker, or more nodes")


def placement_group(ray: Any, options: Options) -> Any:
    """The job's placement group, ready; refused with what the cluster has when it does
    not become ready in ``placement_timeout`` seconds (the resources are in use)."""
    from ray.util.placement_group import placement_group as make

    check_resources(ray, options)
    group = make([dict(options.resources_per_worker)] * options.num_workers,
                 strategy=options.placement_strategy)
    wait_ready(ray, group, options)
    return group


def wait_ready(ray: Any, group: Any, options: Options, n: int | None = None) -> None:
    ready, _ = ray.wait([group.ready()], timeout=options.placement_timeout)
    if not ready:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        raise hookloop.ConfigurationError(
            f"the ray plugin could not place num_workers={options.num_workers if n is None else n} x "
            f"{options.resources_per_worker} ({options.placement_strategy}) within "
            f"{options.placement_timeout:g} s: other jobs hold the resources, or a node is gone. "
            f"Available now: {ray.available_resources()}; nodes: {_describe_nodes(nodes)}. "
            f"Wait longer (ray.placement_timeout) or ask for less")


def elastic_placement_group(ray: Any, options: Options) -> tuple[Any, int]:
    """An elastic job's placement group and its size: as many workers as the cluster can
    place now, from ``num_workers`` (MAX) down to ``min_workers`` (MIN). Each size above
    MIN gets :data:`PROBE_SECONDS`; MIN waits ``placement_timeout``, then the job is
    refused, naming what the cluster has. Sizes the live nodes cannot hold are not tried."""
    from ray.util.placement_group import placement_group as make
    from ray.util.placement_group import remove_placement_group

    low, high = options.min_workers or options.num_workers, options.num_workers
    check_resources(ray, options, low)
    bundle = dict(options.resources_per_worker)
    alive = [node for node in ray.nodes() if node.get("Alive")]
    start = max(low, min(high, _capacity(alive, bundle)))
    for n in range(start, low - 1, -1):
        group = make([bundle] * n, strategy=options.placement_strategy)
        if n == low:
            wait_ready(ray, group, options, n)
            return group, n
        ready, _ = ray.wait([group.ready()], timeout=PROBE_SECONDS)
        if ready:
            return group, n
        remove_placement_group(group)
    raise AssertionError("unreachable")


def growth_probe(ray: Any, options: Options, running: int) -> Any:
    """A placement group of the ``num_workers - running`` workers an elastic job lacks:
    pending until the cluster can hold them beside the running ones (Ray places it as
    soon as resources appear), ready when the job can grow back to MAX."""
    from ray.util.placement_group import placement_group as make

    return make([dict(options.resources_per_worker)] * (options.num_workers - running),
                strategy=options.placement_strategy)


@dataclass
class Place:
    """Where one actor landed and the rank it gets."""

    actor: Any
    bundle: int
    node_id: str
    address: str
    gpu_ids: list
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0


def assign_ranks(places: list[Place], first_node: str | None) -> list[Place]:
    """Ranks as torchrun gives them: the workers of a node are consecutive, the launching
    node first (as Ray Train orders them), then the nodes in the order their first worker
    was placed; within a node by GPU, then by bundle."""
    order: list[str] = []
    for place in sorted(places, key=lambda p: p.bundle):
        if place.node_id not in order:
            order.append(place.node_id)
    if first_node in order:
        order.remove(first_node)
        order.insert(0, first_node)
    ranked: list[Place] = []
    for node_rank, node in enumerate(order):
        here = sorted((p for p in places if p.node_id == node), key=lambda p: (min(p.gpu_ids, default=0), p.bundle))
        for local_rank, place in enumerate(here):
            place.local_rank, place.local_world_size, place.node_rank = local_rank, len(here), node_rank
            ranked.append(place)
    for rank, place in enumerate(ranked):
        place.rank = rank
    return ranked


def worker_environment(place: Place, ranked: list[Place], master: tuple[str, int], attempt: int,
                       token: str) -> dict[str, str]:
    """One worker's place and the launcher's variables (docs/environment.md, "What a worker
    needs from its launcher"); ``HOOKLOOP_LAUNCHER_PID`` is the actor's, set by the actor."""
    env = {
        "RANK": str(place.rank), "WORLD_SIZE": str(len(ranked)),
        "LOCAL_RANK": str(place.local_rank), "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "GROUP_RANK": str(place.node_rank), "NODE_RANK": str(place.node_rank),
        "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
        "HOOKLOOP_WORKER": "1", "HOOKLOOP_ATTEMPT": str(attempt), "HOOKLOOP_RUN_TOKEN": token,
        WORKER_ENV: "1",
    }
    gpus = sorted({g for p in ranked if p.node_id == place.node_id for g in p.gpu_ids})
    if gpus:  # every worker of a node sees the node's GPUs, as Ray Train shares them
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


# ---------------------------------------------------------------------------------------
# Running, and restarting
# ---------------------------------------------------------------------------------------


class WorkerFailed(Exception):
    """A worker of the last attempt failed; ``report`` says which and how."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


def _start_actors(ray: Any, group: Any, options: Options, n: int | None = None) -> list[Place]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from hookloop_ray.worker import Worker

    resources = dict(options.resources_per_worker)
    cpus, gpus = resources.pop("CPU", 0), resources.pop("GPU", 0)
    actors = [
        ray.remote(Worker).options(
            num_cpus=cpus, num_gpus=gpus, resources=resources or None, max_restarts=0,
            max_concurrency=2,  # stop() beside the running run()
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                 placement_group_bundle_index=i),
        ).remote()
        for i in range(options.num_workers if n is None else n)
    ]
    where = ray.get([a.where.remote() for a in actors])
    return [Place(actor=a, bundle=i, node_id=w["node_id"], address=w["address"], gpu_ids=w["gpu_ids"])
            for i, (a, w) in enumerate(zip(actors, where, strict=True))]


#: how a worker that was asked to stop for a growth ends: hookloop's checkpoint-and-stop
#: at a step boundary (128 + SIGTERM), or SIGTERM itself before or after fit's handler
STOPPED = (143, -15)


def _attempt(ray: Any, places: list[Place], job: Job, attempt: int, token: str, probe: Any = None) -> dict | None:
    """Run one attempt to its end; the first failure ends it (the other actors are killed).
    Returns rank 0's report, or ``None`` when ``probe`` (:func:`growth_probe`) became ready
    and every worker stopped at a step boundary for the job to grow back."""
    ranked = assign_ranks(places, ray.get_runtime_context().get_node_id())
    master = (ranked[0].address, ray.get(ranked[0].actor.free_port.remote()))
    payload = ray.put(job.payload) if job.payload is not None else None
    refs = {}
    for place in ranked:
        env = {**job.env, **worker_environment(place, ranked, master, attempt, token)}
        refs[place.actor.run.remote(job.args, env, job.cwd, payload)] = place
    pending, result, failure, stopping = list(refs), None, None, False
    probe_ref = probe.ready() if probe is not None else None
    while pending and failure is None:
        done, _ = ray.wait(pending + ([probe_ref] if probe_ref is not None else []), num_returns=1)
        if done[0] == probe_ref:
            probe_ref, stopping = None, True
            print(f"hookloop-ray: the cluster can place {len(ranked) + len(probe.bundle_specs)} workers again: "
                  f"stopping the {len(ranked)} running at their next step boundary (SIGTERM; they save "
                  f"last.ckpt) to grow back (not a failure)", file=sys.stderr, flush=True)
            for place in ranked:
                place.actor.stop.remote()
            continue
        pending.remove(done[0])
        place = refs[done[0]]
        try:
            report = ray.get(done[0])
        except ray.exceptions.RayActorError as exc:
            failure = WorkerFailed(f"the actor of rank {place.rank} (node {place.address}) was lost: "
                                   f"{str(exc).splitlines()[0]}")
            continue
        if report["returncode"] == 0:
            result = report if place.rank == 0 else result
        elif not (stopping and report["returncode"] in STOPPED):
            failure = WorkerFailed(_describe_failure(place, report), report)
    for place in ranked:
        ray.kill(place.actor)  # the survivors of a failed attempt would wait in a collective
    if failure is not None:
        raise failure
    if stopping and result is None:
        return None  # stopped to grow (rank 0 had not finished: the next attempt resumes)
    return result or {}


def _describe_failure(place: Place, report: dict) -> str:
    code = report["returncode"]
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return f"rank {place.rank} (node {place.address}, pid {report.get('pid')}) {how}"


def run_job(ray: Any, options: Options, job: Job) -> dict:
    """Place the workers, run ``job`` in them, and restart all of them after a failure (a
    lost actor or node, a worker that failed) up to ``options.max_failures`` times; each
    restart is a new attempt (``HOOKLOOP_ATTEMPT``), which resumes from the run's
    ``last.ckpt``. An elastic job (``min_workers``) runs each attempt on as many workers
    as the cluster can place (:func:`run_elastic_job`). Returns rank 0's report (its
    ``result`` in function mode); raises :class:`WorkerFailed` for the last attempt's
    first failure."""
    token = os.environ.get("HOOKLOOP_RUN_TOKEN") or hookloop.resume.rundir.run_token()
    if options.min_workers is not None and options.min_workers < options.num_workers:
        return run_elastic_job(ray, options, job, token)
    group = placement_group(ray, options)
    try:
        for attempt in range(options.max_failures + 1):
            if attempt:
                wait_ready(ray, group, options)  # a lost node's bundles are placed again
            places = _start_actors(ray, group, options)
            try:
                return _attempt(ray, places, job, attempt, token)
            except WorkerFailed as failure:
                if attempt == options.max_failures:
                    raise
                _say_restart(attempt, failure, attempt + 1, options)
    finally:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
    raise AssertionError("unreachable")


def _say_restart(attempt: int, failure: WorkerFailed, used: int, options: Options) -> None:
    print(f"hookloop-ray: attempt {attempt} failed: {failure}; restarting every worker "
          f"({used} of max_failures={options.max_failures}), from the last checkpoint",
          file=sys.stderr, flush=True)
    time.sleep(0.5)


def run_elastic_job(ray: Any, options: Options, job: Job, token: str) -> dict:
    """An elastic job (``num_workers=(MIN, MAX)``): every attempt runs on as many workers
    as the cluster can place then (:func:`elastic_placement_group`). A failure (a lost
    actor or node) uses one of ``max_failures`` and the next attempt runs on the workers
    left (shrink); while an attempt runs on fewer than MAX, a pending
    :func:`growth_probe` watches the cluster, and when it is placed the workers stop at a
    step boundary and the next attempt runs on MAX (grow), using no ``max_failures``.
    Every worker gets ``HOOKLOOP_ELASTIC_WORKERS=MIN:MAX``: the core plans its batch by
    the Trainer's ``elastic_batch`` policy at each world size."""
    from ray.util.placement_group import remove_placement_group

    job = Job(args=job.args, env={**job.env, ELASTIC_ENV: f"{options.min_workers}:{options.num_workers}"},
              cwd=job.cwd, payload=job.payload)
    failures, attempt = 0, 0
    while True:
        group, n = elastic_placement_group(ray, options)
        probe = growth_probe(ray, options, n) if n < options.num_workers else None
        print(f"hookloop-ray: attempt {attempt} on {n} of {options.min_workers}:{options.num_workers} workers",
              file=sys.stderr, flush=True)
        try:
            places = _start_actors(ray, group, options, n)
            report = _attempt(ray, places, job, attempt, token, probe)
            if report is not None:
                return report
        except WorkerFailed as failure:
            if failures == options.max_failures:
                raise
            failures += 1
            _say_restart(attempt, failure, failures, options)
        finally:
            for made in (probe, group):
                if made is not None:
                    remove_placement_group(made)
        attempt += 1
