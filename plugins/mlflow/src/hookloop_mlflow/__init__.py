"""``mlflow``: a run's parameters, metrics and checkpoints, as an MLflow run.

Parameters: ``hookloop.run_hparams(trainer)`` flattened (``trainer/max_epochs``,
``module/lr``), logged when the run starts (``setup``). Metrics: every ``on_log_metrics``
row, at its step. Checkpoints: at the end of ``fit``, the checkpoint observer's best and
last checkpoints (``trainer.checkpoint_callback``) as artifacts under ``checkpoints/``
(a sharded checkpoint directory, DeepSpeed's, as a directory). The run ends FINISHED, or
FAILED when the stage raised. Global rank 0 only.

Tracking URI: the ``tracking_uri`` option, else ``MLFLOW_TRACKING_URI``, else an SQLite
database ``<default_root_dir>/mlflow.db`` with artifacts in ``<default_root_dir>/mlartifacts``
(MLflow 3 refuses its ``./mlruns`` file store unless told otherwise, and defaults to
``sqlite:///mlflow.db`` itself; ``cd <default_root_dir> && mlflow ui`` opens it).
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path

import hookloop

__all__ = ["MLFlowLogger"]

_NOT_IN_NAMES = re.compile(r"[^\w\-. /:]")  # what MLflow allows in metric and param names


def _require(module: str, package: str) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if not found:
        raise hookloop.MissingDependencyError(
            f"the 'mlflow' plugin needs the {module} package, which is not installed: pip install {package} "
            f"(or pip install hookloop-mlflow, which depends on it)"
        )


class MLFlowLogger:
    """Log the run to MLflow: parameters, metrics by step, best and last checkpoints.

    tracking_uri: where runs go (default: MLFLOW_TRACKING_URI, else
        ``sqlite:///<default_root_dir>/mlflow.db`` with artifacts in ``<default_root_dir>/mlartifacts``)
    experiment_name: the experiment, created when missing (default "hookloop")
    run_name: the run's name (default: MLflow's generated name)
    log_checkpoints: log the best and last checkpoints as artifacts at the end of fit
        (default True; False for checkpoints too large to copy)
    """

    hookloop_name = "mlflow"
    hookloop_role = "observer"

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "hookloop",
                 run_name: str | None = None, log_checkpoints: bool = True):
        _require("mlflow", "mlflow")
        if not (tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")):  # the default: MLflow's SQL store
            _require("sqlalchemy", "sqlalchemy alembic")
            _require("alembic", "sqlalchemy alembic")
        if experiment_name is None or str(experiment_name) == "":
            raise hookloop.ConfigurationError("mlflow experiment_name must be a non-empty name (default 'hookloop')")
        if not isinstance(log_checkpoints, bool):
            raise hookloop.ConfigurationError(f"mlflow log_checkpoints={log_checkpoints!r} must be true or false")
        # str(): from the command line, run_name=2024 arrives as a number
        self.tracking_uri, self.experiment_name = tracking_uri, str(experiment_name)
        self.run_name, self.log_checkpoints = None if run_name is None else str(run_name), log_checkpoints
        self.client = None
        self.run_id: str | None = None
        self._run_dir = None  # the trainer.log_dir the run belongs to (fit, then test: one run)
        self._failed = self._ended = False

    # -- the run --------------------------------------------------------------------------

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        self._failed, self._ended = False, stage != "fit"  # fit ends normally in on_fit_end
        if not trainer.is_global_zero:
            return
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        root = Path(trainer.default_root_dir).resolve()
        artifacts = None  # the tracking store's default
        if not uri:
            uri, artifacts = f"sqlite:///{root / 'mlflow.db'}", (root / "mlartifacts").as_uri()
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            root.mkdir(parents=True, exist_ok=True)
            client = MlflowClient(tracking_uri=uri)
            if self.run_id is not None and self._run_dir == trainer.log_dir:
                client.update_run(self.run_id, status="RUNNING")  # the same trainer again (fit, then test)
            else:
                self.run_id = self._start_run(client, trainer, artifacts)
                self._run_dir = trainer.log_dir
        except (MlflowException, OSError) as exc:
            raise hookloop.ConfigurationError(
                f"the mlflow plugin cannot start a run at tracking_uri={uri!r}: {exc}; set the plugin option "
                f"(--plugin-option mlflow.tracking_uri=...) or MLFLOW_TRACKING_URI to a tracking store you can write"
            ) from exc
        self.client = client

    def _start_run(self, client, trainer, artifacts: str | None) -> str:
        experiment = client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = client.create_experiment(self.experiment_name, artifact_location=artifacts)
        run = client.create_run(experiment_id, run_name=self.run_name, tags={"hookloop.log_dir": str(trainer.log_dir)})
        from mlflow.entities import Param

        params = [Param(_NOT_IN_NAMES.sub("_", k), str(v)[:6000])
                  for k, v in hookloop.run_hparams(trainer, flat=True).items()]
        client.log_batch(run.info.run_id, params=params)
        return run.info.run_id

    @hookloop.hookimpl
    def on_log_metrics(self, metrics, step):
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(_NOT_IN_NAMES.sub("_", k), v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=rows)

    @hookloop.hookimpl
    def on_exception(self):
        self._failed = True

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        """Checkpoints are complete here: the checkpoint observer saved its last in
        ``on_train_end``, which runs before."""
        self._ended = True
        callback = trainer.checkpoint_callback
        if self.client is None or not self.log_checkpoints or callback is None:
            return
        for path in dict.fromkeys(p for p in (callback.best_model_path, callback.last_model_path) if p):
            if os.path.isdir(path):
                self.client.log_artifacts(self.run_id, path, artifact_path=f"checkpoints/{os.path.basename(path)}")
            elif os.path.isfile(path):
                self.client.log_artifact(self.run_id, path, artifact_path="checkpoints")

    @hookloop.hookimpl
    def teardown(self):
        client, self.client = self.client, None
        if client is None:
            return
        # FAILED also when fit never reached on_fit_end without raising in it (a plugin's
        # setup raised, a KeyboardInterrupt): on_exception is not called for those
        client.set_terminated(self.run_id, status="FINISHED" if self._ended and not self._failed else "FAILED")
