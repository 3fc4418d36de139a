"""A contract third parties can rely on across versions (issue 20, item 3).

``hookloop.CONTRACT_VERSION`` and the range a plugin declares (``hookloop_requires``),
checked at load; the deprecation path (pluggy's ``warn_on_impl``); the sanity check's
``on_validation_end(sanity_checking=...)`` and the conformance kit's check of it; and a
plugin written from the first release's docs, really installed (a distribution with an
entry point on a subprocess's path), warned with what changed instead of silently wrong.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pluggy
import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch.utils.data import DataLoader

import hookloop
import hookloop.tools.cli
from conftest import TinyModule, install_fake_distribution, tiny_data
from hookloop.contract import versioning
from hookloop.contract.registry import HookloopPluginManager
from hookloop.testing import ObserverConformance

REPO = Path(__file__).resolve().parents[1]

# The first release's documented contract (README of e4c4499): ``on_validation_end(trainer,
# metrics)`` after each validation, and ``<default_root_dir>/checkpoints/last.ckpt`` at every
# epoch end. A CSV observer written from it, as the third party wrote one.
OLD_CSV = '''
import hookloop

class OldCsv:
    """Writes a row per validation: epoch, val_acc, whether last.ckpt exists yet."""

    hookloop_role = "observer"

    @hookloop.hookimpl
    def on_validation_end(self, trainer, metrics):
        if trainer.is_global_zero:
            ckpt = trainer.default_root_dir / "checkpoints" / "last.ckpt"
            with open(trainer.default_root_dir / "val.csv", "a") as f:
                f.write(f"{trainer.current_epoch},{metrics['val_acc']},{ckpt.exists()}\\n")
'''

# The same observer written for contract 2 (CHANGELOG.md says what to change).
NEW_CSV = '''
import hookloop

class NewCsv:
    """Writes a row per validation: epoch, val_acc, whether last.ckpt exists yet."""

    hookloop_role = "observer"
    hookloop_requires = ">=2,<3"

    @hookloop.hookimpl
    def on_validation_end(self, trainer, metrics, sanity_checking):
        if trainer.is_global_zero and not sanity_checking:
            ckpt = trainer.log_dir / "checkpoints" / "last.ckpt"
            with open(trainer.default_root_dir / "val.csv", "a") as f:
                f.write(f"{trainer.current_epoch},{metrics['val_acc']},{ckpt.exists()}\\n")
'''

FIT_SCRIPT = '''
import sys
import hookloop
from torch.utils.data import DataLoader
from hookloop.testing.reference import TinyClassifier, tiny_dataset

trainer = hookloop.Trainer(plugins=[sys.argv[1]], max_epochs=2, num_sanity_val_steps=2,
                           enable_progress_bar=False, default_root_dir=sys.argv[2])
trainer.fit(TinyClassifier(), DataLoader(tiny_dataset(), batch_size=8), DataLoader(tiny_dataset(16, seed=2), batch_size=8))
'''


def _installed_site(tmp_path: Path, site: Path | None = None) -> Path:
    """The three distributions installed in ``site`` (default: ``tmp_path/site``)."""
    site = site or tmp_path / "site"
    install_fake_distribution(site, "hookloop-oldcsv", {"oldcsv": "hl_oldcsv:OldCsv"}, {"hl_oldcsv": OLD_CSV},
                              requires=["hookloop"])
    install_fake_distribution(site, "hookloop-newcsv", {"newcsv": "hl_newcsv:NewCsv"}, {"hl_newcsv": NEW_CSV},
                              requires=["hookloop"])
    install_fake_distribution(site, "hookloop-oldrange", {"oldrange": "hl_oldrange:OldRange"},
                              {"hl_oldrange": 'class OldRange:\n    hookloop_role = "observer"\n'
                                              '    hookloop_requires = ">=1,<2"\n'}, requires=["hookloop"])
    return site


def _env(site: Path) -> dict:
    env = dict(os.environ)
    for key in ("HOOKLOOP_TRAINER_DEFAULTS", "HOOKLOOP_WORKER", "LOCAL_RANK", "HOOKLOOP_PLUGINS", "PYTHONWARNINGS"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _python(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(site), capture_output=True, text=True, timeout=300)


def _python_together(commands: list[list[str]], site: Path, cwd: Path) -> list[subprocess.CompletedProcess]:
    """Several interpreters at once (each mostly waits on its imports), their results in order."""
    procs = [subprocess.Popen([sys.executable, *args], cwd=cwd, env=_env(site), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    results = []
    try:
        for args, proc in zip(commands, procs):
            out, err = proc.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _rows(root: Path) -> list[list[str]]:
    path = root / "val.csv"
    return [line.split(",") for line in path.read_text().splitlines()] if path.exists() else []


# ----------------------------------------------------------------------------- version, range


def test_contract_version_is_semver_and_the_changelog_names_it():
    version = Version(hookloop.CONTRACT_VERSION)
    assert len(hookloop.CONTRACT_VERSION.split(".")) == 3 and str(version) == hookloop.CONTRACT_VERSION
    changelog = (REPO / "CHANGELOG.md").read_text()
    contracts = re.findall(r"^## .*contract (\d+\.\d+\.\d+)", changelog, flags=re.M)
    assert contracts and contracts[0] == hookloop.CONTRACT_VERSION, "the newest CHANGELOG section names the contract"
    for needle in ("logs/version_N/checkpoints/", "sanity_checking", "BREAKING"):
        assert needle in changelog


def test_the_package_version_is_the_newest_changelog_version():
    """pyproject.toml, ``hookloop.__version__`` (what checkpoints record) and the newest
    CHANGELOG section say the same version (they disagreed: 0.1.0 against 0.8.0)."""
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    newest = re.findall(r"^## (\d+\.\d+\.\d+)", (REPO / "CHANGELOG.md").read_text(), flags=re.M)[0]
    assert declared == hookloop.__version__ == newest


def test_in_tree_plugins_declare_a_range_that_admits_the_contract():
    from hookloop.contract.registry import _load_entry_point, installed_plugins

    checked = []
    for name, info in sorted(installed_plugins().items()):
        if info.distribution in (None, "hookloop") or not info.distribution.startswith("hookloop-"):
            continue  # the core's own observers are the core
        try:
            plugin = _load_entry_point(info)
        except hookloop.MissingDependencyError:
            continue
        declared = getattr(plugin, "hookloop_requires", None)
        assert declared is not None, f"in-tree plugin {name!r} ({info.distribution}) declares no hookloop_requires"
        assert SpecifierSet(declared).contains(hookloop.CONTRACT_VERSION), (name, declared)
        checked.append(name)
    assert {"ddp", "amp", "deepspeed", "fsdp", "tp", "tensorboard", "throughput", "compile", "cp", "float8", "pipeline"} <= set(checked)


def test_a_range_that_excludes_the_running_contract_is_refused_at_load(site):
    install_fake_distribution(site, "hookloop-oldrange2", {"oldrange2": "hl_oldrange2:OldRange"},
                              {"hl_oldrange2": 'class OldRange:\n    hookloop_role = "observer"\n'
                                               '    hookloop_requires = ">=1,<2"\n'})
    with pytest.raises(hookloop.PluginValidationError) as info:
        hookloop.Trainer(plugins=["oldrange2"])
    message = str(info.value)
    for needle in ("'oldrange2'", "(hookloop-oldrange2)", ">=1,<2", f"contract {hookloop.CONTRACT_VERSION}",
                   "pip install 'hookloop<0.6'", "CHANGELOG.md", "hookloop_requires = '>=2,<3'"):
        assert needle in message, (needle, message)
    with pytest.raises(hookloop.PluginValidationError, match="oldrange2"):
        hookloop.plugin("oldrange2")


def test_a_plugin_given_in_code_is_held_to_its_range_too():
    class Future:
        hookloop_role = "observer"
        hookloop_requires = ">=3"

    class Fits:
        hookloop_role = "observer"
        hookloop_requires = ">=2,<3"

    with pytest.raises(hookloop.PluginValidationError, match=r"'Future' was written for hookloop contract >=3"):
        hookloop.Trainer(plugins=[Future()])
    hookloop.Trainer(plugins=[Fits()])


@pytest.mark.parametrize("declared, why", [("two or more", "not a version specifier"), (2, "must be a version specifier string")])
def test_a_malformed_range_is_a_clear_error(declared, why):
    plugin = type("Bad", (), {"hookloop_role": "observer", "hookloop_requires": declared})()
    with pytest.raises(hookloop.PluginValidationError, match=f"plugin 'Bad' declares hookloop_requires=.*{why}"):
        hookloop.Trainer(plugins=[plugin])


# ----------------------------------------------------------------------------- deprecation


@hookloop.hookspec(warn_on_impl=versioning.deprecated(
    "the hook on_old_event", since="2.1", changes_in="3.0", instead="implement on_new_event(trainer) instead"))
def on_old_event(trainer):
    """Deprecated."""


@hookloop.hookspec(warn_on_impl_args={"loss": versioning.deprecated(
    "on_batch_done's argument 'loss'", since="2.1", changes_in="3.0", instead="read outputs['loss']")})
def on_batch_done(trainer, loss, outputs):
    """Its ``loss`` argument is deprecated."""


# Hooks declared here, as hookspecs.py would mark one for a minor version.
DeprecatingSpecs = types.SimpleNamespace(on_old_event=on_old_event, on_batch_done=on_batch_done)


class UsesDeprecated:
    @hookloop.hookimpl
    def on_old_event(self, trainer):
        pass

    @hookloop.hookimpl
    def on_batch_done(self, loss):
        pass


class UpToDate:
    @hookloop.hookimpl
    def on_batch_done(self, outputs):
        pass


def test_a_plugin_implementing_a_deprecated_hook_or_argument_is_warned():
    pm = HookloopPluginManager("hookloop")
    pm.add_hookspecs(DeprecatingSpecs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.register(UpToDate(), name="uptodate")
    assert not [w for w in caught if issubclass(w.category, hookloop.HookloopDeprecationWarning)]
    with pytest.warns(hookloop.HookloopDeprecationWarning) as record:
        pm.register(UsesDeprecated(), name="old")
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2, messages
    assert messages[0].startswith("on_batch_done's argument 'loss' is deprecated since hookloop contract 2.1 "
                                  "and changes in 3.0: read outputs['loss']")
    assert messages[1].startswith("the hook on_old_event is deprecated since hookloop contract 2.1 and changes "
                                  "in 3.0: implement on_new_event(trainer) instead")
    # pluggy points the warning at the implementing function, in the plugin's own file
    assert {Path(w.filename).name for w in record} == {Path(__file__).name}


@pytest.mark.slow  # outside pytest: a fresh interpreter with Python's own warning filters
def test_the_deprecation_warning_is_shown_outside_pytest(tmp_path):
    """DeprecationWarning is hidden outside __main__ by default; hookloop's is not."""
    script = tmp_path / "author.py"
    script.write_text(textwrap.dedent('''
        import types
        import hookloop, plugin_mod
        from hookloop import versioning
        from hookloop.contract.registry import HookloopPluginManager

        @hookloop.hookspec(warn_on_impl=versioning.deprecated("the hook on_old", "2.1", "3.0", "use on_new"))
        def on_old(trainer):
            pass

        pm = HookloopPluginManager("hookloop")
        pm.add_hookspecs(types.SimpleNamespace(on_old=on_old))
        pm.register(plugin_mod.Plugin())
    '''))
    (tmp_path / "plugin_mod.py").write_text("import hookloop\nclass Plugin:\n    @hookloop.hookimpl\n"
                                            "    def on_old(self, trainer):\n        pass\n")
    proc = _python([str(script)], tmp_path, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plugin_mod.py:3: HookloopDeprecationWarning: the hook on_old is deprecated since hookloop contract 2.1" in proc.stderr


# ----------------------------------------------------------------------------- the sanity check


class RecordsValidationEnds:
    hookloop_role = "observer"

    def __init__(self):
        self.seen = []

    @hookloop.hookimpl
    def on_validation_end(self, trainer, metrics, sanity_checking):
        self.seen.append((sanity_checking, trainer.sanity_checking, trainer.state.fn))


def test_on_validation_end_says_when_it_is_the_sanity_check():
    recorder = RecordsValidationEnds()
    trainer = hookloop.Trainer(plugins=[recorder], max_epochs=2, num_sanity_val_steps=2, enable_checkpointing=False,
                               enable_progress_bar=False)
    module = TinyModule()
    trainer.fit(module, DataLoader(tiny_data(40), batch_size=8), DataLoader(tiny_data(16, seed=2), batch_size=8))
    trainer.validate(module, DataLoader(tiny_data(16, seed=2), batch_size=8))
    # one sanity check, one validation per epoch (2), one trainer.validate: the trainer's flag agrees
    assert recorder.seen == [(True, True, "fit"), (False, False, "fit"), (False, False, "fit"),
                             (False, False, "validate")]


class TestOldCsvFailsTheKit(ObserverConformance):
    """The kit's sanity-check test, run on the first-contract observer: it must fail."""

    plugin = None

    def test_writes_nothing_during_the_sanity_check(self, tmp_path):
        namespace: dict = {}
        exec(OLD_CSV, namespace)
        self.plugin = namespace["OldCsv"]
        with pytest.raises(AssertionError, match=r"the observer wrote val.csv .*during the sanity check"):
            super().test_writes_nothing_during_the_sanity_check()
        namespace = {}
        exec(NEW_CSV, namespace)
        self.plugin = namespace["NewCsv"]
        super().test_writes_nothing_during_the_sanity_check()

    test_weights_are_unchanged_by_the_observer = None
    test_events_arrive_in_the_documented_order = None
    test_under_ddp_only_global_rank_zero_writes_files = None
    test_its_checkpoint_state_comes_back_after_a_resume = None


# ----------------------------------------------------------------------------- installed, old and new


@pytest.mark.slow  # the warning as a fresh interpreter prints it (once per process), and two real runs
def test_a_first_contract_plugin_installed_is_warned_with_what_changed(tmp_path):
    site = _installed_site(tmp_path)
    (tmp_path / "fit.py").write_text(FIT_SCRIPT)
    old_root, new_root = tmp_path / "old", tmp_path / "new"

    old, new = _python_together([["fit.py", "oldcsv", str(old_root)], ["fit.py", "newcsv", str(new_root)]], site, tmp_path)
    assert old.returncode == 0, old.stderr
    warning = [line for line in old.stderr.splitlines() if "HookloopContractWarning" in line]
    assert len(warning) == 1, old.stderr
    for needle in ("plugin 'oldcsv' (hookloop-oldcsv) declares no hookloop contract range", f"contract {hookloop.CONTRACT_VERSION}",
                   "<log_dir>/checkpoints/", "not <default_root_dir>/checkpoints/",
                   "on_validation_end is also called for the sanity check", "sanity_checking", "CHANGELOG.md"):
        assert needle in warning[0], (needle, warning[0])
    # what the warning announces is what happens: a sanity row first, and no checkpoint at the old path
    assert [row[0] for row in _rows(old_root)] == ["0", "0", "1"]
    assert [row[2] for row in _rows(old_root)] == ["False", "False", "False"]

    assert new.returncode == 0, new.stderr
    assert "HookloopContractWarning" not in new.stderr and "HookloopDeprecationWarning" not in new.stderr
    # one row per epoch's validation (max_epochs=2), and epoch 1 sees epoch 0's last.ckpt
    assert [(row[0], row[2]) for row in _rows(new_root)] == [("0", "False"), ("1", "True")]


def test_an_incompatible_installed_plugin_fails_clearly_and_check_reports_ranges(tmp_path, site, monkeypatch, capsys):
    """``hookloop check`` loads each plugin through the same entry-point path as a run
    (here in this process, through ``hookloop.tools.cli.main``)."""
    _installed_site(tmp_path, site)
    importlib.invalidate_caches()
    monkeypatch.setattr(versioning, "_TOLD", set())  # oldcsv's once-per-process warning: not used up for later tests
    before = set(sys.modules)
    try:
        code = hookloop.tools.cli.main(["check", "oldcsv", "newcsv", "oldrange"])
    finally:
        for name in set(sys.modules) - before:  # the hl_* modules imported from site
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(site)):
                del sys.modules[name]
    out = capsys.readouterr()
    assert code == 1, out.out + out.err  # oldrange's problem
    lines = out.out.splitlines()
    assert "oldcsv: ok" in lines and "newcsv: ok" in lines and "oldrange: 1 problem(s)" in lines, out.out
    # accepted, and said: only oldcsv declares no range
    note = lines.index("oldcsv: ok") + 1
    assert lines[note].startswith("  note: declares no contract range (hookloop_requires)"), out.out
    assert out.out.count("note:") == 1
    assert ("plugin 'oldrange' (hookloop-oldrange) was written for hookloop contract >=1,<2, and this hookloop "
            f"implements contract {hookloop.CONTRACT_VERSION}: install a hookloop whose contract it admits") in out.out
