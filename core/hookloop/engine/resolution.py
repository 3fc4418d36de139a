"""A run's settings and plugins, resolved by one function: :func:`resolve_settings`.

Five sources meet here, and nowhere else in the engine: the ``Trainer`` arguments, the
options of ``hookloop run`` (handed through ``HOOKLOOP_TRAINER_DEFAULTS``), the plugin
options (``--plugin-option``, ``HOOKLOOP_PLUGIN_OPTIONS``), the environment
(``HOOKLOOP_PLUGINS``, ``HOOKLOOP_AUTOLOAD_PLUGINS``, ``HOOKLOOP_MESH``) and the plugins'
own declarations (roles, options, mesh claims). The environment is passed in (a mapping),
never read from ``os.environ`` here, so the resolution is testable without a Trainer.

Precedence, per setting (docs/configurations.md, "Where a setting comes from"):
``Trainer(x=...)`` in code > ``hookloop run --x`` > ``Trainer(x=hookloop.default(...))`` >
:class:`TrainerConfig`'s default; plugin options merge per option
(``HOOKLOOP_PLUGIN_OPTIONS`` < ``hookloop.default`` < ``--plugin-option`` < code);
``autoload_plugins`` and ``mesh`` not given anywhere come from their variables.

Arguments only a compatibility layer understands (Lightning's ``callbacks=``,
``strategy=``, ``logger=`` objects) go to the translators registered in
:mod:`hookloop.contract.translators`; the engine imports no such layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from hookloop.contract import registry as plugin_registry
from hookloop.contract import translators as translators_module
from hookloop.contract.errors import ConfigurationError
from hookloop.contract.translators import ArgumentTranslator, as_list
from hookloop.distributed import mesh as mesh_module
from hookloop.engine.settings import TrainerConfig, env_defaults
from hookloop.resume import rundir

#: the settings of :class:`TrainerConfig`, each a ``Trainer`` argument
CONFIG_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(TrainerConfig))
#: ``Trainer`` arguments that are no setting of their own: Lightning's names for plugins,
#: taken by a compatibility layer (contract.translators)
PLUGIN_ALIASES = ("strategy", "callbacks")


class default:
    """Mark a ``Trainer`` argument as the script's fallback: ``hookloop run`` options win.

    ``Trainer(max_epochs=hookloop.default(20))`` trains 20 epochs, or as many as
    ``hookloop run --max-epochs N`` says. A plain ``Trainer(max_epochs=20)`` always wins.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"hookloop.default({self.value!r})"


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value: Any, lists: bool = True) -> Any:
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, tuple) and lists:
        return [_thawed(v) for v in value]
    return value


@dataclass(frozen=True)
class Settings:
    """Every setting of a run, resolved, validated and normalised (``fast_dev_run``'s
    limits applied, ``precision``'s aliases named): read-only (lists are tuples, dicts
    read-only mappings). ``settings.max_epochs`` reads one; ``sources[name]`` says where it
    came from (``"argument"``, ``"cli"`` (``hookloop run``), ``"fallback"``
    (``hookloop.default``), ``"environment"`` or ``"default"``). :meth:`trainer_config` is
    the run's working copy, ``trainer.config``, which plugins may narrow during the run (a
    devices plugin sets ``devices``; ``global_batch_size`` sets ``accumulate_grad_batches``
    at ``fit``)."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]
    #: the settings whose value was a list (a tuple here, a list again in trainer_config)
    lists: frozenset[str] = frozenset()

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(f"no setting {name!r}") from None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # a spawning strategy pickles the trainer
        return (_settings, (self.trainer_config(), dict(self.sources)))

    def trainer_config(self) -> TrainerConfig:
        """A new :class:`TrainerConfig` with these values (lists and dicts, copied)."""
        return TrainerConfig(**{k: _thawed(v, k in self.lists) for k, v in self.values.items()})


def _settings(config: TrainerConfig, sources: Mapping[str, str]) -> Settings:
    """The read-only :class:`Settings` of a validated ``config``."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return Settings(values=MappingProxyType({k: _frozen(v) for k, v in values.items()}),
                    sources=MappingProxyType(dict(sources)),
                    lists=frozenset(k for k, v in values.items() if isinstance(v, list)))


@dataclass(frozen=True)
class PluginPlan:
    """The plugins of a run, in the order they are registered, made with their options;
    the options themselves (per plugin); the adapter plugin a compatibility layer made
    (Lightning's Callbacks: ``trainer.callbacks`` lists them in its place); the
    compatibility layers left on; the plugins autoloading added; and the lines that say
    what the environment changed (printed by global rank 0 at the start)."""

    plugins: tuple[Any, ...]
    options: Mapping[str, Mapping[str, Any]]
    adapter: Any = None
    translators: tuple[ArgumentTranslator, ...] = ()
    autoloaded: tuple[str, ...] = ()
    environment_lines: tuple[str, ...] = ()


def resolve_settings(arguments: Mapping[str, Any], environ: Mapping[str, str], *,
                     translators: Sequence[ArgumentTranslator] | None = None,
                     launched: bool | None = None) -> tuple[Settings, PluginPlan]:
    """The settings and the plugin plan of a ``Trainer(**arguments)`` in a process whose
    environment is ``environ``.

    ``arguments``: the arguments given (those left out take the other sources');
    ``translators``: the compatibility layers (default: those registered,
    :func:`hookloop.contract.translators.registered`); ``launched``: whether a hookloop
    launcher started this process (its ``HOOKLOOP_TRAINER_DEFAULTS`` is honoured only then;
    ``None``: found from ``HOOKLOOP_LAUNCHER_PID`` and the process's ancestors). Bad input
    raises :class:`ConfigurationError` naming it."""
    translators = translators_module.registered() if translators is None else tuple(translators)
    unknown = sorted(set(arguments) - CONFIG_FIELDS - set(PLUGIN_ALIASES))
    if unknown:
        raise ConfigurationError(
            f"Trainer got unknown arguments {unknown}: see hookloop.TrainerConfig")
    # None is Lightning's "not given" for these three
    given = {k: v for k, v in arguments.items()
             if not (v is None and k in ("logger", *PLUGIN_ALIASES))}
    # hookloop.default(x): the script's own fallback, which `hookloop run` options override.
    fallbacks = {k: v.value for k, v in given.items()
                 if isinstance(v, default) and k in CONFIG_FIELDS}
    given = {k: v for k, v in given.items() if k not in fallbacks}
    from_env = env_defaults(environ, launched)
    names = {t.name for t in translators}
    env_plugins = plugin_registry.environment_plugins(environ, builtin=names)
    specs = as_list(given.get("plugins")) + as_list(from_env.get("plugins")) + env_plugins
    blocked = {s[3:] for s in specs if isinstance(s, str) and s.startswith("no:")}
    active = tuple(t for t in translators if t.name not in blocked)
    given, adapter, replaced = _translate(given, translators, active, environ)
    in_code = [s for s in as_list(given.get("plugins")) if not (isinstance(s, str) and s in names)]
    if "plugins" in given:
        given["plugins"] = in_code

    settings, sources = _merge(given, fallbacks, from_env, environ)
    config = TrainerConfig(**settings)
    config.validate()
    _check_progress_bars(in_code, config)
    _check_checkpointing(in_code, settings)

    # Plugins from code, `hookloop run --plugins` and HOOKLOOP_PLUGINS are combined; code
    # wins only where both name a plugin of the same exclusive role.
    defaults = [s for s in as_list(from_env.get("plugins")) + env_plugins
                if not (isinstance(s, str) and s in names)]
    options = config.plugin_options
    builtin = [n for n in _builtin_observers(config) if n not in replaced]
    autoloaded: list[str] = []
    chosen = plugin_registry.collect(in_code, defaults, autoload=config.autoload_plugins,
                                     builtin=builtin, options=options, autoloaded=autoloaded)
    if config.max_time is not None:
        chosen += [t for t in [_max_time_timer(config.max_time, chosen)] if t is not None]
    chosen += plugin_registry.default_precision_plugin(chosen, config.precision)
    chosen += plugin_registry.default_launcher(chosen, options)
    chosen = [plugin_registry.apply_options(p, options) for p in chosen]
    plugin_registry.check_option_targets(chosen, options)
    plugin_registry.check_composition(chosen)
    mesh_module.check_sizes(config.mesh, mesh_module.claims(chosen))
    from_environ = {name for name, source in sources.items() if source == "environment"}
    autoload_said = "autoload_plugins" in from_environ and config.autoload_plugins
    said_autoload = autoloaded if autoload_said else None
    mesh = config.mesh if "mesh" in from_environ else None
    lines = environment_settings(chosen, said_autoload, mesh, environ)
    plan = PluginPlan(plugins=tuple(chosen), options=_frozen(options), adapter=adapter,
                      translators=active, autoloaded=tuple(autoloaded),
                      environment_lines=tuple(lines))
    return _settings(config, sources), plan


def _translate(given: dict[str, Any], translators: Sequence[ArgumentTranslator],
               active: Sequence[ArgumentTranslator],
               environ: Mapping[str, str]) -> tuple[dict[str, Any], Any, frozenset[str]]:
    """``given`` with the compatibility arguments translated by the ``active`` layers; an
    argument (or variable) of a blocked layer, or of none, is refused, naming it."""
    for translator in translators:
        if translator in active:
            continue
        where = f"plugins=[..., 'no:{translator.name}']"
        if not any(s == f"no:{translator.name}" for s in as_list(given.get("plugins"))):
            where = f"no:{translator.name} in --plugins / HOOKLOOP_PLUGINS"
        for name, value in given.items():
            if translator.owns(name, value):
                what = f"Trainer({name}=...)"
                raise translators_module.blocked_error(translator.name, what, where)
        for variable in translator.variables:
            if environ.get(variable):
                what = f"the environment variable {variable} (set by `hookloop tune`)"
                raise translators_module.blocked_error(translator.name, what, where)
    adapter: Any = None
    replaced: frozenset[str] = frozenset()
    for translator in active:
        translation = translator.translate(given)
        given = dict(translation.arguments)
        adapter = translation.adapter if translation.adapter is not None else adapter
        replaced |= translation.replaces_builtin
    left = [name for name in PLUGIN_ALIASES if name in given]
    if left:
        raise translators_module.unknown_error(f"Trainer({left[0]}=...)")
    if not active:
        logger = given.get("logger")
        if logger is not None and not isinstance(logger, bool):
            raise translators_module.unknown_error("Trainer(logger=<logger objects>)")
    return given, adapter, replaced


def _merge(given: dict[str, Any], fallbacks: dict[str, Any], from_env: dict[str, Any],
           environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The values of the settings given anywhere, and where each came from."""
    settings = {**fallbacks, **from_env, **given}
    sources = {name: ("argument" if name in given else "cli" if name in from_env
                      else "fallback" if name in fallbacks else "default")
               for name in CONFIG_FIELDS}
    # Options of plugins merge per option: HOOKLOOP_PLUGIN_OPTIONS < hookloop run
    # --plugin-option < code.
    from_environ = plugin_registry.environment_plugin_options(environ)
    settings["plugin_options"] = plugin_registry.merge_plugin_options(
        from_environ, fallbacks.get("plugin_options") or {}, from_env.get("plugin_options") or {},
        given.get("plugin_options") or {})
    if from_environ and sources["plugin_options"] == "default":
        sources["plugin_options"] = "environment"
    settings["plugins"] = as_list(settings.get("plugins"))
    if "autoload_plugins" not in settings:
        settings["autoload_plugins"] = plugin_registry.environment_autoload(environ)
        sources["autoload_plugins"] = "environment"
    # The mesh's sizes: code < hookloop run --mesh < HOOKLOOP_MESH (hookloop.mesh).
    if "mesh" not in settings:
        settings["mesh"] = mesh_module.environment_mesh(environ)
        sources["mesh"] = "environment"
    else:
        settings["mesh"] = mesh_module.parse_mesh(settings["mesh"])
    return settings, sources


def environment_settings(
    plugins: Sequence[Any],
    autoloaded: list[str] | None,
    mesh: Mapping[str, Any] | None,
    environ: Mapping[str, str],
) -> list[str]:
    """The lines that say which settings of a run came from the environment (printed on
    global rank 0 as its first lines): each variable that changes what the run does
    (docs/environment.md, "said at start"), when it is set and used; not the options a
    hookloop launcher hands its workers (``HOOKLOOP_TRAINER_DEFAULTS``: the user's own
    command line or code, which they know, printed again at every restart). Plugins name
    their own in ``hookloop_environment`` (``{variable: what it sets}``)."""
    env = environ
    lines = []
    if env.get(plugin_registry.PLUGINS_ENV, "").strip():
        lines.append(
            f"{plugin_registry.PLUGINS_ENV}={env[plugin_registry.PLUGINS_ENV]!r}: "
            f"plugins added to the run"
        )
    if env.get(plugin_registry.OPTIONS_ENV, "").strip():
        lines.append(
            f"{plugin_registry.OPTIONS_ENV}={env[plugin_registry.OPTIONS_ENV]!r}: plugin options "
            f"(--plugin-option and code win per option)"
        )
    if autoloaded is not None:
        added = ", ".join(autoloaded) or "none"
        lines.append(
            f"{plugin_registry.AUTOLOAD_ENV}={env.get(plugin_registry.AUTOLOAD_ENV)!r}: added the "
            f"installed plugins {added} (block one with no:NAME)"
        )
    if mesh:
        lines.append(
            f"{mesh_module.MESH_ENV}={env.get(mesh_module.MESH_ENV)!r}: the device mesh's sizes"
        )
    if env.get(rundir.RUN_ID_ENV):
        lines.append(
            f"{rundir.RUN_ID_ENV}={env[rundir.RUN_ID_ENV]!r}: this job's id (its runs take the run "
            f"directories an earlier job of that id marked)"
        )
    for plugin in plugins:
        for name, meaning in (getattr(plugin, "hookloop_environment", None) or {}).items():
            if env.get(name):
                who = plugin_registry.plugin_name(plugin)
                lines.append(f"{name}={env[name]!r}: {meaning} ({who})")
    return [f"hookloop: from the environment: {line}" for line in lines]


def _max_time_timer(max_time: Any, chosen: list) -> Any:
    """``Trainer(max_time=...)``: Lightning's ``Timer(duration=max_time, interval="step")``,
    added after the other plugins; None beside a Timer the user gave, which then says at
    setup that ``max_time`` was ignored (Lightning's info line)."""
    from hookloop.observers.timer import Timer, parse_duration

    parse_duration(max_time, "Trainer(max_time=...)")
    given = [p for p in chosen if isinstance(p, Timer) or plugin_registry.plugin_name(p) == "timer"]
    if given:
        if isinstance(given[0], Timer):
            given[0]._max_time_ignored = True
        return None
    return Timer(duration=max_time, interval="step")


def _builtin_observers(config: TrainerConfig) -> list[str]:
    """The observers every run gets unless blocked (``no:NAME``) or turned off, as pytest
    ships its terminal reporter: the progress bar, the model summary, the CSV logger, the
    checkpoints."""
    switches = (("progress", config.enable_progress_bar),
                ("model_summary", config.enable_model_summary),
                ("csv", config.logger), ("checkpoint", config.enable_checkpointing))
    return [name for name, on in switches if on]


def _check_checkpointing(in_code: list, settings: dict[str, Any]) -> None:
    """Lightning's rule: no checkpoint callback with ``enable_checkpointing=False`` (as
    given: ``fast_dev_run`` turns checkpointing off without refusing one)."""
    found = [p for p in in_code
             if not isinstance(p, str) and plugin_registry.plugin_name(p) == "checkpoint"]
    if found and settings.get("enable_checkpointing", True) is False:
        raise ConfigurationError(
            f"Trainer was configured with `enable_checkpointing=False` but found `ModelCheckpoint` "
            f"in callbacks list ({type(found[0]).__name__}): remove it, or leave "
            f"enable_checkpointing at True")


def _check_progress_bars(in_code: list, config: TrainerConfig) -> None:
    """Lightning's rule: one progress bar, and none with ``enable_progress_bar=False``."""
    bars = [p for p in in_code
            if not isinstance(p, str) and plugin_registry.plugin_name(p) == "progress"]
    if len(bars) > 1:
        raise ConfigurationError(
            f"callbacks hold {len(bars)} progress bars "
            f"({', '.join(type(b).__name__ for b in bars)}), and a run draws one: keep one of them")
    if bars and not config.enable_progress_bar:
        raise ConfigurationError(
            f"Trainer was configured with `enable_progress_bar=False` but found "
            f"`{type(bars[0]).__name__}` in callbacks list: remove the bar, or leave "
            f"enable_progress_bar at True")


