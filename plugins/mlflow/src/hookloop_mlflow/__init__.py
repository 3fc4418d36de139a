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
import hookloop.lightning.loggers

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


class MLFlowLogger(hookloop.lightning.loggers.ConstructorOptions):
    """Log the run to MLflow: parameters, metrics by step, best and last checkpoints.

    Lightning's arguments, in Lightning's order (``Trainer(logger=MLFlowLogger(...))``, or
    ``plugins=["mlflow"]`` with ``--plugin-option mlflow.NAME=VALUE``):

    experiment_name: the experiment, created when missing (default "lightning_logs")
    run_name: the run's name (default: MLflow's generated name)
    tracking_uri: where runs go (default: MLFLOW_TRACKING_URI, else ``file:<save_dir>``
        when ``save_dir`` is given, else ``sqlite:///<default_root_dir>/mlflow.db`` with
        artifacts in ``<default_root_dir>/mlartifacts``)
    tags: tags of the new run
    save_dir: a local file store (``file:<save_dir>``, Lightning's ``./mlruns``; MLflow 3
        wants ``MLFLOW_ALLOW_FILE_STORE=true`` for one)
    log_model: Lightning's option; checkpoints are logged at the end of fit when it or
        ``log_checkpoints`` is true
    prefix: put before every metric name (``prefix-name``)
    artifact_location: the artifact location of an experiment this creates
    run_id: log into this existing run instead of a new one
    synchronous: MLflow's ``log_batch(synchronous=...)`` (default None: MLflow's own
        default, which waits for each batch)
    log_checkpoints: log the best and last checkpoints as artifacts at the end of fit
        (default True; False for checkpoints too large to copy)

    ``experiment`` is the ``MlflowClient`` (global rank 0; elsewhere a stand-in that does
    nothing), ``run_id``/``experiment_id`` the run's, ``name``/``version`` Lightning's
    aliases of those.
    """

    hookloop_name = "mlflow"
    hookloop_role = "observer"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self, experiment_name: str = "lightning_logs", run_name: str | None = None,
                 tracking_uri: str | None = None, tags: dict | None = None, save_dir: str | os.PathLike | None = None,
                 log_model: bool | str = False, prefix: str = "", artifact_location: str | None = None,
                 run_id: str | None = None, synchronous: bool | None = None, log_checkpoints: bool = True):
        self._init_args = hookloop.lightning.loggers.init_args(locals())
        _require("mlflow", "mlflow")
        if save_dir is not None and not tracking_uri:
            tracking_uri = f"file:{os.fspath(save_dir)}"
        if not (tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")):  # the default: MLflow's SQL store
            _require("sqlalchemy", "sqlalchemy alembic")
            _require("alembic", "sqlalchemy alembic")
        if experiment_name is None or str(experiment_name) == "":
            raise hookloop.ConfigurationError("mlflow experiment_name must be a non-empty name (default 'lightning_logs')")
        if not isinstance(log_checkpoints, bool):
            raise hookloop.ConfigurationError(f"mlflow log_checkpoints={log_checkpoints!r} must be true or false")
        if log_model not in (True, False, "all"):
            raise hookloop.ConfigurationError(f"mlflow log_model={log_model!r} must be True, False or 'all'")
        if tags is not None and not isinstance(tags, dict):
            raise hookloop.ConfigurationError(f"mlflow tags={tags!r} must be a dict of names to values")
        # str(): from the command line, run_name=2024 arrives as a number
        self.tracking_uri, self.experiment_name = tracking_uri, str(experiment_name)
        self.run_name = None if run_name is None else str(run_name)
        self.log_checkpoints = log_checkpoints or bool(log_model)
        self.tags, self.prefix, self.artifact_location = dict(tags or {}), "" if prefix is None else str(prefix), artifact_location
        self.synchronous = synchronous
        self.client = None
        self.run_id: str | None = run_id
        self.experiment_id: str | None = None
        self._given_run_id = run_id
        self._run_dir = None  # the trainer.log_dir the run belongs to (fit, then test: one run)
        self._failed = self._ended = False

    # -- Lightning's logger properties and methods -----------------------------------------

    @property
    def experiment(self):
        """The ``MlflowClient`` of the run (global rank 0; a stand-in elsewhere)."""
        if not hookloop.lightning.loggers.is_rank_zero():
            return hookloop.lightning.loggers.DummyExperiment()
        if self.client is None:
            from mlflow.tracking import MlflowClient

            uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            if not uri:
                raise hookloop.ConfigurationError(
                    "MLFlowLogger's default store is under the run's default_root_dir: use logger.experiment "
                    "during a run, or give a tracking_uri (or save_dir)")
            return MlflowClient(tracking_uri=uri)
        return self.client

    @property
    def name(self) -> str | None:
        """The experiment's id (Lightning's ``name``)."""
        return self.experiment_id

    @property
    def version(self) -> str | None:
        """The run's id (Lightning's ``version``)."""
        return self.run_id

    @property
    def save_dir(self) -> str | None:
        """The local directory of a ``file:`` tracking URI, else ``None``."""
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
        return uri[len("file:"):] if uri.startswith("file:") else None

    root_dir = None
    log_dir = None

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        """Log ``metrics`` (names with ``prefix``) at ``step`` into the run; rank 0, in a run."""
        if self.client is None or not hookloop.lightning.loggers.is_rank_zero():
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(_NOT_IN_NAMES.sub("_", k), float(v.item() if hasattr(v, "item") else v), now, step or 0)
                for k, v in hookloop.lightning.loggers.add_prefix(dict(metrics), self.prefix).items() if not isinstance(v, str)]
        self.client.log_batch(self.run_id, metrics=rows, **self._batch_options())

    def log_hyperparams(self, params) -> None:
        """Log ``params`` (flattened with ``/``) as the run's parameters; rank 0, in a run."""
        if self.client is None or not hookloop.lightning.loggers.is_rank_zero():
            return
        params = vars(params) if hasattr(params, "__dict__") and not isinstance(params, dict) else dict(params or {})
        self._log_params(hookloop.lightning.loggers.flatten_dict(params))

    def log_graph(self, model, input_array=None) -> None:
        """Lightning's ``log_graph``: nothing for MLflow."""

    def save(self) -> None:
        """Everything is sent when logged: nothing to do."""

    def finalize(self, status: str = "success") -> None:
        """End the run: "success"/"finished" as FINISHED, "failed" as FAILED."""
        if self.client is None:
            return
        client, self.client = self.client, None
        client.set_terminated(self.run_id, status="FAILED" if status == "failed" else "FINISHED")

    def _batch_options(self) -> dict:
        return {} if self.synchronous is None else {"synchronous": self.synchronous}

    def _log_params(self, flat: dict) -> None:
        from mlflow.entities import Param

        params = [Param(_NOT_IN_NAMES.sub("_", k), str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100], **self._batch_options())

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
        if self._given_run_id is not None:  # Lightning's run_id: log into that run
            run = client.get_run(self._given_run_id)
            self.experiment_id = run.info.experiment_id
            client.update_run(run.info.run_id, status="RUNNING")
            return run.info.run_id
        experiment = client.get_experiment_by_name(self.experiment_name)
        if experiment is not None and experiment.lifecycle_stage != "deleted":
            experiment_id = experiment.experiment_id
        else:
            experiment_id = client.create_experiment(self.experiment_name,
                                                     artifact_location=self.artifact_location or artifacts)
        self.experiment_id = experiment_id
        tags = {**{k: str(v) for k, v in self.tags.items()}, "hookloop.log_dir": str(trainer.log_dir)}
        run = client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        self.client = client
        self._log_params(hookloop.run_hparams(trainer, flat=True))
        return run.info.run_id

    @hookloop.hookimpl
    def on_log_metrics(self, metrics, step, epoch):
        """The row, with ``epoch`` as Lightning's rows have it."""
        if self.client is not None:
            self.log_metrics({**metrics, "epoch": epoch}, step)

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
