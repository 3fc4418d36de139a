"""The core's built-in plugins are listed once (issue 34, item 4): the table
``hookloop.contract.registry.BUILTINS`` against the installed entry points, ``hookloop plugins``,
the observers a run gets by default and what autoloading adds.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path
from typing import Any

import pytest

import hookloop
from hookloop.contract import registry
from hookloop.tools.cli import main as hookloop_cli


def core_entry_points() -> dict[str, str]:
    return {
        ep.name: ep.value
        for ep in md.entry_points(group=registry.ENTRY_POINT_GROUP)
        if ep.dist is not None and ep.dist.metadata["Name"] == "hookloop"
    }


def test_the_installed_entry_points_are_the_builtins_table() -> None:
    table = {name: b.target for name, b in registry.BUILTINS.items()}
    assert core_entry_points() == table, (
        "pyproject.toml's hookloop.plugins entry points (as installed: reinstall with "
        "`pip install -e .` after changing them) differ from hookloop.contract.registry.BUILTINS"
    )
    for name, builtin in registry.BUILTINS.items():
        cls = builtin.load()
        assert getattr(cls, "hookloop_name", name) == name, (name, cls)
        assert (builtin.switch is not None) == builtin.on_by_default, name


def test_hookloop_plugins_lists_each_builtin_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert hookloop_cli(["plugins"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    for name in registry.BUILTINS:
        mine = [row for row in rows if row and row[0] == name]
        assert len(mine) == 1, (name, mine)
        role = registry.plugin_role(registry.BUILTINS[name].load())
        assert role in ("observer", "launcher") and (mine[0][1], mine[0][3]) == ("hookloop", role), mine


def builtin_names(trainer: hookloop.Trainer) -> list[str]:
    return [n for n in map(registry.plugin_name, trainer.plugins) if n in registry.BUILTINS]


def test_a_run_gets_the_builtins_on_by_default_and_each_switch_turns_one_off(
    tmp_path: Path,
) -> None:
    defaults = [name for name, b in registry.BUILTINS.items() if b.on_by_default]
    assert builtin_names(hookloop.Trainer(default_root_dir=str(tmp_path))) == defaults
    for name in defaults:
        switch = registry.BUILTINS[name].switch
        assert switch is not None, name
        turned_off: dict[str, Any] = {switch: False}
        off = hookloop.Trainer(default_root_dir=str(tmp_path), **turned_off)
        assert builtin_names(off) == [n for n in defaults if n != name], switch


def test_autoload_brings_back_no_builtin_that_a_switch_turned_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """HOOKLOOP_AUTOLOAD_PLUGINS=1 added the progress bar, the CSV logger and checkpoints
    to a run that switched them off (enable_progress_bar=False ...): they are installed
    plugins like any other. A switched-off built-in stays off, and the timer (no
    duration) is not autoloaded either; the opt-in observers still are."""
    monkeypatch.setenv("HOOKLOOP_AUTOLOAD_PLUGINS", "1")
    switches: dict[str, Any] = {b.switch: False for b in registry.BUILTINS.values() if b.switch}
    names = builtin_names(hookloop.Trainer(default_root_dir=str(tmp_path), **switches))
    # early_stopping opts out itself (hookloop_autoload = False: it needs a metric)
    wanted = [
        n
        for n, b in registry.BUILTINS.items()
        if b.autoload and getattr(b.load(), "hookloop_autoload", True)
    ]
    assert sorted(names) == sorted(wanted) and "lr_monitor" in wanted
