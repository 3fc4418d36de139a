"""The core's launchers: ``torchrun`` and ``spawn`` (the ``launcher`` role, contract 2.6).

A launcher starts a run's worker processes and brings back what they did; a strategy
(ddp, fsdp, deepspeed, tp...) only runs inside them. The two compose: any strategy under
any launcher, ``plugins=["fsdp", "spawn"]``, ``hookloop run --plugins ddp,ray``. A run has at
most one launcher; without one it gets its strategy's (``hookloop_launcher``: ``ddp_spawn``
declares ``spawn``, ``horovod`` declares ``horovodrun``), else ``torchrun``.

``torchrun``
    re-runs the script under PyTorch's elastic agent (``launch_command``): ``--devices``
    processes per node, ``--nodes`` through a c10d rendezvous, ``--max-restarts``.
``spawn``
    starts the workers from inside ``fit`` with ``torch.multiprocessing`` (``spawn``):
    the job (trainer, module, dataloaders, plugins) is pickled once and each worker trains
    its copy; the caller's module and trainer then hold what rank 0's run produced
    (:func:`hookloop.adopt_worker_result`). ``max_restarts=K`` starts the workers again
    up to K times after a failure, each attempt resuming from the run's ``last.ckpt``
    (``HOOKLOOP_ATTEMPT``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import socket
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from hookloop.contract.errors import ConfigurationError
from hookloop.contract.hookspecs import hookimpl
from hookloop.distributed.launch import WORKER_ENV, as_launcher, die_with_launcher, elastic_command, in_worker
from hookloop.distributed.ranks import ATTEMPT_ENV
from hookloop.distributed.results import adopt_worker_error, adopt_worker_result, worker_error, worker_result
from hookloop.resume.checkpoint import atomic_save

_RESULT = "result.pt"
START_METHODS = ("spawn", "fork", "forkserver")


class Torchrun:
    """The default launcher: the script again, under ``python -m torch.distributed.run``
    (:func:`hookloop.elastic_command`; the plain interpreter for one process).

    ``processes_per_node``: ``None`` starts ``devices`` processes per node; ``1`` starts
    one whatever ``devices`` says (``ddp2``, whose process drives the node's devices), and
    a run of one node then trains in the calling process.
    """

    hookloop_name = "torchrun"
    hookloop_role = "launcher"

    def __init__(self, processes_per_node: int | None = None):
        if processes_per_node is not None and (not isinstance(processes_per_node, int)
                                               or processes_per_node < 1):
            raise ConfigurationError(f"torchrun option processes_per_node={processes_per_node!r} "
                                     "must be a whole number >= 1, or None for `devices`")
        self.processes_per_node = processes_per_node

    @hookimpl
    def launch_command(self, config, script, script_args):
        """torchrun's command line for ``config`` (``--devices``, ``--nodes``, ``--max-restarts``)."""
        if self.processes_per_node is not None:
            config = dataclasses.replace(config, devices=self.processes_per_node)
        return elastic_command(config, script, script_args)

    @hookimpl
    def spawn(self, trainer, function):
        """With one process per node on one node: that process is this one, train here."""
        config = trainer.config
        if (self.processes_per_node != 1 or config.nodes > 1 or config.max_restarts
                or in_worker()):
            return None
        result = function(trainer)
        return True if result is None else result


class InProcess:
    """One process drives every device (``dp``'s threads, ``pipe``'s partitions): the
    script runs in one plain interpreter and ``fit`` trains in the calling process,
    whatever ``devices`` says. ``check(config)`` (the strategy's) refuses what one process
    cannot do (several nodes); ``label`` names the strategy in messages. ``max_restarts``
    is refused: the calling process cannot start itself again."""

    hookloop_name = "in_process"
    hookloop_role = "launcher"

    def __init__(self, check: Callable[[Any], None] | None = None, label: str = "in_process"):
        self.check = check
        self.label = label

    def _check(self, config: Any) -> None:
        if self.check is not None:
            self.check(config)
        if config.max_restarts:
            raise ConfigurationError(
                f"{self.label} trains in the calling process, which cannot start itself again "
                f"(max_restarts={config.max_restarts}): drop max_restarts and re-run the job with "
                f"ckpt_path='last', or use a strategy whose workers a launcher restarts (ddp, "
                f"under torchrun or spawn)")

    @hookimpl
    def launch_command(self, config, script, script_args):
        """The plain interpreter: the devices are not processes."""
        self._check(config)
        return [sys.executable, script, *script_args]

    @hookimpl
    def spawn(self, trainer, function):
        """Train in this process."""
        self._check(trainer.config)
        result = function(trainer)
        return True if result is None else result


class Spawn:
    """Start ``devices`` worker processes from inside ``fit`` with ``torch.multiprocessing``.

    ``start_method``: ``"spawn"`` (default: fresh interpreters, safe with threads and CUDA),
    ``"forkserver"``, or ``"fork"`` (Linux and macOS; lets a notebook's own classes reach the
    workers, but must not be used after CUDA was initialised in the calling process).
    ``label``: the name the user knows it by in messages (``ddp_spawn`` when that strategy
    chose it). One machine only (``nodes=1``). ``max_restarts=K`` (the Trainer's) starts the
    workers again after a failure, at most K times; each attempt resumes from the run's
    ``last.ckpt``.
    """

    hookloop_name = "spawn"
    hookloop_role = "launcher"

    def __init__(self, start_method: str = "spawn", label: str = "spawn"):
        if start_method not in START_METHODS:
            raise ConfigurationError(
                f"{label} option start_method={start_method!r} must be 'spawn', 'fork' or 'forkserver'"
            )
        self.start_method = start_method
        self.label = label

    @hookimpl
    def launch_command(self, config, script, script_args):
        """Run the script once, in one plain interpreter: ``fit`` spawns the workers."""
        _check_single_node(config, self.label)
        return [sys.executable, script, *script_args]

    @hookimpl
    def spawn(self, trainer, function):
        """Run ``function(trainer)`` in ``devices`` new processes and bring rank 0's results back."""
        import torch.multiprocessing as mp

        if getattr(mp.current_process(), "_inheriting", False):
            # A spawned process re-imports the script; an unguarded fit() lands here.
            raise ConfigurationError(_MAIN_GUARD)
        if "LOCAL_RANK" in os.environ or dist.is_initialized():
            return None  # already a worker of some launcher: train here
        config = trainer.config
        _check_single_node(config, self.label)
        nprocs = config.num_processes()
        if nprocs == 1:
            return None  # a world of one needs no second process
        payload = pickle_job({"trainer": trainer, "function": function}, trainer, self.start_method,
                             self.label)
        # The workers die with this process, even a SIGKILLed one (as_launcher); every
        # attempt is the same job (one run token: one run directory).
        with tempfile.TemporaryDirectory(prefix="hookloop-spawn-") as tmp, as_launcher():
            for attempt in range(config.max_restarts + 1):
                failure = self._attempt(mp, payload, nprocs, Path(tmp), attempt)
                if failure is None:
                    break
                if attempt == config.max_restarts:
                    raise failure
                print(f"hookloop: a {self.label} worker failed ({type(failure).__name__}: "
                      f"{str(failure).splitlines()[0] if str(failure) else ''}); starting attempt "
                      f"{attempt + 1} of {config.max_restarts} restart(s), from the run's last.ckpt",
                      file=sys.stderr, flush=True)
            # Our own file, written by our own worker a moment ago.
            result = torch.load(Path(tmp) / _RESULT, map_location="cpu", weights_only=False)
        # the caller's trainer and module hold the run's results (weights, metrics,
        # counters, run directory, checkpoint paths)
        return adopt_worker_result(trainer, result)

    def _attempt(self, mp: Any, payload: bytes, nprocs: int, tmp: Path,
                 attempt: int) -> BaseException | None:
        """One start of the workers; the exception to raise when one failed, else ``None``."""
        for stale in tmp.glob("error-*.pkl"):
            stale.unlink()
        try:
            mp.start_processes(
                _worker,
                args=(payload, nprocs, _free_port(), str(tmp), attempt),
                nprocs=nprocs,
                join=True,
                start_method=self.start_method,
            )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            own = _worker_exception(tmp, nprocs, self.label)
            if own is not None:
                return own
            failure = RuntimeError(
                f"a {self.label} worker process died before it could report an error ({exc}); "
                f"its output is above. {_MAIN_GUARD}"
            )
            failure.__cause__ = exc
            return failure
        return None


_MAIN_GUARD = (
    "Processes started with start_method='spawn' import the main script again: a script "
    "that calls fit() at top level must do it under `if __name__ == \"__main__\":`."
)


def _check_single_node(config, label: str = "spawn") -> None:
    if config.nodes > 1:
        raise ConfigurationError(
            f"{label} starts its processes on one machine, but nodes={config.nodes}: use "
            f"the 'ddp' strategy for several machines (hookloop run --plugins ddp --nodes "
            f"{config.nodes} --node-rank R --rdzv-endpoint HOST:PORT script.py)"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(local_rank: int, payload: bytes, nprocs: int, port: int, tmp: str, attempt: int = 0) -> None:
    """One spawned process: become rank ``local_rank`` of a torchrun-like environment
    (docs/environment.md, "What a worker needs from its launcher")."""
    # torch.multiprocessing gave this process SIGINT as its parent-death signal, which a
    # training loop survives: SIGKILL instead (a forked worker did not import hookloop).
    die_with_launcher()
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        **{ATTEMPT_ENV: str(attempt), WORKER_ENV: "1"},
    )
    try:
        job = pickle.loads(payload)
        trainer, function = job["trainer"], job["function"]
        value = function(trainer)
        if trainer.global_rank == 0:
            atomic_save(worker_result(trainer, value), Path(tmp) / _RESULT)
    except BaseException as exc:
        # Hand the exception itself to the caller, so it can catch the same type.
        with open(Path(tmp) / f"error-{local_rank}.pkl", "wb") as f:
            pickle.dump(worker_error(exc), f)
        raise


def _worker_exception(tmp: Path, nprocs: int, label: str = "spawn") -> BaseException | None:
    """The first worker's own exception, with its traceback attached as a note."""
    for rank in range(nprocs):
        path = tmp / f"error-{rank}.pkl"
        if not path.exists():
            continue
        with open(path, "rb") as f:
            report = pickle.load(f)
        return adopt_worker_error(report, f"{label} worker process {rank}", f"{label} worker {rank} failed")
    return None


# ---------------------------------------------------------------------------------------
# Pickling the job, and naming what cannot be pickled
# ---------------------------------------------------------------------------------------


class _JobPickler(pickle.Pickler):
    """Plain pickling (tensors by value, so each worker owns its copy) plus two rules:
    modules travel by name, and ``__main__`` objects are noted when the workers could
    not import them (a notebook or ``python -c`` has no file to re-import)."""

    def __init__(self, file, main_unimportable: bool):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.main_unimportable = main_unimportable
        self.main_objects: list = []

    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType) and obj.__name__ != "__main__" and obj.__name__ in sys.modules:
            return _import_module, (obj.__name__,)
        if self.main_unimportable and isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.main_objects.append(obj)
        return NotImplemented


def _import_module(name: str) -> types.ModuleType:
    import importlib

    return importlib.import_module(name)


def _dumps(obj: Any, main_unimportable: bool = False) -> tuple[bytes, list]:
    buffer = io.BytesIO()
    pickler = _JobPickler(buffer, main_unimportable)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.main_objects


ADVICE = (
    "{label} sends the model, the dataloaders (dataset, sampler, collate_fn) and the "
    "plugins/callbacks to its worker processes by pickling them, so all of them must be "
    "picklable (a limitation of Python's multiprocessing). Define functions at module "
    "level instead of lambdas or nested functions, and open files, locks or connections "
    "when they are first used rather than in __init__. Check an object yourself with "
    "`import pickle; pickle.dumps(obj)`. Or use the 'ddp' strategy (hookloop run --plugins "
    "ddp --devices N script.py), which starts every process from your script and pickles "
    "nothing."
)


def pickle_job(job: dict, trainer, start_method: str, label: str = "spawn") -> bytes:
    """Pickle ``job`` for the workers, or raise ``ConfigurationError`` naming what fails."""
    main = sys.modules.get("__main__")
    main_unimportable = start_method != "fork" and not getattr(main, "__file__", None)
    try:
        payload, main_objects = _dumps(job, main_unimportable)
    except Exception:
        raise ConfigurationError(_unpicklable_message(trainer, label)) from None
    if main_objects:
        names = ", ".join(sorted({getattr(o, "__qualname__", repr(o)) for o in main_objects}))
        raise ConfigurationError(
            f"{label} cannot send {names} to its worker processes: defined in __main__ of "
            f"an interactive session (a notebook, python -c), which processes started with "
            f"start_method={start_method!r} cannot import. Move the definitions into a .py "
            f"module and import them, or use {label} with start_method='fork' "
            f"(plugins=[hookloop.plugin({label!r}, start_method='fork')])."
        )
    return payload


def _unpicklable_message(trainer, label: str = "spawn") -> str:
    roots = [("trainer.module", trainer.module)]
    roots += [(f"trainer.{name}", getattr(trainer, name, None)) for name in ("train_dataloader", "val_dataloader")]
    roots += [(f"plugin {_plugin_name(p)!r}", p) for p in trainer.plugins]
    roots += [("trainer", trainer)]
    for path, root in roots:
        found = find_unpicklable(root, path)
        if found is not None:
            where, obj, error = found
            return f"{where} ({describe(obj)}) cannot be pickled: {error}. {ADVICE.format(label=label)}"
    return f"the training job cannot be pickled. {ADVICE.format(label=label)}"


def _plugin_name(plugin: Any) -> str:
    return getattr(plugin, "hookloop_name", None) or type(plugin).__name__


def find_unpicklable(obj: Any, path: str, _seen: set | None = None, _depth: int = 0):
    """``(attribute path, object, error)`` of the innermost part of ``obj`` that cannot be
    pickled, or ``None`` when ``obj`` pickles."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return None
    seen.add(id(obj))
    try:
        _dumps(obj)
        return None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    if _depth < 12:
        for child_path, child in _children(obj, path):
            found = find_unpicklable(child, child_path, seen, _depth + 1)
            if found is not None:
                return found
    return path, obj, error


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{key!r}]", value
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            yield f"{path}[{i}]", value
        return
    try:
        reduced = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    except Exception:
        return
    if not isinstance(reduced, tuple):
        return  # pickled by reference (a function, a class)
    state = reduced[2] if len(reduced) > 2 else None
    if isinstance(state, tuple) and len(state) == 2:
        state = {**(state[0] or {}), **(state[1] or {})}
    if isinstance(state, dict):
        for key, value in state.items():
            # nn.Module keeps submodules, parameters and buffers in dicts: name them as
            # attributes, the way the user wrote them.
            if key in ("_modules", "_parameters", "_buffers") and isinstance(value, dict):
                for name, item in value.items():
                    yield f"{path}.{name}", item
            else:
                yield f"{path}.{key}", value
    for i, arg in enumerate(reduced[1] if len(reduced) > 1 and isinstance(reduced[1], tuple) else ()):
        yield f"{path}<argument {i}>", arg


def describe(obj: Any) -> str:
    """A few words a user recognises the object by."""
    if isinstance(obj, types.FunctionType):
        name = obj.__qualname__
        if name == "<lambda>" or name.endswith(".<lambda>"):
            return f"a lambda defined in {obj.__module__}"
        if "<locals>" in name:
            return f"the nested function {name.split('.')[-1]!r} defined inside {name.split('.<locals>')[0]!r}"
        return f"the function {name!r} of {obj.__module__}"
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    kind = type(obj)
    return f"a {kind.__module__}.{kind.__qualname__} object"
