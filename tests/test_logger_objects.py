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


def make_module(base, histogram: bool = False, extra_hparams: dict | None = None):
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
                if extra_hparams:
                    self.logger.log_hyperparams(extra_hparams)
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


def fit(name: str, root: Path, make_loggers, histogram: bool = False, extra_hparams: dict | None = None,
        checkpointing: bool = False, **trainer_kw):
    """Train under framework ``name`` with the loggers ``make_loggers(loggers namespace)``."""
    base, trainer_cls, loggers = framework(name)
    module = make_module(base, histogram, extra_hparams)
    kw = dict(max_epochs=EPOCHS, log_every_n_steps=1, logger=make_loggers(loggers), enable_progress_bar=False,
              enable_checkpointing=checkpointing, default_root_dir=str(root), num_sanity_val_steps=0, **trainer_kw)
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


def test_checkpoints_and_log_hyperparams_from_the_module_as_lightning(tmp_path):
    """The first logger's version directory holds the checkpoints (Lightning's
    save_dir/name/version_N/checkpoints); self.logger.log_hyperparams in a step adds to
    hparams.yaml as Lightning's does."""
    runs = both(tmp_path, lambda loggers, root: loggers.CSVLogger(root, name="ck"), checkpointing=True,
                extra_hparams={"extra": 2, "nested": {"a": 1}})
    (pl_trainer, _), (hl_trainer, _) = runs["lightning"], runs["hookloop"]
    pl_ckpt = Path(pl_trainer.checkpoint_callback.best_model_path)
    hl_ckpt = Path(hl_trainer.checkpoint_callback.best_model_path)
    assert hl_ckpt.is_file() and pl_ckpt.is_file()
    assert relative(hl_ckpt.parent, tmp_path / "hl") == relative(pl_ckpt.parent, tmp_path / "pl") == "ck/version_0/checkpoints"
    pl_text = (Path(pl_trainer.logger.log_dir) / "hparams.yaml").read_text()
    assert (Path(hl_trainer.logger.log_dir) / "hparams.yaml").read_text() == pl_text
    assert "extra: 2" in pl_text and "nested:" in pl_text


# ---------------------------------------------------------------------------------------
# TensorBoardLogger
# ---------------------------------------------------------------------------------------


def read_events(log_dir: Path) -> tuple[dict, list[str]]:
    """Every scalar as {tag: {step: value}}, and the histogram tags, read by TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    return scalars, sorted(events.Tags()["histograms"])


@pytest.mark.parametrize("sub_dir", [None, "tb"])
def test_tensorboard_logger_events_as_lightning(tmp_path, sub_dir):
    """Scalars (tags, steps, values), the module's own add_histogram through
    self.logger.experiment, hparams.yaml: as Lightning's, in the same directories."""
    runs = both(tmp_path, lambda loggers, root: loggers.TensorBoardLogger(root, name="tb_exp", sub_dir=sub_dir),
                histogram=True)
    (pl_trainer, _), (hl_trainer, hl_module) = runs["lightning"], runs["hookloop"]
    pl_dir, hl_dir = Path(pl_trainer.logger.log_dir), Path(hl_trainer.logger.log_dir)
    assert relative(hl_dir, tmp_path / "hl") == relative(pl_dir, tmp_path / "pl") == os.path.join(
        "tb_exp", "version_0", *([sub_dir] if sub_dir else []))
    assert len(list(hl_dir.glob("events.out.tfevents.*"))) == len(list(pl_dir.glob("events.out.tfevents.*"))) == 1
    pl_scalars, pl_histograms = read_events(pl_dir)
    hl_scalars, hl_histograms = read_events(hl_dir)
    assert hl_histograms == pl_histograms == ["weights"]
    assert sorted(hl_scalars) == sorted(pl_scalars) == ["epoch", "hp_metric", "train_loss", "val_loss"]
    assert hl_scalars["hp_metric"] == pl_scalars["hp_metric"] == {0: -1.0}
    for tag in ("epoch", "train_loss", "val_loss"):
        shifted = {step - 1: value for step, value in hl_scalars[tag].items()}  # decisions.md: the step column
        assert shifted == pytest.approx(pl_scalars[tag], rel=1e-6), tag
    version_dir = Path(pl_trainer.logger.root_dir) / "version_0"
    hl_version_dir = Path(hl_trainer.logger.root_dir) / "version_0"
    assert (hl_dir / "hparams.yaml").read_text() == (pl_dir / "hparams.yaml").read_text() == "lr: 0.05\nnote: port\nwidth: 3\n"
    assert relative(hl_module.seen["log_dir"], tmp_path / "hl") == relative(pl_dir, tmp_path / "pl")
    assert hl_trainer.log_dir == hl_version_dir and version_dir.is_dir()


# ---------------------------------------------------------------------------------------
# MLFlowLogger
# ---------------------------------------------------------------------------------------


def test_mlflow_logger_metrics_as_lightning(tmp_path, monkeypatch):
    """MLFlowLogger(experiment_name=..., tracking_uri=file store under tmp_path, tags,
    run_name, prefix): every metric's history as Lightning's; the run, its name and tags."""
    from mlflow.tracking import MlflowClient

    import mlflow.tracking._tracking_service.utils as tracking_utils

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses new file stores otherwise
    # Lightning's MLFlowLogger calls mlflow.set_tracking_uri, which sets the process's
    # MLFLOW_TRACKING_URI too: both undone after this test, so that later tests' default
    # stores are theirs
    monkeypatch.setattr(tracking_utils, "_tracking_uri", tracking_utils._tracking_uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # records its state before this test, for the undo
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    made = {}

    def make(loggers, root):
        made[root.name] = loggers.MLFlowLogger(experiment_name="port", run_name="r1", tracking_uri=f"file:{root / 'mlruns'}",
                                               tags={"team": "a"}, prefix="m")
        return made[root.name]

    runs = both(tmp_path, make)
    histories = {}
    for sub in ("pl", "hl"):
        client = MlflowClient(f"file:{tmp_path / sub / 'mlruns'}")
        (experiment,) = [e for e in client.search_experiments() if e.name == "port"]
        (run,) = client.search_runs([experiment.experiment_id])
        assert run.info.run_id == made[sub].run_id == made[sub].version and run.info.status == "FINISHED"
        assert made[sub].name == experiment.experiment_id and run.info.run_name == "r1" and run.data.tags["team"] == "a"
        histories[sub] = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
                          for key in run.data.metrics}
    assert sorted(histories["hl"]) == sorted(histories["pl"]) == ["m-epoch", "m-train_loss", "m-val_loss"]
    for key, values in histories["pl"].items():
        shifted = {step - 1: value for step, value in histories["hl"][key].items()}  # decisions.md: the step column
        assert shifted == pytest.approx(values, rel=1e-6), key
    assert runs["hookloop"][0].logger is made["hl"]


# ---------------------------------------------------------------------------------------
# Several loggers, the wrong kind, ddp
# ---------------------------------------------------------------------------------------


def test_a_list_of_loggers_writes_every_one(tmp_path):
    """logger=[CSVLogger, TensorBoardLogger, CSVLogger]: each writes its own files, where
    Lightning's write theirs; trainer.logger is the first, the run directory is its."""
    def make(loggers, root):
        return [loggers.CSVLogger(root, name="a"), loggers.TensorBoardLogger(root, name="b"),
                loggers.CSVLogger(root / "other", name="c", version="v")]

    runs = both(tmp_path, make)
    (pl_trainer, pl_module), (hl_trainer, hl_module) = runs["lightning"], runs["hookloop"]
    assert len(hl_trainer.loggers) == len(pl_trainer.loggers) == 3 and hl_module.seen["loggers"] == 3
    assert [type(x).__name__ for x in hl_trainer.loggers] == [type(x).__name__ for x in pl_trainer.loggers]
    assert hl_trainer.logger is hl_trainer.loggers[0]
    assert relative(hl_trainer.log_dir, tmp_path / "hl") == relative(pl_trainer.log_dir, tmp_path / "pl") == "a/version_0"

    def files(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) if "tfevents" not in p.name else str(p.parent.relative_to(root)) + "/events"
                      for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))

    assert files(tmp_path / "hl") == files(tmp_path / "pl") == [
        "a/version_0/hparams.yaml", "a/version_0/metrics.csv", "b/version_0/events", "b/version_0/hparams.yaml",
        "other/c/v/hparams.yaml", "other/c/v/metrics.csv"]
    for path in ("a/version_0/metrics.csv", "other/c/v/metrics.csv"):
        pl_columns, pl_rows = csv_rows(tmp_path / "pl" / path)
        hl_columns, hl_rows = csv_rows(tmp_path / "hl" / path)
        assert hl_columns == pl_columns and [r["step"] for r in lightning_steps(hl_rows)] == [r["step"] for r in pl_rows]
    pl_scalars, _ = read_events(tmp_path / "pl" / "b" / "version_0")
    hl_scalars, _ = read_events(tmp_path / "hl" / "b" / "version_0")
    assert sorted(hl_scalars) == sorted(pl_scalars)


def test_logger_true_false_none_and_empty(tmp_path):
    """True and None: the default CSV logger (decisions.md); False and []: none."""
    for value, expected in ((True, ["csv"]), (None, ["csv"]), (False, []), ([], [])):
        trainer = hookloop.Trainer(logger=value, default_root_dir=str(tmp_path), enable_progress_bar=False)
        assert [p.hookloop_name for p in trainer.loggers] == expected, value
        assert (trainer.logger is None) == (not expected)


def test_lightning_logger_objects_are_a_clear_error(tmp_path):
    """Lightning's own logger (the import was not changed) names the hookloop import."""
    import pytorch_lightning as pl

    cases = [(pl.loggers.CSVLogger(tmp_path), "from hookloop import CSVLogger"),
             (pl.loggers.TensorBoardLogger(tmp_path), "from hookloop_tensorboard import TensorBoardLogger"),
             ([hookloop.CSVLogger(tmp_path), pl.loggers.CSVLogger(tmp_path)], "pytorch_lightning.loggers.csv_logs.CSVLogger"),
             ("csv", "str, which is not a hookloop logger"),
             (hookloop.CSVLogger, "pass an instance")]
    for value, message in cases:
        with pytest.raises(hookloop.ConfigurationError, match=message):
            hookloop.Trainer(logger=value)
    with pytest.raises(hookloop.ConfigurationError, match="version=1.5"):
        hookloop.CSVLogger(tmp_path, version=1.5)


@pytest.mark.check  # reads the shared ddp job
def test_ddp_only_rank_zero_writes(jobs):
    """A CSV and a TensorBoard logger object on 2 processes: tests/scripts/logger_objects_ddp.py
    in the shared ddp job (tests/jobs.py), its loggers' root (and working directory) OUT/root."""
    run = jobs.run("ddp")
    tmp_path = run.dir("logger_objects_ddp") / "root"
    ranks = run.ranks("logger_objects_ddp")
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["log_dir"] == ranks[1]["log_dir"] == str(tmp_path / "ddp_tb" / "version_0")  # rank 0's, broadcast
    assert ranks[0]["versions"] == ranks[1]["versions"] == [0, 0]
    assert [r["experiment"] for r in ranks] == ["SummaryWriter", "DummyExperiment"]
    # one directory per logger, and one file of each kind: rank 1 wrote nothing anywhere
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp", "ddp_tb"]
    assert [p.name for p in (tmp_path / "ddp").iterdir()] == ["version_0"]
    assert len(list(tmp_path.rglob("events.out.tfevents.*"))) == 1
    assert len(list(tmp_path.rglob("metrics.csv"))) == 1
    columns, rows = csv_rows(tmp_path / "ddp" / "version_0" / "metrics.csv")
    steps = ranks[0]["global_step"]
    assert steps == -(-SAMPLES // 2 // BATCH)  # each rank: half the samples, the last batch short
    assert [r["step"] for r in rows if r["train_loss"]] == [str(s) for s in range(1, steps + 1)]
    scalars, histograms = read_events(tmp_path / "ddp_tb" / "version_0")
    assert sorted(scalars["train_loss"]) == list(range(1, steps + 1)) and histograms == ["weights"]


def test_plugin_options_construct_the_loggers_with_lightnings_arguments(tmp_path):
    """--plugin-option csv.save_dir=... (a read-only property in Lightning's API) and
    tensorboard.log_graph (a method there) construct the logger with them."""
    trainer = hookloop.Trainer(plugins=["tensorboard"], enable_progress_bar=False, default_root_dir=str(tmp_path),
                               plugin_options={"csv": {"save_dir": str(tmp_path / "s"), "name": "n", "version": 2},
                                               "tensorboard": {"log_graph": True, "sub_dir": "tb"}})
    csv_logger, tb_logger = (next(p for p in trainer.loggers if p.hookloop_name == n) for n in ("csv", "tensorboard"))
    assert csv_logger.log_dir == str(tmp_path / "s" / "n" / "version_2")
    assert tb_logger.log_graph_enabled is True and callable(tb_logger.log_graph) and tb_logger._sub_dir == "tb"
    with pytest.raises(hookloop.ConfigurationError, match="has no option 'bogus'.*save_dir, name, version"):
        hookloop.Trainer(plugin_options={"csv": {"bogus": 1}})
