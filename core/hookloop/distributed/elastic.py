"""Elastic membership: a job of ``MIN:MAX`` nodes under torchrun's elastic agent.

``hookloop run --nodes 1:2`` (``Trainer(nodes="1:2")``) starts torchrun with
``--nnodes=1:2`` and the c10d rendezvous. When a node is lost, the agents left restart
their workers (one of ``max_restarts`` on each of them) and train on fewer processes from
the run's ``last.ckpt``; when a node comes back its agent joins, and the others restart
their workers without using a restart (torch: "membership changes do not count as
retries"): the job grows back, again from ``last.ckpt``.

What changes with the world size is the batch, by the policy ``elastic_batch``
(``--elastic-batch``; docs/decisions.md, "Elastic membership"):

- ``"global"`` (the default): the global batch stays what it is on ``MAX`` nodes
  (``global_batch_size``, else the loader's batch x accumulation x processes on ``MAX``
  nodes); the accumulation is recomputed for every world size. Refused at start when
  some node count in ``MIN..MAX`` does not divide it.
- ``"per-device"``: every process keeps the loader's batch and the accumulation given;
  the global batch shrinks and grows with the world.

Global rank 0 states the policy at fit start and every world-size change at a resume.

A launcher that places worker processes itself (hookloop-ray's ``num_workers=(MIN, MAX)``)
says "this job is elastic over MIN..MAX workers" in each worker's environment,
:data:`WORKERS_ENV` (``"MIN:MAX"``); the unit of the range is then one worker process, not
a node, and the same policy applies (:func:`elastic_range`).

Layer: beside :mod:`hookloop.engine.settings` (it checks settings), importing nothing of
the core above :mod:`hookloop.contract.errors`; the engine gives it the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hookloop.contract.errors import ConfigurationError

#: the batch policies (``elastic_batch``); "per_device" is read as "per-device"
POLICIES = ("global", "per-device")
#: torchrun's own example of an elastic job restarts at most 3 times
#: (docs.pytorch.org/docs/stable/elastic/run.html, "Elastic")
ELASTIC_MAX_RESTARTS = 3
#: set by a launcher that places worker processes itself (hookloop-ray) in every worker of
#: an elastic job: "MIN:MAX", the range of the job's worker count (docs/environment.md)
WORKERS_ENV = "HOOKLOOP_ELASTIC_WORKERS"


def parse_nodes(value: Any) -> tuple[int, int]:
    """``(MIN, MAX)`` of ``nodes``: an integer N is ``(N, N)``, ``"MIN:MAX"`` a range, as
    torchrun's ``--nnodes``. Raises ``ConfigurationError`` naming what is wrong."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigurationError(f"nodes={value!r} must be an integer >= 1, or 'MIN:MAX' for an elastic job")
        return value, value
    text = str(value).strip() if isinstance(value, str) else None
    if text is not None and text.isdigit():
        return parse_nodes(int(text))
    parts = text.split(":") if text is not None else []
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigurationError(
            f"nodes={value!r} must be a number of machines (an integer >= 1) or 'MIN:MAX' for an "
            "elastic job (torchrun's --nnodes), e.g. --nodes 1:2 or Trainer(nodes='1:2')")
    low, high = (int(p) for p in parts)
    if low < 1:
        raise ConfigurationError(
            f"nodes={value!r}: MIN must be at least 1 (a job needs one machine to train on), e.g. "
            f"--nodes 1:{max(high, 1)}")
    if low > high:
        raise ConfigurationError(
            f"nodes={value!r}: MIN ({low}) is more than MAX ({high}); the range is 'MIN:MAX', e.g. "
            f"--nodes {high}:{low}")
    return low, high


def check_elastic_settings(config: Any) -> None:
    """Normalise an elastic ``config`` in place (``TrainerConfig.validate`` calls it first):
    ``nodes="MIN:MAX"`` becomes ``nodes=MAX``, ``min_nodes=MIN`` (a range of one number is
    that fixed number); ``max_restarts=None`` becomes 0, or :data:`ELASTIC_MAX_RESTARTS`
    for an elastic job; ``elastic_batch`` is one of :data:`POLICIES`; ``rdzv_conf`` is
    ``KEY=VALUE`` pairs."""
    given_min = config.min_nodes
    low, high = parse_nodes(config.nodes)
    if given_min is not None and low == high and isinstance(config.nodes, int):
        # nodes=MAX with min_nodes=MIN (a validated config again, or both given)
        if not isinstance(given_min, int) or isinstance(given_min, bool) or not 1 <= given_min <= high:
            raise ConfigurationError(
                f"min_nodes={given_min!r} must be an integer in 1..nodes (nodes={high}), or None; "
                "or give nodes='MIN:MAX'")
        low = given_min
    config.nodes, config.min_nodes = high, (low if low < high else None)
    if config.max_restarts is None:
        config.max_restarts = ELASTIC_MAX_RESTARTS if is_elastic(config) else 0
    policy = config.elastic_batch
    if isinstance(policy, str) and policy.replace("_", "-") in POLICIES:
        config.elastic_batch = policy.replace("_", "-")
    else:
        raise ConfigurationError(
            f"elastic_batch={policy!r} must be 'global' (keep the global batch: the accumulation is "
            "recomputed for each world size) or 'per-device' (keep the loader's batch per process: the "
            "global batch follows the world size)")
    if is_elastic(config) and config.elastic_batch == "per-device" and config.global_batch_size is not None:
        raise ConfigurationError(
            f"global_batch_size={config.global_batch_size} and elastic_batch='per-device' contradict each "
            "other: per-device keeps each process's batch, so the global batch follows the world size. Drop "
            "global_batch_size, or keep it with elastic_batch='global'")
    rendezvous_options(config)


def is_elastic(config: Any) -> bool:
    """Whether ``config`` (validated) asks for a range of nodes."""
    return config.min_nodes is not None and config.min_nodes < config.nodes


def elastic_range(config: Any, launched_with: str | None) -> tuple[int, int, str] | None:
    """``(MIN, MAX, unit)`` of an elastic job, ``None`` for a fixed one. ``launched_with``
    is :data:`WORKERS_ENV` of a worker its launcher started (``None`` elsewhere): a range
    of worker processes (``unit`` ``"worker"``), which wins over ``config``'s range of
    nodes (``"node"``): the launcher placed the workers. A malformed value names the
    variable."""
    if launched_with:
        parts = launched_with.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[1]):
            raise ConfigurationError(
                f"{WORKERS_ENV}={launched_with!r} must be 'MIN:MAX' with 1 <= MIN <= MAX; it is set by the "
                "launcher that placed this worker (hookloop-ray's num_workers=(MIN, MAX)), not by hand")
        low, high = int(parts[0]), int(parts[1])
        return (low, high, "worker") if low < high else None
    if is_elastic(config):
        return config.min_nodes, config.nodes, "node"
    return None


def rendezvous_options(config: Any) -> dict[str, str]:
    """``rdzv_conf`` (``"join_timeout=60,last_call_timeout=5"``) as a dict; refused unless
    it is ``KEY=VALUE`` pairs, without ``is_host`` (hookloop sets it from ``node_rank``)."""
    text = config.rdzv_conf
    if text is None or text == "":
        return {}
    if not isinstance(text, str):
        raise ConfigurationError(f"rdzv_conf={text!r} must be a string 'KEY=VALUE,...', e.g. "
                                 "'join_timeout=60,last_call_timeout=5'")
    options = {}
    for pair in text.split(","):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigurationError(
                f"rdzv_conf={text!r}: {pair!r} is not KEY=VALUE; torchrun's --rdzv-conf is "
                "'KEY=VALUE,...', e.g. 'join_timeout=60,last_call_timeout=5'")
        options[key.strip()] = value.strip()
    if "is_host" in options:
        raise ConfigurationError(
            f"rdzv_conf={text!r} sets is_host, which hookloop sets itself: node_rank 0 hosts the "
            "rendezvous (--node-rank 0 on the machine of --rdzv-endpoint); remove is_host")
    return options


@dataclass
class BatchPlan:
    """The batch of an elastic job at this world size: what :func:`plan_batch` decided."""

    policy: str
    #: per-device batch x data-parallel processes x accumulation
    per_device: int
    replicas: int
    accumulate: int
    #: samples per optimizer step now
    global_batch: int

    def describe(self) -> str:
        return (f"{self.global_batch} = {self.per_device} per device x {self.replicas} data-parallel "
                f"process{'es' if self.replicas != 1 else ''} x {self.accumulate} accumulated "
                f"batch{'es' if self.accumulate != 1 else ''}")


def plan_batch(policy: str, per_device: int | None, replicas: int, nodes_now: int, node_range: tuple[int, int],
               accumulate: int, global_batch_size: int | None, unit: str = "node") -> BatchPlan:
    """The accumulation of an elastic job's process with ``replicas`` data-parallel
    processes on ``nodes_now`` nodes (of ``node_range``), by ``policy``. ``unit`` names
    what the range counts in the errors (``"worker"``: a launcher's range of processes).

    ``"global"``: the global batch is ``global_batch_size``, else ``per_device x
    accumulate x`` the data-parallel processes on ``MAX`` nodes; refused unless
    ``per_device x`` the processes on every node count of the range divides it (so the
    job that starts can lose and regain nodes without stopping). ``"per-device"``: the
    accumulation given, whatever the world."""
    low, high = node_range
    if policy == "per-device":
        batch = (per_device or 0) * replicas * accumulate
        return BatchPlan(policy, per_device or 0, replicas, accumulate, batch)
    if per_device is None:
        raise ConfigurationError(
            "elastic_batch='global' keeps the global batch when the world size changes, which needs the "
            "training loader's batch size, and the loader makes its own batches (a batch_sampler, or no "
            "batch_size): give DataLoader(batch_size=...), or elastic_batch='per-device'")
    if replicas % nodes_now:
        raise ConfigurationError(
            f"an elastic job needs the same number of data-parallel processes on every {unit}, and "
            f"{replicas} process(es) on {nodes_now} {unit}(s) are not")
    per_node = replicas // nodes_now
    wanted = global_batch_size if global_batch_size is not None else per_device * accumulate * per_node * high
    bad = [n for n in range(low, high + 1) if wanted % (per_device * per_node * n)]
    if bad:
        sizes = ", ".join(f"{n} {unit}{'s' if n > 1 else ''} ({per_device * per_node * n} samples per batch)"
                          for n in bad)
        fits = per_device * per_node * _lcm_range(low, high)
        raise ConfigurationError(
            f"elastic_batch='global' keeps a global batch of {wanted} samples on {low} to {high} {unit}s, and "
            f"it does not divide into whole accumulated batches on {sizes}: give a global_batch_size "
            f"that is a multiple of {fits}, a {unit} range whose sizes divide {wanted}, or "
            "elastic_batch='per-device' (the global batch then follows the world size)")
    return BatchPlan(policy, per_device, replicas, wanted // (per_device * replicas), wanted)


def _lcm_range(low: int, high: int) -> int:
    import math

    result = 1
    for n in range(low, high + 1):
        result = result * n // math.gcd(result, n)
    return result
