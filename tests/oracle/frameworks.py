"""The two frameworks the oracle runs the same module code under.

``load("lightning")`` and ``load("hookloop")`` return a `Framework` with the names a
Lightning script imports (``LightningModule``, ``seed_everything``, ``EarlyStopping``,
``ModelCheckpoint``) and a ``trainer(...)`` that builds the framework's Trainer with the
same run settings. Everything a case observes is taken through `Framework` methods, so a
case's code is one text run twice with only its imports changed, as a user would port it.

hookloop itself never imports pytorch_lightning; only this test harness does.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

# Every callback event that both frameworks send (hookloop's names are Lightning's).
EVENTS = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
    "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end",
    "on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end",
    "on_test_batch_start", "on_test_batch_end",
    "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end",
    "on_predict_batch_start", "on_predict_batch_end",
)


def _float(v: Any) -> float:
    return float(v.item() if hasattr(v, "item") else v)


class Framework:
    name: str

    def metrics(self, trainer) -> dict:
        return {k: _float(v) for k, v in trainer.callback_metrics.items()}

    def csv_entries(self, trainer) -> list:
        """Every logged value as (step, epoch, key, value), sorted: the CSV log's content
        independent of how a framework groups values into rows."""
        path = Path(self.log_dir(trainer)) / "metrics.csv"
        if not path.is_file():
            return []
        out = []
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step, epoch = int(row.pop("step")), row.pop("epoch")
                epoch = int(epoch) if epoch not in ("", None) else None
                out += [(step, epoch, k, float(v)) for k, v in row.items() if v not in ("", None)]
        return sorted(out, key=lambda e: (e[0], -1 if e[1] is None else e[1], e[2], e[3]))


class Lightning(Framework):
    name = "lightning"

    def __init__(self):
        import warnings

        import pytorch_lightning as pl

        warnings.filterwarnings("ignore")
        os.environ.setdefault("PL_DISABLE_FORK", "1")
        self.pl = pl
        self.LightningModule = pl.LightningModule
        self.LightningDataModule = pl.LightningDataModule
        self.seed_everything = lambda s: pl.seed_everything(s, verbose=False)
        self.EarlyStopping = pl.callbacks.EarlyStopping
        self.ModelCheckpoint = pl.callbacks.ModelCheckpoint
        self.Callback = pl.Callback
        self.BaseFinetuning = pl.callbacks.BaseFinetuning
        self.BasePredictionWriter = pl.callbacks.BasePredictionWriter
        self.GradientAccumulationScheduler = pl.callbacks.GradientAccumulationScheduler

    def trainer(self, root: str, ddp: bool, callbacks=(), checkpointing: bool = False, **kw):
        from pytorch_lightning.loggers import CSVLogger

        cbs = list(callbacks)
        return self.pl.Trainer(
            accelerator="cpu", devices=2 if ddp else 1, strategy="ddp" if ddp else "auto",
            default_root_dir=root, logger=CSVLogger(root, name="lightning"), callbacks=cbs,
            enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=checkpointing or any(isinstance(c, self.ModelCheckpoint) for c in cbs),
            **kw)

    def recorder(self, log: list):
        cls = type("Recorder", (self.pl.Callback,), {
            name: (lambda n: lambda self, *a, **k: log.append("cb:" + n))(name) for name in EVENTS})
        return cls()

    def log_dir(self, trainer) -> str:
        return trainer.logger.log_dir


class Hookloop(Framework):
    name = "hookloop"

    def __init__(self):
        import hookloop

        self.hl = hookloop
        self.LightningModule = hookloop.Module
        self.LightningDataModule = hookloop.DataModule
        self.seed_everything = hookloop.seed_everything
        self.EarlyStopping = hookloop.EarlyStopping
        self.ModelCheckpoint = hookloop.ModelCheckpoint
        self.Callback = hookloop.Callback
        self.BaseFinetuning = hookloop.BaseFinetuning
        self.BasePredictionWriter = hookloop.BasePredictionWriter
        self.GradientAccumulationScheduler = hookloop.GradientAccumulationScheduler

    def trainer(self, root: str, ddp: bool, callbacks=(), checkpointing: bool = False, **kw):
        cbs = list(callbacks)
        return self.hl.Trainer(
            plugins=["ddp"] if ddp else [], devices=2 if ddp else 1, accelerator="cpu",
            default_root_dir=root, callbacks=cbs, enable_progress_bar=False,
            enable_checkpointing=checkpointing or any(isinstance(c, self.ModelCheckpoint) for c in cbs),
            **kw)

    def recorder(self, log: list):
        hookimpl = self.hl.hookimpl

        def impl(name):
            def f(self, trainer):
                log.append("cb:" + name)
            f.__name__ = name
            return hookimpl(specname=name)(f)

        body = {"hookloop_role": "observer", "hookloop_name": "oracle_recorder"}
        body.update({name: impl(name) for name in EVENTS})
        return type("Recorder", (), body)()

    def log_dir(self, trainer) -> str:
        return trainer.log_dir


def load(name: str) -> Framework:
    return {"lightning": Lightning, "hookloop": Hookloop}[name]()
