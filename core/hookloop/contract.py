"""Checking a plugin against the hook contract, before anything runs.

Used when a run registers its plugins (a mistake is an error at ``Trainer(...)``), by
``hookloop plugins --load`` and by ``hookloop check``. Every problem names the plugin,
its class, the hook, what is wrong and how to fix it.
"""

from __future__ import annotations

import difflib
import inspect
import re
import types
from typing import Any

from .pluginspec import (  # noqa: F401  (this module's names before pluginspec was split off)
    IMPL_ATTRIBUTE,
    Problem,
    hook_problems,
    hookimpl_options,
    implementations,
    owner_name,
    specs,
)


def option_problems(plugin: Any, name: str) -> list[Problem]:
    """Options (constructor arguments) that the plugin's docstrings do not mention."""
    from .plugins import plugin_options

    if isinstance(plugin, types.ModuleType):
        return []
    cls = plugin if isinstance(plugin, type) else type(plugin)
    documented = " ".join(inspect.getdoc(c) or "" for c in (cls, cls.__init__))
    problems = []
    for option in plugin_options(plugin):
        if not re.search(rf"\b{re.escape(option)}\b", documented):
            problems.append(Problem(
                name, cls.__qualname__, f"option {option!r} is not documented",
                f"describe {option!r} in the docstring of {cls.__qualname__} (what it does, its "
                f"default); users set it with hookloop.plugin({name!r}, {option}=...) or "
                f"--plugin-option {name}.{option}=...",
            ))
    return problems


def role_problems(plugin: Any, name: str) -> list[Problem]:
    from .plugins import ROLES

    owner = owner_name(plugin)
    role = getattr(plugin, "hookloop_role", None)
    if role is None:
        return [Problem(name, owner, "declares no hookloop_role",
                        f"set hookloop_role to one of {', '.join(ROLES)} (a plain string, so "
                        f"`hookloop plugins` can read it without importing the plugin)")]
    if role not in ROLES:
        close = difflib.get_close_matches(str(role), ROLES, n=1)
        return [Problem(name, owner, f"hookloop_role={role!r} is not a role",
                        (f"did you mean {close[0]!r}? " if close else "") + f"roles: {', '.join(ROLES)}")]
    return []


def dependency_problems(info: Any) -> list[Problem]:
    """Requirements of the plugin's distribution that are missing or not importable."""
    import importlib.metadata as md
    import importlib.util

    problems = []
    owners = md.packages_distributions()
    for requirement in info.requires:
        try:
            md.distribution(requirement)
        except md.PackageNotFoundError:
            problems.append(Problem(info.name, info.distribution or "?", f"needs {requirement}, which is not installed",
                                    f"pip install {requirement}"))
            continue
        wanted = requirement.lower().replace("_", "-")
        modules = [m for m, dists in owners.items() if any(d.lower().replace("_", "-") == wanted for d in dists)]
        if modules and not any(importlib.util.find_spec(m) is not None for m in modules if m.isidentifier()):
            problems.append(Problem(info.name, info.distribution or "?",
                                    f"{requirement} is installed but none of its modules ({', '.join(modules)}) can be found",
                                    f"pip install --force-reinstall {requirement}"))
    return problems


def check(name: str) -> tuple[Any, list[Problem]]:
    """Load the installed plugin ``name`` (its code, not its backend) and every problem
    ``hookloop check`` reports: ``(plugin or None, problems)``."""
    from .errors import HookloopError
    from .plugins import installed_plugins, resolve, unknown_plugin_error

    infos = installed_plugins()
    if name not in infos:
        return None, [Problem(name, "entry point", str(unknown_plugin_error(name, infos)),
                              "install the distribution that provides it, or fix the name")]
    info = infos[name]
    problems = dependency_problems(info)
    try:
        plugin = resolve(name)
    except HookloopError as exc:
        return None, problems + [Problem(name, f"entry point {info.value}", str(exc), "see the message")]
    except Exception as exc:  # the plugin's own code failed to import or construct
        return None, problems + [Problem(name, f"entry point {info.value}", f"{type(exc).__name__}: {exc}",
                                         "fix the plugin's import, or its constructor's defaults")]
    problems += role_problems(plugin, name) + hook_problems(plugin, name) + option_problems(plugin, name)
    return plugin, problems
