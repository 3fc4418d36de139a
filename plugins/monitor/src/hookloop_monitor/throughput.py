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
``throughput/flops_per_step``   FLOPs of one training batch's forward and backward, summed
                                over ranks (measured once, see below)
``throughput/flops_per_sec``    Lightning's ``flops_per_sec``: the sum over ranks of a
                                rank's FLOPs per batch x its batches/s
``throughput/tflops_per_sec``   the same in TFLOP/s
``throughput/mfu``              model FLOPs utilisation, Lightning's ``device/mfu``:
                                ``flops_per_sec`` / the sum of the ranks' peak FLOP/s
                                (only where the peak is known: see below)
==============================  ==========================================================

FLOPs and MFU (``measure_flops=True``, the default): the FLOPs of a training batch are
counted once per fit, on the first training batch (not timed anyway), with
``torch.utils.flop_counter.FlopCounterMode`` around that batch's forward and backward,
as Lightning's ``measure_flops`` does (matrix products, convolutions and attention
count; element-wise operations and the optimizer do not). A device's peak FLOP/s comes
from :data:`PEAK_FLOPS` (dense, no sparsity, NVIDIA's data sheets) by the device's name
and the run's precision (32-bit with TF32 allowed, ``torch.get_float32_matmul_precision()``
not ``"highest"``, reads the TF32 column), or from ``peak_flops=`` (FLOP/s per device),
which wins. The CPU has no entry: on the CPU MFU is logged only with ``peak_flops``.

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


#: Peak dense FLOP/s per device by chip and compute dtype ("tf32": float32 matrix products
#: on tensor cores), from NVIDIA's data sheets (the sparsity figures halved).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h200 sxm": {"float64": 34e12, "float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
    "h200 nvl": {"float64": 30e12, "float32": 60e12, "tf32": 417.5e12, "bfloat16": 835.5e12, "float16": 835.5e12},
    "h100 sxm": {"float64": 34e12, "float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
    "h100 nvl": {"float64": 30e12, "float32": 60e12, "tf32": 417.5e12, "bfloat16": 835.5e12, "float16": 835.5e12},
    "h100 pcie": {"float64": 26e12, "float32": 51.2e12, "tf32": 378e12, "bfloat16": 756e12, "float16": 756e12},
    "a100": {"float64": 9.7e12, "float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
    "a10": {"float32": 31.2e12, "tf32": 62.5e12, "bfloat16": 125e12, "float16": 125e12},
    "l40s": {"float32": 91.6e12, "tf32": 183e12, "bfloat16": 362e12, "float16": 362e12},
    "l40": {"float32": 90.5e12, "tf32": 90.5e12, "bfloat16": 181e12, "float16": 181e12},
    "l4": {"float32": 30.3e12, "tf32": 60e12, "bfloat16": 121e12, "float16": 121e12},
    "v100 sxm": {"float64": 7.8e12, "float32": 15.7e12, "float16": 125e12},
    "v100 pcie": {"float64": 7e12, "float32": 14e12, "float16": 112e12},
    "t4": {"float32": 8.1e12, "float16": 65e12},
}


def chip_of(device_name: str) -> str | None:
    """The :data:`PEAK_FLOPS` key of a CUDA device name (``torch.cuda.get_device_name``),
    or None for a device not in the table."""
    name = device_name.lower()
    for chip in ("h200", "h100"):
        if chip in name:
            if "nvl" in name:
                return f"{chip} nvl"
            if "pcie" in name or (chip == "h100" and "hbm2e" in name):
                return f"{chip} pcie" if chip == "h100" else None
            return f"{chip} sxm"  # "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    if "a100" in name:
        return "a100"
    if "a10g" in name or "a10 " in name or name.endswith("a10"):
        return "a10"
    if "l40s" in name:
        return "l40s"
    if "l40" in name:
        return "l40"
    if "l4" in name.split() or name.endswith(" l4"):
        return "l4"
    if "v100" in name:
        return "v100 pcie" if "pcie" in name else "v100 sxm"
    if "t4" in name.split() or name.endswith(" t4"):
        return "t4"
    return None


def compute_dtype(precision: str, tf32: bool) -> str:
    """The :data:`PEAK_FLOPS` column of a Trainer ``precision`` ("32", "bf16-mixed", ...);
    ``tf32``: float32 matrix products may use TF32."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return "bfloat16"
    if precision.startswith("16"):
        return "float16"
    if precision.startswith("64"):
        return "float64"
    return "tf32" if tf32 else "float32"


def peak_flops_of(device_name: str, dtype: str) -> float | None:
    """A device's peak FLOP/s for ``dtype`` from :data:`PEAK_FLOPS` (None: not in the
    table; a 32-bit run on a chip without TF32 reads its float32 column)."""
    chip = chip_of(device_name)
    if chip is None:
        return None
    row = PEAK_FLOPS[chip]
    if dtype == "tf32" and dtype not in row:
        dtype = "float32"
    return row.get(dtype)


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """The peak FLOP/s of ``device`` under ``precision`` (None off CUDA or for a device
    not in the table)."""
    if device.type != "cuda":
        return None
    tf32 = torch.get_float32_matmul_precision() != "highest"
    return peak_flops_of(torch.cuda.get_device_name(device), compute_dtype(precision, tf32))


def flops_totals(gathered: list[dict], flops: list, peaks: list) -> dict[str, float]:
    """The FLOPs metrics of a row: every rank's :func:`window_stats`, its FLOPs per batch
    and its peak FLOP/s (None where unknown)."""
    measured = [(values, f, p) for values, f, p in zip(gathered, flops, peaks) if values and f is not None]
    if not measured:
        return {}
    per_sec = sum(f * values["batches_per_sec"] for values, f, _ in measured)
    row = {
        "throughput/flops_per_step": float(sum(f for _, f, _ in measured)),
        "throughput/flops_per_sec": per_sec,
        "throughput/tflops_per_sec": per_sec / 1e12,
    }
    if all(p for _, _, p in measured):
        row["throughput/mfu"] = per_sec / sum(p for _, _, p in measured)
    return row


def check_peak_flops(peak_flops):
    if peak_flops is None:
        return None
    if isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float)) or not peak_flops > 0:
        raise hookloop.ConfigurationError(
            f"throughput peak_flops={peak_flops!r} must be a positive number of FLOP/s per device, e.g. "
            f"--plugin-option throughput.peak_flops=989.4e12 (an H100 SXM in bf16)")
    return float(peak_flops)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise hookloop.ConfigurationError(
            f"throughput {name}={value!r} must be True or False (--plugin-option throughput.{name}=True)")
    return value


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
    measure_flops: count the FLOPs of the first training batch (FlopCounterMode) and log
        FLOP/s and, where the device's peak is known, MFU (default True)
    peak_flops: the peak FLOP/s of one device, for MFU (default: from :data:`PEAK_FLOPS`
        by the CUDA device's name; the CPU has none)
    """

    hookloop_name = "throughput"
    hookloop_role = "observer"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self, every_n_steps: int = 50, sync: bool = False, measure_flops: bool = True,
                 peak_flops: float | None = None):
        self.every_n_steps = check_every("throughput", every_n_steps)
        self.sync = check_sync(sync)
        self.measure_flops = check_bool("measure_flops", measure_flops)
        self.peak_flops = check_peak_flops(peak_flops)
        self.flops_per_step: int | None = None  # FLOPs of one training batch on this rank
        self._peak: float | None = None
        self._counter = None
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
        gathered = trainer.all_gather_object(
            (window_stats(self._steps, self._before, self._samples), self.flops_per_step, self._peak))
        self._start_window()
        stats = [g[0] for g in gathered]
        row = {**per_rank_row(stats), **totals(stats),
               **flops_totals(stats, [g[1] for g in gathered], [g[2] for g in gathered])}
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
        self.peak_flops = check_peak_flops(self.peak_flops)
        check_bool("measure_flops", self.measure_flops)
        device = trainer.root_device
        self._peak = self.peak_flops or device_peak_flops(device, trainer.precision)
        self.flops_per_step = None
        self._sync_device = device if self.sync and device.type == "cuda" else None
        self._logged_step, self._last, self._backward = -1, None, None
        self._start_window()

    @hookloop.hookimpl
    def on_train_epoch_start(self):
        self._last = self._backward = None
        # The first batch's FLOPs, counted from here to its end (no per-batch hook: the
        # loader's fetch in between runs no counted operation)
        if self.measure_flops and self.flops_per_step is None and self._counter is None:
            from torch.utils.flop_counter import FlopCounterMode

            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def _stop_counting(self, measured: bool = True) -> None:
        """Leave the FLOP counter; ``measured``: a whole batch ran under it."""
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            if measured:
                self.flops_per_step = counter.get_total_flops()

    @hookloop.hookimpl
    def on_before_backward(self):
        if self._backward is None:  # manual optimization may call backward several times
            self._backward = perf_counter()

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer, batch):
        if self._counter is not None:
            self._stop_counting()
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
        self._stop_counting(measured=False)  # an epoch without batches: the next one counts
        if trainer.global_step != self._logged_step:
            self.report(trainer)

    @hookloop.hookimpl
    def on_exception(self):
        self._stop_counting(measured=False)

    @hookloop.hookimpl
    def on_train_end(self, trainer):
        if trainer.global_step != self._logged_step:  # stopped inside an epoch (max_steps)
            self.report(trainer)
