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

from hookloop.contract.pluginspec import (  # noqa: F401 (names of this module before the split)
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
    from hookloop.contract.registry import plugin_options

    if isinstance(plugin, types.ModuleType):
        return []
    cls: type[Any] = plugin if isinstance(plugin, type) else type(plugin)
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
    from hookloop.contract.registry import ROLES

    owner = owner_name(plugin)
    role = getattr(plugin, "hookloop_role", None)
    if role is None:
        return [Problem(name, owner, "declares no hookloop_role",
                        f"set hookloop_role to one of {', '.join(ROLES)} (a plain string, so "
                        f"`hookloop plugins` can read it without importing the plugin)")]
    if type(role) is not str:  # a tuple, an Enum (even a str one): not readable unimported
        plain = [r for r in ROLES if r == role or (isinstance(role, (tuple, list)) and r in role)
                 or getattr(role, "value", None) == r]
        suggested = plain[0] if plain else ROLES[0]
        return [Problem(name, owner,
                        f"hookloop_role={role!r} is a {type(role).__name__}, not a plain string",
                        f"write hookloop_role = {suggested!r} (one role, a string literal in the "
                        f"class body, so `hookloop plugins` reads it without importing the "
                        f"plugin); roles: {', '.join(ROLES)}")]
    if role not in ROLES:
        close = difflib.get_close_matches(str(role), ROLES, n=1)
        return [Problem(name, owner, f"hookloop_role={role!r} is not a role",
                        (f"did you mean {close[0]!r}? " if close else "")
                        + f"roles: {', '.join(ROLES)}")]
    return []


def dependency_problems(info: Any) -> list[Problem]:
    """Requirements of the plugin's distribution that are missing or not importable."""
    import importlib.metadata as md
    import importlib.util

    from hookloop.contract.registry import packages_distributions

    problems = []
    owners = packages_distributions()
    for requirement in info.requires:
        try:
            md.distribution(requirement)
        except md.PackageNotFoundError:
            problems.append(Problem(info.name, info.distribution or "?",
                                    f"needs {requirement}, which is not installed",
                                    f"pip install {requirement}"))
            continue
        wanted = requirement.lower().replace("_", "-")
        modules = [m for m, dists in owners.items()
                   if any(d.lower().replace("_", "-") == wanted for d in dists)]
        found = (importlib.util.find_spec(m) is not None for m in modules if m.isidentifier())
        if modules and not any(found):
            problems.append(Problem(info.name, info.distribution or "?",
                                    f"{requirement} is installed but none of its modules "
                                    f"({', '.join(modules)}) can be found",
                                    f"pip install --force-reinstall {requirement}"))
    return problems


def check(name: str) -> tuple[Any, list[Problem]]:
    """Load the installed plugin ``name`` (its code, not its backend) and every problem
    ``hookloop check`` reports: ``(plugin or None, problems)``."""
    from hookloop.contract.errors import HookloopError
    from hookloop.contract.registry import installed_plugins, resolve, unknown_plugin_error

    infos = installed_plugins()
    if name not in infos:
        return None, [Problem(name, "entry point", str(unknown_plugin_error(name, infos)),
                              "install the distribution that provides it, or fix the name")]
    info = infos[name]
    problems = dependency_problems(info)
    try:
        plugin = resolve(name)
    except HookloopError as exc:
        return None, problems + [Problem(name, f"entry point {info.value}", str(exc),
                                         "see the message")]
    except Exception as exc:  # the plugin's own code failed to import or construct
        return None, problems + [Problem(name, f"entry point {info.value}",
                                         f"{type(exc).__name__}: {exc}",
                                         "fix the plugin's import, or its constructor's defaults")]
    problems += role_problems(plugin, name) + hook_problems(plugin, name)
    problems += option_problems(plugin, name)
    problems += name_problems(plugin, name) + option_setting_problems(plugin, name)
    return plugin, problems


def name_problems(plugin: Any, name: str) -> list[Problem]:
    """A plugin whose declared ``hookloop_name`` is not its entry-point name (one copied
    into a subclass from an example). Options given by the entry-point name are then
    silently unused, and its checkpoint state and errors go by the other name."""
    declared = getattr(plugin, "hookloop_name", None)
    if declared is None or declared == name:
        return []
    owner = owner_name(plugin)
    inherited = next((base.__qualname__ for base in type(plugin).__mro__[1:]
                      if base.__dict__.get("hookloop_name") == declared), None)
    return [Problem(name, owner,
                    f"it is installed as {name!r} but calls itself hookloop_name={declared!r}"
                    + (f" (inherited from {inherited})" if inherited else "")
                    + f": options given as {name}.<option> are not applied to it, and its "
                    f"checkpoint state and errors go by {declared!r}",
                    f"set hookloop_name = {name!r} in the body of {owner}")]


def option_setting_problems(plugin: Any, name: str) -> list[Problem]:
    """Options (constructor arguments) that cannot be given by name: setting each one to
    its own default through the path ``plugin_options=`` / ``--plugin-option`` /
    ``HOOKLOOP_PLUGIN_OPTIONS`` take must not fail (e.g. an option ``__init__`` takes but
    keeps under another attribute name)."""
    import inspect as _inspect

    from hookloop.contract.errors import HookloopError
    from hookloop.contract.registry import apply_options, plugin_options, resolve

    if isinstance(plugin, (types.ModuleType, type)):
        return []
    try:
        params = _inspect.signature(type(plugin).__init__).parameters
    except (TypeError, ValueError):
        return []
    problems = []
    for option in plugin_options(plugin):
        default = params[option].default
        if default is _inspect.Parameter.empty:
            continue
        try:
            fresh = resolve(name)
            apply_options(fresh, {getattr(fresh, "hookloop_name", None) or name: {option: default}})
        except HookloopError as exc:
            problems.append(Problem(
                name, owner_name(plugin), f"option {option!r} cannot be given by name "
                f"(--plugin-option {name}.{option}={default!r} fails: {exc})",
                "keep each constructor argument as an attribute of the same name (a property "
                "that validates it, as `hookloop new-plugin` generates), or accept it in "
                "hookloop_set_option"))
        except Exception:
            continue  # the plugin's own validation of its own default: not this check's concern
    return problems
