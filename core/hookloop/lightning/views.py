"""Lightning's Trainer attributes over the run's plugins and settings.

``trainer.lightning_module``, ``trainer.early_stopping_callback(s)``,
``trainer.checkpoint_callbacks`` and ``trainer.progress_bar_callback`` are Lightning's names
for things the engine keeps as plugins; they are compatibility, not loop state, so they live
here and the facade registers them (:func:`hookloop.contract.translators.register_view`):
the engine's ``Trainer.__getattr__`` finds them only for names it lacks itself.
"""

from __future__ import annotations

from typing import Any

from hookloop.contract.errors import ConfigurationError
from hookloop.contract.pluginspec import plugin_name
from hookloop.engine.settings import is_count_or_fraction
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
                                  check_val_every_n_epoch, val_check_interval,
                                  num_sanity_val_steps)}


# Lightning's settable attributes and its loop view: properties the facade puts on the
# engine's Trainer class (hookloop/__init__.py), so the engine keeps none of Lightning's names.
def _batch_limit_property(loop: str) -> property:
    """``trainer.limit_<loop>_batches``, Lightning's attribute: the setting, ``1.0`` (the
    whole loader) when not given; settable between runs, as Lightning's."""
    name = f"limit_{loop}_batches"

    def get(trainer: Any) -> int | float:  # noqa: PYI041 (a count or a fraction)
        value = getattr(trainer.config, name)
        return 1.0 if value is None else value

    def set_(trainer: Any, value: int | float) -> None:  # noqa: PYI041
        if not is_count_or_fraction(value):
            raise ConfigurationError(
                f"trainer.{name} = {value!r}: must be a number of batches (an integer >= 0) or "
                f"a fraction of the loader (a float in [0.0, 1.0])")
        setattr(trainer.config, name, value)

    return property(get, set_, doc=get.__doc__)


class FitLoopView:
    """Read-only view of the training loop's position under Lightning's names (the
    loop itself is :mod:`hookloop.loop`, not an object)."""

    def __init__(self, trainer: Any):
        self._trainer = trainer

    @property
    def batch_idx(self) -> int:
        return self._trainer.state.fetched_batch_idx

    @property
    def max_epochs(self) -> int | None:
        return self._trainer.max_epochs

    @max_epochs.setter
    def max_epochs(self, value: int | None) -> None:
        """Lightning's way to train on with the same Trainer: ``fit_loop.max_epochs = n``
        before the next ``fit``."""
        self._trainer.config.max_epochs = value

    @property
    def max_steps(self) -> int:
        return self._trainer.max_steps

    @property
    def epoch_loop(self) -> FitLoopView:
        return self


def _fit_loop(trainer: Any) -> FitLoopView:
    """Lightning's ``trainer.fit_loop``, for what Lightning code reads of it: ``batch_idx``
    (the last training batch fetched), ``max_epochs`` (settable: train on with the same
    Trainer), ``max_steps``, and ``epoch_loop`` (the same view)."""
    return FitLoopView(trainer)


def _fast_dev_run(trainer: Any) -> bool | int:
    """The ``fast_dev_run`` setting as given (False, True or a number of batches)."""
    return trainer.config.fast_dev_run


PROPERTIES = {
    **{f"limit_{loop}_batches": _batch_limit_property(loop)
       for loop in ("train", "val", "test", "predict")},
    "fit_loop": property(_fit_loop, doc=_fit_loop.__doc__),
    "fast_dev_run": property(_fast_dev_run, doc=_fast_dev_run.__doc__),
}
