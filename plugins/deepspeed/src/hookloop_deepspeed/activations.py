"""Activation checkpointing for user modules: DeepSpeed's under this strategy, torch's elsewhere.

A module that calls :func:`checkpoint` in its ``forward`` runs unchanged under any
strategy: under the deepspeed strategy the block goes through
``deepspeed.checkpointing.checkpoint``, which the plugin configured from its options
(``partition_activations``, ``cpu_checkpointing``, ``synchronize_checkpoint_boundary``, or
a custom config's ``activation_checkpointing`` section); anywhere else through
``torch.utils.checkpoint.checkpoint``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.utils.checkpoint

_active = False


def activate() -> None:
    """Called by the strategy once it has configured ``deepspeed.checkpointing``."""
    global _active
    _active = True


def deactivate() -> None:
    """Called by the strategy at teardown."""
    global _active
    _active = False


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` without keeping its activations: they are recomputed in backward.

    Pass a block whose input requires grad (a hidden layer's output, not the raw batch):
    DeepSpeed's checkpoint, like torch's re-entrant one, gives the block's parameters no
    gradient when no input of the block requires one.
    """
    if _active:
        import deepspeed

        return deepspeed.checkpointing.checkpoint(function, *args)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def is_deepspeed_active() -> bool:
    """Whether :func:`checkpoint` currently goes through DeepSpeed."""
    return _active
