"""Sharding a module with ``fully_shard`` and giving it back: the model side of the plugin.

The strategy's ``wrap_model`` turns the user's module into FSDP units (bottom-up, as the
wrap policy says) under a root unit (:class:`FSDPRoot`), whatever its parameters hold:

* real tensors (built in ``__init__``, or with ``meta_init=False``): every rank takes
  global rank 0's values (as DDP does), then ``fully_shard`` keeps each rank's shard;
* meta tensors (``configure_model`` under the meta device): ``fully_shard`` shards the
  meta module, ``to_empty`` allocates only this rank's shards, and each module's own
  ``reset_parameters()`` computes its values, one module at a time, on a full-size
  scratch copy of that module's own tensors; rank 0's values are scattered so every
  rank keeps its slice. The whole model never exists on one rank, and the values are
  those of normal construction with the same seed (see :func:`materialise`);
* DTensors of an earlier run of this process (``state_dict_type="sharded"`` leaves the
  module sharded after ``fit``): re-attached from each rank's local shard, on a mesh of
  the same shape.

:func:`unshard_module` undoes it at teardown: the FSDP classes, hooks and state go,
and each parameter is either gathered into a plain full tensor or left as this rank's
DTensor shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookloop
from hookloop import ConfigurationError

from .options import original_class

# The hook registries of nn.Module that fully_shard (and activation checkpointing) add to.
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


class FSDPRoot(nn.Module):
    """The root FSDP unit: the loop's step module, one level down.

    ``fully_shard`` changes a module's class in place (to a subclass), so the step module
    sharded in place would still look like the loop's own step module, which the loop
    calls past (``training_step`` directly). This wrapper is what the loop calls instead,
    so FSDP's root hooks (lazy initialisation, input casting, the root's all-gather) run
    around every step. ``module`` is the step module, whose ``module`` is the user's.

    Core workaround: hookloop's loop tells "no strategy wrapped the step module" by
    ``isinstance(trainer.model, _StepModule)``; an identity check (or a public step
    module class) would let the step module itself be the root unit.
    """

    def __init__(self, step_module: nn.Module):
        super().__init__()
        self.module = step_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


@dataclass
class Snapshot:
    """What a module was before sharding (its class, attribute names and hooks), to give
    it back at teardown."""

    cls: type
    attributes: set[str]
    hooks: dict[str, set]


@dataclass
class Sharded:
    """One run's sharded model: the root unit, the user's module, what each was."""

    root: nn.Module
    module: nn.Module
    snapshots: dict[nn.Module, Snapshot] = field(default_factory=dict)


def snapshot(model: nn.Module) -> dict[nn.Module, Snapshot]:
    """Every module of ``model`` as it is now (see :func:`unshard_module`)."""
    return {
        m: Snapshot(type(m), set(m.__dict__), {h: set(getattr(m, h, {}) or {}) for h in _HOOK_DICTS})
        for m in model.modules()
    }


def checkpoint_activations(modules: list[nn.Module]) -> None:
    """Recompute each module's activations in backward (torch's non-reentrant
    ``torch.utils.checkpoint``), by replacing its ``forward`` on the instance: the module
    tree, names and state dict keys stay the user's."""
    from torch.utils.checkpoint import checkpoint

    for module in modules:
        forward = module.forward

        def checkpointed(*args: Any, _forward=forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        module.forward = checkpointed


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Every rank takes global rank 0's values (DDP does this when it wraps)."""
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in tensors:
            if t.dtype == torch.bool:
                as_int = t.to(torch.uint8)
                dist.broadcast(as_int, src=0)
                t.copy_(as_int.bool())
            else:
                dist.broadcast(t, src=0)


@dataclass
class _Stale:
    """A parameter or buffer that holds this rank's shard of an earlier run."""

    local: torch.Tensor
    placements: tuple
    mesh_shape: tuple[int, ...]


def detach_stale(model: nn.Module, mesh: Any = None) -> dict[tuple[int, str], _Stale]:
    """Replace the DTensors an earlier run left in ``model`` by meta tensors of the same
    global shape, remembering this rank's shard of each (see :func:`reattach`). DTensors
    on a sub-mesh of this run's ``mesh`` are not stale: tp split them just now (fsdp x tp)."""
    from torch.distributed.tensor import DTensor

    stale: dict[tuple[int, str], _Stale] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor) and not of_this_run(param, mesh):
                stale[(id(module), name)] = _Stale(param.to_local().detach(), tuple(param.placements),
                                                   tuple(param.device_mesh.shape))
                module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                                        requires_grad=param.requires_grad)
    return stale


def of_this_run(tensor: Any, mesh: Any) -> bool:
    """Whether DTensor ``tensor`` is another mesh plugin's split of this run (tp's, under
    fsdp x tp), not an earlier fsdp run's shard: its mesh dimensions are all dimensions
    of this run's mesh and none is fsdp's own (``mesh``, fsdp's part). By names: torch
    reuses equal meshes across runs (DTensor's caches), so identity tells nothing."""
    if mesh is None:
        return False
    names = tuple(getattr(tensor.device_mesh, "mesh_dim_names", None) or ())
    root = getattr(mesh, "_get_root_mesh", None)  # the run's whole mesh (torch 2.x DeviceMesh)
    everything = set(getattr(root(), "mesh_dim_names", None) or ()) if root is not None else set()
    own = set(mesh.mesh_dim_names or ())
    return bool(names) and set(names) <= everything and not set(names) & own


def reattach(model: nn.Module, stale: dict[tuple[int, str], _Stale]) -> None:
    """Copy each rank's remembered shard into the freshly sharded parameter."""
    for module in model.modules():
        for name, param in module._parameters.items():
            old = stale.get((id(module), name))
            if old is None:
                continue
            now = (tuple(param.placements), tuple(param.device_mesh.shape))
            if now != (old.placements, old.mesh_shape) or param.to_local().shape != old.local.shape:
                raise ConfigurationError(
                    f"the module holds the shards of an earlier fsdp run on a mesh of {old.mesh_shape} "
                    f"({old.placements}); this run shards on {now[1]} ({now[0]}), so the shards do not "
                    f"fit. Save a sharded checkpoint in that run and resume from it (torch.distributed."
                    f"checkpoint reshards), or use state_dict_type='full', which leaves the module whole")
            with torch.no_grad():
                param.to_local().copy_(old.local)


def materialise(model: nn.Module, device: torch.device, dtypes: dict[tuple[int, str], torch.dtype],
                keep: set[tuple[int, str]] = frozenset()) -> None:
    """Allocate and initialise what ``configure_model`` created on the meta device.

    Module by module, in ``model.modules()`` order: ``to_empty`` allocates this rank's
    shards, the module's own ``reset_parameters()`` runs on full-size scratch copies of
    its own parameters and buffers (in the dtype they were created in, ``dtypes``), and
    global rank 0's values are scattered so that each rank keeps its slice. Every rank
    draws from its own generator as normal construction would, so with the same seed the
    weights are those of ``MyModel()`` built whole (for modules that initialise their
    own tensors in ``reset_parameters``, created in the order they are registered).
    Tensors in ``keep`` (``(id(module), name)``: shards of an earlier run) are only
    allocated; :func:`reattach` fills them.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    for module in model.modules():
        own = [(n, t, True) for n, t in module._parameters.items() if t is not None]
        own += [(n, t, False) for n, t in module._buffers.items() if t is not None]
        meta = [(n, t, p) for n, t, p in own if t.is_meta]
        if not meta:
            continue
        # to_empty allocates all of the module's own tensors: keep the real ones' values.
        real = [(n, _local(t).detach().clone(), p) for n, t, p in own if not t.is_meta]
        meta = [(n, t, p) for n, t, p in meta if (id(module), n) not in keep]
        reset = getattr(module, "reset_parameters", None)
        if meta and not callable(reset):
            raise ConfigurationError(
                f"{_where(model, module)} ({original_class(module).__name__}) was created on the meta "
                f"device by configure_model, and has no reset_parameters() to initialise "
                f"{', '.join(n for n, _, _ in meta)}: define reset_parameters() on it (torch's own "
                f"layers have one), or build it outside the meta device: "
                f"hookloop.plugin('fsdp', meta_init=False)")
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            for name, value, is_param in real:
                _local((module._parameters if is_param else module._buffers)[name]).copy_(value)
        if not meta:
            continue
        scratch = _scratch(module, dtypes)
        with torch.no_grad():
            scratch.reset_parameters()
        with torch.no_grad():
            for name, _, is_param in meta:
                value = (scratch._parameters if is_param else scratch._buffers)[name]
                if _untouched(value):
                    raise ConfigurationError(
                        f"{_where(model, module)}.reset_parameters() does not set {name!r}, which "
                        f"configure_model created on the meta device: set it in reset_parameters(), or "
                        f"use hookloop.plugin('fsdp', meta_init=False)")
                target = (module._parameters if is_param else module._buffers)[name]
                value = value.detach()
                if isinstance(target, DTensor):
                    value = distribute_tensor(value.to(target.device), target.device_mesh, target.placements,
                                              src_data_rank=0).to_local()
                    target.to_local().copy_(value)
                else:
                    target.copy_(value)
                    broadcast_from_rank0([target])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _scratch(module: nn.Module, dtypes: dict[tuple[int, str], torch.dtype]) -> nn.Module:
    """A shallow stand-in for ``module`` whose own tensors are full-size scratch tensors
    filled with a marker, for its ``reset_parameters()`` to overwrite."""
    cls = original_class(module)
    scratch = cls.__new__(cls)
    scratch.__dict__.update(module.__dict__)

    def blank(key: str, t: torch.Tensor) -> torch.Tensor:
        # t is allocated (to_empty ran); a DTensor's shape and device are the global
        # shape and this rank's device.
        return _marked(torch.empty(t.shape, dtype=dtypes.get((id(module), key), t.dtype), device=t.device))

    scratch.__dict__["_parameters"] = {
        n: (nn.Parameter(blank(n, p), requires_grad=p.requires_grad) if p is not None else None)
        for n, p in module._parameters.items()}
    scratch.__dict__["_buffers"] = {n: (blank(n, b) if b is not None else None) for n, b in module._buffers.items()}
    return scratch


_INT_MARK = -(2**31) + 7


def _marked(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t.fill_(math.nan)
    if t.dtype != torch.bool:
        return t.fill_(_INT_MARK)
    return t.zero_()


def _untouched(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).all())
    return bool((t == _INT_MARK).all())


def _where(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return f"module {name!r}" if name else "the module itself"
    return type(module).__name__


def repoint_optimizers(optimizers: list, old_names: dict[int, str], model: nn.Module) -> None:
    """:func:`hookloop.repoint_optimizers` for the fsdp strategy (the optimizers of
    ``configure_optimizers`` at the sharded parameters)."""
    hookloop.repoint_optimizers(optimizers, old_names, model, owner="fsdp")


def unshard_module(sharded: Sharded, optimizers: list, gather: bool) -> None:
    """Take FSDP off the module at teardown.

    ``gather``: every parameter becomes a plain, full tensor again (a collective: every
    rank calls it), and the optimizers' state is gathered the same way, so the module
    and optimizers are those of a one-process run. Otherwise each parameter stays this
    rank's DTensor shard (re-attached by the next run, see :func:`detach_stale`).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for module in sharded.root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # the sharded parameters registered (no collective)
    replacements: dict[int, nn.Parameter] = {}
    if gather:
        for module in sharded.module.modules():
            for name, param in list(module._parameters.items()):
                if isinstance(param, DTensor):
                    full = nn.Parameter(param.full_tensor().detach().clone(), requires_grad=param.requires_grad)
                    replacements[id(param)] = full
                    module._parameters[name] = full
        for optimizer in optimizers:
            state = {}
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p in optimizer.state:
                        state[replacements.get(id(p), p)] = {
                            k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in optimizer.state[p].items()}
                group["params"][:] = [replacements.get(id(p), p) for p in group["params"]]
            optimizer.state.clear()
            optimizer.state.update(state)
    for module, before in sharded.snapshots.items():
        _restore(module, before)


def _restore(module: nn.Module, before: Snapshot) -> None:
    from torch.distributed import _composable_state

    for name in _HOOK_DICTS:
        hooks = getattr(module, name, None)
        if hooks:
            for key in [k for k in hooks if k not in before.hooks.get(name, ())]:
                del hooks[key]
    for key in [k for k in module.__dict__ if k not in before.attributes]:
        del module.__dict__[key]  # fully_shard's state and registry, a checkpointed forward
    # Private to torch: fully_shard refuses a module it already has state for, and the
    # next run of this process shards the same module again.
    getattr(_composable_state, "_module_state_mapping", {}).pop(module, None)
    if type(module) is not before.cls:
        module.__class__ = before.cls
