"""One device mesh per run (issue 21): the plugins' claims, the sizes, the mesh.

A parallelism plugin declares the mesh dimensions it uses with a class attribute (or a
property, when its options decide) ``hookloop_mesh_dims: tuple[str, ...]``: names from
:data:`CANONICAL_DIMS` or a new one a third party adds (e.g. ``"ep"``). Such a plugin is
a *mesh plugin*: any number of them compose in one run, each on dimensions of its own.

The sizes come from ``Trainer(mesh={"dp_shard": 2, "tp": 2})``, ``hookloop run --mesh
dp_shard=2,tp=2`` or ``HOOKLOOP_MESH`` (the same text); a claimed dimension without a
size takes ``world_size // product(the others)`` when exactly one is unsized, and a plugin
may propose sizes for its own dimensions with a method ``hookloop_mesh_sizes(trainer)``
(fsdp's ``HYBRID_SHARD`` default: nodes x processes per node); the user's sizes win.

Once the process group exists (after ``setup_environment``) the core builds one
``torch.distributed.device_mesh.DeviceMesh`` (:func:`build_device_mesh`): the claimed
dimensions in the order :data:`CANONICAL_DIMS`, then the others in the order they were
claimed; it is ``trainer.device_mesh``, and the hook ``on_device_mesh(trainer, mesh)``
tells every plugin. A plugin takes its part with :func:`submesh`.

Nothing here imports a plugin; ``plugins.check_composition`` uses :func:`claims` and
:func:`check_layout` to refuse two claimants of one dimension and layouts the backends
cannot run, naming both plugins.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any, Iterable

from hookloop.contract.errors import ConfigurationError, PluginConflictError
from hookloop.contract.pluginspec import plugin_name

#: The dimensions hookloop knows, in the mesh's order (torchtitan's): pipeline stages,
#: data-parallel replicas, data-parallel shards, context parallel, tensor parallel.
CANONICAL_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: The data-parallel dimensions: one plugin wraps the model for data parallelism.
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")
MESH_ENV = "HOOKLOOP_MESH"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def mesh_dims(plugin: Any) -> tuple[str, ...] | None:
    """The dimensions ``plugin`` claims, or ``None`` for a plugin that is no mesh plugin
    (it declares no ``hookloop_mesh_dims``; ``()`` is a mesh plugin claiming nothing, such
    as compile). A plugin that says ``hookloop_composes = False`` is none, whatever it
    inherits (deepspeed, ddp_sharded: they own the model/optimizer lifecycle alone)."""
    if getattr(plugin, "hookloop_composes", True) is False:
        return None
    dims = getattr(plugin, "hookloop_mesh_dims", None)
    if dims is None or isinstance(dims, property):
        return None
    if isinstance(dims, str):
        dims = (dims,)
    dims = tuple(dims)
    for d in dims:
        if not isinstance(d, str) or not _NAME.match(d):
            raise ConfigurationError(
                f"plugin {plugin_name(plugin)!r} declares hookloop_mesh_dims={dims!r}: each must be "
                f"a dimension name (an identifier, e.g. one of {', '.join(CANONICAL_DIMS)} or 'ep')")
    return dims


def claims(plugins: Iterable[Any]) -> dict[str, str]:
    """``{dimension: plugin name}`` of every claimed dimension, in claim order; two
    plugins claiming one dimension is a :class:`PluginConflictError` naming both."""
    owner: dict[str, str] = {}
    for p in plugins:
        for d in mesh_dims(p) or ():
            name = plugin_name(p)
            if d in owner and owner[d] != name:
                raise PluginConflictError(
                    f"plugins {owner[d]!r} and {name!r} both claim the mesh dimension {d!r}: a "
                    f"dimension has one owner. Keep one of them (docs/configurations.md lists the "
                    f"layouts that compose).")
            owner[d] = name
    return owner


def check_layout(plugins: Iterable[Any]) -> None:
    """Refuse what the backends cannot run although no dimension is claimed twice: two
    data-parallel wrappers (e.g. ddp on ``dp_replicate`` and fsdp on ``dp_shard``: DDP
    cannot wrap FSDP2; fsdp's ``HYBRID_SHARD`` is that layout)."""
    wrappers = [plugin_name(p) for p in plugins if set(mesh_dims(p) or ()) & set(DATA_PARALLEL_DIMS)]
    if len(wrappers) > 1:
        a, b = wrappers[:2]
        raise PluginConflictError(
            f"plugins {a!r} and {b!r} both wrap the model for data parallelism (dimensions "
            f"{', '.join(DATA_PARALLEL_DIMS)}), and the backends cannot nest one in the other: keep "
            f"one (replicas x shards is fsdp's sharding_strategy='HYBRID_SHARD').")
    check_refusals(plugins)


def refusals(plugin: Any) -> dict[str, str]:
    """``plugin``'s ``hookloop_refuses_beside``: ``{what: why and what to run instead}``,
    where ``what`` is a mesh dimension another enabled plugin claims or another plugin's
    name. A mesh plugin declares the layouts it does not run (or that no test checks yet)
    there, and :func:`check_layout` refuses them at construction in the user's words."""
    table = getattr(plugin, "hookloop_refuses_beside", None)
    if table is None or isinstance(table, property):
        return {}
    if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
        raise ConfigurationError(
            f"plugin {plugin_name(plugin)!r} declares hookloop_refuses_beside={table!r}: it must be a dict "
            f"{{dimension or plugin name: the reason and what to run instead}}")
    return table


def check_refusals(plugins: Iterable[Any]) -> None:
    """Refuse a pair of enabled plugins that one of them declares it does not compose with
    (:func:`refusals`), naming both and giving the declared reason and alternative."""
    plugins = list(plugins)
    for p in plugins:
        table = refusals(p)
        if not table:
            continue
        for other in plugins:
            if other is p:
                continue
            name = plugin_name(other)
            keys = [name, *(mesh_dims(other) or ())]
            hit = next((k for k in keys if k in table), None)
            if hit is not None:
                raise PluginConflictError(
                    f"plugins {plugin_name(p)!r} and {name!r} do not run together: {table[hit]} "
                    f"(docs/configurations.md, \"Every pair of mesh plugins\").")


def lifecycle_lead(plugins: Iterable[Any]) -> Any:
    """The strategy that owns the model/optimizer lifecycle among ``plugins`` (the run's
    ``trainer.strategy``): a strategy that does not compose (it runs alone), else the one
    that wraps the model for data parallelism (fsdp, HSDP, ddp: a tp-like mesh plugin
    beside it only transforms the model; docs/decisions.md, "fsdp x tp"), else the first
    strategy listed; ``None`` without a strategy."""
    strategies = [p for p in plugins if getattr(p, "hookloop_role", None) == "strategy"]
    for p in strategies:
        if mesh_dims(p) is None:
            return p
    for p in strategies:
        if set(mesh_dims(p) or ()) & set(DATA_PARALLEL_DIMS):
            return p
    return strategies[0] if strategies else None


def parse_mesh(value: Any, source: str = "mesh") -> dict[str, int | None]:
    """``{"dp_shard": 2, "tp": None}`` from ``None``, a dict, or text such as
    ``"dp_shard=2,tp=2"`` (``tp`` alone or ``tp=-1``: unsized). Sizes are integers >= 1."""
    if value is None or value == "" or value == {}:
        return {}
    if isinstance(value, str):
        items: list[tuple[str, Any]] = []
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            name, sep, size = part.partition("=")
            size = size.strip()
            if not sep or size in ("-1", "auto", ""):
                items.append((name.strip(), None))
                continue
            try:
                items.append((name.strip(), int(size)))
            except ValueError:
                raise ConfigurationError(
                    f"{source}={value!r}: the size of {name.strip()!r} is {size!r}, not an integer "
                    f"(write DIM=SIZE,..., e.g. dp_shard=2,tp=2)") from None
        value = dict(items)
    if not isinstance(value, dict):
        raise ConfigurationError(f"{source}={value!r} must be a dict {{dimension: size}} or text such "
                                 f"as 'dp_shard=2,tp=2'")
    sizes: dict[str, int | None] = {}
    for name, size in value.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigurationError(f"{source}: {name!r} is not a dimension name (e.g. "
                                     f"{', '.join(CANONICAL_DIMS)})")
        if size == -1:
            size = None
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ConfigurationError(f"{source}: the size of {name!r} is {size!r}; it must be an "
                                     f"integer >= 1 (or -1 / left out: the rest of the world)")
        sizes[name] = size
    return sizes


def environment_mesh(environ: Mapping[str, str] | None = None) -> dict[str, int | None]:
    """The sizes in ``HOOKLOOP_MESH`` (``{}`` when unset), read from ``environ`` (default:
    ``os.environ``)."""
    return parse_mesh((os.environ if environ is None else environ).get(MESH_ENV), MESH_ENV)


def check_sizes(sizes: dict[str, int | None], claimed: dict[str, str]) -> None:
    """What can be checked before the world size is known: every sized dimension is
    claimed by an enabled plugin (a size of 1 may name any), and at most one claimed
    dimension is left without a size. :class:`ConfigurationError` otherwise."""
    for name, size in sizes.items():
        if name not in claimed and size != 1:
            known = ", ".join(f"{d} ({p})" for d, p in claimed.items()) or "none"
            raise ConfigurationError(
                f"mesh dimension {name!r} is claimed by no enabled plugin (claimed: {known}); "
                f"enable the plugin that uses it, or drop {name!r} from mesh / --mesh / {MESH_ENV}")


def layout(sizes: dict[str, int | None], claimed: dict[str, str], world_size: int,
           proposed: dict[str, int] | None = None) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``(dimension names, shape)`` of the mesh for ``world_size`` processes: the claimed
    dimensions in canonical order then claim order; sizes from ``sizes``, else from
    ``proposed`` (the plugins' own), else the one unsized dimension takes the rest.
    Errors name the dimensions, the sizes and the world size."""
    check_sizes(sizes, claimed)
    proposed = proposed or {}
    dims = [d for d in CANONICAL_DIMS if d in claimed] + [d for d in claimed if d not in CANONICAL_DIMS]
    resolved = {d: sizes.get(d, proposed.get(d)) for d in dims}
    unsized = [d for d, s in resolved.items() if s is None]
    if len(unsized) > 1:
        raise ConfigurationError(
            f"mesh dimensions {', '.join(repr(d) for d in unsized)} have no size, and only one may "
            f"take the rest of the world ({world_size} processes): give the others a size, e.g. "
            f"--mesh {unsized[0]}=2" + "".join(f",{d}=..." for d in unsized[1:-1]))
    known = math.prod(s for s in resolved.values() if s is not None)
    if unsized:
        if world_size % known:
            raise ConfigurationError(
                f"mesh {_show(resolved)}: {world_size} processes are not a multiple of "
                f"{known}, so {unsized[0]!r} has no whole size")
        resolved[unsized[0]] = world_size // known
    elif known != world_size:
        raise ConfigurationError(
            f"mesh {_show(resolved)} holds {known} processes, and the run has {world_size}: the "
            f"sizes' product must be the world size (devices x nodes)")
    return tuple(dims), tuple(int(resolved[d]) for d in dims)


def _show(resolved: dict[str, int | None]) -> str:
    return ",".join(f"{d}={'?' if s is None else s}" for d, s in resolved.items())


def build_device_mesh(trainer) -> Any:
    """Build the run's mesh (``trainer.device_mesh``) and fire ``on_device_mesh``; called by
    the session once the process group exists. ``None`` (and no hook) when no enabled
    plugin claims a dimension or no process group was started."""
    import torch.distributed as dist

    trainer.device_mesh = None
    claimed = claims(trainer.plugins)
    if not claimed or not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.device_mesh import init_device_mesh

    proposed: dict[str, int] = {}
    for p in trainer.plugins:
        propose = getattr(p, "hookloop_mesh_sizes", None)
        if callable(propose):
            own = set(mesh_dims(p) or ())
            proposed.update({d: s for d, s in (propose(trainer) or {}).items() if d in own})
    dims, shape = layout(trainer.config.mesh, claimed, trainer.world_size, proposed)
    mesh = init_device_mesh(trainer.root_device.type, shape, mesh_dim_names=dims)
    trainer.device_mesh = mesh
    trainer.hook.on_device_mesh(trainer=trainer, mesh=mesh)
    return mesh


def submesh(trainer, plugin: Any) -> Any:
    """``plugin``'s part of the run's mesh: ``trainer.device_mesh[plugin.hookloop_mesh_dims]``
    (a 1-D mesh for one dimension); ``None`` before the mesh is built, or for a plugin
    that claims no dimension."""
    mesh = getattr(trainer, "device_mesh", None)
    dims = mesh_dims(plugin)
    if mesh is None or not dims:
        return None
    return mesh[dims[0]] if len(dims) == 1 else mesh[dims]


#: The order of the model transforms in ``wrap_model`` (torchtitan's): pipeline split,
#: then tensor-like dimensions (tp, cp, a third party's such as ep), then plugins that
#: claim nothing (compile, float8), then the data-parallel wrapper (or the strategy that
#: owns the lifecycle alone).
TRANSFORM_STAGES = ("pp", "tp", "compile", "dp")


def transform_stage(plugin: Any) -> int | None:
    """The index in :data:`TRANSFORM_STAGES` of a mesh plugin; a strategy that owns the
    lifecycle alone (deepspeed, horovod, dp...) wraps last, as a data-parallel wrapper
    does, so a model transform beside it (compile) runs before it without ``tryfirst``;
    ``None`` for other plugins."""
    dims = mesh_dims(plugin)
    if dims is None:
        return 3 if getattr(plugin, "hookloop_role", None) == "strategy" else None
    if "pp" in dims:
        return 0
    if not dims:
        return 2
    if set(dims) <= set(DATA_PARALLEL_DIMS):
        return 3
    return 1


def registration_order(plugins: list[Any]) -> list[Any]:
    """``plugins`` with the mesh plugins reordered among their own places so that pluggy
    (which calls the last registered first) calls their ``wrap_model`` in
    :data:`TRANSFORM_STAGES` order, whatever order the run listed them in."""
    places = [i for i, p in enumerate(plugins) if transform_stage(p) is not None]
    if len(places) < 2:
        return list(plugins)
    ordered = sorted((plugins[i] for i in places), key=lambda p: -transform_stage(p))
    out = list(plugins)
    for i, p in zip(places, ordered):
        out[i] = p
    return out
