"""Issue 35, Lightning's ModelCheckpoint tests (checkpointing/test_model_checkpoint.py):
``save_on_exception`` where hookloop's resume ``last.ckpt`` was written, evaluation
batch hooks without ``dataloader_idx``, the module's ``on_*_model_eval``/``_train``
overrides, ``seed_everything()`` without a seed, ``save_last``'s type in the signature
(LightningCLI), ``enable_version_counter``/``STARTING_VERSION``, ``current_score``'s
type, a ``Namespace`` given to ``save_hyperparameters`` and ``fit_loop.max_epochs = n``;
each compared with pytorch-lightning 2.6.6 running the same code in the same test.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from test_lightning_semantics import _data, _trainer

sys.path.insert(0, str(Path(__file__).resolve().parent / "oracle"))
import frameworks  # noqa: E402

FRAMEWORKS = ("lightning", "hookloop")


def _module(fw, **methods):
    """A small classifier with ``methods`` added (the hooks a case overrides)."""

    class Small(fw.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.layer(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.layer(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    for name, method in methods.items():
        setattr(Small, name, method)
    fw.seed_everything(0)
    return Small()


def _loaders():
    return DataLoader(_data(8), batch_size=4), DataLoader(_data(8, seed=2), batch_size=4)


def _fit(fw, root, module, quiet=True, **kw):
    fw.seed_everything(0)
    trainer = _trainer(fw, str(root), num_sanity_val_steps=0, **kw)
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        trainer.fit(module, *_loaders())
    return trainer


# -- save_on_exception -----------------------------------------------------------------------


def _raise_at_epoch_1(self):
    if self.current_epoch == 1:
        raise RuntimeError("Trouble!")


def _raise(self):
    raise RuntimeError("Trouble!")


@pytest.mark.parametrize("hook, method", [("on_train_epoch_start", _raise_at_epoch_1), ("on_fit_end", _raise),
                                          ("on_after_backward", _raise_at_epoch_1)])
def test_save_on_exception_saves_where_only_the_resume_file_was_written(tmp_path, hook, method):
    """Lightning saves on an exception unless a checkpoint of that step was saved for the
    user; hookloop's own resume last.ckpt (written at every epoch end) does not count."""
    found = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        mc = fw.ModelCheckpoint(dirpath=tmp_path / name / "ckpts", filename="exception", save_on_exception=True,
                                every_n_epochs=7)
        with pytest.raises(RuntimeError, match="Trouble!"):
            _fit(fw, tmp_path / name, _module(fw, **{hook: method}), max_epochs=3, callbacks=[mc])
        saved = tmp_path / name / "ckpts" / "exception.ckpt"
        found[name] = (saved.is_file(), saved.is_file() and torch.load(saved, weights_only=False)["global_step"])
    assert found["hookloop"] == found["lightning"]
    assert found["lightning"][0]


def test_save_on_exception_not_in_a_fast_dev_run(tmp_path):
    found = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        mc = fw.ModelCheckpoint(dirpath=tmp_path / name / "ckpts", filename="exception", save_on_exception=True)

        def on_train_batch_start(self, batch, batch_idx):
            if self.trainer.fast_dev_run and batch_idx == 1:
                raise RuntimeError("Trouble!")

        with pytest.raises(RuntimeError, match="Trouble!"):
            _fit(fw, tmp_path / name, _module(fw, on_train_batch_start=on_train_batch_start), fast_dev_run=2,
                 callbacks=[mc])
        found[name] = (tmp_path / name / "ckpts" / "exception.ckpt").exists()
    assert found == {"lightning": False, "hookloop": False}


# -- the module's evaluation hooks ---------------------------------------------------------------


def test_eval_batch_hooks_without_dataloader_idx_with_one_loader(tmp_path):
    """With one validation loader Lightning calls ``on_validation_batch_start(batch,
    batch_idx)``: an override without ``dataloader_idx`` is valid."""
    calls = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        seen: list = []

        def on_validation_batch_start(self, batch, batch_idx, seen=seen):
            seen.append(("start", batch_idx))

        def on_validation_batch_end(self, outputs, batch, batch_idx, seen=seen):
            seen.append(("end", batch_idx))

        _fit(fw, tmp_path / name, _module(fw, on_validation_batch_start=on_validation_batch_start,
                                          on_validation_batch_end=on_validation_batch_end), max_epochs=1)
        calls[name] = seen
    assert calls["hookloop"] == calls["lightning"] == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]


def test_model_eval_and_train_overrides_replace_the_loops_modes(tmp_path):
    """``on_validation_model_eval``/``on_validation_model_train`` overridden are called in
    place of ``eval()``/``train()``: here dropout stays in train mode while validating."""
    modes = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        seen: list = []

        def on_validation_model_eval(self, seen=seen):
            seen.append("eval")  # and the model stays in train mode

        def on_validation_model_train(self, seen=seen):
            seen.append("train")
            self.trainer.model.train()

        def validation_step(self, batch, batch_idx, seen=seen):
            seen.append(self.training)

        module = _module(fw, on_validation_model_eval=on_validation_model_eval,
                         on_validation_model_train=on_validation_model_train, validation_step=validation_step)
        _fit(fw, tmp_path / name, module, max_epochs=1)
        trainer = _trainer(fw, str(tmp_path / name / "v"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.validate(module, _loaders()[1], verbose=False)
        modes[name] = seen
    assert modes["hookloop"] == modes["lightning"] == ["eval", True, True, "train"] * 2


# -- seed_everything ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recorded", [None, "7"])
def test_seed_everything_without_a_seed(monkeypatch, recorded):
    """Lightning's: the seed ``PL_GLOBAL_SEED`` holds, else 0 with a warning."""
    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        seed_everything = fw.pl.seed_everything if name == "lightning" else fw.seed_everything
        if recorded is None:
            monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
        else:
            monkeypatch.setenv("PL_GLOBAL_SEED", recorded)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seed = seed_everything()
        out[name] = (seed, torch.rand(3).tolist(), os.environ["PL_GLOBAL_SEED"],
                     [str(w.message) for w in caught if "seed" in str(w.message)])
    assert out["hookloop"] == out["lightning"]


def test_seed_everything_refuses_a_recorded_seed_that_is_no_number(monkeypatch):
    import hookloop

    monkeypatch.setenv("PL_GLOBAL_SEED", "abc")
    with pytest.raises(ValueError, match="Invalid seed specified via PL_GLOBAL_SEED: 'abc'"):
        hookloop.seed_everything()


# -- ModelCheckpoint's signature and names ---------------------------------------------------------


@pytest.mark.parametrize("given", ["yes", "True", "false", "no", "link"])
def test_save_last_type_parses_as_lightnings(given):
    """LightningCLI (jsonargparse) parses ``--save_last`` by the signature's type."""
    from jsonargparse import ArgumentParser

    parsed = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        parser = ArgumentParser()
        parser.add_argument("--a", type=inspect.signature(fw.ModelCheckpoint).parameters["save_last"].annotation)
        parsed[name] = parser.parse_args(["--a", given]).a
    assert parsed["hookloop"] == parsed["lightning"]


def _two_runs(fw, tmp_path, **options):
    """Two fits writing into one dirpath (beside, not in, the run's root)."""
    models = []
    for run in range(2):
        mc = fw.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, monitor="epoch", filename="{epoch}",
                                **options)
        _fit(fw, tmp_path / f"root{run}", _module(fw), max_epochs=2, callbacks=[mc])
        models.append(sorted(Path(p).name for p in mc.best_k_models))
    return models, sorted(os.listdir(tmp_path / "ckpts"))


@pytest.mark.parametrize("options", [{"enable_version_counter": False, "save_last": True}, {}])
def test_enable_version_counter(tmp_path, options):
    out = {name: _two_runs(frameworks.load(name), tmp_path / name, **options) for name in FRAMEWORKS}
    assert out["hookloop"] == out["lightning"]


def test_starting_version(tmp_path):
    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        fw.ModelCheckpoint.STARTING_VERSION = 9
        try:
            out[name] = _two_runs(fw, tmp_path / name)
        finally:
            fw.ModelCheckpoint.STARTING_VERSION = 1
    assert out["hookloop"] == out["lightning"]
    assert "epoch=0-v9.ckpt" in out["lightning"][1]


def test_current_score_is_the_logged_tensor(tmp_path):
    """``current_score`` is a tensor as Lightning's: ``== 0.3`` holds for a float32 0.3."""
    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)

        def on_validation_epoch_end(self):
            self.log("foo", (self.current_epoch + 1) / 10)

        mc = fw.ModelCheckpoint(dirpath=tmp_path / name / "ckpts", save_top_k=3, monitor="foo")
        _fit(fw, tmp_path / name, _module(fw, on_validation_epoch_end=on_validation_epoch_end), max_epochs=3,
             callbacks=[mc])
        out[name] = (isinstance(mc.current_score, torch.Tensor), bool(mc.current_score == 0.3))
    assert out["hookloop"] == out["lightning"] == (True, True)


# -- the Trainer and the module ------------------------------------------------------------------------


def test_save_hyperparameters_of_a_namespace(tmp_path):
    """A Namespace given to save_hyperparameters: its entries are the hyperparameters."""
    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)

        class WithHparams(fw.LightningModule):
            def __init__(self, hparams):
                super().__init__()
                self.save_hyperparameters(hparams)
                self.layer = nn.Linear(4, 2)

        module = WithHparams(argparse.Namespace(test_hp_0=1, test_hp_1=2))
        out[name] = dict(module.hparams)
    assert out["hookloop"] == out["lightning"] == {"test_hp_0": 1, "test_hp_1": 2}


def test_fit_loop_max_epochs_trains_on(tmp_path):
    """``trainer.fit_loop.max_epochs = 4`` then ``fit`` again: Lightning's way to train on."""
    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        module = _module(fw)
        trainer = _fit(fw, tmp_path / name, module, max_epochs=2)
        trainer.fit_loop.max_epochs = 4
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, *_loaders())
        out[name] = (trainer.max_epochs, trainer.current_epoch, trainer.global_step)
    assert out["hookloop"] == out["lightning"]


def test_save_last_without_dirpath_writes_the_resume_file_every_epoch(tmp_path):
    """docs/decisions.md, "`save_last` and hookloop's resume `last.ckpt`": without dirpath,
    save_last's last.ckpt is hookloop's resume file, written at every epoch end (Lightning
    2.6.6: once, at the end, when no top-k checkpoint was saved); the final file holds the
    same step."""
    from unittest.mock import patch

    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        mc = fw.ModelCheckpoint(every_n_epochs=5, save_last=True, save_top_k=0, save_on_train_epoch_end=True)
        fw.seed_everything(0)
        trainer = _trainer(fw, str(tmp_path / name), max_epochs=2, callbacks=[mc], limit_val_batches=0)
        with patch.object(trainer, "save_checkpoint", wraps=trainer.save_checkpoint) as saves, \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(_module(fw), _loaders()[0])
        out[name] = (saves.call_count, torch.load(mc.last_model_path, weights_only=False)["global_step"])
    assert out == {"lightning": (1, 4), "hookloop": (2, 4)}


# -- the module's backward -------------------------------------------------------------------------


def test_backward_override_is_called_for_every_micro_batch(tmp_path):
    """A module's ``backward(loss)`` override runs in place of ``loss.backward()`` (here
    doubling the gradients): the same calls and weights as Lightning's."""
    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        calls: list = []

        def backward(self, loss, *args, calls=calls, **kwargs):
            calls.append(self.global_step)
            (2 * loss).backward(*args, **kwargs)

        module = _module(fw, backward=backward)
        _fit(fw, tmp_path / name, module, max_epochs=1, accumulate_grad_batches=2, limit_val_batches=0)
        out[name] = (calls, [round(v, 6) for v in module.layer.weight.flatten().tolist()])
    assert out["hookloop"] == out["lightning"]
    assert out["lightning"][0] == [0, 0]


def test_backward_override_with_a_plugin_that_runs_the_backward_is_refused(tmp_path):
    import hookloop

    def backward(self, loss, *args, **kwargs):
        loss.backward(*args, **kwargs)

    fw = frameworks.load("hookloop")
    with pytest.raises(hookloop.ConfigurationError, match="overrides backward\\(\\), and amp runs the backward itself"):
        _fit(fw, tmp_path, _module(fw, backward=backward), max_epochs=1, precision="bf16-mixed")


def test_to_yaml_writes_best_k_models(tmp_path):
    import yaml

    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        mc = fw.ModelCheckpoint(dirpath=tmp_path / name / "ckpts", monitor="val_loss", save_top_k=2)
        _fit(fw, tmp_path / name, _module(fw), max_epochs=3, callbacks=[mc])
        mc.to_yaml()
        with open(tmp_path / name / "ckpts" / "best_k_models.yaml") as f:
            written = yaml.safe_load(f)
        out[name] = {Path(k).name: round(v, 5) for k, v in written.items()}
    assert out["hookloop"] == out["lightning"]
    assert len(out["lightning"]) == 2


def test_a_subclass_calls_the_hooks_with_lightnings_arguments(tmp_path):
    """``super().on_train_end(trainer, pl_module)`` (and setup, on_train_epoch_end,
    on_validation_end) from a ModelCheckpoint subclass, as Lightning code writes them."""
    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        seen: list = []

        class Counting(fw.ModelCheckpoint):
            def setup(self, trainer, pl_module, stage):
                seen.append(("setup", stage))
                super().setup(trainer, pl_module, stage)

            def on_train_epoch_end(self, trainer, pl_module):
                seen.append(("epoch_end", trainer.current_epoch))
                super().on_train_epoch_end(trainer, pl_module)

            def on_validation_end(self, trainer, pl_module):
                super().on_validation_end(trainer, pl_module)

            def on_train_end(self, trainer, pl_module):
                seen.append(("train_end", trainer.global_step))
                super().on_train_end(trainer, pl_module)

        mc = Counting(dirpath=tmp_path / name / "ckpts", monitor="val_loss", save_top_k=-1)
        _fit(fw, tmp_path / name, _module(fw), max_epochs=2, callbacks=[mc])
        out[name] = (seen, sorted(Path(p).name for p in mc.best_k_models))
    assert out["hookloop"] == out["lightning"]


def test_save_last_link_with_a_url_dirpath_is_refused_at_setup(tmp_path):
    messages = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        callback = fw.ModelCheckpoint(dirpath="memory://not-a-filesystem-path", save_last="link")
        trainer = _trainer(fw, str(tmp_path / name))
        with pytest.raises(ValueError, match="save_last='link'.* is only supported for local file paths") as info:
            callback.setup(trainer=trainer, pl_module=_module(fw), stage="fit")
        messages[name] = str(info.value)
    assert "memory://not-a-filesystem-path" in messages["hookloop"]


def test_another_checkpoint_name_last_is_refused(tmp_path, monkeypatch):
    import hookloop

    assert frameworks.load("lightning").ModelCheckpoint.CHECKPOINT_NAME_LAST == hookloop.ModelCheckpoint.CHECKPOINT_NAME_LAST
    monkeypatch.setattr(hookloop.ModelCheckpoint, "CHECKPOINT_NAME_LAST", "last-{epoch}")
    fw = frameworks.load("hookloop")
    mc = fw.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    with pytest.raises(hookloop.ConfigurationError, match="CHECKPOINT_NAME_LAST='last-\\{epoch\\}'.*last_model_path"):
        _fit(fw, tmp_path, _module(fw), max_epochs=1, callbacks=[mc])


@pytest.mark.parametrize("logger", [False, True])
def test_save_last_holds_the_last_epoch_where_lightnings_holds_the_newest_saved(tmp_path, logger):
    """decisions.md "`save_last` and hookloop's resume `last.ckpt`": with ``save_last=True``
    (and a ``dirpath``) Lightning 2.6.6 writes ``last.ckpt`` only when it saves a top-k file
    (a copy of the newest one: epoch 3 of 5 here, where the monitored value last improved);
    hookloop writes it at every epoch's end, so it holds the last epoch (4). The same module
    under both; the epochs whose state each framework serialised."""
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger

    import hookloop

    values = [5.0, 1.0, 3.0, 0.5, 4.0]
    found = {}
    for framework in ("lightning", "hookloop"):
        base = pl.LightningModule if framework == "lightning" else hookloop.Module

        class Module(base):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(4, 1)
                self.saves: list = []

            def training_step(self, batch, batch_idx):
                return self.layer(batch[0]).pow(2).mean()

            def validation_step(self, batch, batch_idx):
                self.log("v", torch.tensor(values[self.current_epoch]))

            def on_save_checkpoint(self, checkpoint):
                self.saves.append(self.current_epoch)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        root = tmp_path / framework
        data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
        common = dict(max_epochs=5, default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
        if framework == "lightning":
            callback = pl.callbacks.ModelCheckpoint(dirpath=root / "ck", monitor="v", save_top_k=1, save_last=True)
            trainer = pl.Trainer(logger=CSVLogger(root) if logger else False, callbacks=[callback], accelerator="cpu",
                                 **common)
        else:
            callback = hookloop.ModelCheckpoint(dirpath=root / "ck", monitor="v", save_top_k=1, save_last=True)
            trainer = hookloop.Trainer(logger=logger, callbacks=[callback], **common)
        module = Module()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, data, data)
        last = torch.load(root / "ck" / "last.ckpt", map_location="cpu", weights_only=False)
        found[framework] = (module.saves, last["epoch"], sorted(os.listdir(root / "ck")))
    assert found["lightning"] == ([0, 0, 1, 1, 3, 3], 3, ["epoch=3-step=8.ckpt", "last.ckpt"])
    assert found["hookloop"] == ([0, 1, 2, 3, 4], 4, ["epoch=3-step=8.ckpt", "last.ckpt"])
