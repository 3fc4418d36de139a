"""``lightning`` as the installed pytorch-lightning 2.6.6: Lightning's tests, as written.

Lightning's tests import ``lightning.pytorch`` / ``lightning.fabric`` (the unified package,
not installed here) and name its modules in strings (``mock.patch("lightning.pytorch...")``,
``caplog.set_level(..., logger="lightning.pytorch...")``). `installed` makes both resolve to
``pytorch_lightning`` / ``lightning_fabric``, the same code under its standalone names: a
module ``lightning.pytorch.x`` *is* ``pytorch_lightning.x`` (the same object), and the
logger ``lightning.pytorch.x`` is the logger ``pytorch_lightning.x``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types

PREFIXES = {"lightning.pytorch": "pytorch_lightning", "lightning.fabric": "lightning_fabric"}


def real_name(name: str) -> str | None:
    for alias, real in PREFIXES.items():
        if name == alias or name.startswith(alias + "."):
            return real + name[len(alias):]
    return None


def _alias_loggers() -> None:
    loggers = logging.root.manager.loggerDict
    for name in list(loggers):
        for alias, real in PREFIXES.items():
            if name == real or name.startswith(real + "."):
                aliased = alias + name[len(real):]
                if not isinstance(loggers.get(aliased), logging.Logger):
                    loggers[aliased] = logging.getLogger(name)  # a placeholder (a parent's name) too


class _Existing(importlib.abc.Loader):
    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        _alias_loggers()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "lightning":
            package = types.ModuleType("lightning")
            package.__path__ = []
            spec = importlib.machinery.ModuleSpec("lightning", _Existing(package), is_package=True)
            return spec
        real = real_name(fullname)
        if real is None:
            return None
        module = importlib.import_module(real)
        return importlib.machinery.ModuleSpec(fullname, _Existing(module),
                                              is_package=hasattr(module, "__path__"))


_FINDER = _Finder()


def install() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    importlib.import_module("lightning.pytorch")
    _alias_loggers()


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == "lightning" or n.startswith("lightning.")]:
        del sys.modules[name]
    loggers = logging.root.manager.loggerDict
    for name in [n for n in loggers if real_name(n)]:
        del loggers[name]


@contextlib.contextmanager
def installed():
    """The aliases for the duration of a block (the hookloop run imports the harness in one)."""
    install()
    try:
        yield
    finally:
        uninstall()
