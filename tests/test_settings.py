"""Settings as a pure function (issue 34, item 3): ``resolve_settings(arguments, environ)``
resolves the Trainer arguments, ``hookloop run``'s options, the plugin options, the
environment and the plugins' declarations into read-only settings and a plugin plan,
without a Trainer and without reading ``os.environ``. The precedence is the one
docs/configurations.md ("Where a setting comes from") lists: the tests read it there.
Lightning compatibility is a translator the engine does not import, blockable with
``no:lightning``."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import hookloop
import pytest
from conftest import REPO
from hookloop.contract import translators
from hookloop.contract.registry import plugin_name
from hookloop.engine.resolution import PluginPlan, Settings, default, resolve_settings
from hookloop.engine.settings import DEFAULTS_ENV

pytestmark = pytest.mark.check

QUIET = {"enable_progress_bar": False, "enable_model_summary": False}


def resolve(
    arguments: dict | None = None, environ: dict | None = None, cli: dict | None = None, **kwargs
) -> tuple[Settings, PluginPlan]:
    """``resolve_settings`` with ``cli`` as ``hookloop run`` hands its options over."""
    environ = dict(environ or {})
    if cli is not None:
        environ[DEFAULTS_ENV] = json.dumps(cli)
    return resolve_settings({**QUIET, **(arguments or {})}, environ, launched=True, **kwargs)


def documented_precedence() -> list[str]:
    """The sources, first wins, as docs/configurations.md numbers them."""
    text = (REPO / "docs" / "configurations.md").read_text()
    section = re.search(
        r"^## Where a setting comes from\n(.*?)(?=^## )", text, re.DOTALL | re.MULTILINE
    )
    assert section, "docs/configurations.md has no section 'Where a setting comes from'"
    return re.findall(r"^\d+\. `([a-z]+)`:", section.group(1), re.MULTILINE)


# -- precedence ---------------------------------------------------------------------------


def test_the_documented_precedence_is_the_resolved_one():
    order = documented_precedence()
    assert order == ["argument", "cli", "fallback", "environment", "default"]
    # max_epochs from each source alone, then every pair: the earlier source wins
    given = {
        "argument": {"arguments": {"max_epochs": 5}},
        "cli": {"cli": {"max_epochs": 3}},
        "fallback": {"arguments": {"max_epochs": default(7)}},
        "default": {},
    }
    value = {"argument": 5, "cli": 3, "fallback": 7, "default": None}
    for source, call in given.items():
        settings, _ = resolve(**call)
        assert (settings.max_epochs, settings.sources["max_epochs"]) == (value[source], source)
    ranked = [s for s in order if s in given]
    for i, high in enumerate(ranked):
        for low in ranked[i + 1 :]:
            arguments = {**given[low].get("arguments", {}), **given[high].get("arguments", {})}
            cli = given[high].get("cli", given[low].get("cli"))
            settings, _ = resolve(arguments, cli=cli)
            assert settings.max_epochs == value[high], (high, low)
            assert settings.sources["max_epochs"] == high


def test_the_environment_gives_autoload_and_mesh_only_when_nothing_else_does():
    environ = {"HOOKLOOP_AUTOLOAD_PLUGINS": "0", "HOOKLOOP_MESH": "tp=1"}
    settings, plan = resolve(environ=environ)
    assert (
        settings.autoload_plugins is False and settings.sources["autoload_plugins"] == "environment"
    )
    assert dict(settings.mesh) == {"tp": 1} and settings.sources["mesh"] == "environment"
    assert any("HOOKLOOP_MESH='tp=1'" in line for line in plan.environment_lines)
    settings, plan = resolve({"mesh": "dp_shard=1"}, environ=environ, cli={"mesh": {"cp": 1}})
    assert dict(settings.mesh) == {"dp_shard": 1} and settings.sources["mesh"] == "argument"
    assert not any("HOOKLOOP_MESH" in line for line in plan.environment_lines)
    settings, _ = resolve(environ=environ, cli={"mesh": {"cp": 1}})
    assert dict(settings.mesh) == {"cp": 1} and settings.sources["mesh"] == "cli"


def test_plugin_options_merge_per_option_environment_then_fallback_then_cli_then_code():
    environ = {
        "HOOKLOOP_PLUGIN_OPTIONS": "checkpoint.save_top_k=1; checkpoint.save_last=false; "
        "checkpoint.every_n_epochs=4; checkpoint.mode=max; checkpoint.monitor=val_loss"
    }  # (a monitor: Lightning refuses save_top_k=2 without one)
    settings, plan = resolve(
        {"plugin_options": {"checkpoint": {"save_last": True}}},
        environ=environ,
        cli={"plugin_options": {"checkpoint": {"save_top_k": 2, "save_last": False}}},
    )
    assert dict(settings.plugin_options["checkpoint"]) == {
        "save_top_k": 2,
        "save_last": True,
        "every_n_epochs": 4,
        "mode": "max",
        "monitor": "val_loss",
    }
    (checkpoint,) = [p for p in plan.plugins if plugin_name(p) == "checkpoint"]
    assert (checkpoint.save_top_k, checkpoint.save_last, checkpoint.mode) == (2, True, "max")
    settings, _ = resolve(
        {"plugin_options": default({"checkpoint": {"mode": "min", "save_top_k": 5}})},
        environ=environ,
        cli={"plugin_options": {"checkpoint": {"save_top_k": 2}}},
    )
    assert (
        dict(settings.plugin_options["checkpoint"])["mode"] == "min"
    )  # fallback over the variable
    assert (
        dict(settings.plugin_options["checkpoint"])["save_top_k"] == 2
    )  # --plugin-option over fallback


def test_plugins_from_code_cli_and_environment_are_combined_in_that_order():
    environ = {"HOOKLOOP_PLUGINS": "device_stats"}
    _, plan = resolve({"plugins": ["nan_guard"]}, environ=environ, cli={"plugins": ["lr_monitor"]})
    names = [plugin_name(p) for p in plan.plugins]
    assert names[:3] == ["nan_guard", "lr_monitor", "device_stats"]
    assert "csv" in names and "checkpoint" in names  # the built-ins, last
    _, plan = resolve({"plugins": ["no:csv"]}, environ=environ)
    assert "csv" not in [plugin_name(p) for p in plan.plugins]


# -- purity and immutability ----------------------------------------------------------


def test_the_resolution_reads_the_environment_it_is_given_not_os_environ(monkeypatch):
    monkeypatch.setenv("HOOKLOOP_PLUGINS", "not_a_plugin_anywhere")
    monkeypatch.setenv("HOOKLOOP_AUTOLOAD_PLUGINS", "maybe")
    monkeypatch.setenv(DEFAULTS_ENV, "{not json")
    before = dict(os.environ)
    settings, plan = resolve({"max_epochs": 2}, environ={})
    assert settings.max_epochs == 2 and not plan.environment_lines
    assert dict(os.environ) == before


def test_settings_are_read_only_and_the_trainer_config_is_a_copy():
    settings, plan = resolve(
        {"plugins": ["nan_guard"], "devices": [0], "plugin_options": {"checkpoint": {}}}
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_epochs = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        settings.values["max_epochs"] = 3  # type: ignore[index]
    with pytest.raises(TypeError):
        settings.plugin_options["checkpoint"]["x"] = 1  # type: ignore[index]
    assert isinstance(settings.plugins, tuple) and isinstance(settings.devices, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.plugins = ()  # type: ignore[misc]
    config = settings.trainer_config()
    config.max_epochs, config.devices = 9, [1]
    config.plugins.append("x")
    assert (
        settings.max_epochs is None
        and settings.devices == (0,)
        and settings.plugins == ("nan_guard",)
    )
    assert settings.trainer_config().devices == [0]  # a list again, as given
    with pytest.raises(AttributeError, match="no setting 'not_a_setting'"):
        settings.not_a_setting  # noqa: B018


def test_the_trainer_assigns_what_the_resolution_gives(tmp_path):
    trainer = hookloop.Trainer(
        max_epochs=hookloop.default(4), default_root_dir=str(tmp_path), **QUIET
    )
    assert isinstance(trainer.settings, Settings)
    assert trainer.max_epochs == 4 and trainer.settings.sources["max_epochs"] == "fallback"
    assert trainer.config == trainer.settings.trainer_config()
    assert trainer.config is not trainer.settings.trainer_config()


# -- errors (the messages the suite already checks elsewhere, from the function) ----------


@pytest.mark.parametrize(
    "arguments, environ, message",
    [
        ({"max_epochs": -2}, {}, "max_epochs=-2 must be None or an integer >= 0, or -1 for no limit"),
        ({"precision": "fp8"}, {}, "precision='fp8' is not one of"),
        ({"not_an_argument": 1}, {}, r"Trainer got unknown arguments \['not_an_argument'\]"),
        ({}, {DEFAULTS_ENV: "{not json"}, f"{DEFAULTS_ENV} is not valid JSON"),
        (
            {},
            {DEFAULTS_ENV: '{"max_epoch": 1}'},
            rf"{DEFAULTS_ENV} has unknown settings \['max_epoch'\]",
        ),
        (
            {},
            {"HOOKLOOP_AUTOLOAD_PLUGINS": "maybe"},
            "HOOKLOOP_AUTOLOAD_PLUGINS='maybe' is neither on",
        ),
        (
            {},
            {"HOOKLOOP_PLUGIN_OPTIONS": "checkpoint"},
            "HOOKLOOP_PLUGIN_OPTIONS 'checkpoint' must be PLUGIN.OPTION",
        ),
        ({}, {"HOOKLOOP_MESH": "tp=2"}, "mesh dimension 'tp' is claimed by no enabled plugin"),
        # max_time beside a Timer is ignored with Lightning's info line, not refused
        # (tests/test_lightning_callback_checks.py, tests/test_limits.py)
        (
            {"enable_progress_bar": False, "callbacks": [hookloop.ProgressBar()]},
            {},
            "Trainer was configured with `enable_progress_bar=False`",
        ),
    ],
)
def test_each_bad_input_is_refused_with_its_message(arguments, environ, message):
    with pytest.raises(hookloop.ConfigurationError, match=message):
        resolve(arguments, environ=environ)


def test_an_unknown_plugin_from_the_environment_names_the_variable():
    with pytest.raises(hookloop.PluginNotFoundError, match="HOOKLOOP_PLUGINS='no_such_plugin'"):
        resolve(environ={"HOOKLOOP_PLUGINS": "no_such_plugin"})


def test_leftover_launcher_options_are_ignored_with_a_warning():
    environ = {DEFAULTS_ENV: json.dumps({"max_epochs": 1})}
    with pytest.warns(
        UserWarning, match=f"{DEFAULTS_ENV} is set, but no hookloop launcher started"
    ):
        settings, _ = resolve_settings({}, environ, launched=False)
    assert settings.max_epochs is None


# -- Lightning compatibility: a translator, blockable --------------------------------------


def test_lightning_arguments_are_translated_by_the_registered_layer():
    assert [t.name for t in translators.registered()] == ["lightning"]
    callback, logger = hookloop.Callback(), hookloop.CSVLogger("unused")
    settings, plan = resolve({"callbacks": [callback], "logger": logger, "strategy": "auto"})
    names = [plugin_name(p) for p in plan.plugins]
    assert names[:2] == ["csv", "callbacks"] and names.count("csv") == 1  # the given logger, first
    assert plan.plugins[0] is logger and plan.adapter.callbacks == [callback]
    assert settings.logger is True and [t.name for t in plan.translators] == ["lightning"]
    _, plan = resolve({"plugins": ["lightning"]})  # naming the built-in is allowed: it is on anyway
    assert plan.translators


@pytest.mark.parametrize("where", ["code", "cli", "environment"])
@pytest.mark.parametrize(
    "argument, value",
    [
        ("callbacks", lambda: [hookloop.Callback()]),
        ("strategy", lambda: "auto"),
        ("logger", lambda: hookloop.CSVLogger("unused")),
    ],
)
def test_a_lightning_argument_is_refused_when_compatibility_is_blocked(where, argument, value):
    arguments = {argument: value()}
    environ: dict = {}
    cli = None
    if where == "code":
        arguments["plugins"] = ["no:lightning"]
    elif where == "cli":
        cli = {"plugins": ["no:lightning"]}
    else:
        environ["HOOKLOOP_PLUGINS"] = "no:lightning"
    with pytest.raises(
        hookloop.ConfigurationError,
        match=rf"Trainer\({argument}=\.\.\.\) is Lightning compatibility, which is blocked",
    ):
        resolve(arguments, environ=environ, cli=cli)


def test_blocked_compatibility_leaves_the_engine_s_own_arguments_working(tmp_path):
    settings, plan = resolve({"plugins": ["no:lightning"], "logger": False, "max_epochs": 1})
    assert plan.translators == () and settings.logger is False
    with pytest.raises(
        hookloop.ConfigurationError, match=r"HOOKLOOP_TUNE \(set by `hookloop tune`\).*blocked"
    ):
        resolve({"plugins": ["no:lightning"]}, environ={"HOOKLOOP_TUNE": "{}"})
    with pytest.raises(
        hookloop.ConfigurationError, match=r"Trainer\(callbacks=\.\.\.\) is Lightning compatibility"
    ):
        hookloop.Trainer(
            plugins=["no:lightning"],
            callbacks=[hookloop.Callback()],
            default_root_dir=str(tmp_path),
        )
    trainer = hookloop.Trainer(
        plugins=["no:lightning"], default_root_dir=str(tmp_path), max_epochs=1, **QUIET
    )
    assert trainer._translators == () and trainer.callbacks == trainer.plugins


def test_without_any_translator_a_lightning_argument_says_none_is_registered():
    with pytest.raises(
        hookloop.ConfigurationError,
        match=r"Trainer\(callbacks=\.\.\.\) needs a compatibility layer",
    ):
        resolve({"callbacks": [hookloop.Callback()]}, translators=())
    with pytest.raises(
        hookloop.ConfigurationError, match=r"Trainer\(logger=<logger objects>\) needs"
    ):
        resolve({"logger": hookloop.CSVLogger("unused")}, translators=())
