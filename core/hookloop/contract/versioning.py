"""The plugin contract's version, the range a plugin declares, and deprecations.

``CONTRACT_VERSION`` numbers the contract between the core and its plugins (the hooks of
:mod:`hookloop.contract.hookspecs`, their arguments and when they are called, the plugin attributes,
the public helpers and where the core writes what plugins read). It follows semantic
versioning: a change that can break a plugin written against the documented contract
bumps the major number, an addition the minor one. CHANGELOG.md lists every change.

A plugin declares the contract versions it was written for with a specifier on its class
or module::

    hookloop_requires = ">=2,<3"

and is refused at load, naming its range, when the running contract is outside it. A
plugin that declares nothing is accepted; loaded from an entry point, it is told once
(:class:`HookloopContractWarning`) what changed since the contract it may have been
written for, and ``hookloop check`` says it declares no range.

Deprecations: a hook or an argument that will change meaning is marked for one minor
version first, with :func:`deprecated` as pluggy's ``warn_on_impl`` /
``warn_on_impl_args`` (``@hookspec(warn_on_impl=deprecated(...))``); a plugin implementing
it gets a :class:`HookloopDeprecationWarning` at registration, pointing at its own function.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from hookloop.contract.errors import PluginValidationError

#: The version of the plugin contract this core implements (semver). 1.x is the contract
#: of hookloop 0.1-0.5, numbered after the fact; 2.0.0 came with hookloop 0.6, 2.1.0 (the
#: device mesh: a hook, two plugin attributes, helpers; nothing removed) with 0.7, 2.2.0 (helpers
#: around the loop: the per-step agreement, hook-call observers, errors marked alike on every
#: rank; nothing removed) with 0.8, 2.3.0 (checkpoint tags, shard checks, timeouts, a plugin's
#: environment variables; nothing removed) with 0.9, 2.4.0 (``describe_model``: ``hookloop plan``;
#: nothing removed) with 0.10, 2.5.0 (the core in folders: every module at a new path, the
#: old paths deprecated; nothing removed yet) with 0.11, 2.6.0 (the ``launcher`` role: a
#: launcher composes with any strategy, ``hookloop_launcher``, the core's ``torchrun``,
#: ``spawn`` and ``in_process`` launchers; nothing removed) with 0.11 too (CHANGELOG.md).
CONTRACT_VERSION = "2.6.0"

#: The attribute a plugin (class, instance or module) declares its range with.
REQUIRES = "hookloop_requires"

#: What a plugin written for an earlier contract (one that declares no range) is told.
CHANGES_FOR_UNDECLARED = (
    "checkpoints are written to <log_dir>/checkpoints/ (trainer.log_dir, logs/version_N/), "
    "not <default_root_dir>/checkpoints/ (hookloop 0.3)",
    "on_validation_end is also called for the sanity check before training (hookloop 0.2): "
    "take its `sanity_checking` argument (contract 2.0) and return when it is True, or its "
    "metrics become a bogus first row",
    "a plugin's options construct it (its constructor's own checks), and a strategy "
    "subclass keeps its checkpoint state under its own name (contract 2.0)",
)


class HookloopDeprecationWarning(DeprecationWarning):
    """A hook or argument a plugin uses is deprecated (shown by default, once per place)."""


class HookloopContractWarning(UserWarning):
    """A plugin declares no contract range; what changed since earlier contracts."""


# DeprecationWarning is hidden outside __main__ by default: a plugin author running a
# script would never see hookloop's. This shows hookloop's own category only.
warnings.filterwarnings("default", category=HookloopDeprecationWarning)


def deprecated(what: str, since: str, changes_in: str, instead: str) -> HookloopDeprecationWarning:
    """The warning for pluggy's ``warn_on_impl``/``warn_on_impl_args``: ``what`` is
    deprecated since contract ``since`` and changes (or goes) in ``changes_in``; ``instead``
    says what to implement. Keep a deprecation for at least one minor version."""
    return HookloopDeprecationWarning(
        f"{what} is deprecated since hookloop contract {since} and changes in {changes_in}: "
        f"{instead} (CHANGELOG.md, contract {changes_in}). Running contract: {CONTRACT_VERSION}."
    )


def _specifier(text: Any, name: str):
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if not isinstance(text, str):
        raise PluginValidationError(
            f"plugin {name!r} declares {REQUIRES}={text!r}; it must be a version specifier string "
            f"such as '>=2,<3' (the hookloop contract versions it was written for)"
        )
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise PluginValidationError(
            f"plugin {name!r} declares {REQUIRES}={text!r}, which is not a version specifier: "
            f"write it like '>=2,<3' (the hookloop contract versions it was written for)"
        ) from None


def declared_range(plugin: Any) -> str | None:
    """The plugin's ``hookloop_requires``, or ``None`` when it declares none."""
    return getattr(plugin, REQUIRES, None)


def check_range(plugin: Any, name: str, distribution: str | None = None) -> None:
    """Refuse ``plugin`` when its declared range excludes :data:`CONTRACT_VERSION`."""
    declared = declared_range(plugin)
    if declared is None:
        return
    if _specifier(declared, name).contains(CONTRACT_VERSION, prereleases=True):
        return
    dist = f" ({distribution})" if distribution else ""
    major = int(CONTRACT_VERSION.split(".")[0])
    raise PluginValidationError(
        f"plugin {name!r}{dist} was written for hookloop contract {declared}, and this hookloop "
        f"implements contract {CONTRACT_VERSION}: install a hookloop whose contract it admits "
        f"(CHANGELOG.md says which hookloop versions have which contract; e.g. pip install "
        f"'hookloop<0.6' for contract 1), or update the plugin to contract "
        f"{major} as CHANGELOG.md describes and declare {REQUIRES} = '>={major},<{major + 1}'"
    )


_TOLD: set[str] = set()


def check_loaded(plugin: Any, name: str, distribution: str | None = None) -> None:
    """At load from an entry point: refuse an excluded range; tell a third-party plugin
    that declares none, once per process, what changed under it."""
    check_range(plugin, name, distribution)
    if declared_range(plugin) is not None or distribution == "hookloop" or name in _TOLD:
        return
    if os.environ.get("RANK", "0") != "0":
        return  # told by global rank 0 (and the launching process), not once per worker
    _TOLD.add(name)
    dist = f" ({distribution})" if distribution else ""
    warnings.warn(
        f"plugin {name!r}{dist} declares no hookloop contract range ({REQUIRES}); it may have been "
        f"written for an earlier contract. This hookloop implements contract {CONTRACT_VERSION}; "
        f"what changed under plugins of earlier ones: " + "; ".join(CHANGES_FOR_UNDECLARED)
        + f". See CHANGELOG.md, then declare {REQUIRES} = '>=2,<3' on the plugin.",
        HookloopContractWarning,
        stacklevel=2,
    )


def range_note(plugin: Any) -> str | None:
    """What ``hookloop check`` says about the plugin's range (``None``: declared and fine)."""
    if declared_range(plugin) is None:
        return (f"declares no contract range ({REQUIRES}); running contract {CONTRACT_VERSION}: "
                f"add {REQUIRES} = '>=2,<3' once it follows contract 2 (CHANGELOG.md)")
    return None
