"""fairscale's OSS, with what hookloop's checkpoints need from it.

Imported only when a run builds its optimizer (it imports fairscale); a module of its own
(not a class made inside a function) so that the optimizer pickles by reference.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any

import torch
from fairscale.optim import OSS

import hookloop

#: Marks what ``state_dict()`` returns on a rank that holds only its own partition.
NOT_CONSOLIDATED = "hookloop_fairscale_not_consolidated"


class ShardedOptimizer(OSS):
    """``fairscale.optim.OSS`` around the user's optimizer class and arguments.

    Each rank keeps the state of its partition only (OSS assigns whole parameters to the
    rank with the fewest elements so far). Two differences from OSS:

    * ``state_dict()`` never raises: it returns the global state when this rank holds a
      consolidated copy (``consolidate()``), and otherwise a marked placeholder with the
      parameter groups and no state. ddp_sharded's ``save_checkpoint`` consolidates on
      every rank and puts the global state in the file, so a placeholder never reaches
      a checkpoint.
    * ``load_state_dict()`` keeps this rank's partition only: fairscale also leaves a copy
      of it in the wrapper's own ``state``, which no step ever reads.
    """

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        if all_ranks or self._all_states:
            return super().state_dict(all_ranks=all_ranks)
        placeholder = torch.optim.Optimizer.state_dict(self)
        placeholder["state"] = {}
        placeholder[NOT_CONSOLIDATED] = (
            "this rank holds its own partition of the optimizer state only; "
            "hookloop-fairscale consolidates it when it saves a checkpoint"
        )
        return placeholder

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get(NOT_CONSOLIDATED):
            raise hookloop.CheckpointError(
                "this optimizer state was never consolidated (it holds one rank's partition "
                "description only): load a checkpoint written by hookloop's save_checkpoint"
            )
        # fairscale empties the entries other ranks own, in the dict it is given.
        state_dict = {**state_dict, "state": dict(state_dict["state"])}
        super().load_state_dict(state_dict)
        self.state = defaultdict(dict)

    def consolidate(self, recipient_rank: int = 0) -> None:
        """Gather every rank's partition on ``recipient_rank`` (a collective: call on every
        rank); ``state_dict()`` there then returns the global state."""
        self.consolidate_state_dict(recipient_rank=recipient_rank)

    def release_consolidated(self) -> None:
        """Drop the consolidated copy (it can be as large as the whole optimizer state)."""
        self._all_states = []

    def partition_numels(self) -> list[int]:
        """Elements of trainable parameters each rank owns, in rank order."""
        return [
            sum(p.numel() for group in groups for p in group["params"] if p.requires_grad)
            for groups in self.partition_parameters()
        ]

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters whose state and update this rank owns."""
        return [p for group in self.partition_parameters()[self.rank] for p in group["params"]]

    def local_state_bytes(self) -> int:
        """Bytes of this rank's optimizer state tensors (step counters excluded)."""
        return sum(
            v.numel() * v.element_size()
            for state in self.optim.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.ndim > 0
        )


def shard(optimizer: torch.optim.Optimizer, broadcast_fp16: bool = False) -> ShardedOptimizer:
    """A :class:`ShardedOptimizer` with ``optimizer``'s class, parameter groups and defaults.

    The user's optimizer object is dropped afterwards; the parameter groups (with their
    learning rates and every per-group option) are copied, so LR schedulers built on the
    user's optimizer can be re-pointed at the replacement.
    """
    cls = type(optimizer)
    if isinstance(optimizer, OSS):
        raise hookloop.ConfigurationError(
            "configure_optimizers returned a fairscale OSS already: return the plain optimizer "
            "(e.g. torch.optim.Adam(self.parameters(), lr=...)); ddp_sharded shards it"
        )
    groups = [{**group, "params": list(group["params"])} for group in optimizer.param_groups]
    # Every group keeps all its hyperparameters (each key of the user's groups is copied);
    # the constructor gets the defaults it takes as arguments only: torch's AdamW keeps
    # decoupled_weight_decay in its defaults, which AdamW.__init__ does not accept.
    kwargs = constructor_defaults(cls, optimizer.defaults)
    try:
        sharded = ShardedOptimizer(groups, optim=cls, broadcast_fp16=broadcast_fp16, **kwargs)
    except TypeError as exc:
        raise hookloop.ConfigurationError(
            f"ddp_sharded re-creates the optimizer as fairscale.optim.OSS(params, optim={cls.__name__}, "
            f"**defaults) with the defaults {cls.__name__}'s constructor takes ({', '.join(kwargs) or 'none'}), "
            f"and {cls.__name__} refused them ({exc}): ddp_sharded needs an optimizer class that can be "
            f"built again from its parameter groups and its defaults; use ddp for this one"
        ) from None
    check_same_hyperparameters(optimizer, sharded)
    return sharded


def constructor_defaults(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``defaults`` that ``cls(params, **kwargs)`` takes as keyword arguments
    (all of them when its ``__init__`` takes ``**kwargs``)."""
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read: pass them all, as before
        return dict(defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    accepted = {name for name, p in parameters.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return {key: value for key, value in defaults.items() if key in accepted}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b or (type(a) is type(b) and bool(a == b))


def check_same_hyperparameters(original: torch.optim.Optimizer, sharded: ShardedOptimizer) -> None:
    """Raise, naming the key, unless every parameter group of ``sharded`` (OSS's, and the
    groups of the optimizer that steps this rank's shard: one per group, possibly empty)
    holds the hyperparameters of the same group of the user's optimizer."""
    cls = type(original).__name__
    copies = [("fairscale.optim.OSS", sharded.param_groups), (f"this rank's {cls}", sharded.optim.param_groups)]
    for where, groups in copies:
        if len(groups) != len(original.param_groups):
            raise hookloop.ConfigurationError(
                f"ddp_sharded re-created {cls} with {len(groups)} parameter groups in {where}, but "
                f"configure_optimizers returned {len(original.param_groups)}: use ddp for this optimizer")
    for index, group in enumerate(original.param_groups):
        for key, value in group.items():
            if key == "params":
                continue
            for where, groups in copies:
                copy = groups[index]
                if key not in copy or not _same(copy[key], value):
                    found = repr(copy[key]) if key in copy else "missing"
                    raise hookloop.ConfigurationError(
                        f"ddp_sharded re-created {cls} as fairscale.optim.OSS(params, optim={cls}, ...) "
                        f"and parameter group {index}'s {key!r} changed: {value!r} in the optimizer "
                        f"configure_optimizers returned, {found} in {where}, so the sharded run would "
                        f"not compute what ddp computes. {cls}'s constructor must keep a group's "
                        f"{key!r} as given; otherwise use ddp"
                    )
