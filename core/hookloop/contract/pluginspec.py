"""What a plugin is, as the hook contract sees it: its name, its hook implementations
and their ``@hookloop.hookimpl`` options, and the problems of those implementations
against :mod:`hookloop.contract.hookspecs` (a hook that does not exist, an argument it lacks).

The registry (:mod:`hookloop.contract.registry`) runs these checks when a run registers its
plugins; ``hookloop check`` (:mod:`hookloop.contract`, which re-exports every name here)
runs them and more. This module sits below both, and below the observers that name a
plugin (docs/plugin-authors.md, "How the core is layered").
"""

from __future__ import annotations

import difflib
import inspect
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pluggy._decorators import varnames  # the argument names pluggy itself will read

from hookloop.contract import hookspecs

IMPL_ATTRIBUTE = "hookloop_impl"


def specs() -> dict[str, tuple[str, ...]]:
    """Every hook of the contract and its argument names."""
    found = {}
    for name in dir(hookspecs):
        function = getattr(hookspecs, name)
        if callable(function) and hasattr(function, "hookloop_spec"):
            found[name] = varnames(function)[0]
    return found


def hookimpl_options(plugin: Any, name: str) -> dict | None:
    """The ``@hookloop.hookimpl`` options of ``plugin.name``, or ``None`` if it is no hook
    implementation.

    A subclass method that overrides a base class's hook implementation without
    repeating the decorator stays a hook implementation, with the base's options: an
    override is a change of what the hook does, never a silent removal of the hook (a
    ``configure_sampler`` override that vanished would let every rank train on all the
    data).
    """
    if isinstance(inspect.getattr_static(plugin, name, None), property):
        return None  # never evaluated here: a logger's ``experiment`` opens its files on first use
    try:
        method = getattr(plugin, name)
    except Exception:
        return None
    if not inspect.isroutine(method):
        return None
    options = getattr(method, IMPL_ATTRIBUTE, None)
    if isinstance(options, dict):
        return options
    if isinstance(plugin, types.ModuleType):
        return None
    cls = plugin if isinstance(plugin, type) else type(plugin)
    for base in cls.__mro__[1:]:
        inherited = base.__dict__.get(name)
        if inherited is None:
            continue
        inherited = getattr(inherited, "__func__", inherited)  # staticmethod/classmethod
        options = getattr(inherited, IMPL_ATTRIBUTE, None)
        return dict(options) if isinstance(options, dict) else None
    return None


def implementations(plugin: Any) -> Iterator[tuple[str, Any, dict]]:
    """``(hook name, function, options)`` for every hook implementation of ``plugin``."""
    for name in dir(plugin):
        if name.startswith("__"):
            continue
        options = hookimpl_options(plugin, name)
        if options is not None:
            yield name, getattr(plugin, name), options


@dataclass(frozen=True)
class Problem:
    """One way a plugin does not fit the contract, and its fix."""

    plugin: str
    where: str  # "Class.method", or "Class" for the plugin as a whole
    message: str
    fix: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} ({self.where}): {self.message}. Fix: {self.fix}"


def owner_name(plugin: Any) -> str:
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    return (plugin if isinstance(plugin, type) else type(plugin)).__qualname__


def hook_problems(plugin: Any, name: str) -> list[Problem]:
    """Hook implementations naming a hook that does not exist, or arguments it lacks."""
    known = specs()
    owner = owner_name(plugin)
    problems = []
    for hook, function, _ in implementations(plugin):
        where = f"{owner}.{hook}"
        if hook not in known:
            close = difflib.get_close_matches(hook, list(known), n=3, cutoff=0.6)
            problems.append(Problem(
                name, where, f"{hook!r} is not a hookloop hook",
                f"rename it to {' or '.join(repr(c) for c in close)}" if close
                else "rename it to one of the hooks of hookloop.contract.hookspecs: "
                f"{', '.join(sorted(known))}",
            ))
            continue
        args = varnames(function)[0]
        unknown = [a for a in args if a not in known[hook]]
        for arg in unknown:
            close = difflib.get_close_matches(arg, known[hook], n=1, cutoff=0.6)
            problems.append(Problem(
                name, where, f"argument {arg!r} is not an argument of {hook}",
                (f"rename it to {close[0]!r}; " if close else "remove it; ")
                + f"{hook} takes {', '.join(known[hook])} (any of them, by name)",
            ))
    return problems


def _declared_name(plugin: Any) -> str | None:
    return getattr(plugin, "hookloop_name", None)


def plugin_name(plugin: Any) -> str:
    """The name a plugin object is known by."""
    name = _declared_name(plugin)
    if name:
        return name
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    return type(plugin).__name__
