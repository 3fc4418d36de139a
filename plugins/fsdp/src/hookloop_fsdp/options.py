"""The fsdp plugin's options: their checks, and what each means for ``fully_shard``.

Everything here is checked when an option is set (``Trainer(...)``, before any process
starts) where the value alone decides, and against the model or the world size where
those decide (``setup``, ``wrap_model``), always with an error that names the option,
what was wrong and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hookloop import ConfigurationError

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
STATE_DICT_TYPES = ("full", "sharded")

#: precision -> (dtype the sharded weights are kept in, dtype they are computed in)
PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "32": (None, None),
    "bf16-mixed": (None, torch.bfloat16),
    "16-mixed": (None, torch.float16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "16-true": (torch.float16, torch.float16),
}


def bad(name: str, value: Any, rule: str) -> ConfigurationError:
    return ConfigurationError(f"fsdp option {name}={value!r}: {rule}")


def sharding_strategy(value: Any) -> str:
    """``"FULL_SHARD"`` ... from a string (any case) or torch's ``ShardingStrategy`` enum."""
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.strip().upper() in SHARDING_STRATEGIES:
        return name.strip().upper()
    raise bad("sharding_strategy", value, f"must be one of {', '.join(SHARDING_STRATEGIES)} "
              f"(or torch.distributed.fsdp.ShardingStrategy.<name>)")


def state_dict_type(value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in STATE_DICT_TYPES:
        return value.strip().lower()
    raise bad("state_dict_type", value, "must be 'full' (one file gathered on rank 0: hookloop's "
              "normal checkpoint) or 'sharded' (a directory of per-rank shards written with "
              "torch.distributed.checkpoint)")


def module_policy(name: str, value: Any, sizes: bool) -> Any:
    """Check the shape of ``auto_wrap_policy`` (``sizes=True``: a minimum parameter count
    is allowed) or ``activation_checkpointing_policy``; returns the normalised value."""
    if value is None or callable(value) and not isinstance(value, type):
        return value
    if sizes and isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise bad(name, value, "a minimum number of parameters per sharded unit must be >= 1")
        return value
    if isinstance(value, (type, str)):
        value = [value]
    if isinstance(value, Iterable) and not isinstance(value, (bytes, dict)):
        items: list = []
        for item in value:
            if isinstance(item, str):
                items += [part.strip() for part in item.split(",") if part.strip()]
            elif isinstance(item, type) and issubclass(item, nn.Module):
                items.append(item)
            else:
                raise bad(name, value, f"{item!r} is neither an nn.Module class nor a class name")
        if not items:
            raise bad(name, value, "an empty set wraps nothing: leave it None instead")
        return frozenset(items)
    kinds = "a set of nn.Module classes (or their names), a minimum parameter count, " if sizes else "a set of nn.Module classes (or their names), "
    raise bad(name, value, f"must be None, {kinds}or a function module -> bool")


def device_mesh(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (isinstance(value, (tuple, list)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        return (int(value[0]), int(value[1]))
    raise bad("device_mesh", value, "must be None or (replicas, shard size): two integers >= 1 whose "
              "product is the number of processes, e.g. (2, 4) for 2 nodes x 4 processes")


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad(name, value, "must be True or False")
    return value


# ---------------------------------------------------------------------------------------
# Against the world size and the model
# ---------------------------------------------------------------------------------------


def mesh_shape(strategy: str, mesh: tuple[int, int] | None, world: int, per_node: int | None) -> tuple[int, ...]:
    """The device mesh of ``strategy`` on ``world`` processes (``per_node`` per node).

    FULL_SHARD / SHARD_GRAD_OP: ``(world,)``; NO_SHARD: ``(world, 1)`` (every rank a
    replica with a shard group of one, so each holds everything and gradients are
    all-reduced); HYBRID_SHARD: ``(replicas, shard size)``, by default ``(nodes,
    processes per node)``: replicate across nodes and shard within each.
    """
    if mesh is not None and strategy != "HYBRID_SHARD":
        raise bad("device_mesh", mesh, f"shapes the HYBRID_SHARD mesh; sharding_strategy is {strategy}. "
                  f"Set sharding_strategy='HYBRID_SHARD' or leave device_mesh None")
    if strategy == "NO_SHARD":
        return (world, 1)
    if strategy != "HYBRID_SHARD":
        return (world,)
    if mesh is None:
        per_node = per_node or world
        if world % per_node:
            raise ConfigurationError(
                f"fsdp sharding_strategy='HYBRID_SHARD' shards within a node and replicates across "
                f"nodes, but {world} processes do not split into nodes of {per_node}: start the same "
                f"number of processes on every node, or give device_mesh=(replicas, shard size)")
        mesh = (world // per_node, per_node)
    if mesh[0] * mesh[1] != world:
        raise ConfigurationError(
            f"fsdp sharding_strategy='HYBRID_SHARD' with device_mesh={mesh}: the mesh holds "
            f"{mesh[0]} x {mesh[1]} = {mesh[0] * mesh[1]} processes, but the run has {world}. Give a "
            f"mesh whose product is {world} (replicas x shard size, e.g. "
            f"{_factorisations(world)}), or launch {mesh[0] * mesh[1]} processes")
    return mesh


def _factorisations(world: int) -> str:
    pairs = [(r, world // r) for r in range(1, world + 1) if world % r == 0]
    return ", ".join(str(p) for p in pairs[:4]) + (" ..." if len(pairs) > 4 else "")


def original_class(module: nn.Module) -> type:
    """The user's class of ``module`` (fully_shard swaps in a subclass, FSDP<Name>)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = cls.__mro__[cls._orig_cls_mro_index]
    return cls


def match_classes(name: str, spec: frozenset, model: nn.Module) -> Callable[[nn.Module], bool]:
    """A predicate for the modules of ``model`` that ``spec`` (classes or class names)
    names; ``ConfigurationError`` naming the model's classes when one names none of them."""
    classes = {original_class(m) for m in model.modules()}
    names = {c.__name__ for c in classes} | {f"{c.__module__}.{c.__qualname__}" for c in classes}
    wanted_types: list[type] = []
    wanted_names: set[str] = set()
    for item in spec:
        if isinstance(item, type):
            if not any(issubclass(c, item) for c in classes):
                raise _not_in_model(name, item.__qualname__, classes)
            wanted_types.append(item)
        else:
            if item not in names:
                raise _not_in_model(name, item, classes)
            wanted_names.add(item)

    def matches(module: nn.Module) -> bool:
        cls = original_class(module)
        return isinstance(module, tuple(wanted_types)) or cls.__name__ in wanted_names or (
            f"{cls.__module__}.{cls.__qualname__}" in wanted_names)

    return matches


def _not_in_model(option: str, what: str, classes: set[type]) -> ConfigurationError:
    import difflib

    listed = sorted({c.__name__ for c in classes})
    close = difflib.get_close_matches(what.rsplit(".", 1)[-1], listed, n=1)
    return ConfigurationError(
        f"fsdp option {option} names {what}, but the model contains no {what} module"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f". Its module classes: {', '.join(listed)}. Name classes of this model (the blocks to "
        f"shard or recompute one at a time, e.g. your transformer block), or leave {option} None."
    )


def wrap_units(policy: Any, model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` to shard as units of their own, children before parents
    (``fully_shard`` goes bottom-up); ``model`` itself is never among them (it is part
    of the root unit)."""
    if policy is None:
        return []
    ordered = _post_order(model)
    if isinstance(policy, int):
        # torch's size-based policy: a module becomes a unit when the parameters not
        # already in a unit below it number at least ``policy``.
        units, left = [], {}
        for module in ordered:
            own = sum(p.numel() for p in module.parameters(recurse=False))
            total = own + sum(left.get(id(c), 0) for c in module.children())
            if module is not model and total >= policy:
                units.append(module)
                total = 0
            left[id(module)] = total
        return units
    predicate = match_classes("auto_wrap_policy", policy, model) if isinstance(policy, frozenset) else policy
    return [m for m in ordered if m is not model and predicate(m)]


def checkpointed_modules(policy: Any, model: nn.Module) -> list[nn.Module]:
    if policy is None:
        return []
    predicate = match_classes("activation_checkpointing_policy", policy, model) if isinstance(policy, frozenset) else policy
    return [m for m in model.modules() if predicate(m)]


def _post_order(model: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        out.append(module)

    visit(model)
    return out


def check_precision(precision: str, device: torch.device, allow_cpu_fp16: bool) -> None:
    if precision not in PRECISIONS:
        raise ConfigurationError(
            f"precision={precision!r}: the fsdp strategy applies {', '.join(PRECISIONS)}")
    if precision.startswith("16-") and device.type != "cuda" and not (device.type == "cpu" and allow_cpu_fp16):
        where = "this machine has no CUDA GPU" if not torch.cuda.is_available() else f"this run's device is {device}"
        raise ConfigurationError(
            f"precision={precision!r} (fp16) is meant for CUDA GPUs and {where}: use "
            f"precision='bf16-mixed' (or 'bf16-true'), or hookloop.plugin('fsdp', allow_cpu_fp16=True) "
            f"to run fp16 on the CPU anyway (slow; for tests of the scaler path)")

