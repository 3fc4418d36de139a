"""Issue 35: what the loops check and say, as pytorch-lightning 2.6.6 (its unit tests of
limit_batches, val_check_interval, overfit_batches and the evaluation loop), each case run
under Lightning and under hookloop in this process and compared:

* the info line for a batch limit given as ``1`` or ``1.0`` (one batch, or the whole loader);
* a module's evaluation batch hooks get ``dataloader_idx`` only with several loaders, and a
  step or batch hook that cannot take it with several loaders is Lightning's ``RuntimeError``;
* ``set_epoch`` on the training sampler behind a ``batch_sampler``;
* ``overfit_batches`` with a sampler that is not sequential: Lightning's warning, and the
  same first batches;
* the refusals of ``val_check_interval`` with Lightning's words.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

import hookloop
from conftest import tiny_data

# the reference (make test installs pytorch-lightning==2.6.6): a missing one fails, never skips
import pytorch_lightning as pl  # noqa: E402

FRAMEWORKS = {"lightning": (pl.Trainer, pl.LightningModule), "hookloop": (hookloop.Trainer, hookloop.Module)}


def make_module(base, **hooks):
    class Module(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 3)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("valid_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    for name, function in hooks.items():
        setattr(Module, name, function)
    return Module()


def trainer_of(framework: str, tmp_path, **kw):
    kw.setdefault("max_epochs", 1)
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    if framework == "lightning":
        kw.update(accelerator="cpu", devices=1)
    return FRAMEWORKS[framework][0](default_root_dir=str(tmp_path / framework), enable_progress_bar=False,
                                    enable_model_summary=False, **kw)


@pytest.mark.parametrize(("kwargs", "lines"), [
    ({"limit_train_batches": 1}, 1), ({"limit_train_batches": 1.0}, 1), ({"limit_val_batches": 1}, 1),
    ({"limit_test_batches": 1.0}, 1), ({"limit_predict_batches": 1}, 1), ({"overfit_batches": 1.0}, 1),
    ({"val_check_interval": 1}, 1), ({"val_check_interval": 1.0}, 1),
    ({"overfit_batches": 1, "limit_train_batches": 1, "limit_test_batches": 1.0}, 2),  # train's replaced
    ({"fast_dev_run": True, "limit_val_batches": 1}, 0),  # only overfit_batches is read
    ({"limit_train_batches": 2, "limit_val_batches": 0.5}, 0), ({}, 0),
])
def test_a_limit_of_one_is_said_as_lightning_says_it(kwargs, lines, tmp_path, caplog):
    said = {}
    for framework in FRAMEWORKS:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            trainer_of(framework, tmp_path, **kwargs)
        # Lightning ends the 1.0 lines with two full stops
        said[framework] = [r.getMessage().rstrip(".") for r in caplog.records if "was configured so" in r.getMessage()]
    assert said["hookloop"] == said["lightning"]
    assert len(said["hookloop"]) == lines


def test_evaluation_batch_hooks_get_dataloader_idx_only_with_several_loaders(tmp_path):
    seen = {}
    for framework, (_, base) in FRAMEWORKS.items():
        calls: list = []

        def on_validation_batch_start(self, batch, batch_idx, *index):
            calls.append(("start", batch_idx, index))

        def on_validation_batch_end(self, outputs, batch, batch_idx, *index):
            calls.append(("end", batch_idx, index))

        module = make_module(base, on_validation_batch_start=on_validation_batch_start,
                             on_validation_batch_end=on_validation_batch_end)
        loader = DataLoader(tiny_data(8), batch_size=4)
        trainer_of(framework, tmp_path).validate(module, loader, verbose=False)
        trainer_of(framework, tmp_path).validate(module, [loader, loader], verbose=False)
        seen[framework] = calls
    assert seen["hookloop"] == seen["lightning"]
    assert ("start", 0, ()) in seen["hookloop"] and ("end", 1, (1,)) in seen["hookloop"]


def test_a_batch_hook_without_dataloader_idx_runs_with_one_loader(tmp_path):
    for framework, (_, base) in FRAMEWORKS.items():
        calls: list = []
        module = make_module(base, on_test_batch_end=lambda self, outputs, batch, batch_idx: calls.append(batch_idx),
                             test_step=lambda self, batch, batch_idx: None)
        trainer_of(framework, tmp_path).test(module, DataLoader(tiny_data(8), batch_size=4), verbose=False)
        assert calls == [0, 1], framework


@pytest.mark.parametrize("hook", ["validation_step", "on_validation_batch_start", "predict_step"])
def test_several_loaders_need_dataloader_idx_as_lightning_says(hook, tmp_path):
    messages = {}
    for framework, (_, base) in FRAMEWORKS.items():
        if hook == "on_validation_batch_start":
            module = make_module(base, on_validation_batch_start=lambda self, batch, batch_idx: None)
        else:
            module = make_module(base, **{hook: lambda self, batch, batch_idx: None})
        module.__class__.__name__ = "MyModel"
        loaders = [DataLoader(tiny_data(8), batch_size=4)] * 2
        run = trainer_of(framework, tmp_path)
        with pytest.raises(RuntimeError) as raised:
            if hook == "predict_step":
                run.predict(module, loaders)
            else:
                run.validate(module, loaders, verbose=False)
        messages[framework] = str(raised.value)
    assert messages["hookloop"] == messages["lightning"]


def test_set_epoch_reaches_the_training_sampler_behind_a_batch_sampler(tmp_path):
    epochs = {}
    for framework, (_, base) in FRAMEWORKS.items():
        calls: list = []
        data = tiny_data(16)
        sampler = RandomSampler(data)
        sampler.set_epoch = calls.append
        loader = DataLoader(data, batch_sampler=BatchSampler(sampler, 4, drop_last=True))
        trainer_of(framework, tmp_path, max_epochs=3, limit_val_batches=0).fit(make_module(base), loader)
        epochs[framework] = calls
    assert epochs["hookloop"] == epochs["lightning"] == [0, 1, 2]


class EveryOther(Sampler):
    """Not sequential: even indices, then odd ones."""

    def __init__(self, data):
        self.n = len(data)

    def __iter__(self):
        return iter(list(range(0, self.n, 2)) + list(range(1, self.n, 2)))

    def __len__(self):
        return self.n


def test_overfit_batches_makes_any_sampler_sequential_with_lightnings_warning(tmp_path):
    runs = {}
    for framework, (_, base) in FRAMEWORKS.items():
        firsts: list = []

        def training_step(self, batch, batch_idx):
            firsts.append(batch[0][0, 0].item())
            return F.cross_entropy(self.net(batch[0]), batch[1])

        module = make_module(base, training_step=training_step)
        data = tiny_data(32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer_of(framework, tmp_path, max_epochs=2, overfit_batches=2, num_sanity_val_steps=0).fit(
                module, DataLoader(data, batch_size=4, sampler=EveryOther(data)),
                DataLoader(data, batch_size=4, sampler=EveryOther(data)))
        said = sorted(str(w.message) for w in caught if "requested to overfit" in str(w.message))
        runs[framework] = (firsts, said)
    assert runs["hookloop"] == runs["lightning"]
    assert len(runs["hookloop"][1]) == 2  # the train and the val loader


def test_val_check_interval_refusals_use_lightnings_words(tmp_path):
    for framework, (_, base) in FRAMEWORKS.items():
        with pytest.raises(pl.utilities.exceptions.MisconfigurationException if framework == "lightning"
                           else hookloop.ConfigurationError,
                           match="`val_check_interval` should be an integer or a time-based duration"):
            trainer_of(framework, tmp_path, val_check_interval=0.5, check_val_every_n_epoch=None)
        run = trainer_of(framework, tmp_path, limit_train_batches=3, val_check_interval=5)
        with pytest.raises(ValueError, match=r"`val_check_interval` \(5\) must be less than or equal to the "
                                             r"number of the training batches \(3\)"):
            run.fit(make_module(base), DataLoader(tiny_data(16), batch_size=2), DataLoader(tiny_data(4)))


@pytest.mark.parametrize("kwargs", [{}, {"max_steps": 2}, {"max_time": {"minutes": 5}}, {"fast_dev_run": 2},
                                    {"max_epochs": 2}])
def test_max_epochs_not_given_is_settled_and_warned_as_lightning(kwargs, tmp_path):
    from lightning_fabric.utilities.warnings import PossibleUserWarning as LightningPossibleUserWarning

    from hookloop.contract.errors import PossibleUserWarning

    seen = {}
    for framework, (_, base) in FRAMEWORKS.items():
        category = LightningPossibleUserWarning if framework == "lightning" else PossibleUserWarning
        module = make_module(base, training_step=_stop_at_first_batch)
        run = trainer_of(framework, tmp_path, limit_train_batches=1, limit_val_batches=0,
                         **{"max_epochs": None, **kwargs})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run.fit(module, DataLoader(tiny_data(8), batch_size=4))
        said = [str(w.message) for w in caught if issubclass(w.category, category) and "max_epochs" in str(w.message)]
        seen[framework] = (said, run.max_epochs)
    assert seen["hookloop"] == seen["lightning"]
    assert bool(seen["hookloop"][0]) == (kwargs == {})


def _stop_at_first_batch(self, batch, batch_idx):
    self.trainer.should_stop = True
    return F.cross_entropy(self.net(batch[0]), batch[1])


def _frozen_backbone_run(framework: str, root) -> tuple[list, float, list]:
    """A module whose BatchNorm backbone the user keeps in eval mode (fine-tuning a head):
    the backbone's mode in every training step and validation, its running mean after two
    epochs, and the eval-mode warnings at the start of training."""
    base = pl.LightningModule if framework == "lightning" else hookloop.Module
    seen: list = []

    class FrozenBackbone(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
            self.backbone.eval()
            self.head = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            seen.append(("train", self.current_epoch, self.backbone.training, self.head.training))
            return self.head(self.backbone(batch[0])).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            seen.append(("val", self.current_epoch, self.backbone.training, self.head.training))

        def configure_optimizers(self):
            return torch.optim.SGD(self.head.parameters(), lr=0.1)

    trainer_class = pl.Trainer if framework == "lightning" else hookloop.Trainer
    extra = dict(accelerator="cpu") if framework == "lightning" else {}
    trainer = trainer_class(max_epochs=2, default_root_dir=root, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1, **extra)
    data = DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    module = FrozenBackbone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data, data)
    said = [str(w.message).split(".")[0] for w in caught if "eval mode" in str(w.message)]
    return seen, float(module.backbone[1].running_mean.abs().sum()), said


def test_a_submodule_kept_in_eval_mode_stays_so_as_lightning_keeps_it(tmp_path):
    """Lightning 2.6 trains the modules in the modes they have and gives every submodule its
    own mode back after validation; hookloop called ``model.train()`` at every epoch's start,
    so a frozen BatchNorm backbone trained in train mode (its running statistics moved:
    a silently different function). Lightning's warning for the eval-mode module too."""
    lightning = _frozen_backbone_run("lightning", tmp_path / "lightning")
    ours = _frozen_backbone_run("hookloop", tmp_path / "hookloop")
    assert lightning[0] == ours[0]
    assert [s[2] for s in lightning[0]] == [False] * len(lightning[0])  # the backbone never trains
    assert lightning[1] == ours[1] == 0.0
    # the Sequential, its Linear and its BatchNorm
    assert lightning[2] == ours[2] == ["Found 3 module(s) in eval mode at the start of training"]


def test_val_dataloaders_is_a_list_and_train_dataloader_the_loader_given(tmp_path):
    """decisions.md "Lightning's unit tests: the differences left": one validation loader is
    ``[loader]`` (Lightning: the loader), and with ``overfit_batches`` ``train_dataloader`` is
    the loader given (Lightning: the one it runs, its sampler made sequential). Pinned
    against pytorch-lightning 2.6.6 running the same fit."""
    data = DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2, shuffle=True)
    val = DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    found = {}
    for framework in ("lightning", "hookloop"):
        base = pl.LightningModule if framework == "lightning" else hookloop.Module

        class Module(base):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                return self.layer(batch[0]).sum()

            def validation_step(self, batch, batch_idx):
                pass

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        trainer_class = pl.Trainer if framework == "lightning" else hookloop.Trainer
        extra = dict(accelerator="cpu") if framework == "lightning" else {}
        trainer = trainer_class(max_epochs=1, overfit_batches=2, default_root_dir=tmp_path / framework, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                **extra)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Module(), data, val)
        found[framework] = (trainer.val_dataloaders, trainer.train_dataloader)
    assert found["lightning"][0] is val and found["hookloop"][0] == [val]
    assert found["lightning"][1] is not data and found["hookloop"][1] is data
