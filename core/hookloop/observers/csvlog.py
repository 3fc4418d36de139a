"""``csv``: every logged metric in ``<run dir>/metrics.csv``, and ``hparams.yaml``
(``CSVLogger(save_dir, name, version)``: in ``save_dir/name/version_N``, as Lightning's).

One row per logging event (``on_log_metrics``): the step metrics every
``log_every_n_steps`` optimizer steps, the epoch metrics at each epoch's end, the
validation metrics at each validation's end; columns ``step``, ``epoch`` and one per
metric (the file is rewritten when a new metric appears, as Lightning's CSVLogger does).
Written by global rank 0 only. A run that resumes into the same run directory (an
elastic restart) first drops the rows written after its checkpoint, so the file has
every row once.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from hookloop.resume.checkpoint import atomic_write_text
from hookloop.contract.errors import ConfigurationError
from hookloop.helpers import run_hparams
from hookloop.contract.hookspecs import hookimpl
from hookloop.lightning.loggers import (
    DummyExperiment,
    VersionedDirectory,
    add_prefix,
    init_args,
    is_rank_zero,
    lightning_hparams,
    save_hparams_yaml,
)


class CSVLogger(VersionedDirectory):
    """The CSV logger, with Lightning's arguments (built in: ``no:csv`` or
    ``Trainer(logger=False)`` turn the default one off).

    ``CSVLogger()`` (the default one) writes ``metrics.csv`` and ``hparams.yaml`` into the
    run directory, hookloop's layout (columns ``step``, ``epoch``, then the metrics in the
    order they came; ``hparams.yaml`` with the Trainer's settings and the module's).
    ``CSVLogger(save_dir, name="lightning_logs", version=None, prefix="",
    flush_logs_every_n_steps=100)`` as Lightning's, passed as ``Trainer(logger=...)``:
    ``save_dir/name/version_N/metrics.csv`` (the next free N, or the given version; that
    directory is also the run's, ``trainer.log_dir``, when this is the first logger) with
    Lightning's columns (sorted; ``epoch`` and ``step`` among them) and metric names
    (``prefix-name``), and ``hparams.yaml`` holding what Lightning writes there (the
    module's and the DataModule's ``hparams``). Rows are written when logged (Lightning's
    trainer saves after every row too), so ``flush_logs_every_n_steps`` changes nothing.

    filename: the file's name ("metrics.csv")
    """

    hookloop_name = "csv"
    hookloop_role = "observer"

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "lightning_logs",
                 version: int | str | None = None, prefix: str = "", flush_logs_every_n_steps: int = 100,
                 *, filename: str = "metrics.csv"):
        self._init_args = init_args(locals())
        self._init_directory(save_dir, name, version)
        if not isinstance(flush_logs_every_n_steps, int) or isinstance(flush_logs_every_n_steps, bool) or flush_logs_every_n_steps < 1:
            raise ConfigurationError(
                f"CSVLogger(flush_logs_every_n_steps={flush_logs_every_n_steps!r}) must be an integer >= 1")
        self.prefix = "" if prefix is None else str(prefix)
        self.flush_logs_every_n_steps = flush_logs_every_n_steps
        self.filename = filename
        self.path: Path | None = None
        self.columns: list[str] = ["step", "epoch"]
        self.rows: list[dict] = []
        self.hparams: dict = {}

    @property
    def _lightning(self) -> bool:
        """Constructed with Lightning's ``save_dir``: Lightning's file layout."""
        return self._save_dir is not None

    @property
    def experiment(self) -> Any:
        """Lightning's experiment writer: ``log_metrics(metrics_dict, step)``,
        ``log_hparams(params)``, ``save()``, ``metrics_file_path``, ``log_dir``; on other
        ranks than global rank 0 a stand-in that does nothing."""
        if not is_rank_zero():
            return DummyExperiment()
        return _Experiment(self)

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        """Write a row of ``metrics`` (names with ``prefix``) at ``step`` (default: the
        number of rows so far), as Lightning's ``logger.log_metrics``; global rank 0 only."""
        if is_rank_zero():
            self._write({k: _number(v) for k, v in add_prefix(dict(metrics), self.prefix).items()}, step)

    def log_hyperparams(self, params: Any = None) -> None:
        """Add ``params`` (a dict or an ``argparse.Namespace``) to ``hparams.yaml``;
        global rank 0 only."""
        if not is_rank_zero():
            return
        params = vars(params) if hasattr(params, "__dict__") and not isinstance(params, dict) else dict(params or {})
        self.hparams.update(params)
        if self.log_dir is not None:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            save_hparams_yaml(Path(self.log_dir) / "hparams.yaml", self.hparams)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Lightning's ``log_graph``: nothing for a CSV file."""

    def save(self) -> None:
        """Rows are on disk when written: nothing to do."""

    def finalize(self, status: str) -> None:
        """Nothing left to write (``status``: Lightning's "success"/"failed")."""

    @hookimpl
    def setup(self, trainer, stage):
        if not trainer.is_global_zero:
            return
        self._adopt_run_dir(trainer)
        path = Path(self.log_dir) / self.filename
        if self.path != path:  # a new run directory: a new file (a resumed one: below)
            self.path, self.columns, self.rows = path, (["step"] if self._lightning else ["step", "epoch"]), []
            if path.is_file():
                self._read()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a"):
                pass
        except OSError as exc:
            raise ConfigurationError(
                f"the csv logger cannot write {str(path)!r} ({exc.strerror or exc}): make "
                f"default_root_dir (or the CSVLogger's save_dir) writable, or choose another, or "
                f"turn the CSV log off (Trainer(logger=False) or --plugins no:csv)"
            ) from None
        if self._lightning:  # Lightning logs the hyperparameters at the start of every stage
            params = lightning_hparams(trainer)
            if params is not None:
                self.log_hyperparams(params)
        elif stage == "fit":
            self._write_hparams(trainer)

    def _read(self) -> None:
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            self.columns = list(reader.fieldnames or ["step", "epoch"])
            self.rows = [dict(row) for row in reader]

    def _write_hparams(self, trainer) -> None:
        document = run_hparams(trainer)
        try:
            import yaml

            text, name = yaml.safe_dump(document, sort_keys=True), "hparams.yaml"
        except ImportError:  # pragma: no cover - pyyaml is a core dependency
            text, name = json.dumps(document, indent=2, sort_keys=True), "hparams.json"
        atomic_write_text(self.path.parent / name, text)

    @hookimpl
    def on_log_metrics(self, trainer, metrics, step, epoch):
        if not trainer.is_global_zero or self.path is None:
            return
        if self._lightning:  # Lightning's row: the metrics and the epoch, prefixed; the step
            self._write(add_prefix({**metrics, "epoch": epoch}, self.prefix), step)
        else:
            self._write({"epoch": epoch, **metrics}, step)

    def _write(self, metrics: dict, step: int | None) -> None:
        if self.path is None:  # outside a run: where the logger's directory says
            if self.log_dir is None:
                raise ConfigurationError(
                    "CSVLogger() without save_dir writes into a run's directory: call log_metrics during a "
                    "run, or give it one (CSVLogger(save_dir, name))")
            self.path = Path(self.log_dir) / self.filename
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                self._read()
        row = {"step": len(self.rows) if step is None else step, **metrics}
        new = [k for k in row if k not in self.columns]
        self.rows.append(row)
        if new or not self.path.is_file() or self.path.stat().st_size == 0:
            self.columns += new
            if self._lightning:
                self.columns.sort()
            self._rewrite()
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(row)

    def _rewrite(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)

    @hookimpl
    def on_save_checkpoint(self, trainer, checkpoint):
        """How many rows the file had at this checkpoint, and which file. A checkpoint
        written in ``on_train_batch_end`` counts the step's row the loop writes right after
        that event (``trainer.step_row_pending``): the resumed run starts after that step
        and would not write it again."""
        if self.path is not None:
            rows = len(self.rows) + (1 if trainer.step_row_pending else 0)
            checkpoint["plugins"][self.hookloop_name] = {"path": str(self.path), "rows": rows}

    @hookimpl
    def on_load_checkpoint(self, trainer, checkpoint):
        """Resuming into the same file (a restart): drop the rows written after the
        checkpoint, which the resumed run writes again."""
        state = checkpoint.get("plugins", {}).get(self.hookloop_name)
        if not trainer.is_global_zero or not state or self.path is None or state["path"] != str(self.path):
            return
        if len(self.rows) > state["rows"]:
            self.rows = self.rows[: state["rows"]]
            self._rewrite()



def _number(value: Any) -> Any:
    return value.item() if hasattr(value, "item") and callable(value.item) else value


class _Experiment:
    """``CSVLogger.experiment``: Lightning's experiment writer's methods."""

    def __init__(self, logger: CSVLogger):
        self._logger = logger

    @property
    def log_dir(self) -> str | None:
        return self._logger.log_dir

    @property
    def metrics_file_path(self) -> str | None:
        log_dir = self._logger.log_dir
        return None if log_dir is None else os.path.join(log_dir, self._logger.filename)

    @property
    def hparams(self) -> dict:
        return self._logger.hparams

    def log_metrics(self, metrics_dict: dict, step: int | None = None) -> None:
        self._logger._write({k: _number(v) for k, v in metrics_dict.items()}, step)

    def log_hparams(self, params: dict) -> None:
        self._logger.log_hyperparams(params)

    def save(self) -> None:
        pass
