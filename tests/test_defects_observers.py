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

# the reference (make test installs pytorch-lightning==2.6.6): a missing one fails, never skips
import pytorch_lightning as pl  # noqa: E402

BATCHES = 8  # tiny_data(64) in batches of 8


def make_module(base):
    """The same scripted module on either framework (only the base class differs)."""

    class Scripted(base):
        def __init__(self, values, train_values=()):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 3)
            self.values, self.train_values = list(values), list(train_values)
            self.validations = 0  # validation runs finished (no sanity check: it is off)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.train_values:  # an epoch-level training metric, one value per epoch
                self.log("train_score", torch.tensor(self.train_values[self.current_epoch]), on_step=False,
                         on_epoch=True)
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


def run_lightning(values, callback, root: Path, train_values=(), **trainer_kw):
    module = make_module(pl.LightningModule)(values, train_values)
    trainer = pl.Trainer(default_root_dir=str(root), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                         callbacks=[callback], **trainer_kw)
    trainer.fit(module, *loaders())
    return trainer, module


def run_hookloop(values, callback, root: Path, train_values=(), **trainer_kw):
    module = make_module(hookloop.Module)(values, train_values)
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


def test_early_stopping_on_a_training_epoch_metric_with_validation_stops_where_lightning_stops(tmp_path):
    """Validation at every epoch's end: Lightning checks at the training epoch's end, where
    that epoch's training metric exists (after validation it is the previous epoch's)."""
    values, train_values = [1.0] * 6, [0.5, 0.4, 0.45, 0.3, 0.2, 0.1]
    kw = dict(max_epochs=6, enable_checkpointing=False, train_values=train_values)
    reference, ref_module = run_lightning(values, pl.callbacks.EarlyStopping(monitor="train_score", patience=1),
                                          tmp_path / "pl", **kw)
    trainer, module = run_hookloop(values, hookloop.EarlyStopping(monitor="train_score", patience=1),
                                   tmp_path / "hl", **kw)
    assert reference.global_step == 3 * BATCHES  # 0.45 at epoch 2: no improvement
    assert trainer.global_step == reference.global_step


# -- checkpoints ------------------------------------------------------------------------------


def outcome(callback, directory: Path) -> tuple:
    """What a ModelCheckpoint kept, by file name: the best, the top-k scores, the files.

    ``last.prev.ckpt`` is hookloop's documented previous ``last.ckpt`` (docs/decisions.md,
    "The last two checkpoints are kept"); Lightning has no such file.
    """
    files = sorted(p.name for p in directory.iterdir() if p.name != "last.prev.ckpt") if directory.exists() else []
    scores = {Path(p).name: round(float(s), 6) for p, s in callback.best_k_models.items()}
    return Path(callback.best_model_path).name, scores, files


CHECKPOINTS = [
    # mid-epoch validations (8 batches, validation after 4 and 8): the best score came from
    # a mid-epoch validation (0.5 after step 12)
    (dict(monitor="val_loss"), dict(val_check_interval=0.5, max_epochs=3), [0.9, 0.7, 0.5, 0.8, 0.6, 0.85]),
    (dict(monitor="val_loss", save_top_k=2), dict(val_check_interval=0.5, max_epochs=3),
     [0.9, 0.7, 0.5, 0.8, 0.6, 0.85]),
    (dict(monitor="val_loss", mode="max", save_top_k=-1), dict(val_check_interval=0.5, max_epochs=2),
     [0.1, 0.4, 0.3, 0.2]),
    (dict(monitor="val_loss", save_top_k=2, save_last=True), dict(val_check_interval=0.25, max_epochs=2),
     [0.9, 0.7, 0.5, 0.8, 0.6, 0.85, 0.4, 0.95]),
    (dict(monitor="val_loss", every_n_epochs=2), dict(val_check_interval=0.5, max_epochs=4),
     [0.9, 0.7, 0.5, 0.8, 0.6, 0.85, 0.95, 0.9]),
    (dict(monitor="val_loss", save_top_k=2, every_n_train_steps=3), dict(val_check_interval=0.5, max_epochs=2),
     [0.9, 0.7, 0.5, 0.8]),
    (dict(monitor="val_loss", save_top_k=-1, every_n_train_steps=5, save_last=True),
     dict(val_check_interval=0.5, max_epochs=2), [0.9, 0.7, 0.5, 0.8]),
    # validation every 2 epochs: nothing to rank at the ends of epochs 0 and 2
    (dict(monitor="val_loss"), dict(check_val_every_n_epoch=2, max_epochs=4), [0.9, 0.7]),
    (dict(monitor="val_loss", save_top_k=2, save_last=True), dict(check_val_every_n_epoch=2, max_epochs=6),
     [0.9, 0.7, 0.8]),
    (dict(monitor="val_loss", save_top_k=-1), dict(check_val_every_n_epoch=2, val_check_interval=0.5, max_epochs=4),
     [0.9, 0.7, 0.5, 0.8]),
    (dict(monitor="val_loss", save_top_k=2, every_n_train_steps=6), dict(check_val_every_n_epoch=2, max_epochs=4),
     [0.9, 0.7]),
    # validation at every epoch's end: saved there, as before
    (dict(monitor="val_loss", save_top_k=2), dict(max_epochs=4), [0.9, 0.7, 0.8, 0.6]),
    # nan is kept as the worst score while there is room (Lightning saves it as +-inf)
    (dict(monitor="val_loss", save_top_k=-1), dict(val_check_interval=0.5, max_epochs=2),
     [math.nan, 0.9, math.inf, 0.5]),
    (dict(monitor="val_loss", mode="max", save_top_k=4), dict(val_check_interval=0.5, max_epochs=2),
     [0.2, math.nan, 0.1, 0.3]),
    # no monitor: the latest
    (dict(), dict(val_check_interval=0.5, max_epochs=2), [0.9, 0.7, 0.5, 0.8]),
    (dict(save_top_k=-1), dict(check_val_every_n_epoch=2, max_epochs=4), [0.9, 0.7]),
]


@pytest.mark.parametrize("options, schedule, values", CHECKPOINTS)
def test_checkpoints_kept_and_written_match_lightning(tmp_path, options, schedule, values):
    options = {"save_last": False, **options}  # Lightning's default; hookloop's is True
    reference = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "pl", **options)
    _, ref_module = run_lightning(values, reference, tmp_path / "plroot", **schedule)
    assert ref_module.validations == len(values)  # the script was used up, exactly
    callback = hookloop.ModelCheckpoint(dirpath=tmp_path / "hl", **options)
    run_hookloop(values, callback, tmp_path / "hlroot", **schedule)
    expected = outcome(reference, tmp_path / "pl")
    got = outcome(callback, tmp_path / "hl")
    if options["save_last"]:
        # hookloop also writes last.ckpt at every epoch's end (docs/decisions.md, "Checkpoints
        # are the checkpoint observer's"): the same file name, more often
        assert "last.ckpt" in expected[2]
    assert got == expected


def test_a_monitored_metric_no_validation_produced_yet_is_not_an_error(tmp_path):
    """check_val_every_n_epoch=2: the end of epoch 0 comes before any validation; the
    checkpoint after epoch 1's validation holds that epoch's weights."""
    callback = hookloop.ModelCheckpoint(dirpath=tmp_path / "hl", monitor="val_loss")
    trainer, module = run_hookloop([0.9, 0.7], callback, tmp_path, check_val_every_n_epoch=2, max_epochs=4)
    assert Path(callback.best_model_path).name == "epoch=3-step=32.ckpt"
    saved = torch.load(callback.best_model_path, weights_only=True)
    assert saved["loop"]["global_step"] == 32
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in module.state_dict().items())


def test_a_monitored_metric_missing_after_validation_ran_is_still_an_error(tmp_path):
    callback = hookloop.ModelCheckpoint(dirpath=tmp_path / "hl", monitor="val_acc")
    with pytest.raises(hookloop.ConfigurationError, match=r"monitor='val_acc'.*logged: val_loss"):
        run_hookloop([0.9, 0.7], callback, tmp_path, check_val_every_n_epoch=2, max_epochs=4)


def test_a_mid_epoch_best_checkpoint_resumes_after_its_validation(tmp_path):
    """The checkpoint written after a mid-epoch validation resumes at the next batch
    without validating again, and trains to the weights of the uninterrupted run."""
    values = [0.5, 0.9, 0.8, 0.7]
    callback = hookloop.ModelCheckpoint(dirpath=tmp_path / "a", monitor="val_loss", save_last=False)
    _, straight = run_hookloop(values, callback, tmp_path, val_check_interval=0.5, max_epochs=2)
    assert Path(callback.best_model_path).name == "epoch=0-step=4.ckpt"
    callback = hookloop.ModelCheckpoint(dirpath=tmp_path / "b", monitor="val_loss", save_last=False)
    module = make_module(hookloop.Module)(values)
    module.validations = 1  # the validation before the checkpoint
    trainer = hookloop.Trainer(default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
                               num_sanity_val_steps=0, callbacks=[callback], val_check_interval=0.5, max_epochs=2)
    trainer.fit(module, *loaders(), ckpt_path=tmp_path / "a" / "epoch=0-step=4.ckpt")
    assert module.validations == 4 and trainer.global_step == 2 * BATCHES
    assert all(torch.equal(module.state_dict()[k], v) for k, v in straight.state_dict().items())
