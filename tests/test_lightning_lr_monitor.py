"""Issue 35: ``LearningRateMonitor`` logs what pytorch-lightning 2.6.6's logs: the same
names (a scheduler's ``name``, ``-momentum``/``-weight_decay`` suffixes, ``-<j>`` for the
j-th optimizer of a class), at the same steps, and the same public record (``lrs``,
``last_momentum_values``, ``last_weight_decay_values``); ``log_momentum`` warns for an
optimizer without momentum (Lightning's tests ``callbacks/test_lr_monitor.py``).

Each case runs the same module under both trainers in this process, each with its CSV
logger, and compares the rows with learning rates and the monitor's record.
"""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import tiny_data

# the reference (make test installs pytorch-lightning==2.6.6): a missing one fails, never skips
import pytorch_lightning as pl  # noqa: E402


def _optimizers(module, case: str):
    params = list(module.parameters())
    if case == "step_scheduler":  # SGD with momentum, a per-step scheduler
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
    if case == "named_scheduler":  # Adam, an epoch scheduler with a name
        opt = torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.99))
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        return [opt], [{"scheduler": sched, "name": "my_lr"}]
    if case == "groups_no_scheduler":  # two groups, no scheduler: logged per step and per epoch
        return torch.optim.Adam([{"params": params[:1], "weight_decay": 0.1},
                                 {"params": params[1:], "weight_decay": 0.2}], lr=0.01)
    if case == "no_momentum":  # ASGD has neither momentum nor betas
        opt = torch.optim.ASGD(params, lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]
    if case == "two_of_a_kind":  # manual optimization, two SGDs, one scheduled
        a, b = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(params, lr=0.2)
        return [a, b], [torch.optim.lr_scheduler.StepLR(b, 1, gamma=0.5)]
    raise AssertionError(case)


def make_module(base, case: str):
    class Module(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 3)
            self.automatic_optimization = case != "two_of_a_kind"

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            if self.automatic_optimization:
                return loss
            for opt in self.optimizers():
                opt.zero_grad()
                self.manual_backward(F.cross_entropy(self.net(x), y))
                opt.step()
            return None

        def on_train_epoch_end(self):
            if not self.automatic_optimization:
                self.lr_schedulers().step()

        def configure_optimizers(self):
            return _optimizers(self, case)

    return Module()


def fit(framework: str, case: str, tmp_path, **monitor):
    root = tmp_path / framework
    loader = DataLoader(tiny_data(40), batch_size=8)  # 5 batches
    options = dict(max_epochs=2, log_every_n_steps=2, enable_progress_bar=False, enable_checkpointing=False,
                   num_sanity_val_steps=0)
    if framework == "lightning":
        lr_monitor = pl.callbacks.LearningRateMonitor(**monitor)
        trainer = pl.Trainer(default_root_dir=str(root), logger=pl.loggers.CSVLogger(str(root)),
                             enable_model_summary=False, accelerator="cpu", devices=1, callbacks=[lr_monitor],
                             **options)
        module = make_module(pl.LightningModule, case)
    else:
        lr_monitor = hookloop.LearningRateMonitor(**monitor)
        trainer = hookloop.Trainer(default_root_dir=str(root), callbacks=[lr_monitor], **options)
        module = make_module(hookloop.Module, case)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    momentum_warned = any(issubclass(w.category, RuntimeWarning) and "optimizers do not have momentum" in str(w.message)
                          for w in caught)
    return lr_monitor, _lr_rows(root), momentum_warned


def _lr_rows(root) -> list[tuple[int, dict[str, float]]]:
    """The metrics.csv rows holding a learning rate: (step, {column: value}) for the lr
    monitor's columns."""
    (path,) = root.rglob("metrics.csv")
    rows = []
    with open(path) as f:
        for row in csv.DictReader(f):
            values = {k: round(float(v), 8) for k, v in row.items() if v not in ("", None)
                      and (k.startswith(("lr-", "my_lr")))}
            if values:
                rows.append((int(row["step"]), values))
    return rows


CASES = {
    "step_scheduler": {"log_momentum": True, "log_weight_decay": True},
    "named_scheduler": {"log_momentum": True},
    "groups_no_scheduler": {"log_weight_decay": True},
    "no_momentum": {"log_momentum": True},
    "two_of_a_kind": {},
    "step_interval": {"logging_interval": "step"},
    "epoch_interval": {"logging_interval": "epoch", "log_momentum": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_lr_monitor_logs_what_lightnings_logs(tmp_path, case):
    module_case = {"step_interval": "two_of_a_kind", "epoch_interval": "step_scheduler"}.get(case, case)
    ours, ours_rows, ours_warned = fit("hookloop", module_case, tmp_path, **CASES[case])
    theirs, their_rows, they_warned = fit("lightning", module_case, tmp_path, **CASES[case])
    assert their_rows  # the reference logged something
    assert ours_rows == their_rows
    assert ours.lrs == theirs.lrs and list(ours.lrs) == list(theirs.lrs)
    assert ours.last_momentum_values == theirs.last_momentum_values
    assert ours.last_weight_decay_values == theirs.last_weight_decay_values
    assert ours_warned == they_warned == (case == "no_momentum")
