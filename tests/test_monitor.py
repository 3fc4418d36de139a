"""hookloop-monitor: ``device_stats`` and ``throughput`` on real runs (1 process, and 2
under ddp with gloo), read back from ``trainer.callback_metrics`` and the CSV log.

The references are independent of the plugins: the kernel's own accounts of memory
(``/proc/<pid>/status``, ``/proc/meminfo``, read here, not through psutil); the sleep
each module's ``training_step`` makes (a step cannot be shorter, and under ddp every
rank's step waits for the slowest rank's); window statistics and NVML conversions
worked out by hand. NVML needs a GPU and its driver, which this machine lacks: its
answers come from a stand-in with fixed numbers, through the same code that reads the
real pynvml (tests/gpu/test_gpu.py reads a real GPU).
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import ObserverConformance
from conftest import TinyModule, tiny_data
from hookloop_monitor import DeviceStats, Throughput, per_rank_row, window_stats
from hookloop_monitor.throughput import totals

MiB = 2**20
HOST = {"cpu_percent", "rss_mib", "ram_used_percent"}
THROUGHPUT = {"batches_per_sec", "samples_per_sec", "step_time_p50_ms", "step_time_p90_ms", "step_time_max_ms",
              "before_backward_p50_ms"}


def kernel_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def kernel_ram_used_percent() -> float:
    info = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
    return 100 * (info["MemTotal"] - info["MemAvailable"]) / info["MemTotal"]


def csv_rows(log_dir) -> list[dict]:
    with open(Path(log_dir) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def rows_with(rows: list[dict], column: str) -> list[dict]:
    return [row for row in rows if row.get(column)]


class _Conformance(ObserverConformance):
    @pytest.mark.slow  # the kit's ddp check: a 2-process launch of its own
    def test_under_ddp_only_global_rank_zero_writes_files(self, ddp_runs):
        super().test_under_ddp_only_global_rank_zero_writes_files(ddp_runs)


class TestDeviceStatsConformance(_Conformance):
    plugin = "device_stats"
    options = {"every_n_steps": 1}


class TestThroughputConformance(_Conformance):
    plugin = "throughput"
    options = {"every_n_steps": 1}


# -- NVML, answered by a stand-in ---------------------------------------------------------


class FakeNvml:
    """pynvml's functions for four GPUs with fixed answers: GPU i is i*10+5 % busy, uses
    (i+1) GiB of 81559 MiB, is at 40+i C and draws 100+25*i W."""

    NVML_TEMPERATURE_GPU = 0
    UUIDS = ["GPU-aa01e5a7-0000", "GPU-bb02e5a7-1111", "GPU-cc03e5a7-2222", b"GPU-aa02e5a7-3333"]

    class NVMLError(Exception):
        pass

    def __init__(self, fail_init: bool = False, unsupported: tuple = ()):
        self.fail_init, self.unsupported, self.inits = fail_init, unsupported, 0

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")
        self.inits += 1

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 4

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < 4:
            raise self.NVMLError("Invalid Argument")
        return ("gpu", index)

    def nvmlDeviceGetUUID(self, handle):
        return self.UUIDS[handle[1]]  # pynvml answers str, older versions bytes

    def _answer(self, what, value):
        if what in self.unsupported:
            raise self.NVMLError("Not Supported")
        return value

    def nvmlDeviceGetUtilizationRates(self, handle):
        return self._answer("util", SimpleNamespace(gpu=handle[1] * 10 + 5, memory=1))

    def nvmlDeviceGetMemoryInfo(self, handle):
        used = (handle[1] + 1) * 2**30
        return self._answer("memory", SimpleNamespace(total=81559 * MiB, used=used, free=81559 * MiB - used))

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._answer("temperature", 40 + handle[1])

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._answer("power", 100_000 + 25_000 * handle[1])  # milliwatts


# By hand, from the description of FakeNvml above.
GPU = {
    0: {"gpu_util": 5.0, "gpu_mem_used_mib": 1024.0, "gpu_mem_total_mib": 81559.0, "gpu_temp_c": 40.0, "gpu_power_w": 100.0},
    1: {"gpu_util": 15.0, "gpu_mem_used_mib": 2048.0, "gpu_mem_total_mib": 81559.0, "gpu_temp_c": 41.0, "gpu_power_w": 125.0},
    2: {"gpu_util": 25.0, "gpu_mem_used_mib": 3072.0, "gpu_mem_total_mib": 81559.0, "gpu_temp_c": 42.0, "gpu_power_w": 150.0},
    3: {"gpu_util": 35.0, "gpu_mem_used_mib": 4096.0, "gpu_mem_total_mib": 81559.0, "gpu_temp_c": 43.0, "gpu_power_w": 175.0},
}


@pytest.mark.parametrize("visible, expected", [
    (None, {0: 0, 2: 2}),                             # no CUDA_VISIBLE_DEVICES: NVML's numbering
    ("3,1", {0: 3, 1: 1}),                            # indices
    ("GPU-cc03, GPU-aa02e5a7", {0: 2, 1: 3}),          # UUID prefixes (GPU 3's UUID comes as bytes)
])
def test_nvml_readings_of_the_cuda_device_through_cuda_visible_devices(monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    stats = DeviceStats(nvml=FakeNvml())
    for cuda_index, gpu in expected.items():
        assert stats.gpu_values(cuda_index) == GPU[gpu]


def test_the_row_names_every_ranks_gpu_values(monkeypatch):
    # Two ranks on cuda:0 and cuda:1 of CUDA_VISIBLE_DEVICES=3,1 (each process reads its own).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    stats = DeviceStats(nvml=FakeNvml())
    assert per_rank_row([stats.gpu_values(0), stats.gpu_values(1)]) == {
        "rank0/gpu_util": 35.0, "rank0/gpu_mem_used_mib": 4096.0, "rank0/gpu_mem_total_mib": 81559.0,
        "rank0/gpu_temp_c": 43.0, "rank0/gpu_power_w": 175.0,
        "rank1/gpu_util": 15.0, "rank1/gpu_mem_used_mib": 2048.0, "rank1/gpu_mem_total_mib": 81559.0,
        "rank1/gpu_temp_c": 41.0, "rank1/gpu_power_w": 125.0,
    }


def test_nvml_reading_by_torchs_uuid_and_unsupported_fields(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    # torch's UUID (bare, as get_device_properties(i).uuid prints) wins over the list.
    assert DeviceStats(nvml=FakeNvml()).gpu_values(0, uuid="BB02E5A7-1111") == GPU[1]
    # A field NVML does not support on a GPU is left out alone.
    stats = DeviceStats(nvml=FakeNvml(unsupported=("power", "temperature")))
    assert stats.gpu_values(0) == {k: v for k, v in GPU[0].items() if k not in ("gpu_power_w", "gpu_temp_c")}


def test_nvml_that_cannot_start_leaves_the_gpu_fields_out_with_one_warning(monkeypatch, recwarn):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for nvml, why in [(FakeNvml(fail_init=True), "NVML could not start: Driver Not Loaded"),
                      ("hookloop_no_such_nvml_binding", "pip install nvidia-ml-py")]:
        stats = DeviceStats(nvml=nvml)
        recwarn.clear()
        assert stats.gpu_values(0) == {} and stats.gpu_values(1) == {}
        assert [str(w.message) for w in recwarn if why in str(w.message)] and len(recwarn) == 1, [str(w.message) for w in recwarn]
    # A device NVML does not have: warned once, fields absent.
    stats = DeviceStats(nvml=FakeNvml())
    recwarn.clear()
    assert stats.gpu_values(2) == {} and stats.gpu_values(2) == {}
    assert len(recwarn) == 1 and "cuda:2 not found by NVML" in str(recwarn[0].message)


def test_the_real_pynvml_on_this_machine(recwarn):
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # no NVIDIA driver (the build machines)
        assert DeviceStats().gpu_values(0) == {}
        assert len(recwarn) == 1 and f"NVML could not start: {exc}" in str(recwarn[0].message)
    else:  # a GPU machine: cuda:0 as NVML reads it
        pynvml.nvmlShutdown()
        assert set(DeviceStats().gpu_values(0)) >= {"gpu_util", "gpu_mem_used_mib", "gpu_mem_total_mib"}


def test_missing_psutil_is_an_error_with_the_install_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now raises ImportError
    trainer = hookloop.Trainer(plugins=[DeviceStats()], max_epochs=1, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(hookloop.MissingDependencyError, match="pip install psutil"):
        trainer.fit(TinyModule(), DataLoader(tiny_data(16), batch_size=4))
    assert trainer.global_step == 0


# -- throughput's arithmetic, by hand -------------------------------------------------------


def test_window_statistics_worked_by_hand():
    steps = [0.010, 0.020, 0.040, 0.030, 0.100]  # seconds; 0.2 in all
    stats = window_stats(steps, [0.002, 0.001, 0.005, 0.003, 0.004], samples=40)
    assert stats == pytest.approx({
        "batches_per_sec": 5 / 0.2, "samples_per_sec": 40 / 0.2,
        "step_time_p50_ms": 30.0,   # sorted 10 20 30 40 100: the 3rd of 5 (nearest rank ceil(2.5))
        "step_time_p90_ms": 100.0,  # ceil(4.5) = 5th
        "step_time_max_ms": 100.0,
        "before_backward_p50_ms": 3.0,
    })
    assert window_stats([], [], 0) == {}
    ranks = [{"batches_per_sec": 10.0, "samples_per_sec": 80.0, "before_backward_p50_ms": 4.0}, {},
             {"batches_per_sec": 9.0, "samples_per_sec": 72.0, "before_backward_p50_ms": 10.0}]
    assert totals(ranks) == pytest.approx({"throughput/batches_per_sec": 19.0, "throughput/samples_per_sec": 152.0,
                                           "throughput/slowest_rank": 2.0, "throughput/slowest_rank_ratio": 2.5})
    assert totals([ranks[0]]) == {"throughput/batches_per_sec": 10.0, "throughput/samples_per_sec": 80.0}


# -- bad options ------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: DeviceStats(every_n_steps=0), lambda: Throughput(every_n_steps=2.5),
                                  lambda: Throughput(every_n_steps=True)])
def test_bad_every_n_steps_is_refused_at_construction(make):
    with pytest.raises(hookloop.ConfigurationError, match="every_n_steps=.* must be a positive whole number"):
        make()


@pytest.mark.parametrize("options, message", [
    ({"device_stats": {"every_n_steps": -5}}, "device_stats every_n_steps=-5 must be a positive"),
    ({"throughput": {"sync": "yes"}}, "throughput sync='yes' must be True or False"),
])
def test_bad_options_by_name_are_refused_at_trainer(tmp_path, options, message):
    with pytest.raises(hookloop.ConfigurationError, match=message):
        hookloop.Trainer(plugins=["device_stats", "throughput"], plugin_options=options, default_root_dir=tmp_path)


@pytest.mark.parametrize("plugin, option, value, message", [
    (DeviceStats, "every_n_steps", 0, "device_stats every_n_steps=0 must be a positive"),
    (Throughput, "every_n_steps", "ten", "throughput every_n_steps='ten' must be a positive"),
    (Throughput, "sync", 1, "throughput sync=1 must be True or False"),
    (DeviceStats, "nvml", 3, "device_stats nvml=3 must be None"),
])
def test_bad_options_set_after_construction_are_refused_before_training(tmp_path, plugin, option, value, message):
    # hookloop run --plugin-option sets options on the constructed plugin: checked in setup.
    instance = plugin()
    setattr(instance, option, value)
    trainer = hookloop.Trainer(plugins=[instance], max_epochs=1, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(hookloop.ConfigurationError, match=message):
        trainer.fit(TinyModule(), DataLoader(tiny_data(16), batch_size=4))
    assert trainer.global_step == 0


# -- real runs --------------------------------------------------------------------------------


class Sleepy(TinyModule):
    """TinyModule whose training_step sleeps ``delay`` seconds first, and which notes when
    each batch ended by its own clock (Lightning's module hook, called before plugins')."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay, self.ends = delay, []

    def training_step(self, batch, batch_idx):
        time.sleep(self.delay)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())


@pytest.fixture
def one_thread():
    """One intra-op thread, as every torchrun worker has (OMP_NUM_THREADS=1): on 2 shared
    cores two threads wait for each other's time slices, tens of ms a step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_one_process_cpu_run(tmp_path, one_thread):
    delay, nvml = 0.02, FakeNvml()
    trainer = hookloop.Trainer(
        plugins=[hookloop.plugin("device_stats", every_n_steps=5, nvml=nvml), hookloop.plugin("throughput", every_n_steps=5)],
        max_epochs=2, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    module = Sleepy(delay)
    trainer.fit(module, DataLoader(tiny_data(48), batch_size=4))  # 12 steps an epoch
    rss, ram = kernel_rss_mib(), kernel_ram_used_percent()
    metrics = trainer.callback_metrics
    rows = csv_rows(trainer.log_dir)

    # Every 5 steps and at each epoch's end (12, 24), once per step.
    for name in ("rank0/rss_mib", "rank0/samples_per_sec"):
        assert [int(row["step"]) for row in rows_with(rows, name)] == [5, 10, 12, 15, 20, 24], name
    # A CPU run: the GPU fields are absent, not zero; NVML was not even started.
    assert {k for k in metrics if k.startswith("rank")} == {f"rank0/{n}" for n in HOST | THROUGHPUT}
    assert nvml.inits == 0
    assert float(rows_with(rows, "rank0/rss_mib")[-1]["rank0/rss_mib"]) == metrics["rank0/rss_mib"]

    assert metrics["rank0/rss_mib"] == pytest.approx(rss, rel=0.1)
    assert metrics["rank0/ram_used_percent"] == pytest.approx(ram, abs=5)
    assert 0 <= metrics["rank0/cpu_percent"] <= 100 * (os.cpu_count() + 1)

    # The module's own clock: the timed batches of each window (the first batch of an
    # epoch is not timed) run from the end of the batch before them to the end of the last.
    ends = [None] + module.ends  # ends[n]: batch n (1-based; 1..12 epoch 0, 13..24 epoch 1)
    windows = {5: (1, 5), 10: (5, 10), 12: (10, 12), 15: (13, 15), 20: (15, 20), 24: (20, 24)}
    for row in rows_with(rows, "rank0/batches_per_sec"):
        bps = float(row["rank0/batches_per_sec"])
        first, last = windows[int(row["step"])]
        # The window's length by the monitor's clock against the module's: they differ only by
        # the dispatch between the module's hook and the plugin's (a garbage collection there
        # on a loaded machine takes milliseconds, hence an absolute 10 ms).
        assert (last - first) / bps == pytest.approx(ends[last] - ends[first], abs=0.01), row
        # Every timed step holds one 20 ms sleep: at most 50 batches/s. (No lower bound: a
        # loaded machine may stretch a step to any length.)
        assert bps <= 1 / delay, row
        assert float(row["rank0/samples_per_sec"]) == pytest.approx(4 * bps, rel=1e-9)  # batches of 4
        assert float(row["throughput/samples_per_sec"]) == float(row["rank0/samples_per_sec"])
        p50, p90, top = (float(row[f"rank0/step_time_{q}_ms"]) for q in ("p50", "p90", "max"))
        assert 1000 * delay <= p50 <= p90 <= top, row
        # The sleep is in training_step, before backward.
        assert 1000 * delay <= float(row["rank0/before_backward_p50_ms"]) <= p50, row
        assert row.get("throughput/slowest_rank", "") == "", row  # one rank: no slowest


def test_a_run_stopped_inside_an_epoch_logs_its_last_window(tmp_path):
    trainer = hookloop.Trainer(plugins=[DeviceStats(every_n_steps=5), Throughput(every_n_steps=5)], max_steps=7,
                               enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(TinyModule(), DataLoader(tiny_data(48), batch_size=4))  # 12 steps an epoch; stops at 7
    rows = csv_rows(trainer.log_dir)
    assert [int(row["step"]) for row in rows_with(rows, "rank0/rss_mib")] == [5, 7]
    assert [int(row["step"]) for row in rows_with(rows, "rank0/batches_per_sec")] == [5, 7]
    # Batches of 4 in both windows (2-5: the epoch's first batch is not timed; 6-7).
    assert [float(row["rank0/samples_per_sec"]) / float(row["rank0/batches_per_sec"])
            for row in rows_with(rows, "rank0/batches_per_sec")] == pytest.approx([4.0, 4.0])


@pytest.mark.check  # reads the shared ddp job
def test_two_processes_under_ddp(jobs):
    """tests/scripts/monitor_ddp.py in the shared ddp job (tests/jobs.py): both plugins,
    every 4 steps, rank 0's training_step sleeping 20 ms and rank 1's 60 ms."""
    out = jobs.run("ddp").dir("monitor_ddp")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    names = {f"rank{r}/{n}" for r in (0, 1) for n in HOST | THROUGHPUT}
    names |= {"throughput/batches_per_sec", "throughput/samples_per_sec", "throughput/slowest_rank",
              "throughput/slowest_rank_ratio"}
    names |= {"throughput/flops_per_step", "throughput/flops_per_sec", "throughput/tflops_per_sec"}  # no peak on CPU: no mfu
    for record in ranks:
        # Every rank logged the same gathered row: every rank's values on each.
        assert {k for k in record["callback_metrics"] if "/" in k} == names
        assert {k: record["callback_metrics"][k] for k in names} == {k: ranks[0]["callback_metrics"][k] for k in names}
    rows = csv_rows(ranks[0]["log_dir"])
    for name in names:
        # 8 steps per rank and epoch: every 4 steps, the epoch ends coinciding (8, 16).
        assert [int(row["step"]) for row in rows_with(rows, name)] == [4, 8, 12, 16], name
    last = rows_with(rows, "rank1/rss_mib")[-1]
    for rank, record in enumerate(ranks):
        assert float(last[f"rank{rank}/rss_mib"]) == pytest.approx(record["vmrss_mib"], rel=0.1)

    slow = 0.06  # rank 1's sleep; rank 0 sleeps 0.02 and waits for rank 1 in the all-reduce
    for row in rows_with(rows, "throughput/samples_per_sec"):
        per_rank = [float(row[f"rank{r}/samples_per_sec"]) for r in (0, 1)]
        assert float(row["throughput/samples_per_sec"]) == pytest.approx(sum(per_rank), rel=1e-12)
        assert float(row["throughput/batches_per_sec"]) == pytest.approx(
            sum(float(row[f"rank{r}/batches_per_sec"]) for r in (0, 1)), rel=1e-12)
        # Rank 1 sleeps 60 ms every step and rank 0 waits for it: at most 1/0.06 batches/s
        # each (5 % for the two clocks). No lower bound: a loaded machine stretches any step.
        for r in (0, 1):
            assert float(row[f"rank{r}/batches_per_sec"]) <= 1.05 / slow, row
        before = [float(row[f"rank{r}/before_backward_p50_ms"]) for r in (0, 1)]
        assert before[0] >= 20 and before[1] >= 60, row
        assert float(row["throughput/slowest_rank"]) == 1.0, row
        # (60 + overhead) / (20 + overhead): 3 without overhead, above 1 as rank 1 is slowest.
        assert float(row["throughput/slowest_rank_ratio"]) > 1, row
        assert float(row["throughput/slowest_rank_ratio"]) == pytest.approx(before[1] / before[0], rel=1e-9)
