"""Finding, loading and checking plugins.

Plugins are found through the entry-point group ``hookloop.plugins`` without importing
them; only the plugins a run names are imported (or all of them with autoload, as
pytest does). Each plugin may declare:

``hookloop_name``
    the name it is known by (default: the entry-point name, or the class name).
``hookloop_role``
    one of :data:`ROLES`. ``strategy``, ``precision``, ``devices`` and ``launcher`` are
    exclusive: at most one plugin of each may run (mesh strategies excepted, below).
    ``observer`` and ``extension`` plugins compose freely.
``hookloop_launcher``
    a strategy's launcher when the run names none (contract 2.6): a launcher's name
    (``"spawn"``, ``"horovodrun"``) or a launcher object the strategy configured
    (``ddp_spawn``'s ``spawn`` with its ``start_method``). Without it, and without a
    launcher in the run, the workers start through ``torchrun`` (the built-in default).
``hookloop_owns``
    a set of concerns a strategy takes over from other plugins, e.g. ``{"precision"}``
    for DeepSpeed: a precision plugin then hands its setting to the strategy instead of
    applying it itself.
``hookloop_mesh_dims``
    the device-mesh dimensions a parallelism plugin uses (``("dp_shard",)``, ``("tp",)``;
    :mod:`hookloop.mesh`). Mesh plugins compose: any number of them share a run, one
    owner per dimension. ``hookloop_composes = False``: a strategy that owns the model
    and optimizer lifecycle alone (deepspeed, horovod, dp; the default for a strategy
    without mesh dimensions).
``hookloop_build_status``
    optional, callable without arguments (a ``staticmethod``): ``None`` when the backend is
    ready, else what is not built and the command that builds it. ``hookloop plugins``
    shows it as ``not built: <message>``; it must not import the backend.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.metadata as md
import inspect
import os
import re
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pluggy

from hookloop.contract import hookspecs, pluginspec, sourcescan, versioning
from hookloop.contract.errors import (
    ConfigurationError,
    MissingDependencyError,
    PluginConflictError,
    PluginNotFoundError,
    PluginValidationError,
)
from hookloop.contract.pluginspec import _declared_name, plugin_name
from hookloop.distributed import mesh as mesh_module

ENTRY_POINT_GROUP = "hookloop.plugins"
COMMAND_GROUP = "hookloop.commands"
ROLES = ("strategy", "precision", "devices", "launcher", "observer", "extension")
EXCLUSIVE_ROLES = ("strategy", "precision", "devices", "launcher")
#: the attribute a strategy names its launcher with (:func:`default_launcher`)
LAUNCHER_ATTRIBUTE = "hookloop_launcher"
#: The plugin enabled when ``precision`` is not "32" and no enabled plugin handles it
#: (neither a precision plugin nor a strategy that owns precision), as Lightning users
#: expect ``Trainer(precision="bf16-mixed")`` alone to work. hookloop-amp registers it.
DEFAULT_PRECISION_PLUGIN = "amp"


# ---------------------------------------------------------------------------------------
# Discovery (no imports of plugin code)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PluginInfo:
    """An installed plugin as its distribution's metadata describes it."""

    name: str
    value: str
    distribution: str | None
    version: str | None
    requires: tuple[str, ...]

    def missing_requirements(self) -> list[str]:
        """Requirements of the plugin's distribution that are not installed."""
        return [req for req in self.requires if not _is_installed(req)]

    def build_status(self) -> str | None:
        """The plugin's ``hookloop_build_status()``: ``None`` when ready (or when it has
        none). Imports the plugin only when its source declares one."""
        if not sourcescan.declares(self.value, BUILD_STATUS):
            return None
        try:
            plugin = _load_entry_point(self)
        except (MissingDependencyError, PluginValidationError):
            return None  # shown as missing requirements / by `hookloop check` instead
        return build_status(plugin, self.name)


BUILD_STATUS = "hookloop_build_status"


def build_status(plugin: Any, name: str | None = None) -> str | None:
    """What a plugin object says is not built yet, or ``None`` (see the module docstring)."""
    check = getattr(plugin, BUILD_STATUS, None)
    if not callable(check):
        return None
    try:
        status = check()
    except Exception as exc:  # a broken check must not break the listing
        return (f"unknown ({name or plugin_name(plugin)}.{BUILD_STATUS}() raised "
                f"{type(exc).__name__}: {exc})")
    return None if status is None else str(status)


_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _requirement_names(requires: Iterable[str] | None) -> tuple[str, ...]:
    names = []
    for req in requires or ():
        if "extra ==" in req or "extra==" in req:
            continue
        m = _REQ_NAME.match(req)
        if m:
            names.append(m.group(1))
    return tuple(names)


def _is_installed(requirement: str) -> bool:
    try:
        md.distribution(requirement)
        return True
    except md.PackageNotFoundError:
        return False


#: While :func:`one_scan` is active: what the installed distributions' metadata said.
_scan: dict | None = None


@contextlib.contextmanager
def one_scan() -> Iterator[None]:
    """Within it, the installed distributions' metadata is read once: :func:`installed_plugins`
    and :func:`packages_distributions` answer from the first reading. For a command that
    checks every plugin (``hookloop plugins --load``, ``hookloop check``): without it each
    plugin's check reads every distribution's metadata again (43,633 parses, 12 s, for the
    41 plugins of this repository; 1 s with it). Nothing is installed meanwhile."""
    global _scan
    outer = _scan
    if outer is None:
        _scan = {}
    try:
        yield
    finally:
        if outer is None:
            _scan = None


def packages_distributions() -> Mapping[str, list[str]]:
    """``importlib.metadata.packages_distributions()``, read once within :func:`one_scan`."""
    if _scan is None:
        return md.packages_distributions()
    if "packages" not in _scan:
        _scan["packages"] = md.packages_distributions()
    return _scan["packages"]


def installed_plugins() -> dict[str, PluginInfo]:
    """Every plugin registered under ``hookloop.plugins``, by name; imports nothing."""
    if _scan is not None:
        if "plugins" not in _scan:
            _scan["plugins"] = _read_installed_plugins()
        return dict(_scan["plugins"])
    return _read_installed_plugins()


def _read_installed_plugins() -> dict[str, PluginInfo]:
    found: dict[str, PluginInfo] = {}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        requires = _requirement_names(dist.requires) if dist is not None else ()
        found.setdefault(
            ep.name,
            PluginInfo(
                name=ep.name,
                value=ep.value,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
                requires=tuple(r for r in requires if r not in ("hookloop",)),
            ),
        )
    return found


def installed_commands() -> dict[str, md.EntryPoint]:
    """CLI sub-commands that plugin distributions add (group ``hookloop.commands``)."""
    return {ep.name: ep for ep in md.entry_points(group=COMMAND_GROUP)}


def _load_entry_point(info: PluginInfo) -> Any:
    (ep,) = [e for e in md.entry_points(group=ENTRY_POINT_GROUP) if e.name == info.name][:1]
    try:
        obj = ep.load()
    except MissingDependencyError:
        raise
    except ImportError as exc:
        missing = info.missing_requirements()
        dist = info.distribution or "its distribution"
        if missing:
            raise MissingDependencyError(
                f"plugin {info.name!r} ({dist}) needs {', '.join(missing)}, which "
                f"{'is' if len(missing) == 1 else 'are'} not installed: "
                f"pip install {' '.join(missing)}"
            ) from exc
        raise MissingDependencyError(
            f"plugin {info.name!r} ({dist}) could not be imported: {exc}. "
            f"Reinstall it (pip install --force-reinstall {dist}) or install what it "
            f"imports."
        ) from exc
    versioning.check_loaded(obj, info.name, info.distribution)  # its hookloop_requires
    return obj


def unknown_plugin_error(name: str, installed: Iterable[str]) -> PluginNotFoundError:
    names = sorted(installed)
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    msg = f"no plugin named {name!r} is installed."
    if close:
        msg += f" Did you mean {' or '.join(repr(c) for c in close)}?"
    msg += f" Installed plugins: {', '.join(names) if names else 'none'}."
    msg += (
        f" Install one that registers {name!r} under the entry-point group "
        f"{ENTRY_POINT_GROUP!r} (hookloop's own are named hookloop-<name>), or list them "
        f"with `hookloop plugins`."
    )
    return PluginNotFoundError(msg)


def resolve(name: str, **options: Any) -> Any:
    """Load the installed plugin ``name`` and return a ready-to-register plugin object.

    A class is instantiated with ``options``; a module or an instance is returned as is
    (passing options to those is an error). This is ``hookloop.plugin``.
    """
    infos = installed_plugins()
    if name not in infos:
        raise unknown_plugin_error(name, infos)
    obj = _load_entry_point(infos[name])
    return _instantiate(obj, name, options)


def _instantiate(obj: Any, name: str | None, options: dict) -> Any:
    """A plugin object from ``obj`` (a class is constructed with ``options``, each checked
    to be a constructor parameter unless ``__init__`` takes ``**kwargs``; the arguments are
    recorded so that :func:`apply_options` can construct it again with more). ``name``
    (the entry-point name) becomes the plugin's name unless its class declares one itself:
    a subclass of ``ddp`` installed as ``localsgd`` is ``localsgd``, not ``ddp``."""
    plugin: Any
    if inspect.isclass(obj):
        label = name or _declared_name(obj) or obj.__name__
        _check_option_names(obj, label, options)
        plugin = obj(**options)
        _record_init_args(plugin, options)
    else:
        if options:
            raise ConfigurationError(
                f"plugin {name!r} is not a class (it is {type(obj).__name__} {obj!r}) and takes no "
                f"options; drop {', '.join(sorted(options))} or register a class"
            )
        plugin = obj
    own_name = inspect.isclass(obj) and "hookloop_name" in _own_attributes(obj)
    if name and (not _declared_name(plugin) or (inspect.isclass(obj) and not own_name)):
        try:
            plugin.hookloop_name = name
        except (AttributeError, TypeError):
            pass
    return plugin


def _own_attributes(cls: type) -> set[str]:
    """Names a class declares in its own body (not inherited from a base plugin)."""
    return set(vars(cls))


#: The attribute where :func:`_instantiate` records the constructor arguments it used.
INIT_ARGS = "_hookloop_init_args"


def _record_init_args(plugin: Any, args: dict) -> None:
    try:
        object.__setattr__(plugin, INIT_ARGS, dict(args))
    except (AttributeError, TypeError):  # __slots__ without room: cannot be rebuilt later
        pass


def _recorded_init_args(plugin: Any) -> dict | None:
    """The constructor arguments a plugin object was built with, when known: recorded by
    hookloop (``hookloop.plugin(...)``, a name in ``plugins=``), or kept by the object
    itself in ``_init_args`` (the loggers,
    :class:`hookloop.lightning.loggers.ConstructorOptions`)."""
    args = vars(plugin).get(INIT_ARGS) if hasattr(plugin, "__dict__") else None
    if args is None:
        args = getattr(plugin, "_init_args", None)
    return dict(args) if isinstance(args, dict) else None


def _check_option_names(cls: type, name: str, options: dict) -> None:
    """Every option must be a parameter of ``cls.__init__`` (unless it takes ``**kwargs``)."""
    if _takes_any_keyword(cls):
        return
    known = plugin_options(cls)
    for key in options:
        if key not in known:
            raise _unknown_option_error(name, key, known, cls)


def plugin_role(plugin: Any) -> str:
    role = getattr(plugin, "hookloop_role", "extension")
    if role not in ROLES:
        raise PluginValidationError(
            f"plugin {plugin_name(plugin)!r} declares hookloop_role={role!r}; "
            f"it must be one of {', '.join(ROLES)}"
        )
    return role


def plugin_options(plugin: Any) -> list[str]:
    """A plugin's options: the parameters of its class's ``__init__``."""
    cls: type[Any] = plugin if isinstance(plugin, type) else type(plugin)
    if isinstance(plugin, types.ModuleType):
        return []
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return []
    return [n for n, p in params.items()
            if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def apply_options(plugin: Any, options: dict[str, dict]) -> Any:
    """Give ``options[plugin's name]`` (``plugin_options=``, ``--plugin-option``,
    ``HOOKLOOP_PLUGIN_OPTIONS``) to the plugin's constructor.

    Options construct the plugin, so its ``__init__`` validates them: each must be a
    constructor parameter (unless ``__init__`` takes ``**kwargs``), else the error names
    the real ones. A plugin hookloop built (from a name or a class) already got them; an
    object built with known arguments (``hookloop.plugin(...)``, a logger) is constructed
    again, in place, with its arguments and the options merged (the options win); an
    object whose constructor arguments are unknown (``DDP(...)`` written in code) cannot
    be, and is refused with the way to pass the option instead.
    """
    name = plugin_name(plugin)
    given = options.get(name)
    if not given or isinstance(plugin, type):
        return plugin
    if isinstance(plugin, types.ModuleType):
        raise ConfigurationError(
            f"plugin {name!r} is a module and takes no options, but options are given for it "
            f"({', '.join(sorted(given))}): drop them from plugin_options= / --plugin-option / "
            f"{OPTIONS_ENV}"
        )
    cls: type[Any] = type(plugin)
    _check_option_names(cls, name, given)
    recorded = _recorded_init_args(plugin)
    if recorded is not None and all(k in recorded and _same(recorded[k], v)
                                    for k, v in given.items()):
        return plugin  # constructed with these options already
    if recorded is None:
        set_option = getattr(plugin, "hookloop_set_option", None)
        if callable(set_option):  # an object that rebuilds itself per option
            for key, value in given.items():
                set_option(key, value)
            return plugin
        key = next(iter(given))
        raise ConfigurationError(
            f"option {name}.{key}={given[key]!r} (from plugin_options= / --plugin-option / "
            f"{OPTIONS_ENV}) cannot be given to plugin {name!r}: it was built in code as "
            f"{cls.__qualname__}(...) and hookloop does not know its constructor arguments, so it "
            f"cannot construct it again with the option (options are constructor arguments, "
            f"checked by __init__). Pass {key}=... to {cls.__qualname__}(...) in code, build it "
            f"with hookloop.plugin({name!r}, ...), or name it (plugins=[{name!r}])"
        )
    keep = {k: v for k, v in vars(plugin).items() if k == "hookloop_name"}
    merged = {**recorded, **given}
    cls.__init__(plugin, **merged)  # the constructor's own validation runs
    _record_init_args(plugin, merged)
    for k, v in keep.items():
        object.__setattr__(plugin, k, v)
    return plugin


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:
        return False


def check_option_targets(plugins: Iterable[Any], options: dict[str, dict]) -> None:
    """Refuse options addressed to a plugin name that is neither in the run nor installed:
    a misspelt name would leave its options silently unused. Options for an installed
    plugin the run does not use are allowed (a script may set ddp's options for the runs
    that ``hookloop run --plugins ddp`` makes, and run alone otherwise)."""
    enabled = {plugin_name(p) for p in plugins}
    unknown = [name for name in options if name not in enabled]
    if not unknown:
        return
    installed = installed_plugins()
    unknown = [name for name in unknown if name not in installed]
    if not unknown:
        return
    name, known = unknown[0], sorted(enabled | set(installed))
    close = difflib.get_close_matches(name, known, n=1)
    raise ConfigurationError(
        f"options are given for plugin {name!r} ({', '.join(sorted(options[name])) or 'none'}), "
        f"but no plugin of that name is installed or in the run"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f"; plugins: {', '.join(known)}. Fix the name in plugin_options=, --plugin-option or "
        f"HOOKLOOP_PLUGIN_OPTIONS"
    )


def _unknown_option_error(name: str, key: str, known: list[str],
                          cls: type | None = None) -> ConfigurationError:
    """``key`` is not a constructor parameter of plugin ``name`` (whose are ``known``);
    where a base class's constructor takes it (ddp's ``comm_hook`` under fsdp), says so."""
    close = [c for c in difflib.get_close_matches(key, known, n=2) if c != key][:1]
    base = next((b for b in (cls.__mro__[1:] if cls is not None else ()) if b is not object
                 and key in plugin_options(b)), None)
    return ConfigurationError(
        f"plugin {name!r} has no option {key!r}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + (f" (an option of its base class {base.__name__} that {cls.__name__}'s constructor "
           f"does not take)" if base is not None and cls is not None else "")
        + f"; its options: {', '.join(known) or 'none'}"
    )


def _takes_any_keyword(cls: type[Any]) -> bool:
    """Whether ``cls(**options)`` accepts names outside :func:`plugin_options` (``**kwargs``),
    or its signature cannot be read (then the class checks for itself)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_KEYWORD for p in params.values())


def plugin_owns(plugin: Any) -> frozenset[str]:
    return frozenset(getattr(plugin, "hookloop_owns", ()))


# ---------------------------------------------------------------------------------------
# Choosing the plugins of a run
# ---------------------------------------------------------------------------------------


def split_names(spec: str | None) -> list[str]:
    """``"ddp, amp"`` -> ``["ddp", "amp"]``."""
    return [s.strip() for s in (spec or "").split(",") if s.strip()]


def collect(requested: Iterable[Any], defaults: Iterable[Any] = (), autoload: bool = False,
            builtin: Iterable[str] = (), options: dict[str, dict] | None = None,
            autoloaded: list[str] | None = None) -> list[Any]:
    """Turn the user's plugin specs into plugin objects, in a stable order.

    ``requested`` come from code (``Trainer(plugins=...)``), ``defaults`` from the CLI
    (``--plugins``) and ``HOOKLOOP_PLUGINS``. Both are used; where a default plugin
    has the same exclusive role as a requested one, the requested one wins. With
    ``autoload`` every installed plugin that is not a strategy and claims no mesh
    dimension is loaded too (strategies exclude each other and a mesh dimension is a layout
    the user sizes, so they are always chosen by name), except those that declare
    ``hookloop_autoload = False`` (they need options to mean anything); ``no:NAME``
    blocks one. A strategy is recognised by its class (``hookloop_role``) before it is
    made: one that needs what is not installed (``ddp2`` without hookloop-dp) is not
    constructed. The names of the plugins autoloading added go to ``autoloaded``.
    Built-ins that :data:`BUILTINS` marks ``autoload=False`` are never autoloaded (the
    default ones come by their switch: ``enable_progress_bar=False`` keeps the bar off).
    ``builtin`` names the core's own observers on by default (:data:`BUILTINS`): added last,
    unless blocked or already given (a user's ``ModelCheckpoint(...)`` replaces the
    default one). A plugin this makes from a class is made with its ``options``
    (``options[name]``), so the class checks them as it would in code.
    """
    options = options or {}

    def make(cls: Any, name: str | None) -> Any:
        if not inspect.isclass(cls):
            return _instantiate(cls, name, {})
        given = options.get(name or getattr(cls, "hookloop_name", None) or cls.__name__, {})
        return _instantiate(cls, name, dict(given))  # options construct the plugin

    requested = list(requested)
    defaults = list(defaults)
    blocked = {s[3:] for s in requested + defaults if isinstance(s, str) and s.startswith("no:")}
    requested = [s for s in requested if not (isinstance(s, str) and s.startswith("no:"))]
    defaults = [s for s in defaults if not (isinstance(s, str) and s.startswith("no:"))]

    infos = None
    chosen: list[Any] = []
    names_seen: set[str] = set()

    def load(spec: Any) -> Any:
        nonlocal infos
        if isinstance(spec, str):
            if infos is None:
                infos = installed_plugins()
            if spec not in infos:
                raise unknown_plugin_error(spec, infos)
            return make(_load_entry_point(infos[spec]), spec)
        return make(spec, None) if inspect.isclass(spec) else spec

    code_plugins = [load(s) for s in requested if not (isinstance(s, str) and s in blocked)]
    code_by_role: dict[str, list[str]] = {}
    for p in code_plugins:
        code_by_role.setdefault(plugin_role(p), []).append(plugin_name(p))
    default_plugins = []
    for spec in defaults:
        if isinstance(spec, str) and spec in blocked:
            continue
        p = load(spec)
        role, name = plugin_role(p), plugin_name(p)
        if role in EXCLUSIVE_ROLES and role in code_by_role and name not in code_by_role[role]:
            same_role = [c for c in code_plugins if plugin_role(c) == role]
            if role == "strategy" and _composes_beside(p, same_role):
                default_plugins.append(p)  # mesh plugins on other dimensions: both run
                continue
            # Explicit arguments in code win over CLI / environment defaults.
            _say_once(
                f"hookloop: the {role} {', '.join(map(repr, code_by_role[role]))} named in code "
                f"replaces {name!r} from --plugins / HOOKLOOP_PLUGINS (a run has one {role})"
            )
            continue
        default_plugins.append(p)
    for p in code_plugins + default_plugins:
        n = plugin_name(p)
        if n in names_seen:
            continue
        names_seen.add(n)
        chosen.append(p)

    for name in builtin:
        if name in names_seen or name in blocked:
            continue
        names_seen.add(name)
        chosen.append(make(BUILTINS[name].load(), name))

    if autoload:
        if infos is None:
            infos = installed_plugins()
        for name in sorted(infos):
            if name in names_seen or name in blocked:
                continue
            if name in BUILTINS and not BUILTINS[name].autoload:
                continue  # a default one's switch decides (enable_progress_bar=False stays off)
            obj = _load_entry_point(infos[name])
            if getattr(obj, "hookloop_autoload", True) is False:
                continue  # only useful configured (early_stopping: which metric): by name only
            if (getattr(obj, "hookloop_role", None) in ("strategy", "launcher")
                    or bool(getattr(obj, "hookloop_mesh_dims", ()))):
                continue  # known from the class: not even constructed
            p = make(obj, name)
            if (plugin_role(p) in ("strategy", "launcher")
                    or bool(getattr(p, "hookloop_mesh_dims", ()))):
                continue  # a strategy, a launcher or a mesh dimension: the user chooses them
            names_seen.add(name)
            chosen.append(p)
            if autoloaded is not None:
                autoloaded.append(name)
    return chosen


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """Print ``message`` once per process (a script may build many Trainers)."""
    if message not in _SAID:
        _SAID.add(message)
        print(message, flush=True)


@dataclass(frozen=True)
class Builtin:
    """A plugin of the core's own (``hookloop.observers``), as :data:`BUILTINS` lists it."""

    #: ``"module:Class"``: what its entry point in pyproject.toml says, word for word
    target: str
    #: a run gets it without asking (``no:NAME`` or the switch turns it off); else it is
    #: enabled by name or passed as an object
    on_by_default: bool
    #: the ``Trainer`` argument that turns a default one off (``None``: opt-in)
    switch: str | None
    #: whether ``HOOKLOOP_AUTOLOAD_PLUGINS`` adds it: never a default one (its switch
    #: decides), nor the timer (it needs a duration, ``Trainer(max_time=...)``)
    autoload: bool

    def load(self) -> type:
        """The plugin's class (imports its module)."""
        module, _, attribute = self.target.partition(":")
        cls: type = getattr(importlib.import_module(module), attribute)
        return cls


#: The one list of the core's built-in plugins, by name. pyproject.toml registers each as
#: an entry point of the core distribution (so ``hookloop plugins`` lists it and it can
#: be named), tests/test_hookspec_types.py checks the two agree, and a run gets the ones
#: on by default through the Trainer's switches, in this order.
BUILTINS: dict[str, Builtin] = {
    "progress": Builtin("hookloop.observers.progress:ProgressBar", True,
                        "enable_progress_bar", autoload=False),
    "model_summary": Builtin("hookloop.observers.model_summary:ModelSummary", True,
                             "enable_model_summary", autoload=False),
    "csv": Builtin("hookloop.observers.csvlog:CSVLogger", True, "logger", autoload=False),
    "checkpoint": Builtin("hookloop.observers.checkpoint:ModelCheckpoint", True,
                          "enable_checkpointing", autoload=False),
    "early_stopping": Builtin("hookloop.observers.early_stopping:EarlyStopping", False, None,
                              autoload=True),  # the class opts out: hookloop_autoload = False
    "lr_monitor": Builtin("hookloop.observers.lr_monitor:LearningRateMonitor", False, None,
                          autoload=True),
    "nan_guard": Builtin("hookloop.observers.nan_guard:NanGuard", False, None, autoload=True),
    "ledger": Builtin("hookloop.observers.ledger:Ledger", False, None, autoload=True),
    "timer": Builtin("hookloop.observers.timer:Timer", False, None, autoload=False),
    "torchrun": Builtin("hookloop.distributed.launchers:Torchrun", False, None, autoload=False),
    "spawn": Builtin("hookloop.distributed.launchers:Spawn", False, None, autoload=False),
    "in_process": Builtin("hookloop.distributed.launchers:InProcess", False, None, autoload=False),
}

#: The built-ins a run gets by default (read by ``collect``'s ``builtin`` names).
BUILTIN_OBSERVERS = {name: b.load for name, b in BUILTINS.items() if b.on_by_default}


def default_launcher(chosen: list[Any],
                     options: Mapping[str, Mapping[str, Any]] | None = None) -> list[Any]:
    """The launcher to add to ``chosen``: ``[]`` when ``chosen`` has one (the user's wins
    over the strategy's) or no strategy names one (``torchrun``, the built-in default,
    then answers); else the one the strategies name (``hookloop_launcher``: a name,
    loaded with its ``options``, or an object). Strategies that compose (mesh plugins)
    and name different launchers are refused, naming both."""
    if any(plugin_role(p) == "launcher" for p in chosen):
        return []
    named: dict[str, tuple[Any, str]] = {}
    for p in chosen:
        if plugin_role(p) != "strategy":
            continue
        spec = getattr(p, LAUNCHER_ATTRIBUTE, None)
        if spec is None:
            continue
        key = spec if isinstance(spec, str) else plugin_name(spec)
        named.setdefault(key, (spec, plugin_name(p)))
    if not named:
        return []
    if len(named) > 1:
        which = ", ".join(f"{owner!r} names {key!r}" for key, (_, owner) in named.items())
        raise PluginConflictError(
            f"the strategies of this run name different launchers ({which}), and a run has one "
            f"launcher: name the one to use in plugins=[...] / --plugins (e.g. --plugins "
            f"{', '.join(named)})")
    spec, owner = next(iter(named.values()))
    if not isinstance(spec, str):
        launcher = spec
    else:
        launcher = collect([spec], options={k: dict(v) for k, v in (options or {}).items()})[0]
    if plugin_role(launcher) != "launcher":
        raise PluginValidationError(
            f"strategy {owner!r} names {plugin_name(launcher)!r} as its launcher "
            f"({LAUNCHER_ATTRIBUTE}), but that plugin's role is {plugin_role(launcher)!r}, not "
            f"'launcher': name a launcher (torchrun, spawn, in_process, or an installed launcher "
            f"plugin; `hookloop plugins` lists them with their roles)")
    return [launcher]


def default_precision_plugin(chosen: list[Any], precision: str) -> list[Any]:
    """The precision plugin to add to ``chosen`` so that ``precision`` is applied.

    ``[]`` for ``"32"``, or when a precision plugin or a strategy that owns precision is
    already chosen; else the installed plugin named :data:`DEFAULT_PRECISION_PLUGIN`. A
    precision setting is never dropped silently: without such a plugin this is an error.
    """
    if precision == "32":
        return []
    for p in chosen:
        role = plugin_role(p)
        if role == "precision" or (role == "strategy" and "precision" in plugin_owns(p)):
            return []
    infos = installed_plugins()
    name = DEFAULT_PRECISION_PLUGIN
    if name not in infos:
        raise MissingDependencyError(
            f"precision={precision!r} needs a precision plugin, and none is enabled; the "
            f"default one, {name!r}, is not installed: pip install hookloop-{name} "
            f"(or enable another precision plugin in plugins=[...] / --plugins, or use "
            f"precision='32')"
        )
    return [_instantiate(_load_entry_point(infos[name]), name, {})]


def composes(plugin: Any) -> bool:
    """Whether a strategy shares the run with others on the device mesh: a mesh plugin
    (it declares ``hookloop_mesh_dims``) unless it says ``hookloop_composes = False``.
    A strategy that declares no mesh dimension (deepspeed, horovod, dp, a third party's
    from before issue 21) owns the model/optimizer lifecycle alone."""
    return mesh_module.mesh_dims(plugin) is not None


def _composes_beside(plugin: Any, others: list[Any]) -> bool:
    """Whether mesh plugin ``plugin`` (from --plugins / HOOKLOOP_PLUGINS) runs beside the
    strategies named in code: all compose, no dimension is claimed twice, at most one
    data-parallel wrapper."""
    if not composes(plugin) or not all(composes(o) for o in others):
        return False
    try:
        mesh_module.claims([*others, plugin])
        mesh_module.check_layout([*others, plugin])
    except PluginConflictError:
        return False
    return True


def check_composition(plugins: list[Any]) -> None:
    """Refuse impossible combinations up front, naming the plugins: two precision or
    devices plugins; two strategies that cannot compose (one owner of the model/optimizer
    lifecycle), or one beside a mesh plugin that claims a dimension; two mesh plugins
    claiming one dimension, or a layout the backends cannot run (two data-parallel
    wrappers). Any number of mesh plugins compose (docs/configurations.md)."""
    by_role: dict[str, list[str]] = {}
    for p in plugins:
        by_role.setdefault(plugin_role(p), []).append(plugin_name(p))
    owners = [p for p in plugins if plugin_role(p) == "strategy" and not composes(p)]
    for role in EXCLUSIVE_ROLES:
        names = by_role.get(role, [])
        if role == "strategy" and not owners:
            continue  # mesh plugins only: they compose (the claims are checked below)
        if len(names) > 1:
            why = ""
            if role == "strategy":
                why = (f" ({plugin_name(owners[0])!r} owns the model and optimizer lifecycle "
                       f"alone; only mesh plugins compose, docs/configurations.md)")
            raise PluginConflictError(
                f"plugins {', '.join(repr(n) for n in names)} are all {role} plugins, and "
                f"a run can use only one {role}{why}: keep one of them in plugins=[...] / "
                f"--plugins / HOOKLOOP_PLUGINS."
            )
    meshed = [p for p in plugins if mesh_module.mesh_dims(p)]
    if owners and meshed:
        owner, other = plugin_name(owners[0]), plugin_name(meshed[0])
        dims = ", ".join(mesh_module.mesh_dims(meshed[0]) or ())
        raise PluginConflictError(
            f"plugins {owner!r} and {other!r} cannot run together: {owner!r} owns the model and "
            f"optimizer lifecycle alone (it does not compose on a device mesh), and {other!r} "
            f"claims the mesh dimension(s) {dims}. Keep "
            f"one of them (docs/configurations.md lists the layouts that compose)."
        )
    mesh_module.claims(plugins)
    mesh_module.check_layout(plugins)


# ---------------------------------------------------------------------------------------
# The plugin manager
# ---------------------------------------------------------------------------------------


class HookloopPluginManager(pluggy.PluginManager):
    """pluggy's manager, where an undecorated override of an inherited hook
    implementation stays one (see :func:`hookloop.contract.checks.hookimpl_options`)."""

    def parse_hookimpl_opts(self, plugin: Any, name: str):
        return pluginspec.hookimpl_options(plugin, name)


def make_plugin_manager(plugins: list[Any], defaults_plugin: Any) -> pluggy.PluginManager:
    """A pluggy manager with the hook specs, the built-in defaults and ``plugins``.

    The defaults plugin is registered first so that pluggy calls it last: any plugin's
    ``firstresult`` implementation wins over it. A plugin that does not fit the
    contract (a hook that does not exist, an argument a hook does not have) is refused
    with every problem named.
    """
    pm = HookloopPluginManager("hookloop")
    pm.add_hookspecs(hookspecs)
    pm.register(defaults_plugin, name="hookloop.defaults")
    # Mesh plugins in transform order (hookloop.mesh.registration_order): pluggy calls
    # their wrap_model pipeline split, tp-like, compile, data-parallel wrapping. The
    # launcher last: pluggy calls it first, so its launch_command/spawn answer before a
    # strategy's (one written for contract 2.5 that still implements them).
    ordered = mesh_module.registration_order(plugins)
    ordered = ([p for p in ordered if plugin_role(p) != "launcher"]
               + [p for p in ordered if plugin_role(p) == "launcher"])
    for p in ordered:
        name = plugin_name(p)
        versioning.check_range(p, name)  # a plugin given in code: its declared contract range
        problems = pluginspec.hook_problems(p, name)
        if problems:
            raise PluginValidationError(
                f"plugin {name!r} does not fit the hook contract (core/hookloop/hookspecs.py):\n  "
                + "\n  ".join(str(problem) for problem in problems)
            )
        try:
            pm.register(p, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginValidationError(
                f"plugin {name!r} does not match the hook contract: {exc}. "
                f"See `hookloop.contract.hookspecs` for each hook's arguments."
            ) from None
        except ValueError as exc:  # already registered
            raise PluginConflictError(f"plugin {name!r} is enabled twice: {exc}") from None
    _check_transform_order(pm)
    return pm


def _check_transform_order(pm: pluggy.PluginManager) -> None:
    """The mesh plugins' ``wrap_model`` must run in
    :data:`hookloop.distributed.mesh.TRANSFORM_STAGES` order; a ``tryfirst``/``trylast`` that
    reorders them is refused naming both."""
    called = [(stage, impl.plugin_name)
              for impl in reversed(pm.hook.wrap_model.get_hookimpls())
              if not (impl.hookwrapper or impl.wrapper)
              and (stage := mesh_module.transform_stage(impl.plugin)) is not None]
    for (a, first), (b, then) in zip(called, called[1:], strict=False):  # each and the next
        if a > b:
            stages = mesh_module.TRANSFORM_STAGES
            raise PluginConflictError(
                f"plugin {first!r}'s wrap_model ({stages[a]}) would run before {then!r}'s "
                f"({stages[b]}): "
                f"the model transforms run {', '.join(stages)} (docs/plugin-authors.md, \"Adding a "
                f"mesh dimension\"); take tryfirst/trylast off their wrap_model, or mark every "
                f"transform alike.")


OPTIONS_ENV = "HOOKLOOP_PLUGIN_OPTIONS"


def parse_plugin_options(items: Iterable[str], source: str = "--plugin-option") -> dict[str, dict]:
    """``["amp.init_scale=1024", "ddp.find_unused_parameters=true"]`` ->
    ``{"amp": {"init_scale": 1024}, "ddp": {"find_unused_parameters": True}}``.

    Values are read as JSON (``1024``, ``true``, ``[1, 2]``, ``"text"``), else as Python
    literals (``True``, ``None``), else kept as the string.
    """
    import ast
    import json

    options: dict[str, dict] = {}
    for item in items:
        name_key, sep, raw = item.partition("=")
        plugin, dot, key = name_key.strip().partition(".")
        if not sep or not dot or not plugin or not key:
            raise ConfigurationError(
                f"{source} {item!r} must be PLUGIN.OPTION=VALUE, e.g. amp.init_scale=1024"
            )
        raw = raw.strip()
        try:
            value = json.loads(raw)
        except ValueError:
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw
        options.setdefault(plugin, {})[key.strip()] = value
    return options


def environment_plugin_options(environ: Mapping[str, str] | None = None) -> dict[str, dict]:
    """``HOOKLOOP_PLUGIN_OPTIONS="amp.init_scale=1024; ddp.timeout=60"`` (``;`` or newlines),
    read from ``environ`` (default: ``os.environ``)."""
    raw = (os.environ if environ is None else environ).get(OPTIONS_ENV, "")
    items = [part.strip() for part in re.split(r"[;\n]", raw) if part.strip()]
    return parse_plugin_options(items, source=OPTIONS_ENV)


def merge_plugin_options(*sources: dict) -> dict[str, dict]:
    """Per plugin and option, the last source that sets it wins."""
    merged: dict[str, dict] = {}
    for source in sources:
        for plugin, values in (source or {}).items():
            merged.setdefault(plugin, {}).update(values)
    return merged


PLUGINS_ENV = "HOOKLOOP_PLUGINS"
AUTOLOAD_ENV = "HOOKLOOP_AUTOLOAD_PLUGINS"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def environment_autoload(environ: Mapping[str, str] | None = None) -> bool:
    """``HOOKLOOP_AUTOLOAD_PLUGINS``: on (``1``, ``true``, ``yes``, ``on``) or off (unset,
    empty, ``0``, ``false``, ``no``, ``off``); anything else is refused, naming it."""
    raw = (os.environ if environ is None else environ).get(AUTOLOAD_ENV, "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ConfigurationError(
        f"{AUTOLOAD_ENV}={raw!r} is neither on (1, true, yes) nor off (0, false, no, or "
        f"unset): set one of those, or unset it (`unset {AUTOLOAD_ENV}`)"
    )


def environment_plugins(environ: Mapping[str, str] | None = None,
                        builtin: Iterable[str] = ()) -> list[str]:
    """The plugin names of ``HOOKLOOP_PLUGINS`` (``no:NAME`` blocks one). A name that no
    installed plugin has (nor ``builtin`` names) is refused here, saying it came from the
    environment."""
    raw = (os.environ if environ is None else environ).get(PLUGINS_ENV)
    names = split_names(raw)
    wanted = [n for n in names if not n.startswith("no:") and n not in builtin]
    if wanted:
        infos = installed_plugins()
        unknown = [n for n in wanted if n not in infos]
        if unknown:
            error = unknown_plugin_error(unknown[0], infos)
            raise PluginNotFoundError(
                f"{error} The name comes from the environment variable {PLUGINS_ENV}={raw!r}, "
                f"not from the code or the command line: correct it there, or unset it "
                f"(`unset {PLUGINS_ENV}`)"
            )
    return names
