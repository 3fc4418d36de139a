"""Logger objects with Lightning's arguments (issue 18): ``Trainer(logger=CSVLogger(save_dir,
name, version))``, ``TensorBoardLogger(...)``, ``MLFlowLogger(...)`` or a list of them.

Every comparison runs pytorch-lightning 2.6.6 on the same module code with the same
logger arguments (only the imports differ, as a user ports a script) and reads what each
wrote with the library's own reader: the CSV file, ``hparams.yaml``, TensorBoard's
``EventAccumulator``, MLflow's ``MlflowClient``. The one difference the comparisons
allow is documented in docs/decisions.md: a training row's ``step`` is
``trainer.global_step`` in hookloop and one less in Lightning.
"""

from __future__ import annotations

import csv
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

EPOCHS, SAMPLES, BATCH = 2, 12, 4


def framework(name: str):
    """The names a ported script imports: (module base class, Trainer, loggers namespace)."""
    if name == "lightning":
        import pytorch_lightning as pl

        warnings.filterwarnings("ignore", message=r".*(num_workers|does not have many workers|LitLogger|litlogger|log_every_n_steps|Experiment with name).*")
        os.environ.setdefault("PL_DISABLE_FORK", "1")
        return pl.LightningModule, pl.Trainer, pl.loggers
    import hookloop_mlflow
    import hookloop_tensorboard

    loggers = type("loggers", (), {"CSVLogger": hookloop.CSVLogger,
                                   "TensorBoardLogger": hookloop_tensorboard.TensorBoardLogger,
                                   "MLFlowLogger": hookloop_mlflow.MLFlowLogger})
    return hookloop.Module, hookloop.Trainer, loggers


def make_module(base, histogram: bool = False):
    class Regression(base):
        def __init__(self, lr: float = 0.05, width: int = 3, note: str = "port"):
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(0)
            self.net = nn.Linear(width, 1)
            self.seen = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            if batch_idx == 0:
                if histogram:
                    self.logger.experiment.add_histogram("weights", self.net.weight, self.global_step)
                self.seen.update(log_dir=self.logger.log_dir, loggers=len(self.loggers),
                                 version=self.logger.version, name=self.logger.name)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    return Regression()


def loaders():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 3, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH), DataLoader(TensorDataset(x[:8], y[:8]), batch_size=BATCH)


def fit(name: str, root: Path, make_loggers, histogram: bool = False, **trainer_kw):
    """Train under framework ``name`` with the loggers ``make_loggers(loggers namespace)``."""
    base, trainer_cls, loggers = framework(name)
    module = make_module(base, histogram)
    kw = dict(max_epochs=EPOCHS, log_every_n_steps=1, logger=make_loggers(loggers), enable_progress_bar=False,
              enable_checkpointing=False, default_root_dir=str(root), num_sanity_val_steps=0, **trainer_kw)
    if name == "lightning":
        kw.update(accelerator="cpu", devices=1, enable_model_summary=False)
    trainer = trainer_cls(**kw)
    trainer.fit(module, *loaders())
    return trainer, module


def csv_rows(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), [dict(r) for r in reader]


def lightning_steps(rows: list[dict]) -> list[dict]:
    """hookloop's rows of a fit with Lightning's steps (decisions.md: one less, in the
    training rows and the validation rows between them)."""
    return [{**r, "step": str(int(r["step"]) - 1)} for r in rows]


def both(tmp_path, make_loggers, **kw):
    """The same fit under Lightning (in tmp_path/pl) and hookloop (in tmp_path/hl)."""
    out = {}
    for name, sub in (("lightning", "pl"), ("hookloop", "hl")):
        (tmp_path / sub).mkdir(exist_ok=True)
        out[name] = fit(name, tmp_path / sub, lambda loggers: make_loggers(loggers, tmp_path / sub), **kw)
    return out


def relative(path, root: Path) -> str:
    return str(Path(path).relative_to(root))


# ---------------------------------------------------------------------------------------
# CSVLogger
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [None, 7, "custom"])
def test_csv_logger_files_as_lightning(tmp_path, version):
    """metrics.csv and hparams.yaml, where Lightning puts them and with its content; a
    version counted as Lightning counts (next free, after the version_3 already there)."""
    for sub in ("pl", "hl"):
        for existing in ("version_0", "version_3"):
            (tmp_path / sub / "exp" / existing).mkdir(parents=True)
    runs = both(tmp_path, lambda loggers, root: loggers.CSVLogger(root, name="exp", version=version, prefix="p"))
    (pl_trainer, pl_module), (hl_trainer, hl_module) = runs["lightning"], runs["hookloop"]
    expected_dir = {None: "exp/version_4", 7: "exp/version_7", "custom": "exp/custom"}[version]
    assert relative(pl_trainer.logger.log_dir, tmp_path / "pl") == expected_dir  # the reference agrees
    assert relative(hl_trainer.logger.log_dir, tmp_path / "hl") == expected_dir
    assert relative(hl_trainer.log_dir, tmp_path / "hl") == relative(pl_trainer.log_dir, tmp_path / "pl")
    assert hl_trainer.logger.version == pl_trainer.logger.version
    assert hl_module.seen["version"] == pl_module.seen["version"] and hl_module.seen["loggers"] == 1
    assert relative(hl_module.seen["log_dir"], tmp_path / "hl") == relative(pl_module.seen["log_dir"], tmp_path / "pl")
    pl_dir, hl_dir = Path(pl_trainer.logger.log_dir), Path(hl_trainer.logger.log_dir)
    pl_columns, pl_rows = csv_rows(pl_dir / "metrics.csv")
    hl_columns, hl_rows = csv_rows(hl_dir / "metrics.csv")
    assert hl_columns == pl_columns == ["p-epoch", "p-train_loss", "p-val_loss", "step"]
    assert len(pl_rows) == EPOCHS * (SAMPLES // BATCH + 1)
    for got, want in zip(lightning_steps(hl_rows), pl_rows, strict=True):
        assert got.keys() == want.keys()
        assert got["step"] == want["step"] and got["p-epoch"] == want["p-epoch"]
        for key in ("p-train_loss", "p-val_loss"):
            assert (got[key] == "") == (want[key] == "")
            if want[key]:
                assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-6)
    assert (hl_dir / "hparams.yaml").read_text() == (pl_dir / "hparams.yaml").read_text()
    assert (hl_dir / "hparams.yaml").read_text() == "lr: 0.05\nnote: port\nwidth: 3\n"
