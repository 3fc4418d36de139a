"""The user's side: ``hookloop.Module``, an ``nn.Module`` with ``log``.

A training module defines ``training_step(batch, batch_idx)`` returning the loss (a
scalar tensor, or a dict with a ``"loss"`` entry) and ``configure_optimizers()``; it may
define ``validation_step``, ``configure_model`` (layers built inside the strategy's
sharded-initialisation context) and ``training_step_end`` (DataParallel's gathered
outputs). It holds no device code: the loop moves the model and every batch.

Any ``nn.Module`` with those methods works; subclass ``hookloop.Module`` to get
``self.log`` and ``self.trainer``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from .helpers import REDUCE_OPS, batch_size_of


class Module(nn.Module):
    """Base class for training modules: ``nn.Module`` plus ``log`` and ``trainer``."""

    @property
    def trainer(self):
        trainer = self.__dict__.get("_hookloop_trainer")
        if trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return trainer

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        sync_dist: bool = False,
        reduce_op: str = "mean",
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        batch_size: int | None = None,
    ) -> None:
        """Record a metric.

        In ``training_step`` a value is kept per step (``on_step=True``) unless
        ``on_epoch=True`` asks for the mean over the epoch; in ``validation_step`` it is
        averaged over the validation set, weighted by batch size. ``sync_dist=True``
        reduces it across ranks with ``reduce_op`` ("mean", "sum", "max", "min"), so every
        rank reports the same number. Read metrics back from ``trainer.callback_metrics``.
        """
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"reduce_op={reduce_op!r} must be one of {', '.join(REDUCE_OPS)}")
        trainer = self.__dict__.get("_hookloop_trainer")
        if trainer is None:
            return  # called outside a run (e.g. a unit test of training_step)
        trainer._metrics.log(name, value, prog_bar, sync_dist, reduce_op, on_step, on_epoch, batch_size)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        trainer = self.__dict__.get("_hookloop_trainer")
        if trainer is None or trainer.global_rank == 0:
            print(*args, **kwargs)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_hookloop_trainer", None)  # the trainer does not travel with the module
        return state


class Metrics:
    """What ``self.log`` recorded during a run; reduced across ranks on request."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.stage = "train"
        self.step_values: dict[str, tuple] = {}
        self.epoch_sums: dict[str, list] = {}
        self.callback_metrics: dict[str, float] = {}
        self.prog_bar: set[str] = set()
        self._lock = threading.Lock()

    def log(self, name, value, prog_bar, sync_dist, reduce_op, on_step, on_epoch, batch_size):
        # DataParallel runs the step in one thread per replica: updates must not interleave.
        with self._lock:
            self._log(name, value, prog_bar, sync_dist, reduce_op, on_step, on_epoch, batch_size)

    def _log(self, name, value, prog_bar, sync_dist, reduce_op, on_step, on_epoch, batch_size):
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) needs a scalar, got shape {tuple(value.shape)}")
            value = value.reshape(())
        else:
            value = torch.tensor(float(value))
        if prog_bar:
            self.prog_bar.add(name)
        training = self.stage == "train"
        if on_epoch is None:
            on_epoch = not training
        if on_step is None:
            on_step = training and not on_epoch
        if on_step:
            if sync_dist:
                value = self.trainer.reduce(value, reduce_op)
            self.step_values[name] = value
        if on_epoch:
            if batch_size is None:
                batch_size = batch_size_of(self.trainer._current_batch)
            v = value.double()
            entry = self.epoch_sums.get(name)
            if entry is None:
                # [batch-weighted sum, samples, sync, op, plain sum, max, min]
                self.epoch_sums[name] = [v * batch_size, batch_size, sync_dist, reduce_op, v, v, v]
            else:
                entry[0] = entry[0] + v * batch_size
                entry[1] += batch_size
                entry[4] = entry[4] + v
                entry[5] = torch.maximum(entry[5], v)
                entry[6] = torch.minimum(entry[6], v)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]  # locks do not pickle (spawned workers get the trainer)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def start(self, stage: str) -> None:
        self.stage = stage
        self.epoch_sums = {}
        if stage == "train":
            self.step_values = {}

    def compute_epoch(self) -> dict[str, float]:
        """Reduce the epoch's metrics (across ranks where asked) into floats."""
        out: dict[str, float] = {}
        for name, (total, count, sync, op, plain_sum, vmax, vmin) in self.epoch_sums.items():
            device = self.trainer.root_device
            if op == "mean":
                if sync:
                    pair = self.trainer.reduce(torch.stack([total, torch.tensor(float(count), dtype=torch.float64)]).to(device), "sum")
                    total, count = pair[0], pair[1]
                out[name] = float(total / count)
            elif op == "sum":
                out[name] = float(self.trainer.reduce(plain_sum.to(device), "sum") if sync else plain_sum)
            elif op == "max":
                out[name] = float(self.trainer.reduce(vmax.to(device), "max") if sync else vmax)
            else:
                out[name] = float(self.trainer.reduce(vmin.to(device), "min") if sync else vmin)
        if self.stage == "train":
            for name, value in self.step_values.items():
                out.setdefault(name, float(value))
        self.callback_metrics.update(out)
        return out
