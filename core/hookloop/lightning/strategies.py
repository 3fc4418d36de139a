"""Lightning's strategy strings and strategy classes, as hookloop plugins with options.

``Trainer(strategy="ddp_find_unused_parameters_true")`` is
``Trainer(plugins=[hookloop.plugin("ddp", find_unused_parameters=True)])``. The table is
data: the core never imports a plugin; the plugin a string names is loaded through its
entry point only when a run uses it, and a missing one is an error with its pip line.

``DDPStrategy(...)``, ``FSDPStrategy(...)`` and ``DeepSpeedStrategy(...)`` take the
plugin's options and return the plugin object (``start_method`` picks ``ddp`` or
``ddp_spawn``), so ``from lightning.pytorch.strategies import DDPStrategy`` becomes
``from hookloop.lightning.strategies import DDPStrategy``.
"""

from __future__ import annotations

import difflib
from typing import Any

from hookloop.contract import registry as plugin_registry
from hookloop.contract.errors import ConfigurationError, MissingDependencyError

#: Lightning's strategy string -> (hookloop plugin name, its options). ``None``: the
#: core's own single process (no strategy plugin). Lightning's ``"ddp"`` starts its
#: processes with ``popen`` (a script run once per rank), which is what hookloop's ``ddp``
#: does; ``"ddp_fork"`` and ``"ddp_notebook"`` are ``ddp_spawn`` with ``start_method="fork"``.
STRATEGY_STRINGS: dict[str, tuple[str, dict] | None] = {
    "auto": None,
    "single_device": None,
    "ddp": ("ddp", {}),
    "ddp_spawn": ("ddp_spawn", {}),
    "ddp_fork": ("ddp_spawn", {"start_method": "fork"}),
    "ddp_notebook": ("ddp_spawn", {"start_method": "fork"}),
    "dp": ("dp", {}),
    "fsdp": ("fsdp", {}),
    # The plugins of these names set Lightning's options as their defaults (hookloop-fsdp,
    # hookloop-deepspeed), so plugin_options={"deepspeed_stage_2": {...}} keeps working.
    "fsdp_cpu_offload": ("fsdp_cpu_offload", {}),
    "deepspeed": ("deepspeed", {}),
    "deepspeed_stage_1": ("deepspeed_stage_1", {}),
    "deepspeed_stage_2": ("deepspeed_stage_2", {}),
    "deepspeed_stage_2_offload": ("deepspeed_stage_2_offload", {}),
    "deepspeed_stage_3": ("deepspeed_stage_3", {}),
    "deepspeed_stage_3_offload": ("deepspeed_stage_3_offload", {}),
    "deepspeed_stage_3_offload_nvme": ("deepspeed_stage_3_offload_nvme", {}),
    "horovod": ("horovod", {}),
}
for _base in ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook"):
    for _flag in (True, False):
        _plugin, _options = STRATEGY_STRINGS[_base]
        STRATEGY_STRINGS[f"{_base}_find_unused_parameters_{str(_flag).lower()}"] = (
            _plugin, {**_options, "find_unused_parameters": _flag},
        )
del _base, _flag, _plugin, _options


def distribution(plugin: str) -> str:
    """The in-tree folder of the plugin a table entry names (``plugins/<it>``, distribution
    ``hookloop-<it>``): its name up to the first ``_`` (``deepspeed_stage_2`` -> ``deepspeed``)."""
    return plugin.split("_")[0]


def resolve_string(strategy: str) -> Any:
    """The plugin object (or plugin name) for a strategy string; ``None`` for the core's
    single process. A string that is no Lightning name but an installed plugin's name
    (``"ddp_sharded"``) is that plugin, as before."""
    if strategy in STRATEGY_STRINGS:
        entry = STRATEGY_STRINGS[strategy]
        if entry is None:
            return None
        name, options = entry
        if not options:
            # The plugin by name, as plugins=[name] (its plugin_options go to its constructor)
            require(name, f"strategy={strategy!r}")
            return name
        return load_plugin(name, options, f"strategy={strategy!r}")
    installed = plugin_registry.installed_plugins()
    if strategy in installed:
        return strategy
    known = sorted(set(STRATEGY_STRINGS) | {n for n in installed if n not in plugin_registry.BUILTIN_OBSERVERS})
    close = difflib.get_close_matches(strategy, known, n=3, cutoff=0.6)
    raise ConfigurationError(
        f"strategy={strategy!r} is neither one of Lightning's strategy names nor an installed "
        f"plugin" + (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else "")
        + f". Lightning's names hookloop maps: {', '.join(sorted(STRATEGY_STRINGS))}; or name "
        f"an installed strategy plugin (list them with `hookloop plugins`)."
    )


def require(name: str, what: str) -> None:
    """Refuse, with its pip line, a plugin that ``what`` needs and that is not installed."""
    if name not in plugin_registry.installed_plugins():
        dist = distribution(name)
        raise MissingDependencyError(
            f"{what} needs the plugin {name!r}, which is not installed: pip install "
            f"hookloop-{dist} (in a hookloop checkout: pip install -e plugins/{dist})"
        )


def load_plugin(name: str, options: dict, what: str) -> Any:
    """The installed plugin ``name`` made with ``options`` (see :func:`require`)."""
    require(name, what)
    return plugin_registry.resolve(name, **options)


def DDPStrategy(start_method: str = "popen", **options: Any) -> Any:
    """Lightning's ``DDPStrategy(...)``: the ``ddp`` plugin (``start_method="popen"``, the
    default) or ``ddp_spawn`` (``"spawn"``, ``"fork"``, ``"forkserver"``) with ``options``."""
    if start_method == "popen":
        return load_plugin("ddp", options, "DDPStrategy()")
    if start_method in ("spawn", "fork", "forkserver"):
        return load_plugin("ddp_spawn", {**options, "start_method": start_method}, f"DDPStrategy(start_method={start_method!r})")
    raise ConfigurationError(
        f"DDPStrategy(start_method={start_method!r}): must be 'popen', 'spawn', 'fork' or 'forkserver'"
    )


def FSDPStrategy(**options: Any) -> Any:
    """Lightning's ``FSDPStrategy(...)``: the ``fsdp`` plugin with ``options``."""
    return load_plugin("fsdp", options, "FSDPStrategy()")


def DeepSpeedStrategy(**options: Any) -> Any:
    """Lightning's ``DeepSpeedStrategy(...)``: the ``deepspeed`` plugin with ``options``."""
    return load_plugin("deepspeed", options, "DeepSpeedStrategy()")
