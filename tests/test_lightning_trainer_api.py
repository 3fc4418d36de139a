"""Issue 35, item 3: the Trainer attributes Lightning code reads, and the arguments and
names it passes, as pytorch-lightning 2.6.6 has them.

Every case runs the same code under Lightning 2.6.6 and under hookloop, in this process,
and compares what each Trainer reports: ``lightning_module``, ``early_stopping_callback(s)``,
``checkpoint_callbacks``, ``progress_bar_callback``, ``num_*_batches``, ``limit_*_batches``;
``min_epochs``/``min_steps`` against ``should_stop`` (early stopping, a callback);
``max_epochs=-1``/``max_steps=-1``; ``MisconfigurationException``; and the refusals of the
Lightning names hookloop does not have, each naming what to use instead.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

FRAMEWORKS = ("lightning", "hookloop")


def _fw(name: str) -> types.SimpleNamespace:
    """The names a ported script imports, from Lightning 2.6.6 or from hookloop."""
    if name == "lightning":
        warnings.filterwarnings("ignore")
        import pytorch_lightning as pl
        from pytorch_lightning.utilities.exceptions import MisconfigurationException

        def trainer(root, **kw):
            kw.setdefault("enable_progress_bar", False)
            kw.setdefault("enable_checkpointing", False)
            return pl.Trainer(accelerator="cpu", devices=1, default_root_dir=root, logger=False,
                              enable_model_summary=False, **kw)

        return types.SimpleNamespace(
            Trainer=trainer, Module=pl.LightningModule, Callback=pl.Callback, seed=pl.seed_everything,
            EarlyStopping=pl.callbacks.EarlyStopping, ModelCheckpoint=pl.callbacks.ModelCheckpoint,
            TQDMProgressBar=pl.callbacks.TQDMProgressBar, OnExceptionCheckpoint=pl.callbacks.OnExceptionCheckpoint,
            MisconfigurationException=MisconfigurationException)
    from hookloop.contract.errors import MisconfigurationException

    def trainer(root, **kw):
        kw.setdefault("enable_progress_bar", False)
        kw.setdefault("enable_checkpointing", False)
        return hookloop.Trainer(accelerator="cpu", default_root_dir=root, logger=False,
                                enable_model_summary=False, **kw)

    return types.SimpleNamespace(
        Trainer=trainer, Module=hookloop.Module, Callback=hookloop.Callback, seed=hookloop.seed_everything,
        EarlyStopping=hookloop.EarlyStopping, ModelCheckpoint=hookloop.ModelCheckpoint,
        TQDMProgressBar=hookloop.TQDMProgressBar, OnExceptionCheckpoint=hookloop.OnExceptionCheckpoint,
        MisconfigurationException=MisconfigurationException)


def _data(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _module_class(fw, val_loss_rises: bool = False):
    class Model(fw.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.layer(x), y)
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            x, y = batch
            value = torch.tensor(float(self.current_epoch)) if val_loss_rises else F.cross_entropy(self.layer(x), y)
            self.log("val_loss", value)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", F.cross_entropy(self.layer(x), y))

        def predict_step(self, batch, batch_idx):
            return self.layer(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model


# ---------------------------------------------------------------------------------------
# The attributes
# ---------------------------------------------------------------------------------------


def _attributes_seen(name: str, root: str) -> dict:
    fw = _fw(name)
    seen: dict = {}

    class Look(fw.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["train_start"] = (trainer.lightning_module is pl_module, list(trainer.num_val_batches),
                                   list(trainer.num_sanity_val_batches), trainer.num_training_batches)

        def on_validation_start(self, trainer, pl_module):
            seen.setdefault("validation_start", []).append(
                (trainer.sanity_checking, list(trainer.num_val_batches), list(trainer.num_sanity_val_batches)))

        def on_test_start(self, trainer, pl_module):
            seen["test_start"] = list(trainer.num_test_batches)

        def on_predict_start(self, trainer, pl_module):
            seen["predict_start"] = list(trainer.num_predict_batches)

    fw.seed(0)
    # (one EarlyStopping and one ModelCheckpoint: several of each is issue 35's item 2)
    stopping = fw.EarlyStopping("val_loss/dataloader_idx_0", patience=5)
    checkpoint = fw.ModelCheckpoint(dirpath=f"{root}/a", monitor="val_loss/dataloader_idx_1")
    bar = fw.TQDMProgressBar(refresh_rate=0)
    on_exception = fw.OnExceptionCheckpoint(dirpath=f"{root}/x")
    trainer = fw.Trainer(root, max_epochs=1, limit_val_batches=3, num_sanity_val_steps=2, enable_progress_bar=True,
                         enable_checkpointing=True, callbacks=[Look(), stopping, on_exception, bar, checkpoint])
    before = {n: getattr(trainer, n) for n in ("lightning_module", "num_val_batches", "num_test_batches",
                                                "num_predict_batches", "num_sanity_val_batches")}
    model = _module_class(fw)()
    trainer.fit(model, DataLoader(_data(20), batch_size=4),
                [DataLoader(_data(24, 2), batch_size=4), DataLoader(_data(8, 3), batch_size=4)])
    trainer.test(model, DataLoader(_data(12, 4), batch_size=4), verbose=False)
    trainer.predict(model, DataLoader(_data(10, 5), batch_size=4))
    seen["before"] = before
    seen["after"] = trainer.lightning_module is model
    seen["early_stopping"] = (trainer.early_stopping_callback is stopping,
                              [c is stopping for c in trainer.early_stopping_callbacks])
    seen["checkpoints"] = [[c is e for e in (checkpoint, on_exception)] for c in trainer.checkpoint_callbacks]
    seen["bar"] = trainer.progress_bar_callback is bar
    quiet = fw.Trainer(root, max_epochs=1)
    seen["no_bar"] = (quiet.progress_bar_callback, quiet.early_stopping_callback, quiet.early_stopping_callbacks,
                      quiet.checkpoint_callbacks)
    return seen


def test_trainer_attributes_are_lightnings(tmp_path):
    """``lightning_module``, the callbacks' attributes and the per-loader batch counts read
    in hooks and after the runs: the same as Lightning 2.6.6's."""
    seen = {name: _attributes_seen(name, str(tmp_path / name)) for name in FRAMEWORKS}
    assert seen["hookloop"] == seen["lightning"]
    assert seen["hookloop"]["validation_start"][0] == (True, [3, 2], [2, 2])  # not vacuous
    assert seen["hookloop"]["checkpoints"] == [[False, True], [True, False]]


@pytest.mark.parametrize("kwargs", [
    {},
    {"limit_train_batches": 3, "limit_val_batches": 0.5, "limit_test_batches": 0, "limit_predict_batches": 1.0},
    {"fast_dev_run": 2},
    {"overfit_batches": 2, "limit_test_batches": 0.25},
])
def test_limit_attributes_are_lightnings(tmp_path, kwargs):
    """``trainer.limit_*_batches``: Lightning's values (1.0 when not given, fast_dev_run's
    and overfit_batches' counts), and a value set on the trainer takes effect."""
    values, counts = {}, {}
    for name in FRAMEWORKS:
        fw = _fw(name)
        trainer = fw.Trainer(str(tmp_path / name), max_epochs=1, **kwargs)
        values[name] = [getattr(trainer, f"limit_{s}_batches") for s in ("train", "val", "test", "predict")]
        trainer.limit_test_batches = 2
        trainer.test(_module_class(fw)(), DataLoader(_data(20), batch_size=4), verbose=False)
        counts[name] = (trainer.limit_test_batches, list(trainer.num_test_batches))
    assert values["hookloop"] == values["lightning"]
    assert counts["hookloop"] == counts["lightning"] == (2, [2])


def test_a_limit_set_on_the_trainer_is_checked():
    trainer = hookloop.Trainer(logger=False, enable_checkpointing=False)
    with pytest.raises(hookloop.ConfigurationError, match=r"trainer.limit_val_batches = -1: must be a number"):
        trainer.limit_val_batches = -1


# ---------------------------------------------------------------------------------------
# min_epochs / min_steps, max_epochs=-1 / max_steps=-1
# ---------------------------------------------------------------------------------------


def _stop_run(name: str, root: str, stop_at: str, batches: int = 5, **kwargs) -> dict:
    """Where training ends when ``should_stop`` comes early: from an EarlyStopping on a
    validation loss that rises (``stop_at="early_stopping"``), or from a callback at
    ``on_fit_start`` or after the second batch."""
    fw = _fw(name)
    seen: dict = {"validations": [], "epochs": []}

    class Stop(fw.Callback):
        def on_fit_start(self, trainer, pl_module):
            if stop_at == "fit_start":
                trainer.should_stop = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if stop_at == "batch" and trainer.global_step == 2:
                trainer.should_stop = True

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                seen["validations"].append((trainer.current_epoch, trainer.global_step))

        def on_train_epoch_end(self, trainer, pl_module):
            seen["epochs"].append((trainer.current_epoch, trainer.global_step))

    callbacks = [Stop()]
    if stop_at == "early_stopping":
        callbacks.append(fw.EarlyStopping("val_loss", patience=0))
    fw.seed(0)
    trainer = fw.Trainer(root, callbacks=callbacks, num_sanity_val_steps=0, **kwargs)
    trainer.fit(_module_class(fw, val_loss_rises=True)(), DataLoader(_data(4 * batches), batch_size=4),
                DataLoader(_data(8, 2), batch_size=4))
    # current_epoch after a stop inside an epoch is a documented difference (decisions.md,
    # "Stopping mid-epoch"): the epochs ended and their steps are compared instead
    seen["end"] = (trainer.global_step, trainer.should_stop)
    seen["limits"] = (trainer.min_epochs, trainer.min_steps)
    return seen


@pytest.mark.parametrize(("stop_at", "kwargs"), [
    ("early_stopping", {"max_epochs": 10, "min_epochs": 5}),
    ("early_stopping", {"max_epochs": 10, "min_steps": 17}),
    ("early_stopping", {"max_epochs": 10}),
    ("batch", {"max_epochs": 4}),
    ("batch", {"max_epochs": 4, "min_steps": 4}),
    ("batch", {"max_epochs": 4, "min_steps": 8}),
    ("batch", {"max_epochs": 4, "min_epochs": 2, "val_check_interval": 2}),
    ("fit_start", {"max_epochs": 3}),
    ("fit_start", {"max_epochs": 3, "min_steps": 3}),
    ("fit_start", {"max_epochs": 3, "min_epochs": 2}),
])
def test_min_epochs_and_min_steps_hold_should_stop_back_as_lightning(tmp_path, stop_at, kwargs):
    """``should_stop`` ends training only once ``min_epochs`` epochs and ``min_steps``
    steps are done (``min_steps`` alone: at least one epoch), with Lightning's epochs,
    steps and validations."""
    seen = {name: _stop_run(name, str(tmp_path / name), stop_at, **kwargs) for name in FRAMEWORKS}
    assert seen["hookloop"] == seen["lightning"]


@pytest.mark.parametrize("kwargs", [{"max_epochs": -1, "max_steps": 7}, {"max_epochs": 2, "max_steps": -1}])
def test_minus_one_is_no_limit_as_lightning(tmp_path, kwargs):
    ends = {}
    for name in FRAMEWORKS:
        fw = _fw(name)
        trainer = fw.Trainer(str(tmp_path / name), **kwargs)
        trainer.fit(_module_class(fw)(), DataLoader(_data(12), batch_size=4))
        # (current_epoch after a stop inside an epoch: decisions.md, "Stopping mid-epoch")
        ends[name] = (trainer.current_epoch if kwargs["max_epochs"] != -1 else None, trainer.global_step)
    assert ends["hookloop"] == ends["lightning"]


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"max_epochs": -2}, "max_epochs=-2 must be None or an integer >= 0, or -1 for no limit"),
    ({"min_steps": -1}, "min_steps=-1 must be None or an integer >= 0"),
    ({"min_epochs": 1.5}, "min_epochs=1.5 must be None or an integer >= 0"),
])
def test_bad_limits_are_refused_naming_them(kwargs, says):
    with pytest.raises(hookloop.ConfigurationError, match=says.replace(".", r"\.")):
        hookloop.Trainer(logger=False, **kwargs)


# ---------------------------------------------------------------------------------------
# MisconfigurationException
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_kwargs", [
    lambda fw: {"fast_dev_run": -1},
    lambda fw: {"check_val_every_n_epoch": None, "val_check_interval": 0.5},
    lambda fw: {"enable_progress_bar": False, "callbacks": [fw.TQDMProgressBar()]},
], ids=["fast_dev_run", "val_check_interval", "progress_bar"])
def test_misconfiguration_exception_catches_hookloops_refusals(tmp_path, make_kwargs):
    """``pytest.raises(MisconfigurationException)`` (the rewritten import) catches
    hookloop's refusal of a setting where it catches Lightning's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lightning_scripts import rewrite

    assert rewrite.resolve("MisconfigurationException") is _fw("hookloop").MisconfigurationException
    for name in FRAMEWORKS:
        fw = _fw(name)
        with pytest.raises(fw.MisconfigurationException):
            trainer = fw.Trainer(str(tmp_path / name), max_epochs=1, **make_kwargs(fw))
            trainer.fit(_module_class(fw)(), DataLoader(_data(8), batch_size=4), DataLoader(_data(8), batch_size=4))


# ---------------------------------------------------------------------------------------
# BackboneFinetuning
# ---------------------------------------------------------------------------------------


def _backbone_run(name: str, root: str, **finetuning) -> tuple:
    fw = _fw(name)
    BackboneFinetuning = (__import__("pytorch_lightning").callbacks.BackboneFinetuning if name == "lightning"
                          else hookloop.BackboneFinetuning)
    lrs: list = []

    class Transfer(_module_class(fw)):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
            self.layer = nn.Linear(8, 2)

        def configure_optimizers(self):
            return torch.optim.SGD(self.layer.parameters(), lr=0.2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.layer(self.backbone(x)), y)

        def on_train_epoch_end(self):
            lrs.append([round(g["lr"], 12) for g in self.trainer.optimizers[0].param_groups])

    fw.seed(0)
    model = Transfer()
    trainer = fw.Trainer(root, max_epochs=5, callbacks=[BackboneFinetuning(**finetuning)])
    trainer.fit(model, DataLoader(_data(16), batch_size=4))
    return lrs, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("finetuning", [
    {"unfreeze_backbone_at_epoch": 1, "lambda_func": lambda epoch: 1.5},
    {"unfreeze_backbone_at_epoch": 2, "backbone_initial_lr": 0.05, "train_bn": False},
    {"unfreeze_backbone_at_epoch": 0, "backbone_initial_ratio_lr": 0.5, "should_align": False},
])
def test_backbone_finetuning_is_lightnings(tmp_path, finetuning):
    """The backbone frozen, unfrozen at the epoch given with Lightning's learning rates
    (every epoch's param groups), and the same weights at the end."""
    (pl_lrs, pl_weights), (hl_lrs, hl_weights) = (_backbone_run(name, str(tmp_path / name), **finetuning)
                                                  for name in FRAMEWORKS)
    assert hl_lrs == pl_lrs and len(pl_lrs[-1]) == 2
    for a, b in zip(hl_weights, pl_weights):
        torch.testing.assert_close(a, b)


def test_backbone_finetuning_without_a_backbone_says_so(tmp_path):
    fw = _fw("hookloop")
    trainer = fw.Trainer(str(tmp_path), max_epochs=1, callbacks=[hookloop.BackboneFinetuning()])
    with pytest.raises(hookloop.ConfigurationError, match="Model has no nn.Module attribute `backbone`"):
        trainer.fit(_module_class(fw)(), DataLoader(_data(8), batch_size=4))


# ---------------------------------------------------------------------------------------
# Lightning names hookloop refuses, each naming what to use instead
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lightning_module", "name", "instead"), [
    ("pytorch_lightning.callbacks", "LearningRateFinder", r"hookloop.Tuner\(trainer\).lr_find\(model, ...\)"),
    ("pytorch_lightning.callbacks", "BatchSizeFinder", r"hookloop.Tuner\(trainer\).scale_batch_size\(model"),
    ("pytorch_lightning.utilities", "CombinedLoader", r"as a list \(val_dataloaders=\[a, b\]"),
    ("pytorch_lightning.callbacks", "WeightAveraging", r"hookloop_averaging.EMA \(Lightning's EMAWeightAveraging"),
])
def test_refused_lightning_names_say_what_to_use_instead(lightning_module, name, instead):
    """The import a port rewrites (tests/lightning_scripts/rewrite.py) reaches hookloop's
    name, and making one is an error naming the replacement."""
    import importlib
    import sys
    from pathlib import Path

    assert hasattr(importlib.import_module(lightning_module), name)  # Lightning 2.6.6 has it
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lightning_scripts import rewrite

    refused = rewrite.resolve(name)
    with pytest.raises(hookloop.ConfigurationError, match=f"hookloop has no {name} .*{instead}"):
        refused(min_lr=1e-4) if name != "CombinedLoader" else refused({"a": [1]}, mode="sequential")


@pytest.mark.parametrize("interval", ["00:00:01:00", {"minutes": 1}, __import__("datetime").timedelta(seconds=30)])
def test_a_time_based_val_check_interval_is_refused_naming_the_alternatives(interval):
    """Lightning 2.6.6 validates every so much time; hookloop refuses it (docs/lightning.md),
    naming the batch-count and fraction forms."""
    import pytorch_lightning as pl

    pl.Trainer(val_check_interval=interval, logger=False, enable_checkpointing=False)  # Lightning takes it
    with pytest.raises(hookloop.ConfigurationError,
                       match=r"is a duration \(Lightning's time-based validation\).*val_check_interval=N"):
        hookloop.Trainer(val_check_interval=interval, logger=False)


# ---------------------------------------------------------------------------------------
# avg_fn on the averaging plugins (hookloop-averaging)
# ---------------------------------------------------------------------------------------


def _averaged_run(name: str, root: str, kind: str) -> tuple:
    fw = _fw(name)
    counts: list = []

    def avg_fn(average, weights, num_averaged):  # a fixed-rate average: not either default
        counts.append(int(num_averaged))
        return average + 0.3 * (weights - average)

    if name == "lightning":
        from pytorch_lightning.callbacks import StochasticWeightAveraging, WeightAveraging

        averaging = (StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1, avg_fn=avg_fn)
                     if kind == "swa" else WeightAveraging(avg_fn=avg_fn))
    else:
        options = {"swa_lrs": 0.05, "swa_epoch_start": 2, "annealing_epochs": 1} if kind == "swa" else {}
        averaging = hookloop.plugin(kind, avg_fn=avg_fn, **options)
    fw.seed(0)
    model = _module_class(fw)()
    trainer = fw.Trainer(root, max_epochs=4, callbacks=[averaging])
    trainer.fit(model, DataLoader(_data(16), batch_size=4))
    return counts, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_avg_fn_averages_as_lightning(tmp_path, kind):
    """``avg_fn=`` on ``swa`` (Lightning's ``StochasticWeightAveraging(avg_fn=)``) and
    ``ema`` (Lightning's ``WeightAveraging(avg_fn=)``): called with the same counts, the
    same weights at the end."""
    pytest.importorskip("hookloop_averaging")
    (pl_counts, pl_weights), (hl_counts, hl_weights) = (_averaged_run(name, str(tmp_path / name), kind)
                                                        for name in FRAMEWORKS)
    assert hl_counts == pl_counts and pl_counts
    for a, b in zip(hl_weights, pl_weights):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_an_avg_fn_that_is_not_a_function_is_refused(kind):
    pytest.importorskip("hookloop_averaging")
    with pytest.raises(hookloop.ConfigurationError, match=f"{kind} avg_fn=3 must be a function"):
        hookloop.plugin(kind, avg_fn=3)


# ---------------------------------------------------------------------------------------
# Logging from a callback: Lightning 2.6.6's Callback has no `log`; callbacks log through
# the module (`pl_module.log`), which hookloop's callbacks do alike
# ---------------------------------------------------------------------------------------


def _callback_logging_run(name: str, root: str) -> dict:
    fw = _fw(name)

    class Logs(fw.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pl_module.log("cb_batch", float(batch_idx))
            pl_module.log("cb_both", float(trainer.global_step), on_step=True, on_epoch=True)

        def on_train_epoch_end(self, trainer, pl_module):
            pl_module.log("cb_epoch", float(trainer.current_epoch) + 0.5)

        def on_validation_epoch_end(self, trainer, pl_module):
            pl_module.log("cb_val", float(trainer.current_epoch) + 0.25)

    fw.seed(0)
    trainer = fw.Trainer(root, max_epochs=2, callbacks=[Logs()], num_sanity_val_steps=0)
    trainer.fit(_module_class(fw)(), DataLoader(_data(12), batch_size=4), DataLoader(_data(8, 2), batch_size=4))
    return {k: round(float(v), 6) for k, v in trainer.callback_metrics.items() if k.startswith("cb_")}


def test_a_callback_logs_through_the_module_as_in_lightning(tmp_path):
    import pytorch_lightning as pl

    assert not hasattr(pl.Callback, "log") and not hasattr(hookloop.Callback, "log")
    seen = {name: _callback_logging_run(name, str(tmp_path / name)) for name in FRAMEWORKS}
    assert seen["hookloop"] == seen["lightning"] and len(seen["lightning"]) == 6


def test_lightnings_trainer_views_live_in_the_lightning_layer_and_a_missing_name_stays_an_attribute_error():
    # The engine's Trainer has no Lightning-only view of its own: hookloop.lightning.views
    # provides them (issue 35, item 4), found only for names the Trainer lacks.
    from hookloop.engine.trainer import Trainer as EngineTrainer
    from hookloop.lightning.views import VIEWS

    assert not [name for name in VIEWS if name in vars(EngineTrainer)]
    trainer = hookloop.Trainer(max_epochs=1, enable_progress_bar=False, logger=False)
    assert trainer.early_stopping_callbacks == [] and trainer.lightning_module is None
    with pytest.raises(AttributeError, match="'Trainer' object has no attribute 'early_stoping_callback'"):
        trainer.early_stoping_callback  # noqa: B018 - a misspelt name


def test_trainer_fn_and_running_stage_are_lightnings_names_for_hookloops_state(tmp_path):
    """Lightning's ``TrainerFn``/``RunningStage``: the same members and values as
    pytorch-lightning 2.6.6's, equal to their value in any case, and what hookloop's
    ``trainer.state.fn``/``stage`` hold during a run (compared with Lightning's run of the
    same module)."""
    from pytorch_lightning.trainer import states as pl_states

    for ours, theirs in ((hookloop.TrainerFn, pl_states.TrainerFn), (hookloop.RunningStage, pl_states.RunningStage)):
        assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]
        assert all(m == m.value.upper() and hash(m) == hash(theirs[m.name]) for m in ours)
    assert [s.dataloader_prefix for s in hookloop.RunningStage] == [s.dataloader_prefix for s in pl_states.RunningStage]
    assert [s.evaluating for s in hookloop.RunningStage] == [s.evaluating for s in pl_states.RunningStage]

    def seen_states(trainer_class, base, **extra):
        seen = []

        class Module(base):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                seen.append((self.trainer.state.fn, self.trainer.state.stage))
                return self.layer(batch[0]).sum()

            def validation_step(self, batch, batch_idx):
                seen.append((self.trainer.state.fn, self.trainer.state.stage))

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        trainer = trainer_class(default_root_dir=tmp_path, max_epochs=1, limit_train_batches=1, limit_val_batches=1,
                                num_sanity_val_steps=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, **extra)
        data = DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2)
        trainer.fit(Module(), data, data)
        return seen

    import pytorch_lightning as pl

    lightning = seen_states(pl.Trainer, pl.LightningModule, accelerator="cpu")
    ours = seen_states(hookloop.Trainer, hookloop.Module)
    assert lightning == [(pl_states.TrainerFn.FITTING, pl_states.RunningStage.SANITY_CHECKING),
                         (pl_states.TrainerFn.FITTING, pl_states.RunningStage.TRAINING),
                         (pl_states.TrainerFn.FITTING, pl_states.RunningStage.VALIDATING)]
    assert ours == [(hookloop.TrainerFn.FITTING, hookloop.RunningStage.SANITY_CHECKING),
                    (hookloop.TrainerFn.FITTING, hookloop.RunningStage.TRAINING),
                    (hookloop.TrainerFn.FITTING, hookloop.RunningStage.VALIDATING)]


@pytest.mark.parametrize("kwargs", [{}, dict(check_val_every_n_epoch=3, val_check_interval=0.5, num_sanity_val_steps=-1),
                                    dict(fast_dev_run=True), dict(check_val_every_n_epoch=None, val_check_interval=7)])
def test_validation_settings_read_back_as_lightnings(tmp_path, kwargs):
    """``trainer.check_val_every_n_epoch``, ``val_check_interval``, ``num_sanity_val_steps``:
    the values pytorch-lightning 2.6.6's Trainer reads back for the same arguments."""
    import pytorch_lightning as pl

    names = ("check_val_every_n_epoch", "val_check_interval", "num_sanity_val_steps")
    common = dict(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False)
    theirs = pl.Trainer(**common, **kwargs)
    ours = hookloop.Trainer(**common, **kwargs)
    assert [getattr(ours, n) for n in names] == [getattr(theirs, n) for n in names]
