"""What GPUs this machine has, as plain records: read from NVML, or written by a test.

Selection (:mod:`hookloop_gpus.select`) is a pure function of these records, so it can
be checked against any machine, including ones that are not here; only
:func:`read_machine` talks to the hardware.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

#: NVML's compute modes, by the names used in the records.
DEFAULT, EXCLUSIVE_PROCESS, PROHIBITED = "default", "exclusive_process", "prohibited"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it.

    ``index`` is NVML's (``nvidia-smi``'s, PCI bus order). ``processes`` counts the
    compute processes running on it, ``None`` when that is unknown (no NVML).
    """

    index: int
    name: str = "GPU"
    uuid: str = ""
    memory_total_mib: int = 0
    memory_used_mib: int = 0
    compute_mode: str = DEFAULT
    processes: int | None = 0

    def describe(self) -> str:
        procs = "? processes" if self.processes is None else f"{self.processes} process{'es' if self.processes != 1 else ''}"
        return (
            f"{self.name}, {self.memory_total_mib} MiB ({self.memory_used_mib} MiB used), "
            f"{procs}, compute mode {self.compute_mode}"
        )


@dataclass(frozen=True)
class Machine:
    """The GPUs visible to this process and where the answer came from."""

    gpus: list[GpuInfo] = field(default_factory=list)
    #: "nvml", "torch" (no NVML: nothing is known about other processes) or "none"
    source: str = "none"
    #: why no GPU was found, or other caveats, for messages
    note: str = ""


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or started (no NVIDIA driver, or nvidia-ml-py missing)."""


_MODES = {0: DEFAULT, 1: "exclusive_thread", 2: PROHIBITED, 3: EXCLUSIVE_PROCESS}


def read_nvml() -> list[GpuInfo]:
    """Every GPU NVML sees, with its compute mode and number of compute processes.

    :raises NvmlUnavailable: when NVML cannot start (e.g. a machine without NVIDIA
        driver), with NVML's reason.
    """
    try:
        import pynvml  # nvidia-ml-py; imported here so listing plugins stays cheap
    except ImportError as exc:
        raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc}): pip install nvidia-ml-py") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML could not start: {exc}") from None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                processes: int | None = len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
            except pynvml.NVMLError:
                processes = None  # e.g. not permitted inside some containers
            try:
                mode = _MODES.get(pynvml.nvmlDeviceGetComputeMode(handle), DEFAULT)
            except pynvml.NVMLError:
                mode = DEFAULT
            gpus.append(
                GpuInfo(
                    index=i,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    memory_total_mib=int(memory.total) // 2**20,
                    memory_used_mib=int(memory.used) // 2**20,
                    compute_mode=mode,
                    processes=processes,
                )
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


def read_machine() -> Machine:
    """The GPUs this process may use: NVML's list narrowed by ``CUDA_VISIBLE_DEVICES``.

    Without NVML but with a CUDA build of torch that sees GPUs, torch's count is used
    (nothing is then known about other processes, so auto-selection refuses).
    """
    try:
        gpus = read_nvml()
    except NvmlUnavailable as exc:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            gpus = [GpuInfo(index=i, name=torch.cuda.get_device_name(i), processes=None) for i in range(n)]
            return Machine(gpus, "torch", f"{exc}; GPUs counted by torch (CUDA_VISIBLE_DEVICES applied)")
        why = "torch has no CUDA" if torch.version.cuda is None else "torch sees no CUDA GPU"
        return Machine([], "none", f"{exc}; {why} (torch {torch.__version__})")
    return Machine(visible_subset(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")), "nvml")


def visible_subset(gpus: list[GpuInfo], cuda_visible_devices: str | None) -> list[GpuInfo]:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible, in its order.

    Entries are NVML indices or UUIDs (``GPU-...``, a unique prefix is enough). As
    CUDA does, the list ends at the first entry that names no GPU.
    """
    if cuda_visible_devices is None:
        return list(gpus)
    visible: list[GpuInfo] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if entry.lstrip("-").isdigit():
            match = [g for g in gpus if g.index == int(entry)]
        else:
            match = [g for g in gpus if entry and g.uuid.startswith(entry)]
        if len(match) != 1 or match[0] in visible:
            break
        visible.append(match[0])
    return visible


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
