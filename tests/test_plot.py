"""`hookloop plot`: the curves of a real run's metrics.csv, checked against the CSV itself."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import TinyModule, tiny_data
from hookloop.tools import cli
from hookloop.tools import plot as hplot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Every column the run below writes, and the panel it belongs in, written out by hand.
EXPECTED_FAMILIES = {
    "train_loss": "loss",
    "train_acc_step": "acc",
    "train_acc_epoch": "acc",  # (not "train_acc": a name logged per step and epoch reaches the
    # loggers as name_step and name_epoch only, as in Lightning)
    "val_loss/dataloader_idx_0": "loss",
    "val_loss/dataloader_idx_1": "loss",
    "val_acc/dataloader_idx_0": "acc",
    "val_acc/dataloader_idx_1": "acc",
}


class TwoLoaderModule(TinyModule):
    """Logs a step metric, a step+epoch metric and two validation loaders' metrics."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", (logits.argmax(-1) == y).float().mean(), on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plotrun")
    trainer = hookloop.Trainer(default_root_dir=str(root), max_epochs=3, log_every_n_steps=2,
                               enable_progress_bar=False, enable_checkpointing=False)
    val = [DataLoader(tiny_data(32, seed=2), batch_size=16), DataLoader(tiny_data(32, seed=3), batch_size=16)]
    trainer.fit(TwoLoaderModule(), DataLoader(tiny_data(96), batch_size=16), val)
    assert Path(trainer.log_dir) == root / "logs" / "version_0"
    return root


def csv_columns(path: Path) -> dict[str, tuple[list[float], list[float]]]:
    """The reference: every metric column's (steps, values) over the rows that have it."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out: dict[str, tuple[list[float], list[float]]] = {}
    for name in rows[0]:
        if name in ("step", "epoch"):
            continue
        kept = [r for r in rows if r[name] != ""]
        out[name] = ([float(r["step"]) for r in kept], [float(r[name]) for r in kept])
    return out


def test_family_rule():
    table = {
        "train_loss": "loss", "val_loss": "loss", "loss": "loss", "test_loss": "loss",
        "loss_step": "loss", "loss_epoch": "loss", "train_loss_epoch": "loss",
        "val_loss/dataloader_idx_1": "loss", "valid_acc": "acc", "validation_acc": "acc",
        "train/acc": "acc", "lr-SGD": "lr-SGD", "lr-SGD/pg2": "lr-SGD", "momentum-SGD": "momentum-SGD",
        "grad_norm": "grad_norm", "train_": "train_",
    }
    assert {name: hplot.family(name) for name in table} == table


def test_figure_panels_and_lines_are_the_csv_columns(run_root):
    run = run_root / "logs" / "version_0"
    reference = csv_columns(run / "metrics.csv")
    assert set(reference) == set(EXPECTED_FAMILIES)
    # Epoch-level rows are drawn at their step: the epoch metric has one point per epoch.
    assert len(reference["train_acc_epoch"][0]) == 3

    fig = hplot.figure(run_root)  # a default_root_dir finds its newest run
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert sorted(ax.get_title() for ax in axes) == ["acc", "loss"]
    drawn = {}
    for ax in axes:
        for line in ax.get_lines():
            assert EXPECTED_FAMILIES[line.get_label()] == ax.get_title()
            drawn[line.get_label()] = ([float(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()])
    assert drawn == reference
    assert all(ax.get_xlabel() == "step" for ax in axes)


def test_command_writes_png_of_newest_run(run_root, tmp_path, capsys, monkeypatch):
    # The command as a user runs it in the run's folder (through cli.main, in this process):
    # no arguments = newest ./logs/version_N.
    monkeypatch.chdir(run_root)
    assert cli.main(["plot"]) == 0
    report = run_root / "logs" / "version_0" / "report.png"
    assert capsys.readouterr().out.strip() == str(Path("logs") / "version_0" / "report.png")
    assert report.read_bytes()[:8] == PNG_MAGIC
    # -o chooses the file.
    target = tmp_path / "sub" / "r.png"
    assert cli.main(["plot", str(run_root / "logs" / "version_0"), "-o", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert target.read_bytes()[:8] == PNG_MAGIC


def test_missing_or_empty_run_dir_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nope")]) == 2
    assert f"run directory {str(tmp_path / 'nope')!r} does not exist" in capsys.readouterr().err

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(hookloop.ConfigurationError, match=r"has no metrics.csv and no logs/version_N"):
        hplot.find_run_dir(empty)
    with pytest.raises(hookloop.ConfigurationError, match=r"no run directory under .*logs"):
        hplot.find_run_dir(None)  # the cwd (tmp_path) has no logs/

    run = tmp_path / "logs" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("")  # a run that has not logged yet
    assert cli.main(["plot"]) == 2
    assert "has no logged metric values yet" in capsys.readouterr().err
    (run / "metrics.csv").write_text("a,b\n1,2\n")
    with pytest.raises(hookloop.ConfigurationError, match="not a hookloop metrics file"):
        hplot.figure(run)


def test_without_matplotlib_names_the_install(run_root, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(hookloop.MissingDependencyError, match=r"pip install 'hookloop\[plot\]'.*pip install matplotlib"):
        hplot.plot(run_root)
