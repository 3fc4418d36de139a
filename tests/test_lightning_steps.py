"""Issue 35, items 1, 2, 3 and 9: the training step as Lightning runs it, each case run
under pytorch-lightning 2.6.6 and hookloop with the same module code (written once against
``fw.LightningModule``, as tests/oracle does) and compared.

1. ``training_step`` returning ``None`` and a loader yielding ``None`` batches skip the batch;
2. several ``EarlyStopping`` callbacks each act;
3. a module's ``lr_scheduler_step``, ``optimizer_step`` and ``optimizer_zero_grad`` are called
   as Lightning calls them;
9. ``configure_optimizers`` returning ``None``, manual optimization's schedulers, a scheduler
   dict with extra keys: accepted as Lightning accepts them.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

sys.path.insert(0, str(Path(__file__).resolve().parent / "oracle"))
import frameworks  # noqa: E402

BOTH = ("lightning", "hookloop")


def _data(n: int = 20, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _trainer(fw, root: str, **kw):
    kw.setdefault("enable_checkpointing", False)
    if fw.name == "lightning":
        return fw.pl.Trainer(accelerator="cpu", devices=1, default_root_dir=root, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, **kw)
    return hookloop.Trainer(accelerator="cpu", default_root_dir=root, logger=False,
                            enable_progress_bar=False, **kw)


def _run(case) -> dict:
    """``case(fw, root)`` under each framework, from the same seed; its warnings' messages
    (the first line) are in ``"warnings"``."""
    seen = {}
    for name in BOTH:
        fw = frameworks.load(name)
        fw.seed_everything(0)
        with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = case(fw, root)
        seen[name] = (result, [str(w.message).splitlines()[0] for w in caught])
    return seen


def _warned(messages: list, text: str) -> bool:
    return any(text in m for m in messages)


def _recorder(fw, log: list):
    """A callback recording the step's events with the batch index and global step."""

    class Recorder(fw.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            log.append(("batch_start", batch_idx, trainer.global_step))

        def on_before_zero_grad(self, trainer, pl_module, optimizer):
            log.append(("before_zero_grad", trainer.global_step))

        def on_before_backward(self, trainer, pl_module, loss):
            log.append(("before_backward", trainer.global_step))

        def on_after_backward(self, trainer, pl_module):
            log.append(("after_backward", trainer.global_step))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            log.append(("before_optimizer_step", trainer.global_step))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            shown = sorted(outputs) if isinstance(outputs, dict) else outputs
            log.append(("batch_end", batch_idx, trainer.global_step, shown, batch is None))

    return Recorder()


def _linear(fw, skip=(), step_lr: bool = True):
    class Linear(fw.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.layer(x), y)
            return None if batch_idx in skip else loss

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            if not step_lr:
                return optimizer
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    return Linear


def _weights(module) -> list:
    return [p.detach().flatten().tolist() for p in module.parameters()]


def _lr(trainer) -> float:
    return trainer.optimizers[0].param_groups[0]["lr"]


# -- 1. training_step returning None, a loader yielding None ------------------------------


def test_training_step_returning_none_skips_the_backward_as_lightning():
    """Batches 1 and 4 of 7 return None, accumulating 2: the window's zero_grad and
    optimizer step still run (global_step counts 4), their backward does not; the other
    batches train as usual."""

    def case(fw, root):
        module, log = _linear(fw, skip=(1, 4))(), []
        trainer = _trainer(fw, root, max_epochs=2, accumulate_grad_batches=2,
                           callbacks=[_recorder(fw, log)])
        trainer.fit(module, DataLoader(_data(20), batch_size=3))
        return log, trainer.global_step, _weights(module), _lr(trainer)

    seen = _run(case)
    (lightning, lightning_warnings), (ours, our_warnings) = seen["lightning"], seen["hookloop"]
    assert ours == lightning
    assert _warned(lightning_warnings, "`training_step` returned `None`")
    assert _warned(our_warnings, "`training_step` returned `None`")


def test_a_loader_yielding_none_skips_the_batch_as_lightning():
    """Batches 2 and 5 of 7 are None: no batch start, no step (global_step does not count
    them), the schedulers due there step, ``on_train_batch_end`` sees ``None``."""

    def case(fw, root):
        g = torch.Generator().manual_seed(3)
        batches = [None if i in (2, 5)
                   else (torch.randn(3, 4, generator=g), torch.tensor([0, 1, 1]))
                   for i in range(7)]
        module, log = _linear(fw)(), []
        trainer = _trainer(fw, root, max_epochs=2, accumulate_grad_batches=2,
                           callbacks=[_recorder(fw, log)])
        trainer.fit(module, DataLoader(batches, batch_size=None))
        return log, trainer.global_step, _weights(module), _lr(trainer)

    seen = _run(case)
    (lightning, lightning_warnings), (ours, our_warnings) = seen["lightning"], seen["hookloop"]
    assert ours == lightning
    assert _warned(lightning_warnings, "train_dataloader yielded None")
    assert _warned(our_warnings, "train_dataloader yielded None")


# -- 2. several EarlyStopping callbacks ---------------------------------------------------


def _two_metrics(fw):
    class TwoMetrics(_linear(fw, step_lr=False)):
        def validation_step(self, batch, batch_idx):
            # "falling" improves every epoch; "flat" never does after the first
            self.log("falling", torch.tensor(10.0 - self.current_epoch))
            self.log("flat", torch.tensor(1.0))

    return TwoMetrics


def test_every_early_stopping_callback_acts_as_in_lightning():
    """Lightning checks every EarlyStopping: the one whose patience runs out first stops."""

    def case(fw, root):
        slow = fw.EarlyStopping(monitor="falling", patience=3)
        fast = fw.EarlyStopping(monitor="flat", patience=2)
        trainer = _trainer(fw, root, max_epochs=10, callbacks=[slow, fast], num_sanity_val_steps=0)
        trainer.fit(_two_metrics(fw)(), DataLoader(_data(20), batch_size=5),
                    DataLoader(_data(10, seed=2), batch_size=5))
        return (trainer.current_epoch, trainer.global_step, slow.wait_count, fast.wait_count,
                slow.stopped_epoch, fast.stopped_epoch)

    seen = _run(case)
    assert seen["hookloop"][0] == seen["lightning"][0]


# -- 9. valid Lightning code hookloop refused ---------------------------------------------


def test_configure_optimizers_returning_none_trains_without_an_optimizer_as_lightning():
    def case(fw, root):
        class NoOptimizer(_linear(fw)):
            def configure_optimizers(self):
                return None

        module = NoOptimizer()
        before = _weights(module)
        trainer = _trainer(fw, root, max_epochs=2)
        trainer.fit(module, DataLoader(_data(20), batch_size=5))
        return trainer.global_step, _weights(module) == before, len(trainer.optimizers)

    seen = _run(case)
    assert seen["hookloop"][0] == seen["lightning"][0] == (8, True, 1)
    for name in BOTH:
        assert _warned(seen[name][1], "configure_optimizers` returned `None`")


class _Warmup:
    """A scheduler with no ``step()``: the module advances it (manual optimization)."""

    def __init__(self, optimizer):
        self.optimizer, self.count = optimizer, 0

    def advance(self):
        self.count += 1
        for group in self.optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, self.count / 4)

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def _manual(fw, schedulers):
    class Manual(_linear(fw, step_lr=False)):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer, scheduler = self.optimizers(), self.lr_schedulers()
            x, y = batch
            loss = F.cross_entropy(self.layer(x), y)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(loss.detach() * 0 + 1.0)  # never improves: the lr drops
            else:
                scheduler.advance()

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return schedulers(optimizer)

    return Manual


def test_manual_optimization_takes_lightnings_schedulers():
    """A ReduceLROnPlateau without a monitor, a scheduler object without step(), and a
    config's plateau keys (warned, ignored), all stepped by the module."""
    forms = {
        "plateau without monitor": lambda opt: ([opt], [torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, patience=1)]),
        "no step()": lambda opt: ([opt], [_Warmup(opt)]),
        "config with monitor": lambda opt: {"optimizer": opt, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1),
            "monitor": "loss", "strict": True}},
    }
    for form, schedulers in forms.items():
        def case(fw, root, schedulers=schedulers):
            module = _manual(fw, schedulers)()
            trainer = _trainer(fw, root, max_epochs=2)
            trainer.fit(module, DataLoader(_data(20), batch_size=5))
            return trainer.global_step, _weights(module), _lr(trainer)

        seen = _run(case)
        assert seen["hookloop"][0] == seen["lightning"][0], form
        if form == "config with monitor":
            for name in BOTH:  # the keys are ignored, each says
                assert _warned(seen[name][1], "ignored"), name


def test_extra_keys_in_a_scheduler_config_are_warned_about_and_ignored_as_lightning():
    def case(fw, root):
        class Extra(_linear(fw)):
            def configure_optimizers(self):
                optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
                scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
                return {"optimizer": optimizer,
                        "lr_scheduler": {"scheduler": scheduler, "interval": "step", "warmup": 3}}

        module = Extra()
        trainer = _trainer(fw, root, max_epochs=1)
        trainer.fit(module, DataLoader(_data(20), batch_size=5))
        return trainer.global_step, _weights(module), _lr(trainer)

    seen = _run(case)
    assert seen["hookloop"][0] == seen["lightning"][0]
    for name in BOTH:
        assert _warned(seen[name][1], "warmup"), name


# -- 3. the module's optimizer_step, optimizer_zero_grad and lr_scheduler_step ------------


class _NeedsProgress:
    """A scheduler whose ``step`` needs an argument: only ``lr_scheduler_step`` can step it."""

    def __init__(self, optimizer):
        self.optimizer, self.base = optimizer, optimizer.param_groups[0]["lr"]

    def step(self, progress):
        for group in self.optimizer.param_groups:
            group["lr"] = self.base * (1.0 - 0.1 * progress)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _overriding(fw, log: list, skip_odd_windows: bool = False):
    class Overriding(_linear(fw, step_lr=False)):
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.layer(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True)
            return loss

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            log.append(("optimizer_step", epoch, batch_idx, self.trainer.global_step))
            if skip_odd_windows and (batch_idx // 2) % 2:
                optimizer_closure()  # Lightning's way of not stepping
                return
            optimizer.step(closure=optimizer_closure)
            for group in optimizer.param_groups:  # a warm-up after the step, as Lightning's docs
                group["lr"] = group["lr"] * 1.5

        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            log.append(("optimizer_zero_grad", epoch, batch_idx))
            optimizer.zero_grad(set_to_none=False)

        def lr_scheduler_step(self, scheduler, metric):
            log.append(("lr_scheduler_step", type(scheduler).__name__, metric is None))
            if isinstance(scheduler, _NeedsProgress):
                scheduler.step(self.trainer.current_epoch / 2)
            elif metric is None:
                scheduler.step()
            else:
                scheduler.step(metric)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
            return [optimizer], [{"scheduler": step, "interval": "step"},
                                 {"scheduler": _NeedsProgress(optimizer), "interval": "epoch"},
                                 {"scheduler": plateau, "monitor": "train_loss"}]

    return Overriding


def test_the_modules_optimization_overrides_are_called_as_lightning_calls_them():
    """Arguments, order (among the step's events) and frequency under accumulation; the
    weights and the learning rate after it."""
    for skip in (False, True):
        def case(fw, root, skip=skip):
            log: list = []
            module = _overriding(fw, log, skip_odd_windows=skip)()
            trainer = _trainer(fw, root, max_epochs=3, accumulate_grad_batches=2,
                               callbacks=[_recorder(fw, log)])
            trainer.fit(module, DataLoader(_data(20), batch_size=3))
            return log, trainer.global_step, _weights(module), _lr(trainer)

        seen = _run(case)
        ours, lightning = seen["hookloop"][0], seen["lightning"][0]
        assert ours[0] == _closure_order(lightning[0]), skip
        assert ours[1:] == lightning[1:], skip


def _closure_order(log: list) -> list:
    """Lightning's events with each ``optimizer_step`` moved after the window's last
    backward: Lightning calls it first and runs that batch's zero_grad (a window of one
    batch), forward and backward inside its closure; hookloop calls it after them
    (docs/decisions.md, "The module's optimizer_step runs after the window's last
    backward")."""
    log, out = list(log), []
    while log:
        entry = log.pop(0)
        if entry[0] == "optimizer_step":
            while log and log[0][0] in ("before_zero_grad", "optimizer_zero_grad",
                                        "before_backward", "after_backward"):
                out.append(log.pop(0))
        out.append(entry)
    return out
