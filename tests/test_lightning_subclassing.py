"""Issue 35 item 8: Lightning code subclasses hookloop's Lightning-named plugins
(``EarlyStopping``, ``TQDMProgressBar``, the averaging plugin's ``EMA``/``SWA``) and
overrides a hook with Lightning's arguments (``on_train_epoch_end(self, trainer,
pl_module)``, ``setup(self, trainer, pl_module, stage)``), calling ``super()``.

Each case runs the same subclass body on pytorch-lightning 2.6.6 and on hookloop (only
the base class differs) and compares what the overrides saw and what the run did. The
plugin contract stays as strict for plugin authors: the same override given as
``plugins=`` (not Lightning's ``callbacks=``) is refused as before.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import tiny_data

# the reference (make test installs pytorch-lightning==2.6.6): a missing one fails, never skips
import pytorch_lightning as pl  # noqa: E402


def make_module(base):
    class Scripted(base):
        """Logs a scripted ``val_loss`` (one value per validation) so both stop alike."""

        def __init__(self, values=(1.0, 0.9, 0.95, 0.96, 0.97, 0.98, 0.99, 1.0)):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 3)
            self.values, self.validations = list(values), 0

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
    return DataLoader(tiny_data(32), batch_size=8), DataLoader(tiny_data(16, seed=5), batch_size=8)


def fit(framework: str, callbacks, tmp_path, **kw):
    if framework == "lightning":
        module = make_module(pl.LightningModule)()
        trainer = pl.Trainer(default_root_dir=str(tmp_path / "pl"), logger=False, enable_model_summary=False,
                             num_sanity_val_steps=0, accelerator="cpu", devices=1, callbacks=callbacks, **kw)
    else:
        module = make_module(hookloop.Module)()
        trainer = hookloop.Trainer(default_root_dir=str(tmp_path / "hl"), logger=False, num_sanity_val_steps=0,
                                   callbacks=callbacks, **kw)
    trainer.fit(module, *loaders())
    return trainer


def early_stopping_subclass(base):
    class RecordingStopping(base):
        """Lightning's own tests subclass EarlyStopping this way (test_early_stopping.py)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen: list = []

        def on_train_start(self, trainer, pl_module):
            self.seen.append(("train_start", type(pl_module).__name__))

        def on_validation_end(self, trainer, pl_module):
            self.seen.append(("validation_end", trainer.current_epoch, self.wait_count))
            super().on_validation_end(trainer, pl_module)

        def on_train_epoch_end(self, trainer, pl_module):
            super().on_train_epoch_end(trainer, pl_module)
            self.seen.append(("train_epoch_end", trainer.current_epoch, self.wait_count, trainer.should_stop))

    return RecordingStopping


@pytest.mark.parametrize("check_on_train_epoch_end", [None, False])
def test_an_early_stopping_subclass_with_lightning_hooks_runs_as_lightnings(tmp_path, check_on_train_epoch_end):
    runs = {}
    for framework, base in (("lightning", pl.callbacks.EarlyStopping), ("hookloop", hookloop.EarlyStopping)):
        stopper = early_stopping_subclass(base)(monitor="val_loss", patience=2,
                                                check_on_train_epoch_end=check_on_train_epoch_end)
        trainer = fit(framework, [stopper], tmp_path, max_epochs=8, enable_progress_bar=False)
        runs[framework] = (stopper.seen, trainer.current_epoch, stopper.wait_count)
    assert runs["hookloop"] == runs["lightning"]
    assert runs["lightning"][1] < 8  # it stopped early, through the overridden hooks' super()


def test_an_override_that_does_not_call_super_replaces_the_stopping_check(tmp_path):
    """Lightning's semantics: the override is the hook; without super() no check runs."""
    ends = {}
    for framework, base in (("lightning", pl.callbacks.EarlyStopping), ("hookloop", hookloop.EarlyStopping)):
        class Silent(base):
            def on_validation_end(self, trainer, pl_module):
                pass

            def on_train_epoch_end(self, trainer, pl_module):
                pass

        trainer = fit(framework, [Silent(monitor="val_loss", patience=1)], tmp_path, max_epochs=4,
                      enable_progress_bar=False)
        ends[framework] = trainer.current_epoch
    assert ends["hookloop"] == ends["lightning"] == 4


def test_a_progress_bar_subclass_with_lightning_hooks_runs_as_lightnings(tmp_path, capsys):
    runs = {}
    for framework, base in (("lightning", pl.callbacks.TQDMProgressBar), ("hookloop", hookloop.TQDMProgressBar)):
        class CountingBar(base):
            def __init__(self):
                super().__init__(refresh_rate=1)
                self.seen: list = []

            def on_train_start(self, trainer, pl_module):
                super().on_train_start(trainer, pl_module)
                self.seen.append("train_start")

            def on_train_epoch_end(self, trainer, pl_module):
                super().on_train_epoch_end(trainer, pl_module)
                self.seen.append(("train_epoch_end", trainer.current_epoch, self.train_progress_bar.n))

            def on_validation_end(self, trainer, pl_module):
                super().on_validation_end(trainer, pl_module)
                self.seen.append(("validation_end", trainer.current_epoch))

        bar = CountingBar()
        fit(framework, [bar], tmp_path, max_epochs=2)
        runs[framework] = bar.seen
    capsys.readouterr()
    assert runs["hookloop"] == runs["lightning"]


def test_an_ema_subclass_setup_is_called_as_lightning_calls_it(tmp_path):
    averaging = pytest.importorskip("hookloop_averaging")
    from pytorch_lightning.callbacks import EMAWeightAveraging

    runs = {}
    for framework, base in (("lightning", EMAWeightAveraging), ("hookloop", averaging.EMA)):
        class SetupRecording(base):
            def __init__(self):
                super().__init__(decay=0.9)
                self.stages: list = []

            def setup(self, trainer, pl_module, stage):
                super().setup(trainer, pl_module, stage)
                self.stages.append((stage, type(pl_module).__name__))

            def on_train_epoch_end(self, trainer, pl_module):  # EMA implements no such hook
                self.stages.append(("epoch_end", trainer.current_epoch))

        ema = SetupRecording()
        trainer = fit(framework, [ema], tmp_path, max_epochs=2, enable_progress_bar=False)
        trainer.validate(trainer.lightning_module if framework == "lightning" else trainer.module,
                         loaders()[1], verbose=False)
        runs[framework] = ema.stages
    assert runs["hookloop"] == runs["lightning"]


def test_the_plugin_contract_still_refuses_lightning_arguments_outside_callbacks(tmp_path):
    """Given as ``plugins=`` (a plugin, not Lightning's callbacks=), the override is a hook
    implementation under the contract: its ``pl_module`` is refused, as before."""
    stopper = early_stopping_subclass(hookloop.EarlyStopping)(monitor="val_loss")
    with pytest.raises(hookloop.PluginValidationError, match="pl_module"):
        hookloop.Trainer(default_root_dir=str(tmp_path), plugins=[stopper], logger=False)


def test_a_hookloop_style_override_stays_a_hook_implementation(tmp_path):
    """An undecorated override with the event's arguments keeps its base's hookimpl (the
    contract's rule), in ``callbacks=`` too."""

    class Counting(hookloop.EarlyStopping):
        calls = 0

        def on_train_epoch_end(self, trainer):
            Counting.calls += 1

    fit("hookloop", [Counting(monitor="val_loss")], tmp_path, max_epochs=2, enable_progress_bar=False)
    assert Counting.calls == 2


# ---------------------------------------------------------------------------------------
# LightningCLI.add_lightning_class_args with a Callback subclass (Lightning's fine-tuning
# example: MilestonesFinetuning(BaseFinetuning) added under "finetuning")
# ---------------------------------------------------------------------------------------


def finetuning_cli(framework: str, args: list, tmp_path):
    if framework == "lightning":
        from pytorch_lightning.cli import LightningCLI

        module_base, data_base, finetuning_base = pl.LightningModule, pl.LightningDataModule, pl.callbacks.BaseFinetuning
    else:
        LightningCLI = hookloop.LightningCLI  # noqa: N806
        module_base, data_base, finetuning_base = hookloop.Module, hookloop.DataModule, hookloop.BaseFinetuning

    class MilestonesFinetuning(finetuning_base):  # the example's, unchanged
        def __init__(self, milestones: tuple = (5, 10), train_bn: bool = False):
            super().__init__()
            self.milestones = milestones
            self.train_bn = train_bn

        def freeze_before_training(self, pl_module):
            self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

        def finetune_function(self, pl_module, epoch: int, optimizer):
            if epoch == self.milestones[0]:
                self.unfreeze_and_add_param_group(modules=pl_module.feature_extractor[-2:], optimizer=optimizer,
                                                  train_bn=self.train_bn)
            elif epoch == self.milestones[1]:
                self.unfreeze_and_add_param_group(modules=pl_module.feature_extractor[:-2], optimizer=optimizer,
                                                  train_bn=self.train_bn)

    class Net(module_base):
        def __init__(self, lr: float = 0.05):
            super().__init__()
            torch.manual_seed(0)
            self.lr = lr
            self.feature_extractor = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                                         torch.nn.ReLU())
            self.head = torch.nn.Linear(8, 3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.head(self.feature_extractor(x)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=self.lr)

    class Data(data_base):
        def __init__(self, batch_size: int = 8):
            super().__init__()
            self.batch_size = batch_size

        def train_dataloader(self):
            return DataLoader(tiny_data(32), batch_size=self.batch_size)

    class FinetuningCLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_lightning_class_args(MilestonesFinetuning, "finetuning")

    cli = FinetuningCLI(Net, Data, run=False, args=args, save_config_kwargs={"overwrite": True},
                        trainer_defaults={"accelerator": "cpu", "enable_progress_bar": False, "logger": False,
                                          "enable_checkpointing": False, "default_root_dir": str(tmp_path / framework)})
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    weights = [p.detach().clone() for p in cli.model.parameters()]
    return cli.trainer, weights


def test_a_callback_added_with_add_lightning_class_args_trains_as_lightnings(tmp_path, monkeypatch):
    import sys
    import warnings

    monkeypatch.setattr(sys, "argv", ["finetuning.py"])
    warnings.filterwarnings("ignore")
    args = ["--finetuning.milestones", "[1,2]", "--trainer.max_epochs", "3"]
    (pl_trainer, pl_weights), (hl_trainer, hl_weights) = (finetuning_cli(f, args, tmp_path)
                                                          for f in ("lightning", "hookloop"))
    groups = len(pl_trainer.optimizers[0].param_groups)
    assert groups == 3  # the backbone unfrozen in two steps, as the example means
    assert len(hl_trainer.optimizers[0].param_groups) == groups
    assert any(type(cb).__name__ == "MilestonesFinetuning" for cb in hl_trainer.callbacks)
    for a, b in zip(pl_weights, hl_weights, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
