"""``tensorboard``: every logged metric and the run's hyperparameters, as TensorBoard
event files in the run directory (``<default_root_dir>/logs/version_N/``, where
Lightning's TensorBoardLogger writes them too).

Scalars: one per metric of every ``on_log_metrics`` row, at the row's step. Hyperparameters:
``hookloop.run_hparams(trainer)`` flattened (``trainer/max_epochs``, ``module/lr``), written
for TensorBoard's HParams dashboard at the end of ``fit`` (also after an exception, with
the session marked failed), with every logged metric as the session's metrics (the
dashboard shows each one's last value). Written by global rank 0 only; flushed at the end
of every training epoch, closed at teardown.
"""

from __future__ import annotations

import importlib.util

import hookloop

__all__ = ["TensorBoardLogger"]


def _require_tensorboard() -> None:
    """Raise ``MissingDependencyError`` naming the package when tensorboard is missing.

    Checked when the plugin is created (``Trainer(...)``, ``hookloop run``), before any
    process starts, without importing it.
    """
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if not found:
        raise hookloop.MissingDependencyError(
            "the 'tensorboard' plugin writes with torch.utils.tensorboard, which needs the tensorboard "
            "package, and it is not installed: pip install tensorboard (or pip install hookloop-tensorboard, "
            "which depends on it)"
        )


class TensorBoardLogger:
    """Write metrics and hyperparameters as TensorBoard event files into the run
    directory (``trainer.log_dir``), from global rank 0. No options."""

    hookloop_name = "tensorboard"
    hookloop_role = "observer"

    def __init__(self):
        _require_tensorboard()
        self.writer = None
        self._tags: dict[str, None] = {}  # every metric written, in order
        self._failed = False
        self._fit_ended = False

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        self._tags, self._failed, self._fit_ended = {}, False, False
        if not trainer.is_global_zero:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # found by find_spec, but does not import
            raise hookloop.MissingDependencyError(
                f"the 'tensorboard' plugin cannot import torch.utils.tensorboard ({exc}): "
                f"pip install tensorboard"
            ) from exc
        self.writer = SummaryWriter(log_dir=str(trainer.log_dir))

    @hookloop.hookimpl
    def on_log_metrics(self, metrics, step):
        if self.writer is None:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
            self._tags[name] = None

    @hookloop.hookimpl
    def on_train_epoch_end(self):
        if self.writer is not None:
            self.writer.flush()

    @hookloop.hookimpl
    def on_exception(self):
        self._failed = True

    @hookloop.hookimpl
    def on_fit_end(self):
        self._fit_ended = True

    @hookloop.hookimpl
    def teardown(self, trainer, stage):
        writer, self.writer = self.writer, None
        if writer is None:
            return
        try:
            if stage == "fit":
                self._write_hparams(writer, trainer, ok=self._fit_ended and not self._failed)
        finally:
            writer.close()

    def _write_hparams(self, writer, trainer, ok: bool) -> None:
        """The HParams dashboard's three summaries: the experiment (hyperparameter and
        metric names), the session's values, and how it ended."""
        from tensorboard.plugins.hparams.api_pb2 import STATUS_FAILURE
        from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
        from torch.utils.tensorboard.summary import hparams

        values = {
            k: v if isinstance(v, (bool, int, float, str)) else str(v)
            for k, v in hookloop.run_hparams(trainer, flat=True).items()
        }
        experiment, session_start, session_end = hparams(values, dict.fromkeys(self._tags, 0.0))
        if not ok:  # torch writes every session as a success
            plugin_data = session_end.value[0].metadata.plugin_data
            content = HParamsPluginData.FromString(plugin_data.content)
            content.session_end_info.status = STATUS_FAILURE
            plugin_data.content = content.SerializeToString()
        for summary in (experiment, session_start, session_end):
            writer.file_writer.add_summary(summary)
