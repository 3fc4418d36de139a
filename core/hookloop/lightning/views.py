"""Lightning's read-only Trainer attributes over the run's plugins.

``trainer.lightning_module``, ``trainer.early_stopping_callback(s)``,
``trainer.checkpoint_callbacks`` and ``trainer.progress_bar_callback`` are Lightning's names
for things the engine keeps as plugins; they are compatibility, not loop state, so they live
here and the facade registers them (:func:`hookloop.contract.translators.register_view`):
the engine's ``Trainer.__getattr__`` finds them only for names it lacks itself.
"""

from __future__ import annotations

from typing import Any

from hookloop.contract.pluginspec import plugin_name
from hookloop.observers.checkpoint import ModelCheckpoint
from hookloop.observers.early_stopping import EarlyStopping
from hookloop.observers.on_exception import OnExceptionCheckpoint


def checkpoint_callbacks(trainer: Any) -> list:
    """Every checkpointing plugin of the run, in order (Lightning's: its ``Checkpoint``
    subclasses, ``ModelCheckpoint`` and ``OnExceptionCheckpoint``); empty with none."""
    return [p for p in trainer.callbacks if isinstance(p, (ModelCheckpoint, OnExceptionCheckpoint))]


def early_stopping_callbacks(trainer: Any) -> list:
    """Every :class:`hookloop.EarlyStopping` of the run, in order (Lightning's)."""
    return [p for p in trainer.callbacks if isinstance(p, EarlyStopping)]


def early_stopping_callback(trainer: Any) -> Any:
    """The first :class:`hookloop.EarlyStopping` of the run, or ``None`` (Lightning's)."""
    found = early_stopping_callbacks(trainer)
    return found[0] if found else None


def progress_bar_callback(trainer: Any) -> Any:
    """The run's progress bar plugin (``hookloop.ProgressBar``, the default, or a
    ``TQDMProgressBar``/``RichProgressBar``), or ``None`` with ``enable_progress_bar=False``
    (Lightning's)."""
    return next((p for p in trainer.plugins if plugin_name(p) == "progress"), None)


def lightning_module(trainer: Any) -> Any:
    """The user's module (``trainer.module``; Lightning's name), ``None`` before a run."""
    return trainer.module


def check_val_every_n_epoch(trainer: Any) -> int | None:
    """The setting (1 when not given; ``None``: validation by ``val_check_interval`` batches
    across epochs), as Lightning's."""
    return trainer.config.check_val_every_n_epoch


def val_check_interval(trainer: Any) -> int | float:
    """The setting (1.0 when not given: once per epoch), as Lightning's."""
    return trainer.config.val_check_interval


def num_sanity_val_steps(trainer: Any) -> int | float:
    """The setting (2 when not given, 0 in a ``fast_dev_run``); ``-1`` (the whole validation
    set) reads ``inf``, as Lightning's."""
    steps = trainer.config.num_sanity_val_steps
    return float("inf") if steps == -1 else steps


VIEWS = {f.__name__: f for f in (checkpoint_callbacks, early_stopping_callbacks,
                                  early_stopping_callback, progress_bar_callback, lightning_module,
                                  check_val_every_n_epoch, val_check_interval, num_sanity_val_steps)}
