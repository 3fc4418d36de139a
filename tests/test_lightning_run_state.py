"""Issue 35 item 11: run state that differed from pytorch-lightning 2.6.6's, each
compared with Lightning running the same code in this process:

* ``set_epoch`` on a validation loader's sampler at each validation of ``fit`` (the
  training epoch) and once per ``validate`` (the epochs fit ran);
* ``Timer.time_elapsed("validate")`` counts the sanity check (Lightning times it as a
  validation; it keeps no ``"sanity_check"`` time);
* repeated ``Tuner.lr_find`` calls give the same curve (the search leaves the random
  generators as it found them: Lightning's ``isolate_rng``);
* ``callback_metrics`` after ``fit`` then ``test``: Lightning starts every run with none,
  so only the test's keys remain (in one process; with ``ckpt_path`` too, where hookloop
  brought the fit's back from the checkpoint).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, SequentialSampler

import hookloop
from conftest import tiny_data

# the reference (make test installs pytorch-lightning==2.6.6): a missing one fails, never skips
import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.tuner import Tuner as LightningTuner  # noqa: E402

FRAMEWORKS = {"lightning": (pl.Trainer, pl.LightningModule, pl.Callback, pl.callbacks.Timer, LightningTuner),
              "hookloop": (hookloop.Trainer, hookloop.Module, hookloop.Callback, hookloop.Timer, hookloop.Tuner)}


def make_module(base):
    class Module(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 3)
            self.lr = 0.01

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("valid_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        def test_step(self, batch, batch_idx):
            self.log("test_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    return Module()


def trainer_of(framework: str, tmp_path, **kw):
    trainer_cls = FRAMEWORKS[framework][0]
    kw.setdefault("max_epochs", 3)
    kw.setdefault("logger", False)
    if framework == "lightning":
        kw.update(enable_model_summary=False, accelerator="cpu", devices=1)
    return trainer_cls(default_root_dir=str(tmp_path / framework), enable_progress_bar=False, **kw)


class EpochRecordingSampler(SequentialSampler):
    def __init__(self, data):
        super().__init__(data)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_set_epoch_is_called_on_the_validation_sampler_as_lightning_calls_it(tmp_path):
    seen = {}
    for framework in FRAMEWORKS:
        data = tiny_data(16, seed=5)
        sampler = EpochRecordingSampler(data)
        trainer = trainer_of(framework, tmp_path, num_sanity_val_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(make_module(FRAMEWORKS[framework][1]), DataLoader(tiny_data(32), batch_size=8),
                        DataLoader(data, batch_size=8, sampler=sampler))
            trainer.validate(trainer.lightning_module if framework == "lightning" else trainer.module,
                             DataLoader(data, batch_size=8, sampler=sampler), verbose=False)
        seen[framework] = sampler.epochs
    assert seen["hookloop"] == seen["lightning"]
    # the sanity check, each epoch's validation, then validate's (the epochs fit ran)
    assert seen["lightning"] == [0, 0, 1, 2, 3]


def test_timer_validate_time_includes_the_sanity_check_as_lightnings(tmp_path):
    seen = {}
    for framework, (_, module_base, callback_base, timer_cls, _) in FRAMEWORKS.items():
        timer = timer_cls()

        class AfterSanity(callback_base):
            def on_train_start(self, trainer, pl_module):
                # after the sanity check, before any validation of the fit
                self.validate = timer.time_elapsed("validate")
                self.sanity = timer.time_elapsed("sanity_check")

        probe = AfterSanity()
        trainer = trainer_of(framework, tmp_path, num_sanity_val_steps=2, callbacks=[timer, probe], max_epochs=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(make_module(module_base), DataLoader(tiny_data(32), batch_size=8),
                        DataLoader(tiny_data(16, seed=5), batch_size=8))
        seen[framework] = (probe.validate > 0, probe.sanity)
    assert seen["hookloop"] == seen["lightning"] == (True, 0)


def test_repeated_lr_find_calls_give_lightnings_curve_each_time(tmp_path):
    curves = {}
    for framework, (_, module_base, _, _, tuner_cls) in FRAMEWORKS.items():
        torch.manual_seed(3)
        module = make_module(module_base)
        tuner = tuner_cls(trainer_of(framework, tmp_path))
        runs = []
        for _ in range(2):
            loader = DataLoader(tiny_data(64), batch_size=8, shuffle=True)  # draws from torch's generator
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                finder = tuner.lr_find(module, loader, num_training=10, update_attr=False)
            runs.append(list(finder.results["loss"]))
        curves[framework] = runs
    assert curves["lightning"][0] == curves["lightning"][1]
    for ours, theirs in zip(curves["hookloop"], curves["lightning"], strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5)


@pytest.mark.parametrize("from_checkpoint", [False, True], ids=["model", "ckpt_path_best"])
def test_callback_metrics_after_fit_then_test_are_lightnings(tmp_path, from_checkpoint):
    keys = {}
    for framework, (_, module_base, *_) in FRAMEWORKS.items():
        trainer = trainer_of(framework, tmp_path, max_epochs=2, num_sanity_val_steps=0)
        module = make_module(module_base)
        test_loader = DataLoader(tiny_data(16, seed=5), batch_size=8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(tiny_data(32), batch_size=8), test_loader)
            assert {"train_loss", "valid_loss"} <= set(trainer.callback_metrics)
            if from_checkpoint:
                trainer.test(dataloaders=test_loader, ckpt_path="best", verbose=False)
            else:
                trainer.test(module, test_loader, verbose=False)
        keys[framework] = sorted(trainer.callback_metrics)
    assert keys["hookloop"] == keys["lightning"] == ["test_loss"]
