"""Issue 35: Lightning's callbacks check, say and keep what pytorch-lightning 2.6.6's do
(tests/lightning_unit: callbacks/test_early_stopping.py, test_timer.py,
test_gradient_accumulation_scheduler.py, test_finetuning_callback.py).

Every case runs the same code under both frameworks in this process: a refusal is the
same exception type with Lightning's words in hookloop's message; a run keeps the same
state (``EarlyStopping.stopping_reason``, the Timer a run uses, ``trainer.max_steps``)
and logs Lightning's info lines through ``logging``.
"""

from __future__ import annotations

import logging
import warnings
from datetime import timedelta

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import tiny_data

# the reference (make test installs pytorch-lightning==2.6.6): a missing one fails, never skips
import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.callbacks.early_stopping import EarlyStoppingReason as PlReason  # noqa: E402

FRAMEWORKS = ("lightning", "hookloop")


def names(framework: str):
    """The Lightning names under one framework (what a rewritten import binds)."""
    if framework == "lightning":
        return pl.callbacks, pl.LightningModule, pl.Trainer
    return hookloop, hookloop.Module, hookloop.Trainer


def make_module(framework: str, losses: list[float] | None = None, manual: bool = False, override: str = ""):
    """A linear classifier; ``losses``: the val_loss it logs at each epoch (else its own)."""
    base = names(framework)[1]

    class Module(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 3)
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            value = F.cross_entropy(self.net(batch[0]), batch[1])
            if losses is not None:
                value = torch.tensor(losses[min(self.current_epoch, len(losses) - 1)])
            self.log("val_loss", value)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if override:
        def hook(self, *args, **kwargs):
            return getattr(base, override)(self, *args, **kwargs)

        setattr(Module, override, hook)
    return Module()


def trainer_of(framework: str, tmp_path, **options):
    options = {"default_root_dir": str(tmp_path / framework), "enable_progress_bar": False, "logger": False,
               "enable_checkpointing": False, "num_sanity_val_steps": 0, **options}
    if framework == "lightning":
        return pl.Trainer(accelerator="cpu", devices=1, enable_model_summary=False, **options)
    return hookloop.Trainer(**options)


def fit(trainer, module, **kwargs) -> None:
    loaders = DataLoader(tiny_data(16), batch_size=8), DataLoader(tiny_data(16, seed=5), batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, *loaders, **kwargs)


# -- refusals at construction: Lightning's words --------------------------------------------

ARGUMENT_ERRORS = {
    # case: (the call, with the framework's callbacks namespace; what Lightning's message says)
    "timer_duration": (lambda c: c.Timer(duration="6:00:00"), "Expected a string in the format DD:HH:MM:SS"),
    "timer_interval": (lambda c: c.Timer(duration=timedelta(), interval="invalid"),
                       "Unsupported parameter value `Timer(interval=invalid)`"),
    "early_stopping_mode": (lambda c: c.EarlyStopping(monitor="foo", mode="unknown_option"),
                            "`mode` can be min, max, got unknown_option"),
    "accumulation_epoch": (lambda c: c.GradientAccumulationScheduler(scheduling={1: 2, -3: 4}),
                           "Epoch should be an int greater than or equal to 0. Got [1, -3]."),
    "accumulation_factor": (lambda c: c.GradientAccumulationScheduler(scheduling={0: 2, 2: "2"}),
                            "Accumulation factor should be an int greater than 0. Got [2, '2']."),
}


@pytest.mark.parametrize("case", list(ARGUMENT_ERRORS))
def test_a_bad_callback_argument_is_refused_in_lightnings_words(case):
    call, words = ARGUMENT_ERRORS[case]
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException) as lightning:
        call(pl.callbacks)
    assert words in str(lightning.value)  # the reference still says so
    with pytest.raises(hookloop.ConfigurationError) as ours:
        call(hookloop)
    assert words in str(ours.value)


# -- GradientAccumulationScheduler's checks when training starts ----------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_accumulation_scheduler_refuses_manual_optimization_with_lightnings_runtime_error(framework, tmp_path):
    callbacks = names(framework)[0]
    scheduler = callbacks.GradientAccumulationScheduler({1: 2})
    trainer = trainer_of(framework, tmp_path)
    with pytest.raises(RuntimeError, match="Automatic gradient accumulation and the `GradientAccumulationScheduler`"):
        scheduler.on_train_start(trainer, make_module(framework, manual=True))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("override", ["optimizer_step", "optimizer_zero_grad"])
def test_the_accumulation_scheduler_warns_of_overridden_optimizer_hooks_as_lightning(framework, override, tmp_path):
    callbacks = names(framework)[0]
    trainer = trainer_of(framework, tmp_path)
    with pytest.warns(UserWarning, match="the hooks will not be called on every batch"):
        callbacks.GradientAccumulationScheduler({1: 2}).on_train_start(trainer, make_module(framework, override=override))
    with warnings.catch_warnings():  # no factor above 1: nothing to say
        warnings.simplefilter("error")
        callbacks.GradientAccumulationScheduler({1: 1}).on_train_start(trainer, make_module(framework, override=override))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_accumulation_scheduler_beside_accumulate_grad_batches_is_lightnings_value_error(framework, tmp_path):
    callbacks = names(framework)[0]
    trainer = trainer_of(framework, tmp_path, accumulate_grad_batches=2, max_epochs=1,
                         callbacks=[callbacks.GradientAccumulationScheduler({0: 2})])
    with pytest.raises(ValueError, match="You have set `accumulate_grad_batches` and are using the "
                                         "`GradientAccumulationScheduler` callback"):
        fit(trainer, make_module(framework))


# -- EarlyStopping: why it stopped, its state key -------------------------------------------

STOPS = {
    # case: (EarlyStopping's options, the val_loss of each epoch)
    "patience": ({"patience": 2}, [5.0, 5.0, 5.0, 5.0, 5.0]),
    "stopping_threshold": ({"stopping_threshold": 0.6}, [2.0, 1.0, 0.5, 0.4]),
    "divergence_threshold": ({"divergence_threshold": 8.0}, [5.0, 9.0, 10.0]),
    "non_finite": ({"check_finite": True}, [5.0, float("nan"), 4.0]),
    "not_stopped": ({"patience": 3}, [3.0, 2.0, 1.0]),
}


@pytest.mark.parametrize("case", list(STOPS))
def test_early_stopping_says_why_it_stopped_as_lightning(case, tmp_path):
    options, losses = STOPS[case]
    found = {}
    for framework in FRAMEWORKS:
        stopper = names(framework)[0].EarlyStopping(monitor="val_loss", **options)
        fit(trainer_of(framework, tmp_path, max_epochs=len(losses), callbacks=[stopper]),
            make_module(framework, losses))
        found[framework] = (stopper.stopping_reason.name, stopper.stopping_reason.value,
                            stopper.stopping_reason_message, stopper.stopped_epoch,
                            stopper.state_dict()["stopping_reason"])
    assert found["hookloop"] == found["lightning"]
    assert found["hookloop"][0] != "NOT_STOPPED" or case == "not_stopped"


def test_early_stopping_reason_is_lightnings_enum_and_survives_its_state_dict():
    assert [(r.name, r.value) for r in hookloop.EarlyStoppingReason] == [(r.name, r.value) for r in PlReason]
    for framework, reason in (("lightning", PlReason), ("hookloop", hookloop.EarlyStoppingReason)):
        stopper = names(framework)[0].EarlyStopping(monitor="val_loss")
        assert stopper.stopping_reason is reason.NOT_STOPPED
        stopper.stopping_reason, stopper.stopping_reason_message = reason.PATIENCE_EXHAUSTED, "Test message"
        again = names(framework)[0].EarlyStopping(monitor="val_loss")
        again.load_state_dict(stopper.state_dict())
        assert (again.stopping_reason, again.stopping_reason_message) == (reason.PATIENCE_EXHAUSTED, "Test message")
        old = names(framework)[0].EarlyStopping(monitor="val_loss")  # a state saved before the reasons
        old.load_state_dict({"wait_count": 2, "stopped_epoch": 5, "best_score": torch.tensor(0.5), "patience": 3})
        assert (old.stopping_reason, old.stopping_reason_message) == (reason.NOT_STOPPED, None)


class PlRestore(pl.callbacks.EarlyStopping):
    pass


class HookloopRestore(hookloop.EarlyStopping):
    pass


def test_a_subclassed_early_stoppings_state_key_is_its_own_class_as_lightnings():
    keys = [cls(monitor="val_loss").state_key.split("{")[0] for cls in (PlRestore, HookloopRestore)]
    assert keys == ["PlRestore", "HookloopRestore"]
    assert HookloopRestore(monitor="val_loss").state_key == "HookloopRestore{'monitor': 'val_loss', 'mode': 'min'}"


# -- Timer and max_time ---------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_max_time_beside_a_timer_is_ignored_with_lightnings_info_line(framework, tmp_path, caplog):
    callbacks = names(framework)[0]
    timer = callbacks.Timer(duration={"days": 1})
    trainer = trainer_of(framework, tmp_path, max_time={"seconds": 1337}, max_epochs=1, callbacks=[timer])
    with caplog.at_level(logging.INFO):
        fit(trainer, make_module(framework))
    timers = [c for c in trainer.callbacks if isinstance(c, callbacks.Timer)]
    assert timers == [timer] and timer._duration == 24 * 3600
    assert "Ignoring `Trainer(max_time=...)`, callbacks list already contains a Timer." in caplog.text


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_timers_stop_is_logged_as_lightnings_and_max_steps_reads_minus_one(framework, tmp_path, caplog):
    trainer = trainer_of(framework, tmp_path, max_epochs=1000,
                         callbacks=[names(framework)[0].Timer(duration=timedelta(0))])
    assert trainer.max_steps == -1  # Lightning's "no step limit", its default
    with caplog.at_level(logging.INFO):
        fit(trainer, make_module(framework))
    assert trainer.current_epoch < 999
    assert "Time limit reached. Elapsed time is 0:00:00. Signaling Trainer to stop." in caplog.text


def test_the_timers_stop_is_printed_where_logging_would_show_nothing(tmp_path, capsys):
    """hookloop's logger has no handler of its own (Lightning's has): unconfigured, the
    line is printed, as before."""
    trainer = trainer_of("hookloop", tmp_path, max_epochs=1000, callbacks=[hookloop.Timer(duration=timedelta(0))])
    fit(trainer, make_module("hookloop"))
    assert "Time limit reached. Elapsed time is 0:00:00. Signaling Trainer to stop." in capsys.readouterr().out


# -- resuming past max_epochs ---------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_resuming_a_checkpoint_past_max_epochs_is_refused_as_lightning(framework, tmp_path):
    first = trainer_of(framework, tmp_path, max_epochs=3, enable_checkpointing=True)
    fit(first, make_module(framework))
    path = first.checkpoint_callback.best_model_path  # after epoch 3's end: Lightning's current_epoch 2
    with pytest.raises(hookloop.ConfigurationError if framework == "hookloop"
                       else pl.utilities.exceptions.MisconfigurationException,
                       match=r"You restored a checkpoint with current_epoch=2, but you have set "
                             r"Trainer\(max_epochs=1\)"):
        fit(trainer_of(framework, tmp_path / "again", max_epochs=1), make_module(framework), ckpt_path=str(path))
    # max_epochs equal to the checkpoint's epoch: no error (both)
    fit(trainer_of(framework, tmp_path / "equal", max_epochs=2), make_module(framework), ckpt_path=str(path))


# -- BaseFinetuning under DeepSpeed ---------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_finetuning_under_deepspeed_is_lightnings_not_implemented_error(framework, tmp_path):
    pytest.importorskip("deepspeed")  # the strategy both frameworks refuse the callback under
    callbacks = names(framework)[0]
    module = make_module(framework)
    module.backbone = torch.nn.Linear(8, 8)
    callback = callbacks.BackboneFinetuning()
    options = {"accelerator": "cpu"} if framework == "lightning" else {}
    trainer = names(framework)[2](strategy="deepspeed", callbacks=[callback], logger=False,
                                  default_root_dir=str(tmp_path), **options)
    with pytest.raises(NotImplementedError, match="The Finetuning callback does not support running with the "
                                                  "DeepSpeed strategy"):
        callback.setup(trainer, module, stage=None)
