"""Issue 35, item 4: ``validate``/``test`` over several loaders, compared with
pytorch-lightning 2.6.6 running the same module code in the same test: each loader's
result holds what was logged while it ran (and what the epoch-level hooks logged), and a
name logged per step and per epoch is ``x_epoch/dataloader_idx_0``, in the results,
``logged_metrics``, ``callback_metrics`` and the CSV logger's columns.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import hookloop
from test_lightning_semantics import _data

sys.path.insert(0, str(Path(__file__).resolve().parent / "oracle"))
import frameworks  # noqa: E402


def _module(fw):
    class SeveralLoaders(fw.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("x", torch.tensor(float(batch_idx + 10 * dataloader_idx)), on_step=True, on_epoch=True)
            # without the loader's suffix: still that loader's result only
            self.log("a" if dataloader_idx == 0 else "b", torch.tensor(1.0 + dataloader_idx), add_dataloader_idx=False)
            self.log("y", self.layer(batch[0]).mean())

        test_step = validation_step

        def on_validation_epoch_end(self):
            self.log("after_all", torch.tensor(7.0))  # epoch-level: in every loader's result

        on_test_epoch_end = on_validation_epoch_end

    return SeveralLoaders()


def _observe(name: str, root: Path) -> dict:
    fw = frameworks.load(name)
    fw.seed_everything(0)
    if name == "lightning":
        trainer = fw.pl.Trainer(accelerator="cpu", devices=1, default_root_dir=str(root),
                                logger=fw.pl.loggers.CSVLogger(str(root)), enable_progress_bar=False,
                                enable_model_summary=False)
    else:
        trainer = hookloop.Trainer(accelerator="cpu", default_root_dir=str(root), logger=hookloop.CSVLogger(str(root)),
                                   enable_progress_bar=False)
    seen = {}
    for stage in ("validate", "test"):
        loaders = [DataLoader(_data(8), batch_size=4), DataLoader(_data(8, seed=2), batch_size=4)]
        fw.seed_everything(0)
        results = getattr(trainer, stage)(_module(fw), loaders, verbose=False)
        seen[stage] = {
            "results": [{k: round(float(v), 6) for k, v in r.items()} for r in results],
            "logged": sorted(trainer.logged_metrics),
            "callback": {k: round(float(v), 6) for k, v in trainer.callback_metrics.items()},
        }
    (path,) = root.rglob("metrics.csv")
    with open(path, newline="") as f:
        seen["csv columns"] = sorted(next(csv.reader(f)))
    return seen


def test_several_loaders_results_and_names_are_lightnings(tmp_path):
    lightning = _observe("lightning", tmp_path / "lightning")
    hookloop_ = _observe("hookloop", tmp_path / "hookloop")
    assert hookloop_ == lightning
    first, second = hookloop_["validate"]["results"]
    assert "a" in first and "a" not in second and "b" in second and "b" not in first
    assert "x_epoch/dataloader_idx_0" in first and first["after_all"] == second["after_all"] == 7.0
