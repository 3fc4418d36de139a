"""Lightning's progress bars: ``TQDMProgressBar`` and ``RichProgressBar``.

Passed in ``Trainer(callbacks=[...])``, either replaces hookloop's own bar (their plugin
name is ``progress``: a run has one progress bar). They draw what Lightning's draw, on
global rank 0 only: a training bar per epoch (``Epoch N``, batches/total, the metrics
of :meth:`get_metrics`: ``v_num`` and the values logged with ``prog_bar=True``), a
sanity-check bar, a validation bar under it, and test and predict bars. They redraw
every ``refresh_rate`` batches (and at the last), as Lightning's do: that reads the
logged values from the device (``refresh_rate=0`` draws nothing).

tqdm and rich are optional dependencies: ``pip install tqdm`` / ``pip install rich``.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from hookloop.contract.errors import ConfigurationError, MissingDependencyError
from hookloop.contract.hookspecs import hookimpl
from hookloop.distributed.ranks import rank_zero_warn


def _need(module: str, who: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(
            f"{who} needs the {module!r} package, which is not installed: pip install {module} "
            f"(or leave {who} out: hookloop's own progress bar needs nothing)"
        ) from None


def _finite(x: Any) -> Any:
    """tqdm takes no inf/nan total: None instead (an unsized loader)."""
    if x is None or (isinstance(x, float) and (math.isinf(x) or math.isnan(x))):
        return None
    return x


def _version(trainer) -> Any:
    """``v_num``: the run directory's version number (``logs/version_N``), with a logger."""
    if not trainer.loggers:
        return None
    name = trainer.log_dir.name
    if name.startswith("version_") and name[8:].isdigit():
        return int(name[8:])
    return name[-4:]


class _Bar:
    """What both bars share: Lightning's ``ProgressBar`` base (totals, metrics, enabling).

    The hook implementations also take Lightning's arguments (``pl_module``, ``stage``...,
    with defaults, which pluggy never passes): a Lightning subclass's override calls them
    through ``super()`` with those (hookloop.lightning.callbacks, "Subclasses of
    hookloop's Lightning-named plugins")."""

    hookloop_name = "progress"
    hookloop_role = "observer"

    def __init__(self, refresh_rate: int, leave: bool):
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ConfigurationError(
                f"{type(self).__name__}(refresh_rate={refresh_rate!r}) must be a number of batches >= 0 "
                f"(0 draws nothing)")
        self._refresh_rate = refresh_rate
        self._leave = leave
        self._enabled = True
        self._trainer: Any = None
        self._per_batch: Any = None
        self._current_eval_dataloader_idx: int | None = None

    # -- Lightning's ProgressBar API ----------------------------------------------------------

    @property
    def trainer(self):
        return self._trainer

    @property
    def refresh_rate(self) -> int:
        return self._refresh_rate

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def sanity_check_description(self) -> str:
        return "Sanity Checking"

    @property
    def train_description(self) -> str:
        return "Training"

    @property
    def validation_description(self) -> str:
        return "Validation"

    @property
    def test_description(self) -> str:
        return "Testing"

    @property
    def predict_description(self) -> str:
        return "Predicting"

    @property
    def total_train_batches(self) -> int | float:
        n = getattr(self._trainer, "num_training_batches", None)
        return float("inf") if n is None else n

    def _eval_total(self, dataloader_idx: int) -> int | float:
        trainer = self._trainer
        if trainer.sanity_checking:
            counts = getattr(trainer, "num_sanity_val_batches", [])
        else:
            stage = {"validate": "val", "fit": "val"}.get(trainer.state.fn, trainer.state.fn)
            counts = getattr(trainer, f"num_{stage}_batches", [])
        n = counts[dataloader_idx] if dataloader_idx < len(counts) else None
        return float("inf") if n is None else n

    def get_metrics(self, trainer, pl_module: Any = None) -> dict[str, Any]:
        """What the training bar shows: ``v_num`` (with a logger), then the values logged
        with ``prog_bar=True`` (Lightning's; override to change)."""
        standard: dict[str, Any] = {}
        version = _version(trainer)
        if version not in (None, ""):
            standard["v_num"] = version
        shown = trainer.progress_bar_metrics
        duplicates = sorted(standard.keys() & shown.keys())
        if duplicates:
            rank_zero_warn(
                f"The progress bar already tracks a metric with the name(s) '{', '.join(duplicates)}' and "
                f"`self.log('{duplicates[0]}', ..., prog_bar=True)` will overwrite this value. If this is "
                f"undesired, change the name or override `get_metrics()` in the progress bar callback.")
        return {**standard, **shown}

    def _should_update(self, current: int, total: Any) -> bool:
        return self.is_enabled and (current % self.refresh_rate == 0 or current == total)

    # -- the run ---------------------------------------------------------------------------

    @hookimpl
    def setup(self, trainer, pl_module=None, stage=None):
        self._trainer = trainer
        if not trainer.is_global_zero:
            self.disable()  # rank 0 draws (Lightning's)
        # The per-batch half is registered only where the bar draws.
        if self.is_enabled and self._per_batch is None:
            self._per_batch = _PerBatch(self)
            trainer.plugin_manager.register(self._per_batch, name="progress.per_batch")

    @hookimpl
    def teardown(self, trainer, pl_module=None, stage=None):
        per_batch, self._per_batch = self._per_batch, None
        if per_batch is not None:
            trainer.plugin_manager.unregister(per_batch)


class _PerBatch:
    """The per-batch events of a bar: registered only where it draws."""

    hookloop_role = "observer"

    def __init__(self, bar: _Bar):
        self.bar = bar

    @hookimpl
    def on_train_batch_end(self, trainer, batch_idx):
        self.bar._train_batch_end(trainer, batch_idx)

    @hookimpl
    def on_validation_batch_end(self, trainer, batch_idx, dataloader_idx):
        self.bar._eval_batch_end(trainer, "val", batch_idx, dataloader_idx)

    @hookimpl
    def on_test_batch_end(self, trainer, batch_idx, dataloader_idx):
        self.bar._eval_batch_end(trainer, "test", batch_idx, dataloader_idx)

    @hookimpl
    def on_predict_batch_end(self, trainer, batch_idx, dataloader_idx):
        self.bar._eval_batch_end(trainer, "predict", batch_idx, dataloader_idx)


# ---------------------------------------------------------------------------------------
# tqdm
# ---------------------------------------------------------------------------------------

_PAD_SIZE = 5
_TQDM_CLASS: Any = None


def tqdm_class():
    """``Tqdm``: tqdm whose postfix numbers are padded so the bar does not flicker
    (Lightning's formatting: ``loss=0.500``, ``v_num=0``)."""
    global _TQDM_CLASS
    if _TQDM_CLASS is None:
        base = _need("tqdm", "TQDMProgressBar").tqdm

        class Tqdm(base):
            @staticmethod
            def format_num(n: Any) -> str:
                padded = isinstance(n, (float, str))
                if not isinstance(n, str):
                    n = base.format_num(n)
                if padded and "e" not in n:
                    if "." not in n and len(n) < _PAD_SIZE:
                        try:
                            float(n)
                        except ValueError:
                            return n
                        n += "."
                    n += "0" * (_PAD_SIZE - len(n))
                return n

        _TQDM_CLASS = Tqdm
    return _TQDM_CLASS


class TQDMProgressBar(_Bar):
    """Lightning's tqdm progress bar.

    refresh_rate: redraw every this many batches (and at the last); 0 draws nothing
    process_position: the bar's line, for several runs side by side
    leave: keep every epoch's finished bar on screen (default: one bar, reset per epoch)
    """

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False):
        tqdm_class()  # the clear error now, not at the first epoch
        if "TQDM_MINITERS" in os.environ:  # tqdm's own setting, as Lightning reads it
            refresh_rate = max(int(os.environ["TQDM_MINITERS"]), refresh_rate)
        super().__init__(refresh_rate, leave)
        self._process_position = process_position
        self._train_progress_bar: Any = None
        self._val_progress_bar: Any = None
        self._test_progress_bar: Any = None
        self._predict_progress_bar: Any = None

    def __getstate__(self) -> dict:
        # a spawn-based strategy pickles the plugins: the bars are made again there
        state = self.__dict__.copy()
        for key in ("_train_progress_bar", "_val_progress_bar", "_test_progress_bar", "_predict_progress_bar",
                    "_trainer", "_per_batch"):
            state[key] = None
        return state

    @property
    def process_position(self) -> int:
        return self._process_position

    def _get(self, name: str):
        bar = getattr(self, f"_{name}_progress_bar")
        if bar is None:
            raise TypeError(f"The `{type(self).__name__}._{name}_progress_bar` reference has not been set yet.")
        return bar

    @property
    def train_progress_bar(self):
        return self._get("train")

    @train_progress_bar.setter
    def train_progress_bar(self, bar) -> None:
        self._train_progress_bar = bar

    @property
    def val_progress_bar(self):
        return self._get("val")

    @val_progress_bar.setter
    def val_progress_bar(self, bar) -> None:
        self._val_progress_bar = bar

    @property
    def test_progress_bar(self):
        return self._get("test")

    @test_progress_bar.setter
    def test_progress_bar(self, bar) -> None:
        self._test_progress_bar = bar

    @property
    def predict_progress_bar(self):
        return self._get("predict")

    @predict_progress_bar.setter
    def predict_progress_bar(self, bar) -> None:
        self._predict_progress_bar = bar

    # -- the bars (override to customise, as in Lightning) ------------------------------------

    def _new(self, desc: str, position: int, leave: bool, **kw: Any):
        return tqdm_class()(desc=desc, position=position, disable=self.is_disabled, leave=leave, dynamic_ncols=True,
                            file=sys.stdout, bar_format=self.BAR_FORMAT, **kw)

    def init_sanity_tqdm(self):
        return self._new(self.sanity_check_description, 2 * self.process_position, False)

    def init_train_tqdm(self):
        return self._new(self.train_description, 2 * self.process_position, True, smoothing=0)

    def init_predict_tqdm(self):
        return self._new(self.predict_description, 2 * self.process_position, True, smoothing=0)

    def init_validation_tqdm(self):
        has_main_bar = self._trainer.state.fn != "validate"
        return self._new(self.validation_description, 2 * self.process_position + has_main_bar, not has_main_bar)

    def init_test_tqdm(self):
        return self._new("Testing", 2 * self.process_position, True)

    @staticmethod
    def _start_total(bar, total: Any, desc: str) -> None:
        bar.reset()
        bar.total = _finite(total)
        bar.initial = 0
        bar.set_description(desc)

    @staticmethod
    def _update_n(bar, n: int) -> None:
        if not bar.disable:
            bar.n = n
            bar.refresh()

    # -- training -------------------------------------------------------------------------

    @hookimpl
    def on_sanity_check_start(self, trainer=None, pl_module=None):
        self.val_progress_bar = self.init_sanity_tqdm()
        self.train_progress_bar = tqdm_class()(disable=True)  # a stand-in, as Lightning's

    @hookimpl
    def on_sanity_check_end(self, trainer=None, pl_module=None):
        self.val_progress_bar.close()
        self.train_progress_bar.close()

    @hookimpl
    def on_train_start(self, trainer=None, pl_module=None):
        self.train_progress_bar = self.init_train_tqdm()

    @hookimpl
    def on_train_epoch_start(self, trainer, pl_module=None):
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self._start_total(self.train_progress_bar, self.total_train_batches, f"Epoch {trainer.current_epoch}")

    def _train_batch_end(self, trainer, batch_idx: int) -> None:
        bar, n = self._train_progress_bar, batch_idx + 1
        if bar is not None and self._should_update(n, bar.total):
            self._update_n(bar, n)
            bar.set_postfix(self.get_metrics(trainer, trainer.module))

    @hookimpl
    def on_train_epoch_end(self, trainer, pl_module=None):
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, trainer.module))
        if self._leave:
            self.train_progress_bar.close()

    @hookimpl
    def on_train_end(self, trainer=None, pl_module=None):
        self.train_progress_bar.close()

    # -- validation, test, predict ------------------------------------------------------------

    def _eval_bar_start(self, kind: str, description: str) -> None:
        self._current_eval_dataloader_idx = 0
        bar = getattr(self, f"_{kind}_progress_bar")
        self._start_total(bar, self._eval_total(0), f"{description} DataLoader 0")

    def _eval_batch_end(self, trainer, kind: str, batch_idx: int, dataloader_idx: int) -> None:
        bar = getattr(self, f"_{kind}_progress_bar")
        if bar is None:
            return
        if dataloader_idx != self._current_eval_dataloader_idx:
            self._current_eval_dataloader_idx = dataloader_idx
            description = {"val": self.sanity_check_description if trainer.sanity_checking else self.validation_description,
                           "test": self.test_description, "predict": self.predict_description}[kind]
            self._start_total(bar, self._eval_total(dataloader_idx), f"{description} DataLoader {dataloader_idx}")
        n = batch_idx + 1
        if self._should_update(n, bar.total):
            self._update_n(bar, n)

    @hookimpl
    def on_validation_start(self, trainer, pl_module=None):
        if not trainer.sanity_checking:
            self.val_progress_bar = self.init_validation_tqdm()
        self._eval_bar_start("val", self.sanity_check_description if trainer.sanity_checking else
                             self.validation_description)

    @hookimpl
    def on_validation_end(self, trainer, pl_module=None):
        self.val_progress_bar.close()
        self._current_eval_dataloader_idx = None
        if self._train_progress_bar is not None and trainer.state.fn == "fit":
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, trainer.module))

    @hookimpl
    def on_test_start(self, trainer=None, pl_module=None):
        self.test_progress_bar = self.init_test_tqdm()
        self._eval_bar_start("test", self.test_description)

    @hookimpl
    def on_test_end(self, trainer=None, pl_module=None):
        self.test_progress_bar.close()
        self._current_eval_dataloader_idx = None

    @hookimpl
    def on_predict_start(self, trainer=None, pl_module=None):
        self.predict_progress_bar = self.init_predict_tqdm()
        self._eval_bar_start("predict", self.predict_description)

    @hookimpl
    def on_predict_end(self, trainer=None, pl_module=None):
        self.predict_progress_bar.close()
        self._current_eval_dataloader_idx = None

    @hookimpl
    def on_exception(self, trainer=None, pl_module=None, exception=None):
        for bar in (self._train_progress_bar, self._val_progress_bar, self._test_progress_bar,
                    self._predict_progress_bar):
            if bar is not None:
                bar.close()

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """Print above the active bar (``tqdm.write``)."""
        for bar in (self._train_progress_bar, self._val_progress_bar, self._test_progress_bar,
                    self._predict_progress_bar):
            if bar is not None and not bar.disable:
                bar.write(sep.join(map(str, args)), **kwargs)
                return
        print(*args, sep=sep, **kwargs)


# ---------------------------------------------------------------------------------------
# rich
# ---------------------------------------------------------------------------------------


@dataclass
class RichProgressBarTheme:
    """The styles of :class:`RichProgressBar` (Lightning's fields; rich style strings)."""

    description: str = ""
    progress_bar: str = "#6206E0"
    progress_bar_finished: str = "#6206E0"
    progress_bar_pulse: str = "#6206E0"
    batch_progress: str = ""
    time: str = "dim"
    processing_speed: str = "dim underline"
    metrics: str = "italic"
    metrics_text_delimiter: str = " "
    metrics_format: str = ".3f"


class RichProgressBar(_Bar):
    """Lightning's rich progress bar.

    refresh_rate: redraw every this many batches (and at the last); 0 draws nothing
    leave: keep every epoch's finished bar on screen
    theme: a :class:`RichProgressBarTheme`
    console_kwargs: arguments of the ``rich.console.Console`` it draws on
    """

    def __init__(self, refresh_rate: int = 1, leave: bool = False, theme: RichProgressBarTheme | None = None,
                 console_kwargs: dict | None = None):
        _need("rich", "RichProgressBar")
        super().__init__(refresh_rate, leave)
        self.theme = theme if theme is not None else RichProgressBarTheme()
        self._console_kwargs = console_kwargs or {}
        self.progress: Any = None
        self.train_progress_bar_id: Any = None
        self.val_sanity_progress_bar_id: Any = None
        self.val_progress_bar_id: Any = None
        self.test_progress_bar_id: Any = None
        self.predict_progress_bar_id: Any = None
        self._metrics: dict[str, Any] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["progress"] = state["_trainer"] = state["_per_batch"] = None
        return state

    # -- drawing --------------------------------------------------------------------------

    def _metrics_text(self) -> str:
        theme = self.theme
        parts = []
        for name, value in self._metrics.items():
            if not isinstance(value, str):
                try:
                    value = format(value, theme.metrics_format)
                except (TypeError, ValueError):
                    value = str(value)
            parts.append(f"{name}: {value}")
        return theme.metrics_text_delimiter.join(parts)

    def _start_progress(self) -> None:
        if self.progress is not None or self.is_disabled:
            return
        from rich import progress as rp
        from rich.console import Console

        theme = self.theme
        columns = [
            rp.TextColumn("[progress.description]{task.description}", style=theme.description),
            rp.BarColumn(complete_style=theme.progress_bar, finished_style=theme.progress_bar_finished,
                         pulse_style=theme.progress_bar_pulse),
            rp.MofNCompleteColumn(),
            rp.TimeElapsedColumn(),
            rp.TimeRemainingColumn(),
            rp.TextColumn("{task.fields[metrics]}", style=theme.metrics),
        ]
        self.progress = rp.Progress(*columns, console=Console(**self._console_kwargs), auto_refresh=False,
                                    disable=self.is_disabled)
        self.progress.start()

    def _stop_progress(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def _add_task(self, total: Any, description: str, visible: bool = True) -> Any:
        if self.progress is None:
            return None
        return self.progress.add_task(description, total=_finite(total), visible=visible, metrics="")

    def _update(self, task_id: Any, current: int, visible: bool = True) -> None:
        if self.progress is not None and task_id is not None and self.is_enabled:
            total = self.progress.tasks[task_id].total
            if not self._should_update(current, total):
                return
            self.progress.update(task_id, completed=current, visible=visible)
            self.progress.refresh()

    def _show_metrics(self, trainer) -> None:
        self._metrics = self.get_metrics(trainer, trainer.module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, metrics=self._metrics_text())
            self.progress.refresh()

    # -- training ---------------------------------------------------------------------------

    @hookimpl
    def on_sanity_check_start(self, trainer=None, pl_module=None):
        self._start_progress()

    @hookimpl
    def on_sanity_check_end(self, trainer=None, pl_module=None):
        if self.progress is not None and self.val_sanity_progress_bar_id is not None:
            self.progress.update(self.val_sanity_progress_bar_id, advance=0, visible=False)
            self.progress.refresh()

    @hookimpl
    def on_train_epoch_start(self, trainer, pl_module=None):
        self._start_progress()
        if self.progress is None:
            return
        description = self._train_description(trainer)
        if self.train_progress_bar_id is not None and self._leave:
            self.train_progress_bar_id = None  # keep the finished epoch's bar, start another
        if self.train_progress_bar_id is None:
            self.train_progress_bar_id = self._add_task(self.total_train_batches, description)
        else:
            self.progress.reset(self.train_progress_bar_id, total=_finite(self.total_train_batches),
                                description=description, visible=True)
        self.progress.refresh()

    def _train_description(self, trainer) -> str:
        """``Epoch N/last``, padded to the validation bar's description (Lightning's)."""
        max_epochs = trainer.max_epochs
        if max_epochs is None:  # Lightning's: 1000 epochs, or -1 (endless) with max_steps
            max_epochs = 1000 if trainer.max_steps in (None, -1) else -1
        description = f"Epoch {trainer.current_epoch}/{max_epochs - 1}"
        return f"{description:{len(self.validation_description)}}"

    def _train_batch_end(self, trainer, batch_idx: int) -> None:
        n = batch_idx + 1
        if self.train_progress_bar_id is not None and self.progress is not None:
            total = self.progress.tasks[self.train_progress_bar_id].total
            if self._should_update(n, total):
                self.progress.update(self.train_progress_bar_id, completed=n)
                self._show_metrics(trainer)

    @hookimpl
    def on_train_epoch_end(self, trainer, pl_module=None):
        self._show_metrics(trainer)

    @hookimpl
    def on_train_end(self, trainer=None, pl_module=None):
        self._stop_progress()

    # -- validation, test, predict ------------------------------------------------------------

    def _eval_start(self, kind: str, description: str, visible: bool = True) -> None:
        self._start_progress()
        self._current_eval_dataloader_idx = 0
        task = self._add_task(self._eval_total(0), f"{description} DataLoader 0", visible=visible)
        setattr(self, f"{kind}_progress_bar_id", task)
        if self.progress is not None:
            self.progress.refresh()

    def _eval_batch_end(self, trainer, kind: str, batch_idx: int, dataloader_idx: int) -> None:
        name = "val_sanity" if kind == "val" and trainer.sanity_checking else kind
        if dataloader_idx != self._current_eval_dataloader_idx:
            self._current_eval_dataloader_idx = dataloader_idx
            description = {"val": self.validation_description, "val_sanity": self.sanity_check_description,
                           "test": self.test_description, "predict": self.predict_description}[name]
            task = getattr(self, f"{name}_progress_bar_id")
            if self.progress is not None and task is not None:
                self.progress.reset(task, total=_finite(self._eval_total(dataloader_idx)),
                                    description=f"{description} DataLoader {dataloader_idx}")
        self._update(getattr(self, f"{name}_progress_bar_id"), batch_idx + 1)

    def _eval_end(self, kind: str) -> None:
        task = getattr(self, f"{kind}_progress_bar_id")
        if self.progress is not None and task is not None:
            # the training bar stays; an evaluation bar under it goes (Lightning's)
            self.progress.update(task, advance=0, visible=False)
            self.progress.refresh()
        self._current_eval_dataloader_idx = None

    @hookimpl
    def on_validation_start(self, trainer, pl_module=None):
        if trainer.sanity_checking:
            self._eval_start("val_sanity", self.sanity_check_description)
        else:
            self._eval_start("val", self.validation_description)

    @hookimpl
    def on_validation_end(self, trainer, pl_module=None):
        if trainer.sanity_checking:
            self._eval_end("val_sanity")
            return
        if trainer.state.fn == "fit":
            self._eval_end("val")
            self._show_metrics(trainer)
        else:
            self._stop_progress()
            self._current_eval_dataloader_idx = None

    @hookimpl
    def on_test_start(self, trainer=None, pl_module=None):
        self._eval_start("test", self.test_description)

    @hookimpl
    def on_test_end(self, trainer=None, pl_module=None):
        self._stop_progress()
        self._current_eval_dataloader_idx = None

    @hookimpl
    def on_predict_start(self, trainer=None, pl_module=None):
        self._eval_start("predict", self.predict_description)

    @hookimpl
    def on_predict_end(self, trainer=None, pl_module=None):
        self._stop_progress()
        self._current_eval_dataloader_idx = None

    @hookimpl
    def on_exception(self, trainer=None, pl_module=None, exception=None):
        self._stop_progress()

    @hookimpl
    def teardown(self, trainer, pl_module=None, stage=None):
        self._stop_progress()
        super().teardown(trainer)
