"""Epoch metrics and epoch ends that differed from Lightning (issue 17, section 2).

Every test runs the same module under hookloop and under pytorch-lightning 2.6.6 (the
reference for Lightning semantics) and/or checks a number worked out by hand:

* ``sync_dist=True`` with ``on_step`` and ``on_epoch``: the epoch value is reduced once,
  from each rank's local values (2 real processes, gloo: tests/scripts/sync_dist_ddp.py
  in the shared ddp job, tests/jobs.py);
* ``self.log`` in ``on_train_epoch_start`` is an epoch metric;
* training stopped inside an epoch (``max_steps``, ``trainer.should_stop``) still ends
  the epoch: ``on_train_epoch_end`` and the epoch's metrics;
* an epoch cut inside an accumulation window (``on_train_batch_start`` returning -1)
  does not carry that window's gradients into the next epoch.
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl  # the reference (tests only)
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

# Lightning's info lines off for this file's runs, restored after each test (conftest.py)
pytestmark = pytest.mark.usefixtures("quiet_lightning")


def _quiet() -> None:
    warnings.filterwarnings("ignore", module=r"(pytorch_)?lightning.*")
    warnings.filterwarnings("ignore", message=r".*(num_workers|does not have many workers|LitLogger|litlogger).*")


def pl_trainer(root: Path, **kw) -> pl.Trainer:
    _quiet()
    kw.setdefault("logger", pl.loggers.CSVLogger(str(root), name="pl"))
    return pl.Trainer(accelerator="cpu", devices=kw.pop("devices", 1), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


def hl_trainer(root: Path, **kw) -> hookloop.Trainer:
    kw.setdefault("enable_checkpointing", False)
    return hookloop.Trainer(default_root_dir=str(root), num_sanity_val_steps=0, enable_progress_bar=False, **kw)


def data(n: int = 40, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def weights(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_weights(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=atol, rtol=0), (k, float((wa[k] - wb[k]).abs().max()))


# ---------------------------------------------------------------------------------------
# 1. sync_dist with on_step and on_epoch: reduced once, at the epoch's end
# ---------------------------------------------------------------------------------------

STEPS_PER_RANK = 4


def sync_logged_class(base):
    class SyncLogged(base):
        """Rank r logs (r + 1) * (batch_idx + 1) at every step, with every reduce_fx."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            rank = self.trainer.global_rank
            value = torch.tensor((rank + 1.0) * (batch_idx + 1))
            both = dict(on_step=True, on_epoch=True, sync_dist=True)
            self.log("s", value, reduce_fx="sum", **both)
            # per-rank batch sizes: 1 on rank 0, 3 on rank 1
            self.log("m", value, reduce_fx="mean", batch_size=1 + 2 * rank, **both)
            self.log("hi", value, reduce_fx="max", **both)
            self.log("lo", value, reduce_fx="min", **both)
            self.log("s_epoch_only", value, reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)
            return self.layer(batch[0]).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return SyncLogged


@pytest.mark.check  # reads the shared ddp job
def test_sync_dist_epoch_value_is_reduced_once_from_local_values(jobs):
    # tests/scripts/sync_dist_ddp.py in the shared ddp job (tests/jobs.py): hookloop's ddp,
    # then pytorch-lightning's, on sync_logged_class's module
    ranks = jobs.run("ddp").ranks("sync_dist_ddp")
    steps = range(1, STEPS_PER_RANK + 1)  # batch_idx + 1
    # every rank's every value once: sum over r of (r + 1) * i
    total = sum((r + 1) * i for r in (0, 1) for i in steps)
    # mean weighted by each rank's batch size (1 and 3), over both ranks
    weighted = sum((1 + 2 * r) * (r + 1) * i for r in (0, 1) for i in steps) / (STEPS_PER_RANK * (1 + 3))
    expected = {
        "s_epoch": total, "s": total, "s_epoch_only": total,  # 30 (the defect gave 60)
        "m_epoch": weighted, "m": weighted,  # 4.375 (the defect gave 3.75)
        "hi_epoch": 2.0 * STEPS_PER_RANK, "lo_epoch": 1.0,
        # the last step's value, reduced across ranks
        "s_step": 3.0 * STEPS_PER_RANK, "m_step": 1.5 * STEPS_PER_RANK,
        "hi_step": 2.0 * STEPS_PER_RANK, "lo_step": 1.0 * STEPS_PER_RANK,
    }
    for record in ranks:
        for name, value in expected.items():
            assert record["lightning"][name] == pytest.approx(value, rel=1e-6), ("lightning", name)
            assert record["hookloop"][name] == pytest.approx(value, rel=1e-6), ("hookloop", name, record["hookloop"])


# ---------------------------------------------------------------------------------------
# Epoch-level modules shared by the tests below
# ---------------------------------------------------------------------------------------


def recording_class(base):
    class Recording(base):
        """Linear 8 -> 2 with SGD; records the epoch-level hooks and logs per step, per
        epoch, in on_train_epoch_start and in on_train_epoch_end."""

        def __init__(self, stop_at_batch: int | None = None, cut_at_batch: int | None = None, lr: float = 0.1):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(8, 2)
            self.calls: list = []
            self.stop_at_batch, self.cut_at_batch, self.lr = stop_at_batch, cut_at_batch, lr

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss, on_step=True, on_epoch=True)
            self.log("batches", float(batch_idx), on_step=False, on_epoch=True, reduce_fx="sum")
            return loss

        def validation_step(self, batch, batch_idx):
            self.calls.append(("validation_step", batch_idx))
            self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        def on_train_epoch_start(self):
            self.calls.append(("on_train_epoch_start", self.current_epoch))
            self.log("start", float(self.current_epoch + 1))
            self.log("start_sum", 10.0 * (self.current_epoch + 1), reduce_fx="sum")

        def on_train_batch_start(self, batch, batch_idx):
            if self.cut_at_batch is not None and self.current_epoch == 0 and batch_idx == self.cut_at_batch:
                self.calls.append(("cut", batch_idx))
                return -1
            return None

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.stop_at_batch is not None and batch_idx == self.stop_at_batch:
                self.trainer.should_stop = True

        def on_validation_epoch_start(self):
            self.calls.append(("on_validation_epoch_start", self.current_epoch))

        def on_train_epoch_end(self):
            metrics = self.trainer.callback_metrics
            self.calls.append(("on_train_epoch_end", self.current_epoch, self.global_step,
                               round(float(metrics["loss_epoch"]), 6), float(metrics["batches"])))
            self.log("at_end", 7.0)

        def on_train_end(self):
            self.calls.append(("on_train_end", self.global_step))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    return Recording


HookloopRecording, LightningRecording = recording_class(hookloop.Module), recording_class(pl.LightningModule)
EPOCH_KEYS = ("loss_epoch", "loss", "batches", "start", "start_sum", "at_end")


def fit_both(tmp_path: Path, module_kw: dict, val: bool = True, **trainer_kw):
    """The same module, data and settings under hookloop and Lightning; both trainers
    and modules."""
    loaders = lambda: (DataLoader(data(40), batch_size=4), DataLoader(data(16, seed=2), batch_size=4) if val else None)  # noqa: E731
    hl_class, pl_class = module_kw.pop("classes", (HookloopRecording, LightningRecording))
    hl_module, pl_module = hl_class(**module_kw), pl_class(**module_kw)
    hl = hl_trainer(tmp_path / "hl", limit_val_batches=2, **trainer_kw)
    hl.fit(hl_module, *loaders())
    lightning = pl_trainer(tmp_path / "pl", limit_val_batches=2, **trainer_kw)
    lightning.fit(pl_module, *loaders())
    return (hl, hl_module), (lightning, pl_module)


def epoch_rows(path: Path) -> list[dict]:
    """The rows of a metrics.csv that carry epoch metrics, with those metrics only."""
    return [{k: round(v, 6) for k, v in row.items() if k in EPOCH_KEYS or k == "epoch"}
            for row in csv_rows(path) if "loss_epoch" in row or "start" in row]


# ---------------------------------------------------------------------------------------
# 5. self.log in on_train_epoch_start is an epoch metric
# ---------------------------------------------------------------------------------------


def test_log_in_on_train_epoch_start_is_an_epoch_metric_in_metrics_csv(tmp_path):
    (hl, _), (lightning, _) = fit_both(tmp_path, {}, val=False, max_epochs=2)
    hl_rows, pl_rows = (epoch_rows(Path(d) / "metrics.csv") for d in (hl.log_dir, lightning.logger.log_dir))
    # one row per epoch, with every epoch metric: batches 0 + 1 + ... + 9 = 45
    expected = [{"epoch": e, "batches": 45.0, "start": e + 1.0, "start_sum": 10.0 * (e + 1), "at_end": 7.0}
                for e in (0, 1)]
    for rows in (pl_rows, hl_rows):
        assert [{k: v for k, v in row.items() if k != "loss_epoch"} for row in rows] == expected, rows
    assert hl_rows == pl_rows  # loss_epoch too
    for name in ("start", "start_sum", "loss_epoch", "batches"):
        assert hl.callback_metrics[name] == pytest.approx(float(lightning.callback_metrics[name]), abs=1e-6), name


# ---------------------------------------------------------------------------------------
# 6. Training stopped inside an epoch ends the epoch
# ---------------------------------------------------------------------------------------


def hand_losses(batches: int) -> list[float]:
    """The losses of Recording's first ``batches`` steps, in a hand-written loop."""
    torch.manual_seed(0)
    net = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for x, y in list(DataLoader(data(40), batch_size=4))[:batches]:
        loss = F.cross_entropy(net(x), y)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses


def _stops_in_validation(base):
    class StopsInValidation(recording_class(base)):
        def on_validation_epoch_end(self):
            self.trainer.should_stop = True  # as an early-stopping callback does

    return StopsInValidation


StopsInValidation, LightningStopsInValidation = _stops_in_validation(hookloop.Module), _stops_in_validation(pl.LightningModule)


@pytest.mark.parametrize("how", ["max_steps", "should_stop", "should_stop_in_validation"])
def test_stopping_inside_an_epoch_ends_it_as_lightning_does(tmp_path, how):
    """10 batches per epoch, stopped after 3 of them: by max_steps (no validation), by
    should_stop set at a batch's end (Lightning validates first), or by should_stop set
    in a validation every 3 batches (the epoch ends right after it)."""
    module_kw, trainer_kw = {}, {"max_epochs": 2}
    if how == "max_steps":
        trainer_kw = {"max_steps": 3}
    elif how == "should_stop":
        module_kw = {"stop_at_batch": 2}
    else:
        trainer_kw["val_check_interval"] = 3
        module_kw = {"classes": (StopsInValidation, LightningStopsInValidation)}
    (hl, hl_module), (lightning, pl_module) = fit_both(tmp_path, module_kw, **trainer_kw)
    validated = how != "max_steps"
    assert pl_module.calls == [
        ("on_train_epoch_start", 0),
        *([("on_validation_epoch_start", 0), ("validation_step", 0), ("validation_step", 1)] if validated else []),
        ("on_train_epoch_end", 0, 3, pl_module.calls[-2][3], 3.0),
        ("on_train_end", 3),
    ]
    assert hl_module.calls == pl_module.calls
    assert (hl.global_step, hl.current_epoch, hl.batch_idx) == (3, 0, 3)  # the position stays (Lightning: epoch 1)
    # the epoch's metrics over the 3 batches trained, reported and logged
    for name in ("loss_epoch", "loss", "batches", "start", "start_sum", "at_end") + (("val_loss",) if validated else ()):
        assert hl.callback_metrics[name] == pytest.approx(float(lightning.callback_metrics[name]), abs=1e-6), name
    hl_rows, pl_rows = (epoch_rows(Path(d) / "metrics.csv") for d in (hl.log_dir, lightning.logger.log_dir))
    assert hl_rows == pl_rows and len(pl_rows) == 1 and pl_rows[0]["batches"] == 0 + 1 + 2
    assert pl_rows[0]["loss_epoch"] == pytest.approx(sum(hand_losses(3)) / 3, abs=1e-6)


def test_a_resume_after_a_mid_epoch_stop_reports_the_whole_epochs_metrics(tmp_path):
    """The checkpoint written as the stopped epoch ends keeps the position and the
    epoch's partial sums: resumed, the epoch's mean loss is over all 10 batches."""
    loader = lambda: DataLoader(data(40), batch_size=4)  # noqa: E731
    first = hl_trainer(tmp_path, max_steps=3, enable_checkpointing=True)
    first.fit(HookloopRecording(), loader())
    last = Path(first.log_dir) / "checkpoints" / "last.ckpt"
    saved = hookloop.safe_load(last)
    assert {k: saved["loop"][k] for k in ("epoch", "global_step", "batch_idx", "stage")} == {
        "epoch": 0, "global_step": 3, "batch_idx": 3, "stage": "train"}
    resumed_module = HookloopRecording()
    resumed = hl_trainer(tmp_path, max_epochs=1, enable_checkpointing=True)
    resumed.fit(resumed_module, loader(), ckpt_path=last)
    losses = hand_losses(10)  # the reference (full batches: a plain mean)
    assert resumed.global_step == 10
    assert resumed.callback_metrics["loss_epoch"] == pytest.approx(sum(losses) / len(losses), abs=1e-6)
    assert resumed.callback_metrics["batches"] == sum(range(10))
    assert resumed_module.calls[-2][1:] == (0, 10, round(sum(losses) / len(losses), 6), 45.0)


# ---------------------------------------------------------------------------------------
# 7. An epoch cut inside an accumulation window leaks nothing into the next epoch
# ---------------------------------------------------------------------------------------


def test_an_epoch_cut_inside_an_accumulation_window_leaks_no_gradient_into_the_next(tmp_path):
    """accumulate_grad_batches=3; epoch 0 is cut (on_train_batch_start returns -1) at
    batch 4, inside the window [3, 4, 5]: batch 3's gradient is never stepped, and the
    next epoch starts from zero gradients (Lightning zeroes at every window's start)."""
    (hl, hl_module), (lightning, pl_module) = fit_both(
        tmp_path, {"cut_at_batch": 4}, val=False, max_epochs=2, accumulate_grad_batches=3)
    assert ("cut", 4) in hl_module.calls and ("cut", 4) in pl_module.calls
    assert hl.global_step == lightning.global_step == 1 + 4  # epoch 0: [0, 1, 2]; epoch 1: 3 windows + [9]
    # the hand-written reference: SGD, the loss divided by 3, windows of 3 per epoch
    torch.manual_seed(0)
    net = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for epoch in (0, 1):
        optimizer.zero_grad()
        for i, (x, y) in enumerate(DataLoader(data(40), batch_size=4)):
            if epoch == 0 and i == 4:
                break
            (F.cross_entropy(net(x), y) / 3).backward()
            if (i + 1) % 3 == 0 or i == 9:
                optimizer.step()
                optimizer.zero_grad()
    assert_same_weights(pl_module.net, net)
    assert_same_weights(hl_module.net, net)
