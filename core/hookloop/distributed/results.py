"""What a run in worker processes hands back to the process that started them.

A launcher that runs ``fit`` (``validate``, ``test``, ``predict``) in processes of its
own and returns to the caller (the ``spawn`` hook: ``ddp_spawn``; a launcher placing its
workers as Ray actors) makes the caller's ``Trainer`` and module hold what the run
produced, as if the run had been in-process:

    # in the worker of global rank 0, after ``value = function(trainer)``
    result = hookloop.worker_result(trainer, value)      # plain data: pickle or torch.save it
    # in the caller, once the workers are done
    return hookloop.adopt_worker_result(trainer, result)  # the spawn hook's return value

:func:`adopt_worker_result` gives the caller's objects: the trained weights (into
``trainer.module``), ``callback_metrics`` and ``logged_metrics``, ``current_epoch``,
``global_step`` and ``batch_idx``, the run directory the workers used
(``trainer.log_dir``: no second ``version_N`` is claimed in the caller), and each
checkpoint observer's bookkeeping (``best_model_path``, ``last_model_path``,
``best_model_score``, ``best_k_models``, its ``dirpath``). What the function returned
comes back (``True`` in its place when it returned ``None``: the spawn hook's sentinel).

A worker that fails sends :func:`worker_error` instead (inside its ``except``), and the
caller raises :func:`adopt_worker_error`'s exception: the worker's own, so the caller
can catch its type, with the worker's traceback attached as a note.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from hookloop.contract.pluginspec import plugin_name
from hookloop.engine.session import adopt_run_dirs

#: the format of :func:`worker_result`'s dictionary, for a launcher that stores it
RESULT_VERSION = 1


def _checkpoint_observers(trainer: Any) -> list:
    return [p for p in trainer.plugins if plugin_name(p) == "checkpoint"
            and callable(getattr(p, "state_dict", None))]


def worker_result(trainer: Any, value: Any) -> dict[str, Any]:
    """What the worker of global rank 0 sends back when its run returned ``value``: plain
    Python values and CPU tensors (``torch.save`` or pickle it)."""
    return {
        "version": RESULT_VERSION,
        "value": value,
        "state_dict": {k: v.detach().cpu() for k, v in trainer.module.state_dict().items()},
        "callback_metrics": dict(trainer.callback_metrics),
        "logged_metrics": dict(trainer.logged_metrics),
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "batch_idx": trainer.batch_idx,
        "run_dirs": trainer.state.run_dirs,
        "checkpoints": [p.state_dict() for p in _checkpoint_observers(trainer)],
    }


def adopt_worker_result(trainer: Any, result: dict[str, Any]) -> Any:
    """Make the caller's ``trainer`` (and its module and checkpoint observers) hold what
    the workers' run produced; return the spawn hook's value (``True`` for ``None``)."""
    if result.get("version") != RESULT_VERSION:
        raise ValueError(f"a worker result of format {result.get('version')!r}, where this hookloop "
                         f"reads format {RESULT_VERSION}: the workers ran another hookloop version")
    trainer.module.load_state_dict(result["state_dict"])
    trainer.state.metrics.callback_metrics.update(result["callback_metrics"])
    trainer.state.logged_metrics.update(result["logged_metrics"])
    trainer.current_epoch = result["current_epoch"]
    trainer.global_step = result["global_step"]
    trainer.batch_idx = result["batch_idx"]
    if result["run_dirs"] is not None:
        adopt_run_dirs(trainer, result["run_dirs"])
    for observer, state in zip(_checkpoint_observers(trainer), result["checkpoints"], strict=False):
        observer.dirpath = state.get("dirpath", observer.dirpath)  # resolved in the workers' setup
        observer.load_state_dict(state)
    value = result["value"]
    return True if value is None else value


def worker_error(exc: BaseException) -> dict[str, Any]:
    """What a failed worker sends back, called inside its ``except``: the exception pickled
    (``None`` when it cannot be) and its traceback as text (plain data: pickle it)."""
    text = traceback.format_exc()
    try:
        blob: bytes | None = pickle.dumps(exc)
    except Exception:
        blob = None
    return {"exception": blob, "traceback": text}


def adopt_worker_error(report: dict[str, Any], where: str, fallback: str) -> BaseException:
    """The exception for the caller to raise from a :func:`worker_error` report: the
    worker's own (its type kept) with the note ``(raised in WHERE:)`` and the worker's
    traceback; ``RuntimeError(fallback)`` when it could not be pickled back."""
    exc: Any = None
    if report.get("exception") is not None:
        try:
            exc = pickle.loads(report["exception"])  # the launcher's own file, from its own worker
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(fallback)
    exc.add_note(f"(raised in {where}:)\n{report.get('traceback', '')}")
    return exc
