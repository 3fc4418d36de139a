"""What one rank holds under fsdp, measured from its local shards, in bytes.

A DTensor's ``numel()`` is the global tensor's; what the rank holds is its local
tensor (``to_local()``). Plain tensors (ddp, a world of one) count whole, so the same
report measures every strategy.
"""

from __future__ import annotations

from typing import Any

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of ``tensors``, each storage counted once."""
    total, seen = 0, set()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = _local(t)
        if local.numel() == 0:
            continue
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def parameter_bytes(module: torch.nn.Module) -> int:
    return local_bytes(module.parameters())


def gradient_bytes(module: torch.nn.Module) -> int:
    return local_bytes(p.grad for p in module.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: Any) -> int:
    """This rank's optimizer state (momentum, Adam's moments), step counters excluded."""
    return local_bytes(v for state in optimizer.state.values() for v in state.values()
                       if isinstance(v, torch.Tensor) and v.ndim > 0)


def parameter_count(module: torch.nn.Module) -> int:
    """Elements of the whole model (a DTensor's global size)."""
    return sum(p.numel() for p in module.parameters())


def memory_report(trainer: Any) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, and the model's
    size, for ``trainer.module`` as it is now (call it inside a run: e.g. in
    ``on_before_optimizer_step`` for gradients, ``on_fit_end`` for the rest)."""
    module = trainer.module
    optimizers = list(getattr(trainer, "optimizers", []) or [])
    return {
        "parameter_bytes": parameter_bytes(module),
        "gradient_bytes": gradient_bytes(module),
        "optimizer_state_bytes": sum(optimizer_state_bytes(o) for o in optimizers),
        "parameter_count": parameter_count(module),
    }
