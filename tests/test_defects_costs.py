"""Issue 17 §2, defect 13: per-step costs that are paid for nothing.

* 13a: under manual optimization, every ``self.manual_backward(loss)`` resolved (and
  compiled, with ``exec``) the callers of ``on_before_backward``/``on_after_backward``
  again when someone implements them; now once per fit, as on the automatic path.
* 13b: the SIGTERM agreement (``hookloop.faults.Preemption.agreed``) was a blocking
  all-reduce at every optimizer step: each rank waited there for the slowest. It is now
  started at a boundary and read at the next, on a gloo side group.

Counted, never timed (the timings are in benchmarks/ddp_throughput.py).
"""

from __future__ import annotations

import gc
import sys

import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import TinyModule, tiny_data
from hookloop import loops


class ManualTiny(TinyModule):
    automatic_optimization = False

    def __init__(self):
        super().__init__(seed=0)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class AroundBackward:
    """Implements both backward events (as ddp's manual-optimization helper does)."""

    hookloop_role = "observer"

    def __init__(self):
        self.before = self.after = 0

    @hookloop.hookimpl
    def on_before_backward(self, loss):
        self.before += 1

    @hookloop.hookimpl
    def on_after_backward(self):
        self.after += 1


def test_manual_backward_resolves_the_backward_events_once_per_fit_not_per_call():
    compiled = 0

    def profile(frame, event, arg):
        nonlocal compiled
        if event == "call" and frame.f_code is loops._direct_caller.__code__:
            compiled += 1

    def fit(steps):
        nonlocal compiled
        observer = AroundBackward()
        trainer = hookloop.Trainer(plugins=[observer], max_steps=steps, enable_checkpointing=False, logger=False,
                                   enable_progress_bar=False, num_sanity_val_steps=0)
        module, loader = ManualTiny(), DataLoader(tiny_data(8 * 40), batch_size=8)
        compiled = 0
        gc.collect()
        gc.disable()
        sys.setprofile(profile)
        try:
            trainer.fit(module, loader)
        finally:
            sys.setprofile(None)
            gc.enable()
        assert observer.before == observer.after == steps  # the events still reach the plugin
        assert getattr(trainer, "_backward_events", None) is None  # dropped with the run
        return compiled

    ten, twenty = fit(10), fit(20)
    # before: 2 compilations per manual_backward (ten=20 + setup, twenty=40 + setup)
    assert twenty == ten, (ten, twenty)
    assert ten <= 6  # the fit's own resolutions: a constant


class BackwardAtTrainStart(ManualTiny):
    def on_train_start(self):  # before the loop's steps exist
        x, y = next(iter(DataLoader(tiny_data(16), batch_size=8)))
        self.manual_backward(torch.nn.functional.cross_entropy(self(x), y))


def test_manual_backward_outside_the_steps_still_reaches_the_events():
    observer = AroundBackward()
    trainer = hookloop.Trainer(plugins=[observer], max_steps=2, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False)
    trainer.fit(BackwardAtTrainStart(), DataLoader(tiny_data(16), batch_size=8))
    assert observer.before == observer.after == 3
