"""The module paths of hookloop 0.10 keep working for one minor contract version, as the
very modules at their new paths, each with a HookloopDeprecationWarning naming the new
path (core/hookloop/_moved.py, CHANGELOG 0.11.0)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import hookloop
from hookloop import _moved
from hookloop.contract.versioning import HookloopDeprecationWarning

pytestmark = pytest.mark.check

CORE = Path(hookloop.__file__).parent


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_module_path_is_the_module_at_its_new_path(old):
    new = importlib.import_module("hookloop." + _moved.MOVED[old])
    sys.modules.pop(f"hookloop.{old}", None)
    with pytest.warns(HookloopDeprecationWarning, match=rf"hookloop\.{old} .*import hookloop\.{_moved.MOVED[old]}"):
        aliased = importlib.import_module(f"hookloop.{old}")
    assert aliased is new
    assert not (CORE / f"{old}.py").exists(), f"hookloop/{old}.py is both moved and present"


def test_an_old_module_as_an_attribute_of_the_package_warns_and_is_the_new_module(monkeypatch):
    # an earlier `import hookloop.faults` binds the attribute (then it no longer warns)
    monkeypatch.delattr(hookloop, "faults", raising=False)
    with pytest.warns(HookloopDeprecationWarning, match=r"hookloop\.faults .*hookloop\.distributed\.faults"):
        faults = hookloop.faults
    assert faults is importlib.import_module("hookloop.distributed.faults")


@pytest.mark.parametrize("package, name", [("distributed", "RankZeroOrder"), ("resume", "restore"),
                                           ("contract", "implementations")])
def test_a_folder_named_like_its_old_module_hands_out_the_old_names(package, name):
    module = importlib.import_module("hookloop." + _moved.SHADOWED[package])
    folder = importlib.import_module("hookloop." + package)
    with pytest.warns(HookloopDeprecationWarning, match=rf"hookloop\.{package}\.{name} "):
        got = getattr(folder, name)
    assert got is getattr(module, name)
    with pytest.raises(AttributeError):
        getattr(folder, "no_such_name")


def test_new_paths_import_without_a_deprecation_warning():
    # a fresh interpreter: every module of the core at its new path, warnings as errors
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "import importlib, pkgutil, hookloop\n"
            "for m in pkgutil.walk_packages(hookloop.__path__, 'hookloop.'):\n"
            "    if m.name not in ('hookloop.__main__', 'hookloop.lightning.cli', 'hookloop.testing.resume_job'):\n"
            "        importlib.import_module(m.name)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
