"""``throughput``: samples/s, batches/s and step times of every rank, and the slowest rank.

A step's time is the wall-clock time between two ``on_train_batch_end`` calls (one
``time.perf_counter()`` and one batch size per training batch; nothing else runs per
step, and the device is not synchronised unless ``sync=True``). The first batch of every
epoch is not timed (its time would include starting the loader's iterator and workers);
validation and this plugin's own reporting are not part of any step. Every
``every_n_steps`` optimizer steps and at the end of every epoch, each rank summarises its
window of steps, the summaries are gathered, and one row goes to the loggers:

==============================  ==========================================================
``rank<R>/batches_per_sec``     training batches (micro-batches) of the window / its time
``rank<R>/samples_per_sec``     samples (``hookloop.batch_size_of``) / the window's time
``rank<R>/step_time_p50_ms``    median step time (nearest-rank percentile)
``rank<R>/step_time_p90_ms``    90th percentile step time
``rank<R>/step_time_max_ms``    the longest step of the window
``rank<R>/before_backward_p50_ms``  median time from the end of the previous batch to the
                                start of backward: loading the batch, forward, the rest
                                of ``training_step``
``throughput/batches_per_sec``  the sum over ranks
``throughput/samples_per_sec``  the sum over ranks
``throughput/slowest_rank``     (several ranks) the rank with the longest median
                                ``before_backward``
``throughput/slowest_rank_ratio``  its median ``before_backward`` / the fastest rank's
==============================  ==========================================================

Why the slowest rank is found before backward: under ddp every rank waits in backward's
gradient all-reduce for the slowest one, so every rank's step takes the same wall-clock
time; the part of the step before backward is where the ranks do not wait for each other
(time a rank spends waiting in a collective before backward, e.g. a buffer broadcast in
forward, and differences in backward compute are not seen).

On CUDA without ``sync``, host and device overlap: a step's time is the time the host
took to queue it, which over a window of many steps averages to the device's time (the
queue is bounded, so the host cannot run ahead by more than its length); percentiles of
single steps are then those of queueing times.
"""

from __future__ import annotations

import math
from time import perf_counter

import torch

import hookloop

from ._common import check_every, per_rank_row


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile: the smallest value with at least ``q`` % of
    ``values`` at or below it (always one of the values)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def window_stats(step_times: list[float], before_backward: list[float], samples: int) -> dict[str, float]:
    """One rank's summary of a window of timed steps (times in seconds); ``{}`` for none."""
    if not step_times:
        return {}
    total = sum(step_times)
    return {
        "batches_per_sec": len(step_times) / total,
        "samples_per_sec": samples / total,
        "step_time_p50_ms": percentile(step_times, 50) * 1000,
        "step_time_p90_ms": percentile(step_times, 90) * 1000,
        "step_time_max_ms": max(step_times) * 1000,
        "before_backward_p50_ms": percentile(before_backward, 50) * 1000,
    }


def totals(gathered: list[dict]) -> dict[str, float]:
    """The cross-rank metrics of a row from every rank's :func:`window_stats`."""
    measured = [(rank, values) for rank, values in enumerate(gathered) if values]
    if not measured:
        return {}
    row = {
        "throughput/batches_per_sec": sum(values["batches_per_sec"] for _, values in measured),
        "throughput/samples_per_sec": sum(values["samples_per_sec"] for _, values in measured),
    }
    if len(measured) > 1:
        def key(item):
            return item[1]["before_backward_p50_ms"]
        slowest, fastest = max(measured, key=key), min(measured, key=key)
        row["throughput/slowest_rank"] = float(slowest[0])
        if key(fastest) > 0:
            row["throughput/slowest_rank_ratio"] = key(slowest) / key(fastest)
    return row


def check_sync(sync) -> bool:
    if not isinstance(sync, bool):
        raise hookloop.ConfigurationError(
            f"throughput sync={sync!r} must be True or False (--plugin-option throughput.sync=True)")
    return sync


class Throughput:
    """Log samples/s, batches/s and step-time percentiles per rank and in total, and the
    slowest rank.

    every_n_steps: report every this many optimizer steps (default 50), and at the end of
        every training epoch
    sync: on CUDA, wait for the device at every batch end (torch.cuda.synchronize), so
        that each step's time is the device's; costs the overlap of host and device
        (default False: per-step times are queueing times, exact as window averages)
    """

    hookloop_name = "throughput"
    hookloop_role = "observer"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self, every_n_steps: int = 50, sync: bool = False):
        self.every_n_steps = check_every("throughput", every_n_steps)
        self.sync = check_sync(sync)
        self._sync_device: torch.device | None = None
        self._logged_step = -1
        self._start_window()
        self._last: float | None = None  # when the previous batch ended; None: not timing
        self._backward: float | None = None  # when this batch's first backward started

    def _start_window(self) -> None:
        self._steps: list[float] = []
        self._before: list[float] = []
        self._samples = 0

    def report(self, trainer) -> None:
        """Summarise the window on every rank (a collective: every rank calls it at the
        same step) and log one row."""
        self._logged_step = trainer.global_step
        gathered = trainer.all_gather_object(window_stats(self._steps, self._before, self._samples))
        self._start_window()
        row = {**per_rank_row(gathered), **totals(gathered)}
        if row:
            trainer.log_metrics(row)
        if self._last is not None:
            self._last = perf_counter()  # the report is no step's time

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        if stage != "fit":
            return
        check_every("throughput", self.every_n_steps)  # --plugin-option sets them after __init__
        check_sync(self.sync)
        device = trainer.root_device
        self._sync_device = device if self.sync and device.type == "cuda" else None
        self._logged_step, self._last, self._backward = -1, None, None
        self._start_window()

    @hookloop.hookimpl
    def on_train_epoch_start(self):
        self._last = self._backward = None

    @hookloop.hookimpl
    def on_before_backward(self):
        if self._backward is None:  # manual optimization may call backward several times
            self._backward = perf_counter()

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer, batch):
        if self._sync_device is not None:
            torch.cuda.synchronize(self._sync_device)
        now = perf_counter()
        if self._last is not None:
            self._steps.append(now - self._last)
            self._before.append((now if self._backward is None else self._backward) - self._last)
            self._samples += hookloop.batch_size_of(batch)
        self._last, self._backward = now, None
        step = trainer.global_step
        if step and step != self._logged_step and step % self.every_n_steps == 0:
            self.report(trainer)

    @hookloop.hookimpl
    def on_validation_end(self):
        if self._last is not None:
            self._last = perf_counter()  # validation inside the epoch is no step's time

    @hookloop.hookimpl
    def on_train_epoch_end(self, trainer):
        if trainer.global_step != self._logged_step:
            self.report(trainer)

    @hookloop.hookimpl
    def on_train_end(self, trainer):
        if trainer.global_step != self._logged_step:  # stopped inside an epoch (max_steps)
            self.report(trainer)
