"""`hookloop new-plugin`: every role's skeleton pip-installs, passes `hookloop check` and
its own generated tests (the role's conformance suite, real training), and bad requests
are refused before anything is written.

The generated packages are really built and installed by pip (into a folder put on
PYTHONPATH, so the venv is untouched) and everything about them runs in subprocesses, as
an author would run it: the strategy's suite launches `hookloop run --plugins NAME`
workers, which inherit PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest

from conftest import run_python
from hookloop import ConfigurationError
from hookloop.tools import cli
from hookloop.tools import scaffold

ROLES = ("strategy", "precision", "observer", "devices")
#: An option of each generated plugin and a value its check must refuse.
BAD_OPTION = {"strategy": ("verbose", "yes"), "precision": ("cache_enabled", 1),
              "observer": ("every", -1), "devices": ("count", 0)}


def generate(role: str, directory, capsys) -> tuple[str, object]:
    """Write the package for ``role`` through the command, as a user would."""
    name = f"gen_{role}"
    assert cli.main(["new-plugin", name, "--role", role, "--dir", str(directory)]) == 0
    printed = capsys.readouterr().out
    package = directory / f"hookloop-{name}"
    assert f"pip install -e {package}" in printed and f"hookloop check {name}" in printed
    assert f"pytest {package / 'tests'}" in printed
    return name, package


def pip_install(package, site) -> None:
    # --no-deps: hookloop, hookloop-ddp and torch are in the venv already, and pip must not
    # touch torch; --no-build-isolation: build with the venv's setuptools, offline.
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(site), str(package)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (
        f"pip could not build {package} (--no-build-isolation needs setuptools in the venv):\n"
        f"{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``installed(role, capsys) -> (name, package, site)``: generated and pip-installed
    once per role, for every test of this module that needs it."""
    cache: dict[str, tuple] = {}

    def get(role: str, capsys):
        if role not in cache:
            root = tmp_path_factory.mktemp(f"new-plugin-{role}")
            name, package = generate(role, root, capsys)
            pip_install(package, root / "site")
            cache[role] = (name, package, root / "site")
        return cache[role]

    return get


#: `make test` installs and runs the strategy template's package (the one that launches 2
#: processes); the other roles' packages (25-30 s each) run under `make test-full`.
FULL_ROLES = pytest.mark.full  # every role's generated package


@pytest.mark.slow
@pytest.mark.parametrize("role", [r if r == "strategy" else pytest.param(r, marks=FULL_ROLES) for r in ROLES])
def test_the_generated_package_installs_checks_and_passes_its_conformance_suite(role, installed, capsys, tmp_path):
    name, package, site = installed(role, capsys)
    env = {"PYTHONPATH": str(site)}
    assert list(site.glob(f"hookloop_{name}-*.dist-info/entry_points.txt")), "pip installed no entry point"

    check = run_python([sys.executable, "-m", "hookloop", "check", name], cwd=tmp_path, env=env)
    assert check.stdout.strip() == f"{name}: ok"

    # One interpreter for the rest (each start imports torch): the role as `hookloop
    # plugins` reads it from the source, unimported; and its option, checked when it is
    # set and naming the plugin: an early, clear error.
    option, bad = BAD_OPTION[role]
    run_python([sys.executable, "-c", textwrap.dedent(f"""
        import hookloop
        from hookloop.contract.sourcescan import declared_role
        role = declared_role(hookloop.installed_plugins()[{name!r}].value)
        assert role == {role!r}, role
        try:
            hookloop.plugin({name!r}, {option}={bad!r})
        except hookloop.ConfigurationError as exc:
            assert {name!r} in str(exc) and {option!r} in str(exc), exc
        else:
            raise SystemExit("{option}={bad!r} was accepted")
    """)], cwd=tmp_path, env=env)

    tests = run_python([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests")],
                       cwd=tmp_path, env=env, timeout=600)
    summary = tests.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, tests.stdout


@pytest.mark.slow
def test_the_generated_observer_keeps_its_counts_in_checkpoints(installed, capsys, tmp_path):
    name, _, site = installed("observer", capsys)
    script = textwrap.dedent(f"""
        import glob, torch, hookloop
        from torch.utils.data import DataLoader
        from hookloop.testing.reference import TinyClassifier, tiny_dataset

        def fit(epochs, root, ckpt_path=None):
            observer = hookloop.plugin({name!r})
            trainer = hookloop.Trainer(plugins=[observer], max_epochs=epochs, default_root_dir=root,
                                       enable_progress_bar=False)
            trainer.fit(TinyClassifier(), DataLoader(tiny_dataset(), batch_size=8), ckpt_path=ckpt_path)
            return observer

        first = fit(2, "first")
        assert (first.batches, first.epochs) == (16, 2), (first.batches, first.epochs)
        (last,) = glob.glob("first/**/last.ckpt", recursive=True)
        # Saved after the epoch is counted, and loadable without unpickling code.
        assert torch.load(last, weights_only=True)["plugins"][{name!r}] == {{"batches": 16, "epochs": 2}}
        resumed = fit(3, "resumed", ckpt_path=last)
        assert (resumed.batches, resumed.epochs) == (24, 3), (resumed.batches, resumed.epochs)
    """)
    run_python([sys.executable, "-c", script], cwd=tmp_path, env={"PYTHONPATH": str(site)})


@pytest.mark.parametrize("role", ROLES)
def test_the_pyproject_names_the_entry_point_and_never_torch(role, tmp_path):
    package = scaffold.new_plugin("my_thing", role, tmp_path)
    assert package == tmp_path / "hookloop-my_thing"
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    assert project["name"] == "hookloop-my_thing"
    assert project["entry-points"]["hookloop.plugins"] == {"my_thing": "hookloop_my_thing:MyThing"}
    assert project["dependencies"] == (["hookloop", "hookloop-ddp"] if role == "strategy" else ["hookloop"])
    assert sorted(p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()) == [
        "README.md", "pyproject.toml", "src/hookloop_my_thing/__init__.py", "tests/test_my_thing.py"]
    assert "class TestMyThing(" in (package / "tests" / "test_my_thing.py").read_text()
    readme = (package / "README.md").read_text()
    for text in ("--plugins my_thing", "pip install -e .", "pytest tests", "python -m build", "twine upload"):
        assert text in readme, text


def test_a_keyword_name_still_makes_a_class():
    # none -> None would be a syntax error in `class None:`.
    assert scaffold.class_name("none") == "NonePlugin"
    assert scaffold.class_name("my_2nd_idea") == "My2ndIdea"


@pytest.mark.parametrize("name", ["MyPlugin", "my-plugin", "2fast", "_private", "", "two words", "café"])
def test_a_name_that_is_not_a_lowercase_identifier_is_refused(name, tmp_path):
    with pytest.raises(ConfigurationError, match="not a lowercase identifier: use letters a-z"):
        scaffold.new_plugin(name, "observer", tmp_path)
    assert list(tmp_path.iterdir()) == [], "nothing is written for a refused request"


def test_the_refusal_suggests_a_name():
    with pytest.raises(ConfigurationError, match="e.g. 'my_plugin'"):
        scaffold.check_name("My-Plugin")
    with pytest.raises(ConfigurationError, match="use 'ema2'"):
        scaffold.check_name("hookloop_ema2")


def test_the_name_of_an_installed_plugin_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="'ddp' is installed already, from hookloop-ddp: pick another name"):
        scaffold.new_plugin("ddp", "strategy", tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("role, message", [
    ("strateg", r"role 'strateg' is not one new-plugin writes \(did you mean 'strategy'\?\): "
                r"use --role strategy\|precision\|observer\|devices\|extension"),
    ("extention", r"role 'extention' is not one new-plugin writes \(did you mean 'extension'\?\)"),
])
def test_an_unknown_role_is_refused(role, message, tmp_path):
    with pytest.raises(ConfigurationError, match=message):
        scaffold.new_plugin("my_thing", role, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_is_refused_and_left_as_it_was(tmp_path):
    existing = tmp_path / "hookloop-my_thing"
    existing.mkdir()
    (existing / "mine.txt").write_text("keep me")
    with pytest.raises(ConfigurationError, match="exists already; new-plugin never overwrites: remove it, or write "
                                                 "elsewhere with --dir PATH"):
        scaffold.new_plugin("my_thing", "observer", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["hookloop-my_thing"], "no staging folder left behind"
    assert [p.name for p in existing.iterdir()] == ["mine.txt"] and (existing / "mine.txt").read_text() == "keep me"


def test_the_command_reports_a_bad_request_with_status_2(tmp_path, capsys):
    assert cli.main(["new-plugin", "Bad-Name", "--role", "observer", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hookloop: error: plugin name 'Bad-Name' is not a lowercase identifier"), err
    assert cli.main(["new-plugin", "fine", "--role", "nope", "--dir", str(tmp_path)]) == 2
    assert "role 'nope' is not one new-plugin writes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse: --role is required
        cli.main(["new-plugin", "fine", "--dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --role" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
