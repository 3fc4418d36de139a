"""``device_stats``: every rank's GPU, CUDA allocator, CPU and memory, as logged metrics.

Every ``every_n_steps`` optimizer steps and at the end of every training epoch, each
rank measures (names below, MiB = 2**20 bytes), the measurements are gathered, and one
row with every rank's, ``rank<R>/<name>``, goes to the loggers:

==========================  ==============================================================
``gpu_util``                NVML: percent of the last sample period a kernel ran (0-100)
``gpu_mem_used_mib``        NVML: memory used on the GPU, by every process on it
``gpu_mem_total_mib``       NVML: the GPU's memory
``gpu_temp_c``              NVML: core temperature, Celsius
``gpu_power_w``             NVML: board power draw, W
``cuda_max_allocated_mib``  ``torch.cuda.max_memory_allocated`` of the rank's device
``cpu_percent``             psutil: this process's CPU use since the previous measurement
                            (100 = one core busy; above 100 with several threads)
``rss_mib``                 psutil: this process's resident memory
``ram_used_percent``        psutil: the machine's memory in use, percent
==========================  ==============================================================

The GPU fields exist only on a rank whose ``root_device`` is a CUDA device and whose GPU
NVML can read (a field NVML does not support on that GPU, e.g. power on some boards, is
left out alone). Without nvidia-ml-py or without a driver NVML does not start: the GPU
fields are absent and a warning says so once.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

import torch

import hookloop

from ._common import check_every, per_rank_row

MiB = 2**20


def nvml_device(cuda_index: int, visible: str | None) -> int | str:
    """The NVML index (an int) or UUID prefix (a str) of CUDA device ``cuda_index``,
    from ``CUDA_VISIBLE_DEVICES`` (``visible``).

    Unset, cuda:i is NVML's GPU i; set, cuda:i is its i-th entry, an NVML index or a
    ``GPU-`` UUID (a prefix is enough). Indices mean NVML's (PCI bus) order when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, as the gpus plugin sets it; on a real CUDA run
    :meth:`DeviceStats.measure` asks torch for the device's UUID instead, which needs no
    assumption about the order.
    """
    if visible is None:
        return cuda_index
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if cuda_index >= len(entries):
        raise LookupError(f"cuda:{cuda_index} is not in CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[cuda_index]
    return int(entry) if entry.isdigit() else entry


def check_nvml(nvml: Any) -> Any:
    if nvml is None or isinstance(nvml, str) or callable(getattr(nvml, "nvmlInit", None)):
        return nvml
    raise hookloop.ConfigurationError(
        f"device_stats nvml={nvml!r} must be None (pynvml, from nvidia-ml-py), a module name, or an "
        f"object with pynvml's functions (nvmlInit, nvmlDeviceGetHandleByIndex, ...)")


class DeviceStats:
    """Log GPU (NVML), CUDA-allocator, CPU and RAM statistics of every rank.

    every_n_steps: measure every this many optimizer steps (default 50, Lightning's
        log_every_n_steps), and at the end of every training epoch
    nvml: the NVML binding: None for pynvml (nvidia-ml-py); a module name; or an object
        with pynvml's nvmlInit, nvmlShutdown, nvmlDeviceGetCount,
        nvmlDeviceGetHandleByIndex, nvmlDeviceGetUUID, nvmlDeviceGetUtilizationRates,
        nvmlDeviceGetMemoryInfo, nvmlDeviceGetTemperature, nvmlDeviceGetPowerUsage and
        NVMLError (tests give one with fixed answers)
    """

    hookloop_name = "device_stats"
    hookloop_role = "observer"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self, every_n_steps: int = 50, nvml: Any = None):
        self.every_n_steps = check_every("device_stats", every_n_steps)
        self.nvml = check_nvml(nvml)
        self._process: Any = None
        self._binding: Any = None  # the started NVML binding; False: it could not start
        self._handles: dict[int, Any] = {}
        self._warned = False
        self._logged_step = -1

    # -- NVML -------------------------------------------------------------------------

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"device_stats: no GPU statistics on this CUDA run ({why}); the CPU and "
                          f"memory statistics are logged", RuntimeWarning, stacklevel=2)

    def _start_nvml(self) -> Any:
        """The started NVML binding, or None (warned once) when it cannot start."""
        if self._binding is None:
            self._binding = False
            binding = self.nvml
            if binding is None or isinstance(binding, str):
                try:
                    binding = importlib.import_module(binding or "pynvml")
                except ImportError as exc:
                    self._warn(f"{exc}: pip install nvidia-ml-py")
                    return None
            try:
                binding.nvmlInit()
            except binding.NVMLError as exc:  # no driver, no libnvidia-ml
                self._warn(f"NVML could not start: {exc}")
                return None
            self._binding = binding
        return self._binding or None

    def _handle(self, nvml: Any, cuda_index: int, uuid: str | None) -> Any:
        if cuda_index not in self._handles:
            bare = uuid.lower().removeprefix("gpu-") if uuid else None
            device = f"GPU-{bare}" if bare else nvml_device(cuda_index, os.environ.get("CUDA_VISIBLE_DEVICES"))
            if isinstance(device, int):
                handle = nvml.nvmlDeviceGetHandleByIndex(device)
            else:
                handles = map(nvml.nvmlDeviceGetHandleByIndex, range(nvml.nvmlDeviceGetCount()))
                matches = [h for h in handles if _text(nvml.nvmlDeviceGetUUID(h)).lower().startswith(device.lower())]
                if len(matches) != 1:  # a MIG instance, or an ambiguous prefix
                    raise LookupError(f"{device!r} matches {len(matches)} of NVML's GPUs")
                handle = matches[0]
            self._handles[cuda_index] = handle
        return self._handles[cuda_index]

    def gpu_values(self, cuda_index: int, uuid: str | None = None) -> dict[str, float]:
        """NVML's readings of CUDA device ``cuda_index`` (``{}`` without NVML).

        ``uuid``: the device's UUID as torch reports it (without ``GPU-``); without it
        the device is found through ``CUDA_VISIBLE_DEVICES`` (:func:`nvml_device`).
        """
        nvml = self._start_nvml()
        if nvml is None:
            return {}
        try:
            handle = self._handle(nvml, cuda_index, uuid)
        except (LookupError, nvml.NVMLError) as exc:
            self._warn(f"cuda:{cuda_index} not found by NVML: {exc}")
            return {}

        def ask(function: str, *args: Any) -> Any:
            try:
                return getattr(nvml, function)(handle, *args)
            except nvml.NVMLError:  # "Not Supported" on this GPU: that field is left out
                return None

        util, memory = ask("nvmlDeviceGetUtilizationRates"), ask("nvmlDeviceGetMemoryInfo")
        temperature = ask("nvmlDeviceGetTemperature", getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
        power = ask("nvmlDeviceGetPowerUsage")  # milliwatts
        values = {
            "gpu_util": None if util is None else util.gpu,
            "gpu_mem_used_mib": None if memory is None else memory.used / MiB,
            "gpu_mem_total_mib": None if memory is None else memory.total / MiB,
            "gpu_temp_c": temperature,
            "gpu_power_w": None if power is None else power / 1000,
        }
        return {name: float(value) for name, value in values.items() if value is not None}

    # -- measuring --------------------------------------------------------------------

    def host_values(self) -> dict[str, float]:
        """psutil's readings of this process and this machine."""
        import psutil

        return {
            "cpu_percent": float(self._process.cpu_percent(None)),
            "rss_mib": self._process.memory_info().rss / MiB,
            "ram_used_percent": float(psutil.virtual_memory().percent),
        }

    def measure(self, trainer) -> dict[str, float]:
        """This rank's values, unprefixed."""
        values = self.host_values()
        device = trainer.root_device
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            values.update(self.gpu_values(index, str(uuid) if uuid else None))
            values["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(index) / MiB
        return values

    def log(self, trainer) -> None:
        """Measure on every rank (a collective: every rank calls it at the same step)."""
        self._logged_step = trainer.global_step
        trainer.log_metrics(per_rank_row(trainer.all_gather_object(self.measure(trainer))))

    # -- hooks ------------------------------------------------------------------------

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        if stage != "fit":
            return
        check_every("device_stats", self.every_n_steps)  # --plugin-option sets them after __init__
        check_nvml(self.nvml)
        try:
            import psutil
        except ImportError:
            raise hookloop.MissingDependencyError(
                "device_stats reads CPU and memory use with psutil, which is not installed: "
                "pip install psutil (or pip install hookloop-monitor, which depends on it)"
            ) from None
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first reading only starts the interval
        self._logged_step = -1
        if trainer.root_device.type == "cuda":
            self._start_nvml()  # warn at the start, not at the first measurement

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer):
        step = trainer.global_step
        if step and step != self._logged_step and step % self.every_n_steps == 0:
            self.log(trainer)

    @hookloop.hookimpl
    def on_train_epoch_end(self, trainer):
        if trainer.global_step != self._logged_step:
            self.log(trainer)

    @hookloop.hookimpl
    def on_train_end(self, trainer):
        if trainer.global_step != self._logged_step:  # stopped inside an epoch (max_steps)
            self.log(trainer)

    @hookloop.hookimpl
    def teardown(self):
        if self._binding:
            try:
                self._binding.nvmlShutdown()
            except self._binding.NVMLError:
                pass
        self._binding, self._handles, self._process = None, {}, None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
