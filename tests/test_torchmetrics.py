"""torchmetrics Metric objects in ``self.log``/``self.log_dict`` (issue 18, item 4).

Lightning's pattern: the step updates the metric (``self.acc(preds, y)`` or
``self.acc.update(...)``) and logs the Metric object; the step value is its forward
result, the epoch value its ``compute()`` (the metric syncs itself across ranks: no
second reduction, ``sync_dist`` does not apply), then ``reset()``. Numbers are worked out
by hand and, under ddp, compared with pytorch-lightning 2.6.6 running the same module.
The Lightning oracle's ``torchmetrics`` case (tests/oracle) compares a full run
(Accuracy, MeanMetric, a MetricCollection; one process and ddp) with Lightning.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hookloop

# Lightning's info lines off for this file's runs, restored after each test (conftest.py)
pytestmark = pytest.mark.usefixtures("quiet_lightning")

# Per batch of 4: predictions and labels with 4, 2, 3 and 1 correct.
PREDS = torch.tensor([0, 1, 2, 0, 0, 1, 2, 0, 0, 1, 2, 0, 0, 1, 2, 0])
LABELS = torch.tensor([0, 1, 2, 0, 0, 1, 1, 1, 0, 1, 2, 2, 1, 2, 2, 1])
CORRECT = [4, 2, 3, 1]


def accuracy_class(base):
    class Scored(base):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(1, 1)
            self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
            self.total = torchmetrics.SumMetric()
            self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

        def training_step(self, batch, batch_idx):
            preds, y = batch
            self.acc(preds, y)
            self.log("acc", self.acc, on_step=True, on_epoch=True)
            # sync_dist and reduce_fx do not apply to a Metric (it would double the sum)
            self.total.update((preds == y).sum().float())
            self.log("correct", self.total, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
            return self.layer(preds.float().unsqueeze(1)).mean()

        def validation_step(self, batch, batch_idx):
            preds, y = batch
            self.val_acc.update(preds, y)
            self.log("val_acc", self.val_acc)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return Scored


def _loader(shuffle: bool = False) -> DataLoader:
    return DataLoader(TensorDataset(PREDS, LABELS), batch_size=4, shuffle=shuffle)


def test_metric_step_and_epoch_values_and_reset(tmp_path):
    model = accuracy_class(hookloop.Module)()
    trainer = hookloop.Trainer(max_epochs=2, default_root_dir=str(tmp_path), enable_checkpointing=False,
                               enable_progress_bar=False, num_sanity_val_steps=2)
    trainer.fit(model, _loader(), _loader())
    m = trainer.callback_metrics
    assert m["acc_step"] == pytest.approx(CORRECT[-1] / 4)  # the last batch's forward()
    assert m["acc_epoch"] == pytest.approx(sum(CORRECT) / 16) == m["acc"]  # compute() over the epoch
    assert m["correct"] == pytest.approx(sum(CORRECT))  # the second epoch's alone: reset between epochs
    # the sanity check's 2 batches were forgotten (reset): all 16 samples once
    assert m["val_acc"] == pytest.approx(sum(CORRECT) / 16)
    assert [model.acc.update_count, model.total.update_count, model.val_acc.update_count] == [0, 0, 0]
    assert trainer.validate(model, _loader(), verbose=False) == [{"val_acc": pytest.approx(10 / 16)}]
    assert model.val_acc.update_count == 0


def test_update_only_metric_has_no_step_value(tmp_path):
    class UpdateOnly(hookloop.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(1, 1)
            self.mean = torchmetrics.MeanMetric()

        def training_step(self, batch, batch_idx):
            self.mean.update(batch[0].float())
            self.log("mean", self.mean, on_step=True, on_epoch=True)
            return self.layer(batch[0].float().unsqueeze(1)).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_checkpointing=False,
                               enable_progress_bar=False)
    trainer.fit(UpdateOnly(), _loader())
    m = trainer.callback_metrics
    assert "mean_step" not in m
    assert m["mean_epoch"] == m["mean"] == pytest.approx(float(PREDS.float().mean()))


class _Logs(hookloop.Module):
    def __init__(self, make_value):
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.make_value = make_value
        self.metric = torchmetrics.Accuracy(task="multiclass", num_classes=3, average=None)
        self.collection = torchmetrics.MetricCollection([torchmetrics.MeanMetric()])

    def training_step(self, batch, batch_idx):
        self.log("bad", self.make_value(self, batch))
        return self.layer(batch[0].float().unsqueeze(1)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("make_value,error,message", [
    (lambda self, b: (self.metric(*b), self.metric)[1], hookloop.ConfigurationError,
     r"forward\(\) result must be a scalar tensor, got a tensor of shape \(3,\)"),
    (lambda self, b: (self.collection(b[0].float()), self.collection)[1], TypeError,
     r"MetricCollection: log it with self.log_dict\(collection\)"),
    (lambda self, b: object(), ValueError, r"was called, but `object` values cannot be logged: log a number, a "
                                           r"one-element tensor or a torchmetrics Metric"),
], ids=["non-scalar-forward", "collection-in-log", "not-a-metric"])
def test_bad_values_are_named(tmp_path, make_value, error, message):
    trainer = hookloop.Trainer(max_epochs=1, limit_train_batches=1, default_root_dir=str(tmp_path),
                               enable_checkpointing=False, enable_progress_bar=False, logger=False)
    with pytest.raises(error, match=message):
        trainer.fit(_Logs(make_value), _loader())


@pytest.mark.slow  # a fresh interpreter: this one imported torchmetrics
def test_hookloop_does_not_import_torchmetrics(tmp_path):
    code = (
        "import sys, torch, hookloop\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "class M(hookloop.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(1, 1)\n"
        "    def training_step(self, batch, i):\n"
        "        loss = self.l(batch[0]).mean(); self.log('loss', loss); self.log_dict({'x': 1.0}); return loss\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "t = hookloop.Trainer(max_epochs=1, enable_checkpointing=False, enable_progress_bar=False)\n"
        "t.fit(M(), DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2))\n"
        "assert 'torchmetrics' not in sys.modules, 'hookloop imported torchmetrics'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


# ---------------------------------------------------------------------------------------
# 2 processes (gloo): the metric syncs itself, hookloop does not reduce it again
# ---------------------------------------------------------------------------------------


@pytest.mark.check  # reads the shared ddp job
def test_ddp_metric_syncs_itself_once(jobs):
    # tests/scripts/torchmetrics_ddp.py in the shared ddp job (tests/jobs.py): hookloop's
    # ddp, then pytorch-lightning's, on accuracy_class's module
    ranks = jobs.run("ddp").ranks("torchmetrics_ddp")
    # Training: DistributedSampler(shuffle=True, seed=0) at epoch 0 gives rank r the
    # samples randperm(16)[r::2], two batches of 4; a rank's step value is its own batch's.
    correct = (PREDS == LABELS).float()[torch.randperm(16, generator=torch.Generator().manual_seed(0))]
    last_batch = {0: correct[0::2][4:8].mean(), 1: correct[1::2][4:8].mean()}
    assert last_batch[0] != last_batch[1]  # so each rank's own (unreduced) value shows
    for record in ranks:
        for fw in ("hookloop", "lightning"):
            m = record[fw]
            assert m["acc_step"] == pytest.approx(float(last_batch[record["rank"]])), (fw, m)
            assert m["acc_epoch"] == pytest.approx(sum(CORRECT) / 16), (fw, m)  # both ranks' samples
            assert m["correct"] == pytest.approx(sum(CORRECT)), (fw, m)  # 10, not 20 (reduced twice)
            assert m["val_acc"] == pytest.approx(sum(CORRECT) / 16), (fw, m)
        assert record["hookloop"] == pytest.approx(record["lightning"])


def f1_class(base):
    """F1 (not linear in the batches: an epoch's F1 is not the mean of the batches') logged
    the ways Lightning's examples log it: a Metric object step and epoch, an update-only
    Metric, a tensor value per batch (averaged), a MetricCollection computed at epoch end
    with log_dict, and a test-time Metric."""
    class F1Module(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(8, 3)
            f1 = lambda: torchmetrics.F1Score(task="multiclass", num_classes=3, average="macro")  # noqa: E731
            self.f1, self.vf1, self.vf1_value, self.test_f1 = f1(), f1(), f1(), f1()
            self.collection = torchmetrics.MetricCollection(
                {"f1": torchmetrics.F1Score(task="multiclass", num_classes=3, average="micro"),
                 "acc": torchmetrics.Accuracy(task="multiclass", num_classes=3)}, prefix="col_")

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            self.f1(out.argmax(-1), y)
            self.log("train_f1", self.f1, on_step=True, on_epoch=True, prog_bar=True)
            return nn.functional.cross_entropy(out, y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            preds = self.net(x).argmax(-1)
            self.vf1.update(preds, y)
            self.log("val_f1", self.vf1)
            self.log("val_f1_value", self.vf1_value(preds, y))
            self.collection.update(preds, y)

        def on_validation_epoch_end(self):
            self.log_dict(self.collection.compute())
            self.collection.reset()

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.test_f1(self.net(x).argmax(-1), y)
            self.log("test_f1", self.test_f1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return F1Module


def test_f1_logged_the_ways_lightning_examples_log_it_equals_lightnings(tmp_path):
    """Issue 35 reported an F1 logged in one process as 0.767 where Lightning gives 0.823 (the
    example was not named). The patterns Lightning's examples use, on batches of 7 that do not
    divide the 50 samples (the last is smaller: a mean of batch F1s is neither the epoch's F1
    nor a size-weighted mean), give Lightning's numbers exactly, fit and test."""
    import pytorch_lightning as pl

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 8, generator=g), torch.randint(0, 3, (50,), generator=g)

    def loader():
        return DataLoader(TensorDataset(x, y), batch_size=7)

    results = {}
    for name, trainer_class, base in (("lightning", pl.Trainer, pl.LightningModule),
                                      ("hookloop", hookloop.Trainer, hookloop.Module)):
        extra = dict(accelerator="cpu", devices=1) if name == "lightning" else {}
        trainer = trainer_class(max_epochs=2, default_root_dir=tmp_path / name, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, **extra)
        module = f1_class(base)()
        trainer.fit(module, loader(), loader())
        fitted = {k: float(v) for k, v in trainer.callback_metrics.items()}
        tested = trainer.test(module, loader(), verbose=False)
        results[name] = (fitted, tested)
    assert set(results["hookloop"][0]) == set(results["lightning"][0]) >= {
        "train_f1_step", "train_f1_epoch", "val_f1", "val_f1_value", "col_f1", "col_acc"}
    assert results["hookloop"][0] == pytest.approx(results["lightning"][0], abs=1e-6)
    (hl_test,), (pl_test,) = results["hookloop"][1], results["lightning"][1]
    assert hl_test == pytest.approx(pl_test, abs=1e-6) and set(hl_test) == {"test_f1"}
