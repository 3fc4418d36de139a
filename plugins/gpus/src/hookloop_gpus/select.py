"""Choosing GPUs: a pure function of the spec and the machine's GPU records."""

from __future__ import annotations

from typing import Any

import hookloop

from .inventory import EXCLUSIVE_PROCESS, PROHIBITED, GpuInfo
from .parse import ALL, parse_gpus

_EXCLUSIVE = (EXCLUSIVE_PROCESS, "exclusive_thread")


def select_gpus(spec: Any, gpus: list[GpuInfo], auto_select: bool = False) -> list[GpuInfo] | None:
    """The GPUs ``spec`` asks for on a machine whose visible GPUs are ``gpus``.

    Indices in ``spec`` are positions in ``gpus`` (all of NVML's GPUs, or those
    ``CUDA_VISIBLE_DEVICES`` already leaves). With ``auto_select`` and an int ``k``
    (``-1``: all), picks the first ``k`` GPUs that run no compute process and do not
    prohibit compute, instead of the first ``k`` GPUs.

    :returns: the chosen records in order (local rank ``r`` uses the ``r``-th), or
        ``None`` for the CPU.
    :raises hookloop.ConfigurationError: a bad spec; GPUs asked for on a machine without
        any; more GPUs than exist; an index that does not exist; a GPU that cannot take
        another process (exclusive compute mode, already in use) or none (prohibited);
        too few free GPUs to auto-select.
    """
    wanted = parse_gpus(spec, len(gpus))
    if wanted is None:
        return None
    if not gpus:
        raise hookloop.ConfigurationError(
            f"gpus={spec!r} asks for GPUs, but this machine has no GPU that this process can "
            f"see. To run on the CPU, pass gpus=None or 0 (or leave out the gpus plugin / "
            f"use accelerator='cpu', --accelerator cpu); devices=N then counts CPU processes"
        )
    counted = isinstance(spec, int) and not isinstance(spec, bool)
    if counted and len(wanted) > len(gpus):
        raise hookloop.ConfigurationError(
            f"gpus={spec!r} asks for {len(wanted)} GPUs, but this machine has {len(gpus)}: "
            f"use gpus<={len(gpus)} (or -1 for all of them)"
        )
    if auto_select and counted:
        return _pick_free(spec, len(wanted), gpus)
    missing = [i for i in wanted if i >= len(gpus)]
    if missing:
        raise hookloop.ConfigurationError(
            f"gpus={spec!r} names GPU {', '.join(map(str, missing))}, which does not exist: "
            f"this machine has {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} (indices "
            f"0..{len(gpus) - 1}). `hookloop devices {spec!r}` lists them"
        )
    chosen = [gpus[i] for i in wanted]
    for position, gpu in zip(wanted, chosen):
        if gpu.compute_mode == PROHIBITED:
            raise hookloop.ConfigurationError(
                f"GPU {position} ({gpu.name}) is in compute mode 'prohibited' and runs no "
                f"compute process: choose another GPU (`hookloop devices -1` lists them)"
            )
        if gpu.compute_mode in _EXCLUSIVE and gpu.processes:
            raise hookloop.ConfigurationError(
                f"GPU {position} ({gpu.name}) is in compute mode '{gpu.compute_mode}' and "
                f"already runs {gpu.processes} process(es), so it cannot take another: "
                f"choose a free GPU, or let hookloop pick with auto_select_gpus=True "
                f"(`hookloop devices K --auto-select` shows which)"
            )
    return chosen


def is_free(gpu: GpuInfo) -> bool:
    """Runs no compute process and allows compute (what auto-selection takes)."""
    return gpu.processes == 0 and gpu.compute_mode != PROHIBITED


def _pick_free(spec: Any, k: int, gpus: list[GpuInfo]) -> list[GpuInfo]:
    unknown = [g for g in gpus if g.processes is None]
    if unknown:
        raise hookloop.ConfigurationError(
            f"auto_select_gpus=True needs to know which GPUs are busy, and NVML could not "
            f"tell for {len(unknown)} GPU(s): install nvidia-ml-py (pip install "
            f"nvidia-ml-py) where the NVIDIA driver is, or name GPUs instead (gpus=[0, 1])"
        )
    free = [g for g in gpus if is_free(g)]
    if len(free) < k:
        busy = [
            f"GPU {i}: {'compute prohibited' if g.compute_mode == PROHIBITED else f'{g.processes} process(es)'}"
            + (f", {g.compute_mode} mode" if g.compute_mode in _EXCLUSIVE else "")
            for i, g in enumerate(gpus)
            if not is_free(g)
        ]
        wanted = "all" if spec == ALL else str(k)
        raise hookloop.ConfigurationError(
            f"auto_select_gpus=True asked for {wanted} free GPU(s), but only {len(free)} of "
            f"{len(gpus)} run no other process ({'; '.join(busy)}). Wait for them, ask for "
            f"fewer, or name GPUs yourself (GPUs in exclusive compute mode cannot be shared)"
        )
    return free[:k]
