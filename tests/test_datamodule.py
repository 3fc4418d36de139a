"""DataModules (Lightning's LightningDataModule) in one process; the per-node
``prepare_data`` under ddp is checked in tests/test_lightning_ddp.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import TinyModule, max_abs_diff, reference_loop, state_of, tiny_data


class Digits(hookloop.DataModule):
    def __init__(self, batch_size: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.calls: list = []
        self.epochs_seen = 0

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(("setup", stage))
        self.train, self.val, self.test = tiny_data(64), tiny_data(24, seed=2), tiny_data(20, seed=3)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=8)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=8)

    def predict_dataloader(self):
        return DataLoader(self.test.tensors[0], batch_size=8)

    def teardown(self, stage):
        self.calls.append(("teardown", stage))

    def state_dict(self):
        return {"epochs_seen": self.epochs_seen}

    def load_state_dict(self, state):
        self.epochs_seen = state["epochs_seen"]


class WithTestStep(TinyModule):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean())


def test_fit_validate_test_predict_from_a_datamodule(tmp_path):
    dm = Digits()
    torch.manual_seed(4)
    module = WithTestStep()
    trainer = hookloop.Trainer(max_epochs=2, default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    torch.manual_seed(4)
    reference = TinyModule()
    reference_loop(reference, DataLoader(tiny_data(64), batch_size=16, shuffle=True), epochs=2)
    assert max_abs_diff(state_of(module), state_of(reference)) == 0.0
    assert "val_acc" in trainer.callback_metrics
    (val,) = trainer.validate(module, datamodule=dm, verbose=False)
    (test,) = trainer.test(module, dm, verbose=False)  # positionally, as Lightning allows
    x, y = tiny_data(20, seed=3).tensors
    with torch.no_grad():
        assert test["test_acc"] == pytest.approx((module(x).argmax(-1) == y).float().mean().item(), abs=1e-6)
        predictions = trainer.predict(module, datamodule=dm)
        assert torch.allclose(torch.cat(predictions), module(x), atol=1e-6)
    assert dm.calls == [
        "prepare_data", ("setup", "fit"), ("teardown", "fit"),
        "prepare_data", ("setup", "validate"), ("teardown", "validate"),
        "prepare_data", ("setup", "test"), ("teardown", "test"),
        "prepare_data", ("setup", "predict"), ("teardown", "predict"),
    ]
    assert val.keys() == {"val_acc", "val_loss"}


def test_datamodule_state_travels_in_checkpoints(tmp_path):
    dm = Digits()
    dm.epochs_seen = 7
    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(tmp_path))
    trainer.fit(TinyModule(), datamodule=dm)
    assert torch.load(tmp_path / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)["datamodule"] == {"epochs_seen": 7}
    fresh = Digits()
    hookloop.Trainer(max_epochs=2, default_root_dir=str(tmp_path)).fit(TinyModule(), datamodule=fresh, ckpt_path="last")
    assert fresh.epochs_seen == 7


def test_loaders_defined_on_the_module_are_used():
    class Self(TinyModule):
        def train_dataloader(self):
            return DataLoader(tiny_data(32), batch_size=8)

    trainer = hookloop.Trainer(max_epochs=1, enable_checkpointing=False)
    trainer.fit(Self())
    assert trainer.global_step == 4


def test_missing_data_and_double_data_are_errors():
    with pytest.raises(hookloop.ConfigurationError, match="needs training data"):
        hookloop.Trainer(max_epochs=1).fit(TinyModule())
    with pytest.raises(hookloop.ConfigurationError, match="both dataloaders and a datamodule"):
        hookloop.Trainer(max_epochs=1).fit(TinyModule(), DataLoader(tiny_data(8)), datamodule=Digits())
    with pytest.raises(hookloop.ConfigurationError, match="test needs data"):
        hookloop.Trainer().test(WithTestStep(), datamodule=hookloop.DataModule())
