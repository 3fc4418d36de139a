"""hookloop-gpus: choose the GPUs of a run before any process starts.

* ``gpus`` / ``devices`` specs are read as Lightning's "Select GPU devices" table does
  (:func:`parse_gpus`): ``0`` is the CPU, ``3`` the first three GPUs, ``"3"`` GPU 3.
* ``auto_select_gpus=True`` picks ``k`` GPUs that run no other process (NVML), aware of
  exclusive compute mode (:func:`select_gpus`, a pure function of the machine's
  :class:`GpuInfo` records; :func:`read_machine` reads them from NVML).
* The choice is made once, in the launching process, and published through
  ``CUDA_VISIBLE_DEVICES`` (with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so indices mean what
  ``nvidia-smi`` shows): every worker inherits it, local rank ``r`` uses ``cuda:r``,
  the ``r``-th chosen GPU, and no rank chooses again.
* ``hookloop devices SPEC [--auto-select]`` shows how SPEC is read and what this
  machine has.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import hookloop

from .inventory import GpuInfo, Machine, NvmlUnavailable, read_machine, read_nvml, visible_subset
from .parse import describe, parse_gpus
from .select import is_free, select_gpus

__all__ = [
    "GPUs",
    "GpuInfo",
    "Machine",
    "NvmlUnavailable",
    "describe",
    "is_free",
    "parse_gpus",
    "read_machine",
    "read_nvml",
    "select_gpus",
    "visible_subset",
]

#: Set by the launching process to the chosen NVML indices; workers reuse it.
SELECTED_ENV = "HOOKLOOP_GPUS_SELECTED"
_FROM_DEVICES: Any = type("_FromDevices", (), {"__repr__": lambda self: "<devices>"})()


class GPUs:
    """The devices plugin: reads ``gpus``/``devices`` as Lightning's table, picks GPUs.

    Options (``plugin_options={"gpus": {...}}``):

    ``gpus``
        Lightning's ``Trainer(gpus=...)``; when not given, ``devices`` is read with the
        same table (with this plugin, ``devices="3"`` is GPU 3, one process).
    ``auto_select_gpus``
        with an int ``k`` (or ``-1``), take ``k`` GPUs that run no other process instead
        of the first ``k``.
    ``machine``
        a callable returning a :class:`Machine`; the default reads NVML. Tests give the
        answer of hardware that is not there.
    """

    hookloop_name = "gpus"
    hookloop_role = "devices"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self, gpus: Any = _FROM_DEVICES, auto_select_gpus: bool = False, machine: Callable[[], Machine] | None = None):
        self.gpus = gpus
        self.auto_select_gpus = auto_select_gpus
        self.machine = machine
        #: the chosen GPUs' NVML indices; [] for the CPU; None before select_devices
        self.selected: list[int] | None = None
        self._first_k = False
        self._told = False

    @hookloop.hookimpl
    def select_devices(self, config):
        """Choose GPUs (in the launching process) or take the inherited choice (workers).

        Narrows ``config.devices`` to the number of chosen GPUs and sets
        ``config.accelerator`` to ``"cuda"`` (``"cpu"`` when the spec says CPU).
        Returns the chosen NVML indices, ``[]`` for the CPU, or ``None`` when the spec
        comes from ``devices`` on a machine without GPUs (CPU processes, as without
        this plugin).
        """
        inherited = os.environ.get(SELECTED_ENV)
        if inherited is not None and hookloop.in_worker():
            # Chosen once by the launcher; choosing again here would see the other ranks
            # as busy GPUs and pick differently.
            entries = [e for e in inherited.split(",") if e.strip()]
            return self._use([int(e) if e.strip().isdigit() else n for n, e in enumerate(entries)], config)
        explicit = self.gpus is not _FROM_DEVICES
        spec = self.gpus if explicit else config.devices
        if config.accelerator == "cpu":
            if explicit and parse_gpus(spec, 0) is not None:
                raise hookloop.ConfigurationError(
                    f"gpus={spec!r} asks for GPUs but accelerator='cpu': drop one of them"
                )
            return self._use([], config)
        machine = (self.machine or read_machine)()
        wants_gpu = explicit or self.auto_select_gpus or config.accelerator in ("cuda", "gpu")
        if not machine.gpus and not wants_gpu:
            self.selected = []
            return None  # devices=N on a CPU-only machine: N CPU processes, as usual
        try:
            chosen = select_gpus(spec, machine.gpus, auto_select=self.auto_select_gpus)
        except hookloop.ConfigurationError as exc:
            if not machine.gpus and machine.note:
                raise hookloop.ConfigurationError(f"{exc} ({machine.note})") from None
            raise
        if chosen is None:
            return self._use([], config)
        ids = [g.index for g in chosen]
        entries = [str(i) for i in ids]
        current = os.environ.get("CUDA_VISIBLE_DEVICES")
        if machine.source == "torch" and current is not None:
            # torch numbered the GPUs that CUDA_VISIBLE_DEVICES already left visible.
            entries = [current.split(",")[i].strip() for i in ids]
        # The first k of an unrestricted machine are cuda:0..k-1 even where CUDA started
        # too early in this process to read the published CUDA_VISIBLE_DEVICES.
        self._first_k = current is None and ids == list(range(len(ids)))
        publish(entries, pci_order=machine.source == "nvml")
        return self._use(ids, config)

    def _use(self, ids: list[int], config) -> list[int]:
        self.selected = ids
        if ids:
            config.devices, config.accelerator = len(ids), "cuda"
        else:
            config.accelerator = "cpu"
        return ids

    @hookloop.hookimpl
    def setup(self, trainer):
        """Check that this process sees exactly the chosen GPUs; say which once."""
        ids = self.selected
        if not ids:
            return
        import torch

        if not torch.cuda.is_available():
            raise hookloop.ConfigurationError(
                f"GPUs {ids} were chosen, but torch {torch.__version__} cannot use CUDA "
                f"(a CPU build?): install a CUDA build of torch, or run on the CPU with gpus=0"
            )
        seen = torch.cuda.device_count()
        if seen > len(ids) and self._first_k:
            pass  # cuda:r is GPU r either way
        elif seen != len(ids):
            raise hookloop.ConfigurationError(
                f"GPUs {ids} were chosen and published as CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, but this process sees {seen} GPUs: "
                f"CUDA had started before the Trainer was created (something called torch.cuda "
                f"first), so it no longer reads CUDA_VISIBLE_DEVICES. Create the Trainer "
                f"before touching CUDA, launch with `hookloop run`, or set "
                f"CUDA_VISIBLE_DEVICES={','.join(map(str, ids))} yourself"
            )
        if trainer.global_rank == 0 and not self._told:
            self._told = True
            ranks = ", ".join(f"cuda:{r} = GPU {i}" for r, i in enumerate(ids))
            print(f"hookloop-gpus: using GPUs {ids} ({ranks})", flush=True)


def publish(entries: list[str], pci_order: bool = True) -> None:
    """Make the GPUs ``entries`` (``CUDA_VISIBLE_DEVICES`` entries) the only ones that this
    process's children (and, before CUDA starts, this process) see, in this order."""
    if pci_order:
        # NVML numbers GPUs in PCI bus order; CUDA's default order may differ.
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(entries)
    os.environ[SELECTED_ENV] = ",".join(entries)
