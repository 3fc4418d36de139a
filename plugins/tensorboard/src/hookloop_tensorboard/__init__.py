"""``tensorboard``: every logged metric and the run's hyperparameters, as TensorBoard
event files in the run directory (``<default_root_dir>/logs/version_N/``), or, constructed
with Lightning's arguments (``TensorBoardLogger(save_dir, name, version, ...)``, passed as
``Trainer(logger=...)``), where Lightning's TensorBoardLogger writes them and as it does.

Scalars: one per metric of every ``on_log_metrics`` row, at the row's step. Hyperparameters:
``hookloop.run_hparams(trainer)`` flattened (``trainer/max_epochs``, ``module/lr``), written
for TensorBoard's HParams dashboard at the end of ``fit`` (also after an exception, with
the session marked failed), with every logged metric as the session's metrics (the
dashboard shows each one's last value). Written by global rank 0 only; flushed at the end
of every training epoch, closed at teardown.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import hookloop
import hookloop.lightning.loggers
from hookloop.lightning.loggers import DummyExperiment, VersionedDirectory, add_prefix, flatten_dict, save_hparams_yaml

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


class TensorBoardLogger(VersionedDirectory):
    """Write metrics and hyperparameters as TensorBoard event files, from global rank 0.

    ``TensorBoardLogger()`` (``plugins=["tensorboard"]``): into the run directory
    (``trainer.log_dir``), every metric at its step, the run's settings for the HParams
    dashboard at the end of ``fit``.

    ``TensorBoardLogger(save_dir, name="lightning_logs", version=None, log_graph=False,
    default_hp_metric=True, prefix="", sub_dir=None, **kwargs)``, Lightning's arguments,
    passed as ``Trainer(logger=...)``: into ``save_dir/name/version_N[/sub_dir]`` as
    Lightning's logger writes there: every metric (``prefix-name``) and ``epoch`` at the
    row's step; at the start of every stage the module's (and DataModule's) ``hparams``
    for the HParams dashboard with ``hp_metric`` -1 at step 0 (``default_hp_metric``), the
    model's graph (``log_graph``, from ``example_input_array``); ``hparams.yaml`` in
    ``log_dir``. ``kwargs`` go to ``SummaryWriter``.

    ``experiment`` is the ``torch.utils.tensorboard.SummaryWriter`` (``add_image``,
    ``add_histogram``...), on global rank 0; elsewhere a stand-in that does nothing.
    """

    hookloop_name = "tensorboard"
    hookloop_role = "observer"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self, save_dir: Any = None, name: str | None = "lightning_logs", version: int | str | None = None,
                 log_graph: bool = False, default_hp_metric: bool = True, prefix: str = "",
                 sub_dir: Any = None, **kwargs: Any):
        self._init_args = hookloop.lightning.loggers.init_args(locals())
        _require_tensorboard()
        self._init_directory(save_dir, name, version, sub_dir)
        for option, value in (("log_graph", log_graph), ("default_hp_metric", default_hp_metric)):
            if not isinstance(value, bool):
                raise hookloop.ConfigurationError(f"TensorBoardLogger({option}={value!r}) must be True or False")
        self.log_graph_enabled, self.default_hp_metric = log_graph, default_hp_metric
        self.prefix = "" if prefix is None else str(prefix)
        self.kwargs = kwargs
        self.hparams: dict = {}
        self.writer = None
        self._closed = None  # the writer finalize closed (Lightning's experiment after the run)
        self._tags: dict[str, None] = {}  # every metric written, in order
        self._failed = False
        self._fit_ended = False

    @property
    def _lightning(self) -> bool:
        """Constructed with Lightning's ``save_dir``: Lightning's layout and contents."""
        return self._save_dir is not None

    @property
    def experiment(self) -> Any:
        """The ``SummaryWriter`` (created on first use, as Lightning's), global rank 0 only."""
        if not hookloop.lightning.loggers.is_rank_zero():
            return DummyExperiment()
        if self.writer is None and self._closed is not None:
            return self._closed  # closed by finalize: it opens a new event file if written to, as Lightning's
        if self.writer is None:
            if self.log_dir is None:
                raise hookloop.ConfigurationError(
                    "TensorBoardLogger() without save_dir writes into a run's directory: use "
                    "logger.experiment during a run, or give it one (TensorBoardLogger(save_dir, name))")
            self.writer = _summary_writer(self.log_dir, self.kwargs)
        return self.writer

    # -- Lightning's logger methods ------------------------------------------------------

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        """One scalar per metric (``prefix-name``) at ``step``; global rank 0 only."""
        if not hookloop.lightning.loggers.is_rank_zero():
            return
        writer = self.experiment
        for name, value in add_prefix(dict(metrics), self.prefix).items():
            value = value.item() if hasattr(value, "item") and callable(value.item) else value
            if isinstance(value, dict):
                writer.add_scalars(name, value, step)
            else:
                writer.add_scalar(name, value, step)
                self._tags[name] = None

    def log_hyperparams(self, params: Any, metrics: dict | None = None, step: int | None = None) -> None:
        """The HParams dashboard's summaries for ``params`` (flattened with ``/``) with
        ``metrics`` (default ``{"hp_metric": -1}`` with ``default_hp_metric``), as
        Lightning's; ``params`` also go to ``hparams.yaml``. Global rank 0 only."""
        if not hookloop.lightning.loggers.is_rank_zero():
            return
        params = vars(params) if hasattr(params, "__dict__") and not isinstance(params, dict) else dict(params or {})
        self.hparams.update(params)
        flat = {k: str(v) if hasattr(v, "ndim") and v.ndim > 1 else _hparam_value(v)
                for k, v in flatten_dict(params).items()}
        if metrics is None:
            metrics = {"hp_metric": -1} if self.default_hp_metric else None
        elif not isinstance(metrics, dict):
            metrics = {"hp_metric": metrics}
        if metrics:
            self.log_metrics(metrics, step)
            from torch.utils.tensorboard.summary import hparams

            experiment, session_start, session_end = hparams(flat, metrics)
            writer = self.experiment._get_file_writer()
            for summary in (experiment, session_start, session_end):
                writer.add_summary(summary, step)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """The model's graph, traced with ``input_array`` (default: the module's
        ``example_input_array``), when constructed with ``log_graph=True``."""
        if not self.log_graph_enabled or not hookloop.lightning.loggers.is_rank_zero():
            return
        input_array = getattr(model, "example_input_array", None) if input_array is None else input_array
        if input_array is None:
            hookloop.rank_zero_warn("Could not log computational graph to TensorBoard: the model's "
                                    "example_input_array is not set and no input_array was given")
            return
        self.experiment.add_graph(model, input_array)

    def save(self) -> None:
        """Flush the events; write ``hparams.yaml`` into ``log_dir`` once (Lightning's)."""
        if self.writer is None or not hookloop.lightning.loggers.is_rank_zero():
            return
        self.writer.flush()
        path = Path(self.log_dir) / "hparams.yaml"
        if self._lightning and path.parent.is_dir() and not path.is_file():
            save_hparams_yaml(path, self.hparams)

    def finalize(self, status: str) -> None:
        """Close the event file ("success": after writing ``hparams.yaml``)."""
        if self.writer is None:
            return
        if status == "success":
            self.save()
        writer, self.writer = self.writer, None
        writer.flush()
        writer.close()
        self._closed = writer

    def __getstate__(self) -> dict:
        """Without the writer (a spawned worker opens its own)."""
        return {**self.__dict__, "writer": None, "_closed": None}

    # -- hooks -----------------------------------------------------------------------

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        self._tags, self._failed, self._fit_ended = {}, False, False
        if not trainer.is_global_zero:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as exc:  # found by find_spec, but does not import
            raise hookloop.MissingDependencyError(
                f"the 'tensorboard' plugin cannot import torch.utils.tensorboard ({exc}): "
                f"pip install tensorboard"
            ) from exc
        self._adopt_run_dir(trainer)
        if not self._lightning:
            self.writer = _summary_writer(self.log_dir, self.kwargs)
            return
        self.writer, self._closed = self._closed, None  # Lightning's: the same writer in every stage
        self.experiment  # noqa: B018 - the writer, for the rows and the module's own calls
        # Lightning: hyperparameters, graph and a save at the start of every stage
        params = hookloop.lightning.loggers.lightning_hparams(trainer)
        if params is not None:
            self.log_hyperparams(params)
        self.log_graph(trainer.module)
        self.save()

    @hookloop.hookimpl
    def on_log_metrics(self, metrics, step, epoch):
        if self.writer is None:
            return
        if self._lightning:  # Lightning's row: the metrics and the epoch
            self.log_metrics({**metrics, "epoch": epoch}, step)
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
        if self.writer is None:
            return
        if self._lightning:
            self.finalize("failed" if self._failed else "success")
            return
        writer, self.writer = self.writer, None
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


def _summary_writer(log_dir: str, kwargs: dict) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return SummaryWriter(log_dir=str(log_dir), **kwargs)


def _hparam_value(value: Any) -> Any:
    """What TensorBoard's hparams summary takes: a bool, a number, a string (a tensor's
    item; ``None`` and anything else as text, as Lightning's ``_sanitize_params``)."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
