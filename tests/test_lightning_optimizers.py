"""Issue 35 (Lightning's tests/trainer/optimization and tuner/test_lr_finder): what
``configure_optimizers`` may return, its refusals and warnings, run under pytorch-lightning
2.6.6 and hookloop with the same module code (written once against ``fw.LightningModule``,
as tests/oracle does) and compared: the exception's class and Lightning's wording in both
messages (hookloop's goes on to say what to do), the warnings' category and wording.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn, optim
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop
from hookloop.engine.optim import LoopOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent / "oracle"))
import frameworks  # noqa: E402

BOTH = ("lightning", "hookloop")


def _data(n: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _module(fw, configure, automatic: bool = True, **methods):
    """A linear classifier whose ``configure_optimizers`` is ``configure(module)``."""

    class Linear(fw.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)
            self.automatic_optimization = automatic

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.layer(x), y)
            self.log("train_loss", loss)
            if not automatic:
                self.manual_backward(loss)
                for opt in self.optimizers() if isinstance(self.optimizers(), list) else [self.optimizers()]:
                    opt.step()
                    opt.zero_grad()
                return None
            return loss

        def configure_optimizers(self):
            return configure(self)

    for name, method in methods.items():
        setattr(Linear, name, method)
    return Linear()


def _fit(fw, module, root: str, **kw) -> object:
    options = dict(max_epochs=1, default_root_dir=root, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, accelerator="cpu")
    if fw.name == "lightning":
        options["enable_model_summary"] = False
    options.update(kw)
    trainer = (fw.pl.Trainer if fw.name == "lightning" else hookloop.Trainer)(**options)
    trainer.fit(module, DataLoader(_data(), batch_size=4))
    return trainer


def _outcomes(configure, automatic: bool = True, **methods) -> dict:
    """framework name -> (the exception raised or None, [(warning category, message)])."""
    seen = {}
    for name in BOTH:
        fw = frameworks.load(name)
        with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _fit(fw, _module(fw, configure, automatic, **methods), root)
                error = None
            except Exception as exc:  # noqa: BLE001 -- compared below
                error = exc
        seen[name] = (error, [(w.category, str(w.message)) for w in caught])
    return seen


def _opt(module):
    return optim.SGD(module.parameters(), lr=0.1)


def _step_lr(opt):
    return optim.lr_scheduler.StepLR(opt, 1)


def _dict_with_scheduler(config: dict):
    def configure(module):
        opt = _opt(module)
        return {"optimizer": opt, "lr_scheduler": {k: (v(opt) if callable(v) else v) for k, v in config.items()}}
    return configure


def _two_optimizers(module):
    return optim.SGD(module.parameters(), lr=0.1), optim.Adam(module.parameters())


def _scheduler_of_another_optimizer(module):
    other = optim.SGD(module.parameters(), lr=0.1)
    return [_opt(module)], [_step_lr(other)]


def _plateau_without_monitor(module):
    opt = _opt(module)
    return [opt], [optim.lr_scheduler.ReduceLROnPlateau(opt)]


class _NoStep:
    """A scheduler object without ``step()``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class _NoState:
    """A scheduler object with ``step()`` and without ``state_dict()``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        pass


class _Stepping(_NoStep):
    """Stateful, with a ``step()``, not a torch LRScheduler."""

    def step(self):
        pass


# (configure_optimizers, the exception class both raise, Lightning's wording)
REFUSALS = {
    "unknown return": (lambda m: 1, ValueError, "Unknown configuration for model optimizers"),
    "a dict beside an optimizer": (lambda m: [{"optimizer": _opt(m)}, _opt(m)], ValueError,
                                   "Unknown configuration for model optimizers"),
    "several optimizers, automatic": (_two_optimizers, RuntimeError,
                                      "multiple optimizers is only supported with manual optimization"),
    "scheduler of another optimizer": (_scheduler_of_another_optimizer, ValueError,
                                       "attached with an optimizer that wasn't returned"),
    "plateau without monitor": (_plateau_without_monitor, ValueError,
                                "`configure_optimizers` must include a monitor when a `ReduceLROnPlateau`"),
    "plateau dict without monitor": (_dict_with_scheduler({"scheduler": optim.lr_scheduler.ReduceLROnPlateau}),
                                     ValueError, "must include a monitor when a `ReduceLROnPlateau`"),
    "unknown interval": (_dict_with_scheduler({"scheduler": _step_lr, "interval": "sometimes"}), ValueError,
                         'The "interval" key in lr scheduler dict must be "step" or "epoch" but is "sometimes"'),
    "scheduler dict without scheduler": (lambda m: {"optimizer": _opt(m), "lr_scheduler": {}}, ValueError,
                                         'The lr scheduler dict must have the key "scheduler"'),
    "scheduler without step": (lambda m: ([o := _opt(m)], [_NoStep(o)]), ValueError,
                               "doesn't follow PyTorch's LRScheduler API"),
    "scheduler not torch's": (lambda m: ([o := _opt(m)], [_Stepping(o)]), ValueError,
                              "doesn't follow PyTorch's LRScheduler API"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_configure_optimizers_refusals_are_lightnings(case):
    """Lightning's wording in both messages; hookloop's error is a ConfigurationError
    (its MisconfigurationException), also a RuntimeError where Lightning raises one."""
    configure, kind, wording = REFUSALS[case]
    seen = _outcomes(configure)
    lightning, ours = seen["lightning"][0], seen["hookloop"][0]
    assert lightning is not None and ours is not None, seen
    assert wording in str(lightning), str(lightning)
    assert wording in str(ours), str(ours)
    assert isinstance(ours, hookloop.ConfigurationError)  # Lightning's MisconfigurationException
    if kind is RuntimeError:
        assert isinstance(lightning, RuntimeError) and isinstance(ours, RuntimeError)
    else:
        assert type(lightning).__name__ == "MisconfigurationException"


def test_training_step_with_optimizer_idx_is_lightnings_runtime_error():
    def training_step(self, batch, batch_idx, optimizer_idx):
        return F.cross_entropy(self.layer(batch[0]), batch[1])

    seen = _outcomes(lambda m: _opt(m), training_step=training_step)
    for name in BOTH:
        error = seen[name][0]
        assert isinstance(error, RuntimeError), (name, error)
        assert "Remove the `optimizer_idx` argument from `training_step`" in str(error), (name, error)


def test_a_module_stepping_its_schedulers_needs_no_step_method():
    """Lightning: a scheduler without ``step()`` is fine when the module overrides
    ``lr_scheduler_step`` (hookloop refused it before)."""
    calls = {name: [] for name in BOTH}

    def configure(module):
        opt = _opt(module)
        return [opt], [_NoStep(opt)]

    for name in BOTH:
        fw = frameworks.load(name)

        def lr_scheduler_step(self, scheduler, metric, _log=calls[name]):
            _log.append((type(scheduler).__name__, metric))

        with tempfile.TemporaryDirectory() as root:
            _fit(fw, _module(fw, configure, lr_scheduler_step=lr_scheduler_step), root, max_epochs=2)
    assert calls["hookloop"] == calls["lightning"] == [("_NoStep", None)] * 2


def test_a_scheduler_without_state_dict_is_refused_with_lightnings_wording():
    seen = _outcomes(lambda m: ([o := _opt(m)], [_NoState(o)]))
    wording = "The provided lr scheduler `_NoState` is invalid. It should have `state_dict` and `load_state_dict`"
    assert wording in str(seen["lightning"][0])
    assert wording in str(seen["hookloop"][0])


def _warned(messages: list, wording: str) -> bool:
    return any(category is RuntimeWarning and wording in text for category, text in messages)


# (configure_optimizers, automatic optimization, Lightning's wording of its RuntimeWarning)
WARNINGS = {
    "optimizer dict extra keys": (lambda m: {"optimizer": _opt(m), "foo": 1}, True,
                                  "Found unsupported keys in the optimizer configuration: {"),
    "scheduler dict extra keys": (_dict_with_scheduler({"scheduler": _step_lr, "foo": 1}), True,
                                  "Found unsupported keys in the lr scheduler dict: {"),
    "OneCycleLR by epoch": (_dict_with_scheduler({"scheduler": lambda o: optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.1, total_steps=10)}), True, "Are you sure you didn't mean 'interval': 'step'?"),
    "manual: plateau keys": (_dict_with_scheduler({"scheduler": _step_lr, "monitor": "train_loss"}), False,
                             "The lr scheduler dict contains the key(s) ['monitor'], but the keys will be ignored"),
}


@pytest.mark.parametrize("case", sorted(WARNINGS))
def test_configure_optimizers_warnings_are_lightnings(case):
    configure, automatic, wording = WARNINGS[case]
    seen = _outcomes(configure, automatic)
    for name in BOTH:
        error, messages = seen[name]
        assert error is None, (name, error)
        assert _warned(messages, wording), (name, messages)


def _plateau_on(metric: str, strict: bool):
    return _dict_with_scheduler({"scheduler": optim.lr_scheduler.ReduceLROnPlateau, "monitor": metric,
                                 "strict": strict})


def test_a_plateau_monitoring_a_metric_never_logged_is_lightnings_error_or_warning():
    seen = _outcomes(_plateau_on("giraffe", strict=True))
    for name in BOTH:
        assert "ReduceLROnPlateau conditioned on metric giraffe which is not available. Available metrics are: " \
               "['train_loss']" in str(seen[name][0]), (name, seen[name][0])
    seen = _outcomes(_plateau_on("giraffe", strict=False))
    for name in BOTH:
        error, messages = seen[name]
        assert error is None, (name, error)
        assert _warned(messages, "ReduceLROnPlateau conditioned on metric giraffe which is not available but "
                                 "strict is set to `False`. Skipping learning rate update."), (name, messages)


def test_lr_scheduler_configs_are_lightnings_lr_scheduler_config():
    """``hookloop.SchedulerConfig`` is Lightning's ``LRSchedulerConfig``: the same fields in
    the same order, equal to one built from them (Lightning's test_reducelronplateau_scheduling)."""
    from pytorch_lightning.utilities.types import LRSchedulerConfig

    assert ([f.name for f in dataclasses.fields(hookloop.SchedulerConfig) if f.compare]
            == [f.name for f in dataclasses.fields(LRSchedulerConfig)])
    fw = frameworks.load("hookloop")

    def configure(module):
        opt = _opt(module)
        return {"optimizer": opt, "lr_scheduler": optim.lr_scheduler.ReduceLROnPlateau(opt), "monitor": "train_loss"}

    with tempfile.TemporaryDirectory() as root:
        trainer = _fit(fw, _module(fw, configure), root)
    config = trainer.lr_scheduler_configs[0]
    assert config == hookloop.SchedulerConfig(scheduler=config.scheduler, monitor="train_loss", interval="epoch",
                                              frequency=1, reduce_on_plateau=True, strict=True, name=None)
    assert hookloop.SchedulerConfig(_step_lr(_opt(nn.Linear(1, 1)))).reduce_on_plateau is False


def test_manual_optimizer_step_refuses_keyword_arguments_naming_what_to_do():
    """Lightning passes ``opt.step(closure, **kwargs)``'s keyword arguments on to the
    optimizer's ``step``; hookloop's step goes through the optimizer_step hooks, which take
    none: refused (docs/lightning.md), not a bare TypeError."""
    optimizer = optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(hookloop.ConfigurationError, match=r"optimizer.step\(optim=...\): .*opt.optimizer.step"):
        LoopOptimizer(None, optimizer).step(closure=None, optim="sgd")


# -- documented differences (docs/decisions.md, "Checkpoints") -----------------------------


@pytest.mark.parametrize("logger", [False, True])
def test_the_resume_file_at_the_epoch_end_is_one_more_on_save_checkpoint_than_lightning(logger):
    """With a logger (hookloop's run directory) hookloop writes its resume file (``last.ckpt``
    of the run directory) at every epoch's end whatever the checkpoint schedule says, so a
    module's ``on_save_checkpoint`` sees one more checkpoint than under Lightning, after the
    epoch's last step-interval scheduler step (decisions.md). Without a logger there is no
    resume file ("A run without a logger"): the saves are Lightning's."""
    seen = {}
    for name in BOTH:
        fw = frameworks.load(name)
        saves: list = []

        def on_save_checkpoint(self, checkpoint, _saves=saves):
            _saves.append(checkpoint["lr_schedulers"][0]["last_epoch"])

        def configure(module):
            opt = _opt(module)
            return [opt], [{"scheduler": _step_lr(opt), "interval": "step"}]

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.cross_entropy(self.layer(batch[0]), batch[1]))

        with tempfile.TemporaryDirectory() as root:
            checkpoint = (fw.pl.callbacks.ModelCheckpoint if name == "lightning" else hookloop.ModelCheckpoint)(
                dirpath=root, save_on_train_epoch_end=False)
            module = _module(fw, configure, on_save_checkpoint=on_save_checkpoint, validation_step=validation_step)
            options = dict(max_epochs=1, default_root_dir=root, logger=logger, enable_progress_bar=False,
                           accelerator="cpu", callbacks=[checkpoint], num_sanity_val_steps=0)
            if name == "lightning":
                options["enable_model_summary"] = False
            trainer = (fw.pl.Trainer if name == "lightning" else hookloop.Trainer)(**options)
            loader = DataLoader(_data(), batch_size=4)
            trainer.fit(module, loader, DataLoader(_data(4), batch_size=4))
        seen[name] = saves
    assert seen["lightning"] == [2]  # after validation at the epoch's last batch
    # with a logger: the same, then the resume file at the epoch's end
    assert seen["hookloop"] == ([2, 2] if logger else [2])


def test_a_run_without_logger_and_checkpoints_leaves_default_root_dir_empty(tmp_path):
    """Lightning leaves ``default_root_dir`` empty with ``logger=False`` and
    ``enable_checkpointing=False``, and so does hookloop (no run directory without a
    logger: decisions.md, "A run without a logger"), also for a fit refused at
    configure_optimizers."""
    for name in BOTH:
        fw = frameworks.load(name)
        root = tmp_path / name
        root.mkdir()
        with pytest.raises(RuntimeError, match="multiple optimizers"):
            _fit(fw, _module(fw, _two_optimizers), str(root))
        made = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        assert made == []
