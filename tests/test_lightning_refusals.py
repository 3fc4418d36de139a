"""Issue 35 item 10: what pytorch-lightning 2.6.6 refuses, hookloop refuses too (the run
went on silently before): a ``LearningRateMonitor`` without a logger, parameter groups of
one optimizer sharing a ``name``, ``self.log(on_step=False, on_epoch=False)`` from a
callback, a step or batch hook whose ``dataloader_idx`` has no default with one loader.

Each case runs the same module and callbacks under both trainers in this process and
checks that both refuse, hookloop with an error a Lightning user's ``except`` catches
(Lightning's ``RuntimeError`` is one here too) and Lightning's words in its message.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import tiny_data

# the reference (make test installs pytorch-lightning==2.6.6): a missing one fails, never skips
import pytorch_lightning as pl  # noqa: E402


def make_module(base, variant: str):
    class Module(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            if variant == "duplicate_group_names":
                return torch.optim.SGD([{"params": [self.net.weight], "name": "body"},
                                        {"params": [self.net.bias], "name": "body"}], lr=0.1)
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if variant == "step_dataloader_idx":
        def validation_step(self, batch, batch_idx, dataloader_idx):
            self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        Module.validation_step = validation_step
    if variant == "hook_dataloader_idx":
        def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx):
            pass

        Module.on_validation_batch_end = on_validation_batch_end
    return Module()


def callbacks(framework: str, variant: str) -> list:
    lightning = framework == "lightning"
    if variant in ("no_logger", "duplicate_group_names", "named_groups"):
        return [(pl.callbacks.LearningRateMonitor if lightning else hookloop.LearningRateMonitor)()]
    if variant == "log_nowhere":
        class LogsNowhere(pl.Callback if lightning else hookloop.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                pl_module.log("seen", 1.0, on_step=False, on_epoch=False)

        return [LogsNowhere()]
    return []


def fit(framework: str, variant: str, tmp_path, sanity: int = 0):
    logger: object = variant != "no_logger"
    loaders = DataLoader(tiny_data(16), batch_size=8), DataLoader(tiny_data(16, seed=5), batch_size=8)
    if framework == "lightning":
        if logger:
            logger = pl.loggers.CSVLogger(str(tmp_path / "pl"))
        module = make_module(pl.LightningModule, variant)
        trainer = pl.Trainer(default_root_dir=str(tmp_path / "pl"), logger=logger, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=sanity, accelerator="cpu",
                             devices=1, max_epochs=1, callbacks=callbacks(framework, variant))
    else:
        module = make_module(hookloop.Module, variant)
        trainer = hookloop.Trainer(default_root_dir=str(tmp_path / "hl"), logger=logger, enable_progress_bar=False,
                                   num_sanity_val_steps=sanity, max_epochs=1, callbacks=callbacks(framework, variant))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, *loaders)
    return trainer


REFUSALS = {
    # variant: (what Lightning's message says, the builtin type Lightning's error is)
    "no_logger": ("Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger", Exception),
    "duplicate_group_names": ("A single `Optimizer` cannot have multiple parameter groups with identical `name` "
                              "values. lr-SGD has duplicated parameter group names {'body'}", Exception),
    "log_nowhere": ("on_step=False, on_epoch=False)` is not useful", Exception),
    "step_dataloader_idx": ("You provided only a single `val_dataloader`, but have included `dataloader_idx` in "
                            "`Module.validation_step()`", RuntimeError),
    "hook_dataloader_idx": ("You provided only a single `val_dataloader`, but have included `dataloader_idx` in "
                            "`Module.on_validation_batch_end()`", RuntimeError),
}


@pytest.mark.parametrize("variant", list(REFUSALS))
def test_hookloop_refuses_what_lightning_refuses(tmp_path, variant):
    words, kind = REFUSALS[variant]
    with pytest.raises(kind) as lightning:
        fit("lightning", variant, tmp_path)
    assert words in str(lightning.value)  # the reference still says so
    with pytest.raises(kind) as ours:
        fit("hookloop", variant, tmp_path)
    assert isinstance(ours.value, hookloop.ConfigurationError)
    assert words in str(ours.value)


def test_the_dataloader_idx_refusal_comes_at_the_sanity_check_as_lightnings(tmp_path):
    """Lightning checks when each evaluation starts: the sanity check is the first, before
    any training step."""
    for framework in ("lightning", "hookloop"):
        with pytest.raises(RuntimeError, match=re.escape("Either remove the argument or give it a default")):
            fit(framework, "step_dataloader_idx", tmp_path, sanity=1)


def test_named_parameter_groups_are_logged_under_their_names_as_lightnings(tmp_path):
    """The monitor's keys: Lightning suffixes a group's ``name`` (``lr-SGD/body``)."""

    class Named:
        def configure_optimizers(self):
            return torch.optim.SGD([{"params": [self.net.weight], "name": "body"},
                                    {"params": [self.net.bias], "name": "head"}], lr=0.1)

    found = {}
    for framework, base in (("lightning", pl.LightningModule), ("hookloop", hookloop.Module)):
        module = make_module(base, "named_groups")
        type(module).configure_optimizers = Named.configure_optimizers
        root = tmp_path / framework
        if framework == "lightning":
            trainer = pl.Trainer(default_root_dir=str(root), logger=pl.loggers.CSVLogger(str(root)),
                                 enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                 accelerator="cpu", devices=1, max_epochs=1,
                                 callbacks=callbacks(framework, "named_groups"))
        else:
            trainer = hookloop.Trainer(default_root_dir=str(root), enable_progress_bar=False, num_sanity_val_steps=0,
                                       max_epochs=1, callbacks=callbacks(framework, "named_groups"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(tiny_data(16), batch_size=8))
        found[framework] = _lr_keys_written(root)
    assert found["hookloop"] == found["lightning"] == ["lr-SGD/body", "lr-SGD/head"]


def _lr_keys_written(root) -> list[str]:
    """The ``lr-*`` columns of the metrics.csv the run's CSV logger wrote."""
    import csv

    (path,) = root.rglob("metrics.csv")
    with open(path) as f:
        header = next(csv.reader(f))
    return sorted(k for k in header if k.startswith("lr-"))


@pytest.mark.parametrize("kwargs, words", [
    (dict(swa_epoch_start=0, swa_lrs=0.1), ">0 integer or a float between 0 and 1"),
    (dict(swa_epoch_start=1.5, swa_lrs=0.1), ">0 integer or a float between 0 and 1"),
    (dict(swa_epoch_start=-1, swa_lrs=0.1), ">0 integer or a float between 0 and 1"),
    (dict(swa_epoch_start=5, swa_lrs=[0.2, 1]), "positive float, or a list of positive floats"),
    (dict(swa_epoch_start=5, swa_lrs=1), "positive float, or a list of positive floats"),
])
def test_stochastic_weight_averaging_refuses_lightnings_arguments_in_its_words(kwargs, words):
    """Lightning's test_swa_raises: the same arguments refused by both, Lightning's words in
    hookloop's message (an int learning rate is refused by both)."""
    from hookloop_averaging import SWA

    from hookloop.contract.errors import MisconfigurationException

    with pytest.raises(pl.utilities.exceptions.MisconfigurationException, match=re.escape(words)):
        pl.callbacks.StochasticWeightAveraging(**kwargs)
    with pytest.raises(MisconfigurationException, match=re.escape(words)):
        SWA(**kwargs)
