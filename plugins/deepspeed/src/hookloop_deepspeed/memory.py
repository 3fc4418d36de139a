"""What one rank holds: optimizer state, fp32 master weights and parameters, in bytes.

For the memory benchmark and for users checking what a ZeRO stage saves. Works on plain
torch optimizers too (DDP), so every strategy is measured the same way.
"""

from __future__ import annotations

from typing import Any

import torch


def base_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO, bf16/fp16 optimizers)."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) or type(optimizer).__module__.startswith("deepspeed.runtime"):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or seen > 8:
            break
        optimizer, seen = inner, seen + 1
    return optimizer


def _tensor_bytes(tensors) -> int:
    total, seen = 0, set()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of this rank's optimizer state (momentum, Adam moments...), step counters excluded."""
    base = base_optimizer(optimizer)
    tensors = [v for state in base.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.ndim > 0]
    return _tensor_bytes(tensors)


def master_weight_bytes(optimizer: Any) -> int:
    """Bytes of the fp32 master copy of the weights that DeepSpeed's optimizer keeps on this
    rank (ZeRO keeps only this rank's partition); 0 for a plain torch optimizer."""
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        groups = getattr(optimizer, name, None)
        if groups:
            return _tensor_bytes(groups)
    return 0


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds now: its ZeRO-3 partition plus any parameter
    that is currently whole (not partitioned, persistent below ZeRO-3's
    ``stage3_param_persistence_threshold``, or gathered)."""
    total = 0
    for p in module.parameters():
        total += p.numel() * p.element_size()
        local = getattr(p, "ds_tensor", None)
        if local is not None:
            total += local.numel() * local.element_size()
    return total


def parameter_count(module: torch.nn.Module) -> int:
    """Number of elements of the full model, partitioned (ZeRO-3) or not."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def memory_report(trainer: Any) -> dict[str, int]:
    """This rank's bytes of optimizer state, master weights and parameters, and the model size."""
    return {
        "optimizer_state_bytes": optimizer_state_bytes(trainer.optimizer) if trainer.optimizer is not None else 0,
        "master_weight_bytes": master_weight_bytes(trainer.optimizer) if trainer.optimizer is not None else 0,
        "parameter_bytes": parameter_bytes(trainer.module),
        "parameter_count": parameter_count(trainer.module),
    }
