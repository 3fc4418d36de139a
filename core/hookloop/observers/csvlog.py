"""``csv``: every logged metric in ``<run dir>/metrics.csv``, and ``hparams.yaml``.

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

import hookloop


class CSVLogger:
    """The CSV logger (built in: ``no:csv`` or ``Trainer(logger=False)`` turn it off).

    filename: the file's name in the run directory ("metrics.csv")
    """

    hookloop_name = "csv"
    hookloop_role = "observer"

    def __init__(self, filename: str = "metrics.csv"):
        self.filename = filename
        self.path: Path | None = None
        self.columns: list[str] = ["step", "epoch"]
        self.rows: list[dict] = []

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        if not trainer.is_global_zero:
            return
        path = Path(trainer.log_dir) / self.filename
        if self.path != path:  # a new run directory: a new file (a resumed one: below)
            self.path, self.columns, self.rows = path, ["step", "epoch"], []
            if path.is_file():
                self._read()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a"):
                pass
        except OSError as exc:
            raise hookloop.ConfigurationError(
                f"the csv logger cannot write {str(path)!r} ({exc.strerror or exc}): make "
                f"default_root_dir writable, or choose another (Trainer(default_root_dir=...)), or "
                f"turn the CSV log off (Trainer(logger=False) or --plugins no:csv)"
            ) from None
        if stage == "fit":
            self._write_hparams(trainer)

    def _read(self) -> None:
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            self.columns = list(reader.fieldnames or ["step", "epoch"])
            self.rows = [dict(row) for row in reader]

    def _write_hparams(self, trainer) -> None:
        document = hookloop.run_hparams(trainer)
        try:
            import yaml

            text, name = yaml.safe_dump(document, sort_keys=True), "hparams.yaml"
        except ImportError:  # pragma: no cover - pyyaml is a core dependency
            text, name = json.dumps(document, indent=2, sort_keys=True), "hparams.json"
        hookloop.atomic_write_text(self.path.parent / name, text)

    @hookloop.hookimpl
    def on_log_metrics(self, trainer, metrics, step, epoch):
        if not trainer.is_global_zero or self.path is None:
            return
        row = {"step": step, "epoch": epoch, **metrics}
        new = [k for k in row if k not in self.columns]
        self.rows.append(row)
        if new or not self.path.is_file() or self.path.stat().st_size == 0:
            self.columns += new
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

    @hookloop.hookimpl
    def on_save_checkpoint(self, trainer, checkpoint):
        """How many rows the file had at this checkpoint, and which file. A checkpoint
        written in ``on_train_batch_end`` counts the step's row the loop writes right after
        that event (``trainer.step_row_pending``): the resumed run starts after that step
        and would not write it again."""
        if self.path is not None:
            rows = len(self.rows) + (1 if trainer.step_row_pending else 0)
            checkpoint["plugins"]["csv"] = {"path": str(self.path), "rows": rows}

    @hookloop.hookimpl
    def on_load_checkpoint(self, trainer, checkpoint):
        """Resuming into the same file (a restart): drop the rows written after the
        checkpoint, which the resumed run writes again."""
        state = checkpoint.get("plugins", {}).get("csv")
        if not trainer.is_global_zero or not state or self.path is None or state["path"] != str(self.path):
            return
        if len(self.rows) > state["rows"]:
            self.rows = self.rows[: state["rows"]]
            self._rewrite()

