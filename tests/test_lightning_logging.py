"""Issue 35: ``self.log`` takes and refuses what pytorch-lightning 2.6.6's takes and refuses
(Lightning's tests ``test__training_step__log_max_reduce_fx``, ``test_log_invalid_raises``,
``test_logging_raises``).

Each case runs the same module under both trainers in this process: the reductions Lightning
accepts (any case of the names, Python's ``min``/``max``/``sum``) give Lightning's epoch
values; what Lightning refuses, hookloop refuses with the same exception type and Lightning's
words in the message.
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


def make_module(base, log_value):
    """A module whose ``training_step`` logs ``log_value(batch_idx)`` under ``log_value.name``
    with the keyword arguments ``log_value.kwargs``."""

    class Module(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 3)

        def training_step(self, batch, batch_idx):
            self.log(log_value.name, log_value(batch_idx), **log_value.kwargs)
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def fit(framework: str, log_value, tmp_path, batches: int = 3):
    loader = DataLoader(tiny_data(8 * batches), batch_size=8)
    if framework == "lightning":
        module = make_module(pl.LightningModule, log_value)
        trainer = pl.Trainer(default_root_dir=str(tmp_path / "pl"), logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
                             devices=1, max_epochs=1)
    else:
        module = make_module(hookloop.Module, log_value)
        trainer = hookloop.Trainer(default_root_dir=str(tmp_path / "hl"), logger=False, enable_progress_bar=False,
                                   enable_checkpointing=False, max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return trainer


def logs(value, name: str = "foo", **kwargs):
    """What a module's ``training_step`` logs: ``value(batch_idx)`` under ``name``."""
    def log_value(batch_idx):
        return value(batch_idx)

    log_value.name, log_value.kwargs = name, kwargs
    return log_value


@pytest.mark.parametrize(("fx", "expected"), [(min, 0.0), (max, 4.0), (sum, 10.0), ("SUM", 10.0), ("Max", 4.0),
                                              ("AVG", 2.0)])
def test_reduce_fx_takes_lightnings_spellings(tmp_path, fx, expected):
    log_value = logs(lambda batch_idx: torch.tensor(batch_idx), on_step=False, on_epoch=True, reduce_fx=fx)
    values = {framework: float(fit(framework, log_value, tmp_path, batches=5).callback_metrics["foo"])
              for framework in ("lightning", "hookloop")}
    assert values == {"lightning": expected, "hookloop": expected}


REFUSED = {
    # what training_step logs: (its kwargs, Lightning's words)
    "none": (None, {}, "`self.log(foo, None)` was called, but `NoneType` values cannot be logged"),
    "str": ("bar", {}, "`self.log(foo, bar)` was called, but `str` values cannot be logged"),
    "dict": ({"a": 1}, {}, "`self.log(foo, {'a': 1})` was called, but `dict` values cannot be logged"),
    "nested_dict": ({"a": {"b": 1}}, {}, "was called, but nested dictionaries cannot be logged"),
    "list": ([1, 2, 3], {}, "`self.log(foo, [1, 2, 3])` was called, but `list` values cannot be logged"),
    "tuple": ((1, 2), {}, "`self.log(foo, (1, 2))` was called, but `tuple` values cannot be logged"),
    "tensor_of_two": (torch.tensor([1.0, 2.0]), {}, "was called, but the tensor must have a single element"),
    "dataloader_idx_in_name": (1.0, {"name": "foo/dataloader_idx_0"},
                               "You called `self.log` with the key `foo/dataloader_idx_0` but it should not contain "
                               "information about `dataloader_idx` when `add_dataloader_idx=True`"),
    "custom_reduction": (1.0, {"reduce_fx": torch.argmax}, "Only `self.log(..., reduce_fx={min,max,mean,sum})` "
                                                          "are supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_log_refuses_what_lightning_refuses(tmp_path, case):
    value, kwargs, words = REFUSED[case]
    log_value = logs(lambda batch_idx: value, **kwargs)
    with pytest.raises(Exception) as lightning:
        fit("lightning", log_value, tmp_path)
    assert words in str(lightning.value)  # the reference still says so
    # Lightning's MisconfigurationException is hookloop's ConfigurationError; its ValueError a ValueError
    from pytorch_lightning.utilities.exceptions import MisconfigurationException

    kind = hookloop.ConfigurationError if type(lightning.value) is MisconfigurationException else ValueError
    assert type(lightning.value) in (MisconfigurationException, ValueError)
    with pytest.raises(kind, match=re.escape(words)):
        fit("hookloop", log_value, tmp_path)


def _fit_with(framework: str, tmp_path, callback, epoch_end=None, **trainer_options):
    """Fit the plain module (it logs ``foo``=1.0 per step; ``epoch_end``: its
    ``on_train_epoch_end``) with ``callback``."""
    loader = DataLoader(tiny_data(24), batch_size=8)
    log_value = logs(lambda batch_idx: 1.0)
    options = {"max_epochs": 1, "enable_checkpointing": False, "num_sanity_val_steps": 0, **trainer_options}
    if framework == "lightning":
        trainer = pl.Trainer(default_root_dir=str(tmp_path / "pl"), enable_model_summary=False, accelerator="cpu",
                             devices=1, callbacks=[callback], **options)
        module = make_module(pl.LightningModule, log_value)
    else:
        trainer = hookloop.Trainer(default_root_dir=str(tmp_path / "hl"), callbacks=[callback], **options)
        module = make_module(hookloop.Module, log_value)
    if epoch_end is not None:
        type(module).on_train_epoch_end = epoch_end
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return trainer, module


def test_a_callbacks_self_log_is_the_modules(tmp_path):
    """Lightning attaches the module's ``log``/``log_dict`` to every callback for the run
    (``test_logging_in_callbacks_with_log_function``)."""
    found = {}
    for framework, base in (("lightning", pl.Callback), ("hookloop", hookloop.Callback)):
        class Logs(base):
            def on_train_start(self, trainer, pl_module):
                self.log("started", 1.0)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.log_dict({"batch": float(batch_idx), "twice": 2.0 * batch_idx})

            def on_train_epoch_end(self, trainer, pl_module):
                self.log("epoch_end", 5.0)

        trainer, _ = _fit_with(framework, tmp_path, Logs(), logger=False, enable_progress_bar=False)
        found[framework] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert found["hookloop"] == found["lightning"] == {"foo": 1.0, "started": 1.0, "batch": 2.0, "twice": 4.0,
                                                      "epoch_end": 5.0}


def test_a_progress_bar_subclass_gets_lightnings_get_metrics_arguments(tmp_path):
    """A ``TQDMProgressBar`` subclass overriding ``get_metrics(self, trainer, model)``
    (Lightning's documented example) is called with the trainer and the module
    (``test_progress_bar_metrics_contains_values_on_train_epoch_end``)."""
    seen = {}
    for framework, base in (("lightning", pl.callbacks.TQDMProgressBar), ("hookloop", hookloop.TQDMProgressBar)):
        calls = []

        class Bar(base):
            def get_metrics(self, trainer, model):
                calls.append(model)
                items = super().get_metrics(trainer, model)
                items.pop("v_num", None)
                return items

        _, module = _fit_with(framework, tmp_path, Bar(), logger=False)
        seen[framework] = bool(calls) and all(m is module for m in calls)
    assert seen == {"lightning": True, "hookloop": True}


def test_the_default_progress_bar_has_lightnings_get_metrics(tmp_path):
    """``trainer.progress_bar_callback.get_metrics(trainer, module)``: ``v_num`` and the
    values logged with ``prog_bar=True`` (``test_log_works_in_train_callback``)."""
    found = {}
    for framework in ("lightning", "hookloop"):
        class Shown(pl.Callback if framework == "lightning" else hookloop.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                pl_module.log("shown", float(batch_idx), prog_bar=True)

        trainer, module = _fit_with(framework, tmp_path / framework, Shown(), enable_progress_bar=True)
        found[framework] = {k: float(v) for k, v in trainer.progress_bar_callback.get_metrics(trainer, module).items()}
    assert found["hookloop"] == found["lightning"] == {"v_num": 0.0, "shown": 2.0}


@pytest.mark.parametrize("module_hook", [False, True], ids=["callback_only", "with_module_hook"])
def test_what_a_callback_logs_in_on_train_epoch_end_is_an_epoch_metric(tmp_path, module_hook):
    """Per epoch by default, in ``callback_metrics``, the progress bar's metrics and the
    loggers' epoch row, with or without a module ``on_train_epoch_end`` (hookloop lost a
    callback's ``on_epoch=True`` value when the module had none)."""
    found = {}
    for framework in ("lightning", "hookloop"):
        class AtEpochEnd(pl.Callback if framework == "lightning" else hookloop.Callback):
            def on_train_epoch_end(self, trainer, pl_module):
                pl_module.log("explicit", 3.0 + trainer.current_epoch, on_step=False, on_epoch=True, prog_bar=True)
                pl_module.log("default", 4.0, prog_bar=True)

        epoch_end = (lambda self: self.log("from_module", 5.0)) if module_hook else None
        trainer, module = _fit_with(framework, tmp_path / framework, AtEpochEnd(), epoch_end=epoch_end,
                                    max_epochs=2, enable_progress_bar=False, log_every_n_steps=1)
        found[framework] = [{k: float(v) for k, v in m.items()} for m in (
            trainer.callback_metrics, trainer.progress_bar_metrics, trainer.logged_metrics)]
    assert found["hookloop"] == found["lightning"]
    assert found["hookloop"][1] == {"explicit": 4.0, "default": 4.0}


def test_evaluation_step_values_logged_to_the_progress_bar_show_there(tmp_path):
    """An evaluation value logged per step with ``prog_bar=True`` is in
    ``progress_bar_metrics`` (not in ``callback_metrics``), as Lightning's; the sanity
    check's are not (``test_log_works_in_val_callback``)."""
    found = {}
    for framework in ("lightning", "hookloop"):
        lightning = framework == "lightning"

        class InValidation(pl.Callback if lightning else hookloop.Callback):
            def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                name = "sanity" if trainer.sanity_checking else "step_only"
                pl_module.log(name, float(batch_idx), on_step=True, on_epoch=False, prog_bar=True)
                pl_module.log("forked", 2.0 * batch_idx, on_step=True, on_epoch=True, prog_bar=True)

        module = make_module(pl.LightningModule if lightning else hookloop.Module, logs(lambda batch_idx: 1.0))
        type(module).validation_step = lambda self, batch, batch_idx: self.log("val", 1.0)
        options = dict(default_root_dir=str(tmp_path / framework), max_epochs=1, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=1,
                       callbacks=[InValidation()])
        trainer = (pl.Trainer(enable_model_summary=False, accelerator="cpu", devices=1, **options) if lightning
                   else hookloop.Trainer(**options))
        found[framework] = []
        loader = DataLoader(tiny_data(24), batch_size=8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, loader, loader)
            found[framework].append(({k: float(v) for k, v in trainer.progress_bar_metrics.items()},
                                     sorted(trainer.callback_metrics)))
            trainer.validate(module, loader, verbose=False)
            found[framework].append(({k: float(v) for k, v in trainer.progress_bar_metrics.items()},
                                     sorted(trainer.callback_metrics)))
    assert found["hookloop"] == found["lightning"]
    assert found["hookloop"][1][0]["step_only"] == 2.0


def test_documented_logging_differences(tmp_path):
    """What Lightning's logging tests assert that hookloop does otherwise on purpose
    (docs/decisions.md, "Lightning's logging tests and hookloop's logging choices"): the
    metrics are floats, ``logged_metrics`` is empty without a logger, a torchmetrics
    ``Metric`` need not be a module attribute, and the built-in observers (the learning
    rate monitor) run after the Lightning-style callbacks of an event."""
    import torchmetrics

    found = {}
    for framework in ("lightning", "hookloop"):
        lightning = framework == "lightning"
        seen_at_epoch_start = []
        monitor = (pl.callbacks.LearningRateMonitor if lightning else hookloop.LearningRateMonitor)()

        class AfterTheMonitor(pl.Callback if lightning else hookloop.Callback):
            def on_train_epoch_start(self, trainer, pl_module):
                seen_at_epoch_start.append(len(monitor.lrs.get("lr-SGD", [])))

        trainer, _ = _fit_with(framework, tmp_path / framework, monitor, enable_progress_bar=False)
        float_typed = all(isinstance(v, float) for v in trainer.callback_metrics.values())
        # the monitor listed first: Lightning calls it first
        trainer = (pl.Trainer(default_root_dir=str(tmp_path / "o"), enable_model_summary=False, accelerator="cpu",
                              devices=1, max_epochs=1, enable_progress_bar=False, callbacks=[monitor, AfterTheMonitor()])
                   if lightning else hookloop.Trainer(default_root_dir=str(tmp_path / "o"), max_epochs=1,
                                                      enable_progress_bar=False,
                                                      callbacks=[monitor, AfterTheMonitor()]))
        module = make_module(pl.LightningModule if lightning else hookloop.Module, logs(lambda batch_idx: 1.0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(tiny_data(16), batch_size=8))
        monitor_first = seen_at_epoch_start == [1]  # the monitor had logged the epoch's first lr
        no_logger, _ = _fit_with(framework, tmp_path / f"{framework}-nolog", pl.Callback() if lightning
                                 else hookloop.Callback(), logger=False, enable_progress_bar=False)

        def updated_metric(batch_idx):
            metric = torchmetrics.MeanMetric()  # not an attribute of the module
            metric.update(torch.tensor(1.0))
            return metric

        metric = logs(updated_metric, on_step=False, on_epoch=True)
        try:
            fit(framework, metric, tmp_path / f"{framework}-metric")
            metric_taken = True
        except Exception as error:  # Lightning: MisconfigurationException
            metric_taken = "setting an attribute for the metric" not in str(error)
        found[framework] = (float_typed, sorted(no_logger.logged_metrics), monitor_first, metric_taken)
    assert found == {"lightning": (False, ["foo"], True, False), "hookloop": (True, [], False, True)}
