"""Process groups and collectives: what every strategy built on ``torch.distributed``
needs, and what the core reports when a collective fails.

* process groups: :func:`init_process_group` (rendezvous, keys of its own per attempt, the
  timeout), :func:`cpu_process_group` (a gloo side group for small CPU collectives),
  :func:`release_process_group` (teardown that cannot deadlock gloo's threads);
* timeouts: :data:`DEFAULT_TIMEOUTS`, :func:`default_process_group_timeout`;
* reductions: :data:`REDUCE_OPS`, :func:`torch_reduce_op`;
* failed collectives: :func:`is_collective_failure`, :func:`describe_collective`,
  :func:`census` (which ranks still answer in the group's store) and
  :func:`collective_failure_error` (the :class:`~hookloop.contract.errors.CollectiveTimeoutError`).

A layer of the core above ``errors`` and ``utilities`` and below everything that trains
(docs/plugin-authors.md, "How the core is layered"). Its names are also importable from
:mod:`hookloop.helpers` and :mod:`hookloop.faults`, where they lived before.
"""

from __future__ import annotations

import atexit
import itertools
import os
import time
from typing import Any

import torch

from hookloop.distributed import failures
from hookloop.contract.errors import CollectiveTimeoutError, ConfigurationError
from hookloop.distributed.ranks import attempt, env_int

#: Seconds a collective may wait, per backend, when neither the Trainer nor the strategy
#: says: NCCL as torch (10 minutes); gloo (CPU) 5 minutes, where torch waits 30.
DEFAULT_TIMEOUTS = {"gloo": 300.0, "nccl": 600.0}

def default_process_group_timeout(backend: str | None) -> float | None:
    """The timeout (seconds) for a process group of ``backend`` when nobody chose one:
    :data:`DEFAULT_TIMEOUTS`, the longest of a per-device list (``"cpu:gloo,cuda:nccl"``),
    ``None`` (torch's own default) for other backends."""
    if not backend:
        return None
    found = [DEFAULT_TIMEOUTS.get(part.split(":")[-1].strip().lower()) for part in str(backend).split(",")]
    found = [t for t in found if t is not None]
    return max(found) if found else None


# ---------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------

# How many process groups this process has made; every rank of a job counts the same.
_GROUP_GENERATION = itertools.count()
# The newest group's store (keys of its own) and timeout in seconds, for the report of a
# collective that failed (collective_failure_error).
_GROUP_STORE: Any = None
_GROUP_TIMEOUT: float | None = None


def init_process_group(backend: str, rank: int, world_size: int, timeout: float | None = None,
                       master_addr: str | None = None, master_port: int | None = None) -> None:
    """Make ``torch.distributed``'s default process group for a strategy's
    ``setup_environment``: rank ``rank`` of ``world_size``, rendezvous at
    ``MASTER_ADDR:MASTER_PORT`` (``env://``; arguments fill them in when the launcher did
    not, as under SLURM). A world of one needs no rendezvous (an in-memory store).

    A process may make several groups (``fit``, then a resumed ``fit``...), and under an
    elastic agent its restarted successor reuses the agent's store, which keeps the keys
    of the attempt before. torch names every default group alike, so each group gets
    keys of its own: prefixed by the run id, the agent's restart count and this process's
    group count. A rank that read an earlier group's keys would connect to dead peers.

    ``timeout`` (seconds) bounds every collective of the group; ``None`` is the backend's
    default, ``hookloop.distributed.collectives.DEFAULT_TIMEOUTS`` (gloo 300 s, nccl 600 s; torch's own for
    other backends). Strategies pass ``Trainer(process_group_timeout=...)`` (or their
    own option) here.
    """
    import torch.distributed as dist
    from datetime import timedelta

    global _GROUP_STORE, _GROUP_TIMEOUT
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout is None:
        timeout = default_process_group_timeout(backend)
    _GROUP_TIMEOUT = timeout
    if timeout is not None:
        kwargs["timeout"] = timedelta(seconds=timeout)
    master_addr = master_addr or os.environ.get("MASTER_ADDR")
    master_port = master_port or env_int("MASTER_PORT")
    if world_size == 1 and not (master_addr and master_port):
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return
    if not (master_addr and master_port):
        raise ConfigurationError(
            f"{world_size} processes were started but MASTER_ADDR / MASTER_PORT are not set, so "
            f"they cannot find each other: launch with `hookloop run --plugins ddp --devices N` or torchrun"
        )
    os.environ.setdefault("MASTER_ADDR", str(master_addr))
    os.environ.setdefault("MASTER_PORT", str(master_port))
    rendezvous = dist.rendezvous("env://", rank=rank, world_size=world_size,
                                 **({"timeout": kwargs["timeout"]} if "timeout" in kwargs else {}))
    store, _, _ = next(rendezvous)
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("HOOKLOOP_RUN_ID") or "run"
    restart = attempt()[0]
    store = dist.PrefixStore(f"hookloop/{run}/{restart}/{next(_GROUP_GENERATION)}", store)
    _GROUP_STORE = store  # for the report of a failed collective (census)
    dist.init_process_group(store=store, rank=rank, world_size=world_size, **kwargs)


# Process groups destroyed by the latest release of this process (see release_process_group).
_RETIRED: list = []
#: name -> (the default group it was made for, the gloo group): cpu_process_group's.
_CPU_GROUPS: dict[str, tuple] = {}


def cpu_process_group(name: str = "agreement") -> Any:
    """A gloo process group over the ranks of ``torch.distributed``'s default group, for
    collectives of CPU tensors that must neither touch the device (no host-device sync
    under NCCL) nor queue behind the training's collectives: the preemption agreement's
    (``hookloop.faults``, the default ``name``), and those a background thread runs while
    training goes on (fsdp's ``torch.distributed.checkpoint.async_save``, deepspeed's
    asynchronous commit; one group per ``name``: two threads never share a group). Made
    once per name and default group, by every rank at the same point (``new_group`` is
    collective), with the run's timeout; destroyed with the default group
    (:func:`release_process_group`, or ``destroy_process_group()``, which destroys every
    group)."""
    import torch.distributed as dist
    from datetime import timedelta

    world = dist.group.WORLD
    made = _CPU_GROUPS.get(name)
    if made is None or made[0] is not world:
        kwargs = {"timeout": timedelta(seconds=_GROUP_TIMEOUT)} if _GROUP_TIMEOUT else {}
        _CPU_GROUPS[name] = made = (world, dist.new_group(backend="gloo", **kwargs))
    return made[1]


def _quiesce_at_exit() -> None:
    """Let gloo's worker threads finish before the interpreter shuts down.

    A gloo worker destroys each finished collective's work object itself, and with it the
    last references to tensors Python made, which takes the GIL. If the interpreter is
    already finalising then, the thread is made to exit inside that C++ destructor and
    the process aborts ("terminate called without an active exception", exit -6) after a
    run that succeeded: seen in about 1 of 10 two-process runs (core dump: the
    ``ProcessGroupGloo::runLoop`` thread in ``~AsyncWork`` -> ``take_gil`` ->
    ``PyThread_exit_thread``). Sleeping here releases the GIL while those threads
    finish; then the retired groups are dropped."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if _RETIRED or _GROUP_STORE is not None or distributed:
        time.sleep(0.2)
    _RETIRED.clear()


atexit.register(_quiesce_at_exit)


def release_process_group(destroy: Any = None) -> None:
    """Destroy ``torch.distributed``'s default process group and its subgroups, for a
    strategy's ``teardown`` (a run leaves no process group behind). ``destroy``: the
    backend's own destroy function when it keeps references to the groups (DeepSpeed's
    ``deepspeed.comm.destroy_process_group``); default ``torch.distributed``'s.

    ``destroy_process_group`` only unregisters a group; its C++ object, and the gloo
    threads in it, die with the last reference, wherever that is dropped. Right after a
    collective, a gloo thread is still freeing that collective's tensors, which takes
    the GIL when Python made them. Dropped then, the group deadlocks (DDP's C++ reducer
    releases it with the GIL held, and its destructor joins that thread) or aborts
    ("Resource deadlock avoided"); both were seen in processes that train several times
    under CPU load. So the groups' handles are held until the next release (or exit),
    long after their threads went idle, and dropped from Python.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_names", {})) or [dist.group.WORLD]
    _CPU_GROUPS.clear()  # destroyed with the rest (they are in pg_names)
    previous = _RETIRED[:]
    _RETIRED[:] = groups
    del previous
    (destroy or dist.destroy_process_group)()


# ---------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------

REDUCE_OPS = ("mean", "sum", "max", "min")


def torch_reduce_op(op: str):
    """``"mean"``/``"sum"``/``"max"``/``"min"`` -> ``torch.distributed.ReduceOp`` (mean is SUM,
    divide by world size afterwards: gloo has no AVG)."""
    import torch.distributed as dist

    return {
        "mean": dist.ReduceOp.SUM,
        "sum": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }[op]


# ---------------------------------------------------------------------------------------
# Hung or broken collectives
# ---------------------------------------------------------------------------------------

# torch.distributed functions, as they appear in a traceback, and what to call them.
_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
                "gather", "gather_object", "scatter", "scatter_object_list", "reduce_scatter", "barrier",
                "all_to_all", "send", "recv", "monitored_barrier")
_TIMEOUT_WORDS = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe", "connection refused")


def is_collective_failure(exc: BaseException) -> bool:
    """A torch.distributed error of a collective that timed out or lost a peer."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(word in text for word in _TIMEOUT_WORDS) and _distributed_in_traceback(exc)


failures.COLLECTIVE_FAILURE_TESTS.append(is_collective_failure)  # the worker's error file says so


def _distributed_in_traceback(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return any(_frame_kind(frame) is not None or _in_torch_distributed(frame) for frame in _frames(exc))


def _in_torch_distributed(frame) -> bool:
    """A frame of torch.distributed's own code or of DistributedDataParallel: a collective
    torch runs for itself (DDP's constructor compares the ranks' parameters with an
    all_gather from torch/distributed/utils.py, then broadcasts them)."""
    path = frame.f_code.co_filename.replace("\\", "/")
    return "/torch/distributed/" in path or path.endswith("torch/nn/parallel/distributed.py")


def _frames(exc: BaseException) -> list:
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


#: hookloop.faults.Preemption's methods that start or wait for the stop agreement's all_reduce
_AGREEMENT_FRAMES = frozenset({"agreed", "_boundary", "agree_now", "agree_stop", "finish"})


def _frame_kind(frame) -> str | None:
    path = frame.f_code.co_filename.replace("\\", "/")
    name = frame.f_code.co_name
    if path.endswith("torch/distributed/distributed_c10d.py") and name in _COLLECTIVES:
        return name
    if name in ("backward", "run_backward", "_engine_run_backward") and "/torch/" in path:
        return "backward"
    if name in _AGREEMENT_FRAMES and path.endswith("hookloop/distributed/faults.py"):
        return "agreement"  # the preemption check's all_reduce, or the wait for it
    return None


def describe_collective(exc: BaseException) -> str:
    """Which collective failed, read from the traceback: torch.distributed's function, and
    where hookloop called it from (a named barrier, the preemption check...)."""
    frames = _frames(exc)
    kinds = [(frame, kind) for frame in frames if (kind := _frame_kind(frame)) is not None]
    if not kinds:
        inside = [frame for frame in frames if _in_torch_distributed(frame)]
        if not inside:
            return "a collective"
        ddp = any(frame.f_code.co_name == "__init__" and frame.f_code.co_filename.replace("\\", "/").endswith(
            "torch/nn/parallel/distributed.py") for frame in inside)
        what = f"torch.distributed's {inside[-1].f_code.co_name}"
        return what + (" in DistributedDataParallel's constructor (the ranks compare and broadcast the "
                       "model's parameters)" if ddp else "")
    if any(kind == "agreement" for _, kind in kinds):
        return "all_reduce of the preemption check (the SIGTERM flag, at an optimizer-step boundary)"
    frame, kind = kinds[-1]
    if kind == "backward":
        return ("the all_reduce of the gradients in backward (DistributedDataParallel's reducer, or the "
                "strategy's gradient synchronisation)")
    caller = None
    for f in frames:
        if f is frame:
            break
        path = f.f_code.co_filename.replace("\\", "/")
        if "/hookloop" in path and "/torch/" not in path:
            caller = f
    where = ""
    if caller is not None:
        name = caller.f_code.co_name
        label = caller.f_locals.get("name") if name == "barrier" else None
        if name in _AGREEMENT_FRAMES:
            where = " of the preemption check (the SIGTERM flag, at an optimizer-step boundary)"
        elif label:
            where = f" {label!r}"
        else:
            where = f" (called from hookloop's {name})"
    return f"{kind}{where}"


def census(trainer, grace: float) -> tuple[list[int], list[int]] | None:
    """After a failed collective: each surviving rank reports in the process group's store
    and waits up to ``grace`` seconds for the others. Returns ``(reported, missing)``, or
    ``None`` when the store cannot be reached (its host may be the rank that failed)."""
    store = _GROUP_STORE
    world, rank = trainer.world_size, trainer.global_rank
    if store is None or world <= 1:
        return None
    try:
        store.set(f"hookloop/census/{rank}", str(trainer.global_step))
        deadline = time.monotonic() + grace
        while True:
            reported = [r for r in range(world) if store.check([f"hookloop/census/{r}"])]
            if len(reported) == world or time.monotonic() >= deadline:
                return reported, [r for r in range(world) if r not in reported]
            time.sleep(0.2)
    except Exception:  # the store went with the failure: nothing can be known
        return None


def collective_failure_error(trainer, exc: BaseException):
    """The :class:`CollectiveTimeoutError` that explains ``exc``, a failed collective; or
    ``None`` when ``exc`` is something else."""
    if trainer.world_size <= 1 or not is_collective_failure(exc):
        return None
    timeout = _GROUP_TIMEOUT
    grace = min(5.0, (timeout or 10.0) / 2)
    found = census(trainer, grace)
    if found is None:
        suspects = ("Which rank failed cannot be known: the process group's store could not be reached "
                    "(it lives in the elastic agent, or on global rank 0, which may be the one that failed)")
    elif found[1]:
        missing = found[1]
        suspects = (f"Suspected rank(s): {', '.join(map(str, missing))} (did not report within {grace:g} s after the "
                    f"failure: stopped, dead, or stuck outside the collective; ranks {found[0]} reported)")
    else:
        suspects = ("Every rank reported after the failure, so none is stuck now: a rank was slower than the "
                    "timeout, or the network between them failed")
    limit = f"{timeout:g} s" if timeout else "torch's default"
    return CollectiveTimeoutError(
        f"global rank {trainer.global_rank}: {describe_collective(exc)} failed after global step "
        f"{trainer.global_step} (process-group timeout {limit}): {(str(exc).strip().splitlines() or [type(exc).__name__])[-1]}. "
        f"{suspects}. This process exits so that the elastic agent restarts the workers (hookloop run "
        f"--max-restarts N), which resume from this run's last.ckpt. If a rank is legitimately that slow "
        f"(rank-0-only work such as prepare_data or a large checkpoint), raise the timeout: "
        f"Trainer(process_group_timeout=SECONDS) or hookloop run --process-group-timeout SECONDS"
    )
