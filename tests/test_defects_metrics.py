"""Epoch metrics and epoch ends that differed from Lightning (issue 17, section 2).

Every test runs the same module under hookloop and under pytorch-lightning 2.6.6 (the
reference for Lightning semantics) and/or checks a number worked out by hand:

* ``sync_dist=True`` with ``on_step`` and ``on_epoch``: the epoch value is reduced once,
  from each rank's local values (2 real processes, gloo);
* ``self.log`` in ``on_train_epoch_start`` is an epoch metric;
* training stopped inside an epoch (``max_steps``, ``trainer.should_stop``) still ends
  the epoch: ``on_train_epoch_end`` and the epoch's metrics;
* an epoch cut inside an accumulation window (``on_train_batch_start`` returning -1)
  does not carry that window's gradients into the next epoch.
"""

from __future__ import annotations

import csv
import logging
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop
from hookloop.testing import run_processes

import pytorch_lightning as pl  # the reference (tests only)

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


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


def _sync_dist_worker(root: str) -> dict:
    rank = int(os.environ["RANK"])
    loader = DataLoader(TensorDataset(torch.arange(2.0 * 2 * STEPS_PER_RANK).unsqueeze(1)), batch_size=2)
    out = {}
    trainer = hookloop.Trainer(plugins=["ddp"], max_epochs=1, default_root_dir=os.path.join(root, "hl"),
                               enable_checkpointing=False, enable_progress_bar=False, logger=False)
    trainer.fit(sync_logged_class(hookloop.Module)(), loader)
    out["hookloop"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    _quiet()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=os.path.join(root, "pl"))
    trainer.fit(sync_logged_class(pl.LightningModule)(), loader)
    out["lightning"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    out["rank"] = rank
    return out


def test_sync_dist_epoch_value_is_reduced_once_from_local_values(tmp_path):
    ranks = run_processes(_sync_dist_worker, nprocs=2, args=(str(tmp_path),), timeout=240)
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
