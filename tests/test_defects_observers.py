"""Issue 17 section 2: early stopping and the checkpoint observer against
pytorch-lightning 2.6.6 running the same module with the same logged values.

The module logs ``val_loss`` from a script, one value per validation run, so both
trainers see exactly the same numbers; what is compared is when training stopped
(early stopping) and what the checkpoint observer kept and wrote (ModelCheckpoint).
Lightning is the reference: its ``EarlyStopping`` and ``ModelCheckpoint`` run on the
same data, module and schedule.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import tiny_data

pl = pytest.importorskip("pytorch_lightning")

BATCHES = 8  # tiny_data(64) in batches of 8


def make_module(base):
    """The same scripted module on either framework (only the base class differs)."""

    class Scripted(base):
        def __init__(self, values):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 3)
            self.values = list(values)
            self.validations = 0  # validation runs finished (no sanity check: it is off)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.tensor(self.values[self.validations]))

        def on_validation_epoch_end(self):
            self.validations += 1

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Scripted


def loaders():
    return DataLoader(tiny_data(64), batch_size=8), DataLoader(tiny_data(16, seed=5), batch_size=8)


def run_lightning(values, callback, root: Path, **trainer_kw):
    module = make_module(pl.LightningModule)(values)
    trainer = pl.Trainer(default_root_dir=str(root), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                         callbacks=[callback], **trainer_kw)
    trainer.fit(module, *loaders())
    return trainer, module


def run_hookloop(values, callback, root: Path, **trainer_kw):
    module = make_module(hookloop.Module)(values)
    trainer = hookloop.Trainer(default_root_dir=str(root), logger=False, enable_progress_bar=False,
                               num_sanity_val_steps=0, callbacks=[callback], **trainer_kw)
    trainer.fit(module, *loaders())
    return trainer, module


# -- early stopping ---------------------------------------------------------------------------

NAN, INF = math.nan, math.inf

EARLY_STOPPING = [
    # patience=1 stops at the first check without improvement (Lightning 2: wait_count >= patience)
    (dict(patience=1), [1.0, 0.9, 0.95, 0.8, 0.7, 0.6]),
    (dict(patience=2), [1.0, 0.9, 0.95, 0.97, 0.7, 0.6]),
    (dict(patience=0), [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]),
    # min_delta: an improvement must be larger than it
    (dict(patience=2, min_delta=0.1), [1.0, 0.85, 0.8, 0.78, 0.5, 0.4]),
    # ... computed as Lightning does, in the metric's float32: 1.0 -> 0.9 is no improvement by 0.1
    (dict(patience=1, min_delta=0.1), [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]),
    (dict(patience=1, mode="max"), [0.1, 0.2, 0.15, 0.3, 0.4, 0.5]),
    (dict(patience=2, mode="max", min_delta=0.05), [0.1, 0.2, 0.22, 0.24, 0.4, 0.5]),
    # check_finite
    (dict(patience=5), [1.0, 0.9, NAN, 0.8, 0.7, 0.6]),
    (dict(patience=5), [1.0, INF, 0.8, 0.7, 0.6, 0.5]),
    # without check_finite a nan first value is a check without improvement, not a best score
    (dict(patience=2, check_finite=False), [NAN, 1.0, 0.9, 0.95, 0.97, 0.99]),
    (dict(patience=2, check_finite=False), [1.0, NAN, 0.9, NAN, NAN, 0.5]),
    # stopping_threshold: strictly better than it (0.3 in float32 is not below 0.3)
    (dict(patience=5, stopping_threshold=0.5), [1.0, 0.7, 0.5, 0.4, 0.3, 0.2]),
    (dict(patience=5, mode="max", stopping_threshold=0.3), [0.1, 0.2, 0.3, 0.31, 0.4, 0.5]),
    # divergence_threshold: strictly worse than it
    (dict(patience=5, divergence_threshold=2.0), [1.0, 1.5, 2.0, 2.5, 0.5, 0.4]),
    (dict(patience=5, mode="max", divergence_threshold=0.2), [0.5, 0.6, 0.2, 0.1, 0.7, 0.8]),
]


@pytest.mark.parametrize("options, values", EARLY_STOPPING)
def test_early_stopping_stops_where_lightning_stops(tmp_path, options, values):
    lightning_stopper = pl.callbacks.EarlyStopping(monitor="val_loss", **options)
    reference, ref_module = run_lightning(values, lightning_stopper, tmp_path / "pl", max_epochs=len(values),
                                          enable_checkpointing=False)
    stopper = hookloop.EarlyStopping(monitor="val_loss", **options)
    trainer, module = run_hookloop(values, stopper, tmp_path / "hl", max_epochs=len(values),
                                   enable_checkpointing=False)
    assert (module.validations, trainer.global_step) == (ref_module.validations, reference.global_step)
    assert stopper.wait_count == lightning_stopper.wait_count


def test_early_stopping_after_mid_epoch_validations_stops_where_lightning_stops(tmp_path):
    values = [1.0, 0.8, 0.9, 0.7, 0.75, 0.72, 0.6, 0.5]
    kw = dict(max_epochs=4, val_check_interval=0.5, enable_checkpointing=False)
    reference, ref_module = run_lightning(values, pl.callbacks.EarlyStopping(monitor="val_loss", patience=2),
                                          tmp_path / "pl", **kw)
    trainer, module = run_hookloop(values, hookloop.EarlyStopping(monitor="val_loss", patience=2),
                                   tmp_path / "hl", **kw)
    assert ref_module.validations == 6  # stopped after the second validation of epoch 2
    assert (module.validations, trainer.global_step) == (ref_module.validations, reference.global_step)
