"""``progress``: a progress bar on global rank 0 (tqdm).

On a terminal: one bar per training epoch (batch/total, it/s, elapsed and remaining
time, the metrics logged with ``prog_bar=True``) and a bar per validation, test and
predict run. When stdout is not a terminal (CI logs, redirected workers): one plain line
per epoch instead of redraws. Metric values are read from the device only when the bar
redraws (at most every ``refresh_seconds``), never every step.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from hookloop.contract.hookspecs import hookimpl


def _format(metrics: dict) -> dict[str, str]:
    return {k: f"{v:.4g}" for k, v in sorted(metrics.items())}


class ProgressBar:
    """The progress bar (built in: ``no:progress`` or ``enable_progress_bar=False`` turn it off).

    refresh_seconds: the most often the bar redraws and reads the logged values (0.5)
    file: where it writes (default: stdout)
    """

    hookloop_name = "progress"
    hookloop_role = "observer"

    def __init__(self, refresh_seconds: float = 0.5, file: Any = None):
        self.refresh_seconds = refresh_seconds
        self.file = file
        self._bar: Any = None
        self._eval_bar: Any = None
        self._last_refresh = 0.0
        self._epoch_start = 0.0
        self._first_batch = 0
        self._pending = 0  # batches done since the bar last redrew
        self._updates: Any = None

    def _out(self):
        return self.file or sys.stdout

    def _interactive(self) -> bool:
        out = self._out()
        return bool(getattr(out, "isatty", lambda: False)())

    def get_metrics(self, trainer, pl_module: Any = None) -> dict[str, Any]:
        """Lightning's ``ProgressBar.get_metrics``: ``v_num`` (with a logger), then the
        values logged with ``prog_bar=True`` (reads the device)."""
        from hookloop.observers.bars import TQDMProgressBar

        return TQDMProgressBar.get_metrics(self, trainer, pl_module)  # the one definition

    def _postfix(self, trainer, extra: dict | None = None) -> dict[str, str]:
        metrics = dict(trainer.progress_bar_metrics)  # reads the device: only when redrawing
        if extra:
            metrics.update({k: v for k, v in extra.items() if k in trainer.state.metrics.prog_bar})
        return _format(metrics)

    # -- the run --------------------------------------------------------------------------

    @hookimpl
    def setup(self, trainer):
        # Only a bar that redraws pays a call per batch: on other ranks and without a
        # terminal, nothing is registered on the step path.
        if trainer.is_global_zero and self._interactive() and self._updates is None:
            self._updates = _BarUpdates(self)
            trainer.plugin_manager.register(self._updates, name="progress.bar_updates")

    @hookimpl
    def teardown(self, trainer):
        updates, self._updates = self._updates, None
        if updates is not None:
            trainer.plugin_manager.unregister(updates)

    # -- training -------------------------------------------------------------------------

    @hookimpl
    def on_train_epoch_start(self, trainer, epoch):
        if not trainer.is_global_zero:
            return
        self._epoch_start = self._last_refresh = time.monotonic()
        self._first_batch = trainer.state.total_batch_idx
        self._pending = 0
        if self._interactive():
            from tqdm import tqdm

            total = getattr(trainer, "num_training_batches", None)
            limit = f"/{trainer.max_epochs}" if trainer.max_epochs and 0 < trainer.max_epochs < 10**6 else ""
            self._bar = tqdm(total=total, desc=f"Epoch {epoch + 1}{limit}", file=self._out(), dynamic_ncols=True,
                             leave=True, unit="it")

    @hookimpl
    def on_train_epoch_end(self, trainer, epoch, metrics):
        if not trainer.is_global_zero:
            return
        shown = self._postfix(trainer, metrics)
        if self._bar is not None:
            self._flush()
            self._bar.set_postfix(shown, refresh=True)
            self._bar.close()
            self._bar = None
            return
        elapsed = time.monotonic() - self._epoch_start
        batches = trainer.state.total_batch_idx - self._first_batch
        rate = batches / elapsed if elapsed > 0 else float("inf")
        limit = f"/{trainer.max_epochs}" if trainer.max_epochs and 0 < trainer.max_epochs < 10**6 else ""
        values = " ".join(f"{k}={v}" for k, v in shown.items())
        print(f"Epoch {epoch + 1}{limit}: {batches} batches in {elapsed:.1f}s ({rate:.1f} it/s)"
              + (f"  {values}" if values else ""), file=self._out(), flush=True)

    def _flush(self) -> None:
        if self._pending and self._bar is not None:
            self._bar.update(self._pending)
        self._pending = 0

    @hookimpl
    def on_exception(self, trainer):
        for bar in (self._bar, self._eval_bar):
            if bar is not None:
                bar.close()
        self._bar = self._eval_bar = None

    # -- validation, test, predict ----------------------------------------------------------

    def _eval_start(self, trainer, what: str) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking or not self._interactive():
            return
        from tqdm import tqdm

        self._eval_bar = tqdm(desc=what, file=self._out(), dynamic_ncols=True, leave=False, unit="it")

    def _eval_end(self, trainer, what: str, metrics: dict | None) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None
        if trainer.is_global_zero and metrics and trainer.state in ("validate", "test") and not self._interactive():
            print(f"{what}: " + " ".join(f"{k}={v}" for k, v in _format(metrics).items()), file=self._out(), flush=True)

    @hookimpl
    def on_validation_start(self, trainer):
        self._eval_start(trainer, "Validation")

    @hookimpl
    def on_validation_end(self, trainer, metrics):
        self._eval_end(trainer, "Validation", metrics)

    @hookimpl
    def on_test_start(self, trainer):
        self._eval_start(trainer, "Testing")

    @hookimpl
    def on_test_end(self, trainer, metrics):
        self._eval_end(trainer, "Testing", metrics)

    @hookimpl
    def on_predict_start(self, trainer):
        self._eval_start(trainer, "Predicting")

    @hookimpl
    def on_predict_end(self, trainer):
        self._eval_end(trainer, "Predicting", None)


class _BarUpdates:
    """The per-batch half of :class:`ProgressBar`: registered only where a bar redraws."""

    hookloop_role = "observer"

    def __init__(self, bar: ProgressBar):
        self.bar = bar

    @hookimpl
    def on_train_batch_end(self, trainer):
        # Counted here, handed to tqdm only when the bar redraws: a step costs this call.
        progress = self.bar
        progress._pending += 1
        now = time.monotonic()
        if now - progress._last_refresh >= progress.refresh_seconds and progress._bar is not None:
            progress._last_refresh = now
            progress._flush()
            progress._bar.set_postfix(progress._postfix(trainer), refresh=True)

    def _eval_batch(self) -> None:
        if self.bar._eval_bar is not None:
            self.bar._eval_bar.update(1)

    @hookimpl
    def on_validation_batch_end(self):
        self._eval_batch()

    @hookimpl
    def on_test_batch_end(self):
        self._eval_batch()

    @hookimpl
    def on_predict_batch_end(self):
        self._eval_batch()
