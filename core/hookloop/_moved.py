"""The module paths of hookloop 0.10 and before, and where each module lives now.

hookloop 0.11 moved the core's flat modules into folders (engine/, contract/,
distributed/, resume/, lightning/, tools/; docs/explanation/architecture.md). The old
paths keep working for one minor contract version (2.5.x) with a
:class:`~hookloop.contract.versioning.HookloopDeprecationWarning` naming the new path, and
go in contract 2.6.0 (CHANGELOG.md). ``import hookloop.step`` gives the very module
``hookloop.engine.step`` (not a copy), so a test that patches one patches the other.

Three old modules had the name their folder has now (``hookloop.contract``,
``hookloop.distributed``, ``hookloop.resume``): those packages hand out the old module's
names, with the same warning, through :func:`forward`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

#: ``old module -> new module``, both relative to ``hookloop``.
MOVED: dict[str, str] = {
    "errors": "contract.errors",
    "versioning": "contract.versioning",
    "hookspecs": "contract.hookspecs",
    "pluginspec": "contract.pluginspec",
    "sourcescan": "contract.sourcescan",
    "plugins": "contract.registry",
    "config": "engine.settings",
    "metrics": "engine.metrics",
    "state": "engine.state",
    "optim": "engine.optim",
    "defaults": "engine.defaults",
    "step": "engine.step",
    "loop": "engine.loop",
    "session": "engine.session",
    "trainer": "engine.trainer",
    "utilities": "distributed.ranks",
    "failures": "distributed.failures",
    "launch": "distributed.launch",
    "dist": "distributed.collectives",
    "faults": "distributed.faults",
    "mesh": "distributed.mesh",
    "rundir": "resume.rundir",
    "unpickling": "resume.unpickling",
    "checkpoint": "resume.checkpoint",
    "loader_state": "resume.loader_state",
    "dcp": "resume.dcp",
    "types": "contract.types",
    "loggers": "lightning.loggers",
    "callbacks": "lightning.callbacks",
    "module": "lightning.module",
    "datamodule": "lightning.datamodule",
    "strategies": "lightning.strategies",
    "tuner": "lightning.tuner",
    "lightning_cli": "lightning.cli",
    "cli": "tools.cli",
    "scaffold": "tools.scaffold",
    "plot": "tools.plot",
}

#: Old modules whose name is now a folder: ``folder -> the module the old names live in``.
SHADOWED: dict[str, str] = {
    "contract": "contract.checks",
    "distributed": "distributed.strategy",
    "resume": "resume.run",
}

REMOVED_IN = "2.6.0"


def _warn(old: str, new: str, stacklevel: int) -> None:
    from hookloop.contract.versioning import deprecated

    warnings.warn(
        deprecated(f"the module path {old}", since="2.5.0", changes_in=REMOVED_IN, instead=f"import {new}"),
        stacklevel=stacklevel,
    )


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``hookloop.<old>`` and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        old = fullname[len("hookloop."):] if fullname.startswith("hookloop.") else None
        if old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = "hookloop." + MOVED[spec.name[len("hookloop."):]]
        _warn(spec.name, new, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path is already executed."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())


def attribute(name: str) -> ModuleType:
    """``hookloop.<old>`` as an attribute of the package (``import hookloop; hookloop.step``)."""
    if name not in MOVED:
        raise AttributeError(f"module 'hookloop' has no attribute {name!r}")
    new = "hookloop." + MOVED[name]
    _warn(f"hookloop.{name}", new, stacklevel=4)
    return importlib.import_module(new)


def forward(package: str, name: str) -> Any:
    """A name of the old module ``hookloop.<package>`` (now ``SHADOWED[package]``)."""
    if name.startswith("__") or f"{package}.{name}" in MOVED.values():
        # a module of the folder (``from hookloop.distributed import mesh``): the import
        # system's to load, not a name of the old module
        raise AttributeError(f"module 'hookloop.{package}' has no attribute {name!r}")
    new = "hookloop." + SHADOWED[package]
    module = importlib.import_module(new)
    if not hasattr(module, name):
        raise AttributeError(f"module 'hookloop.{package}' has no attribute {name!r}")
    _warn(f"hookloop.{package}.{name}", f"{new}.{name}", stacklevel=4)
    return getattr(module, name)
