"""The `hookloop` command: listing plugins, and `run` handing its options to the script.

Commands whose launch is not what a test checks run in this process through
``hookloop.tools.cli.main`` (what the console script and ``python -m hookloop`` call); the
tests of ``hookloop run`` starting a script (its options, its arguments, a real training
run, the elastic agent's restart) launch it for real and are marked slow.
"""

import importlib
import json
import sys
import textwrap

import pytest

from conftest import REPO, install_fake_distribution, run_python
from hookloop.tools import cli
from hookloop.contract import versioning

HOOKLOOP = [sys.executable, "-m", "hookloop"]

SHOW_CONFIG = textwrap.dedent(
    """
    import json, os, hookloop
    t = hookloop.Trainer(max_epochs=7, limit_train_batches=hookloop.default(5), default_root_dir=hookloop.default("x"))
    c = t.config
    print("CONFIG=" + json.dumps({"max_epochs": c.max_epochs, "limit": c.limit_train_batches,
        "accumulate": c.accumulate_grad_batches, "root": c.default_root_dir,
        "worker": os.environ.get("HOOKLOOP_WORKER"), "plugins": [type(p).__name__ for p in t.plugins]}))
    """
)


def config_from(stdout: str) -> dict:
    (line,) = [l for l in stdout.splitlines() if l.startswith("CONFIG=")]
    return json.loads(line[len("CONFIG="):])


@pytest.fixture
def fake_site(site, monkeypatch):
    """``site`` for ``cli.main`` in this process: hookloop's once-per-process notes
    (versioning._TOLD) start empty and end as they were, and the fake plugins' modules
    imported from ``site`` are forgotten afterwards (a later test's fake module of the same
    name must be imported from its own files)."""
    monkeypatch.setattr(versioning, "_TOLD", set())
    before = set(sys.modules)
    yield site
    for name in set(sys.modules) - before:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(site)):
            del sys.modules[name]


def installed(site, *args, **kwargs) -> None:
    """``install_fake_distribution`` into ``site``, then seen by this process's imports."""
    install_fake_distribution(site, *args, **kwargs)
    importlib.invalidate_caches()


@pytest.mark.slow  # the options reach the script's own interpreter through the launch
def test_run_options_become_trainer_defaults(tmp_path):
    (tmp_path / "show.py").write_text(SHOW_CONFIG)
    out = run_python(HOOKLOOP + ["run", "--max-epochs", "3", "--accumulate-grad-batches", "4",
                                 "--default-root-dir", "out", "show.py"], cwd=tmp_path)
    cfg = config_from(out.stdout)
    # code wins (max_epochs=7), the CLI wins over hookloop.default (root), default fills the rest.
    # One plain interpreter is not a launched worker: a Trainer in it may still launch some.
    assert cfg == {"max_epochs": 7, "limit": 5, "accumulate": 4, "root": "out", "worker": None,
                   "plugins": ["ProgressBar", "ModelSummary", "CSVLogger", "ModelCheckpoint"]}


@pytest.mark.slow  # the script's arguments reach the launched interpreter
def test_run_passes_script_arguments(tmp_path):
    (tmp_path / "args.py").write_text("import sys; print('ARGS=' + ','.join(sys.argv[1:]))")
    out = run_python(HOOKLOOP + ["run", "args.py", "--lr", "0.1", "x"], cwd=tmp_path)
    assert "ARGS=--lr,0.1,x" in out.stdout


def test_plugins_lists_without_importing(tmp_path, fake_site, capsys):
    # The marker file is the proof: the plugin's module writes it when imported.
    marker = tmp_path / "imported"
    installed(
        fake_site, "hookloop-noisy", {"noisy": "hl_noisy:Noisy"},
        {"hl_noisy": f"open({str(marker)!r}, 'w').write('x')\nclass Noisy:\n    hookloop_role = 'observer'\n"},
        requires=["hookloop", "surely-not-installed-pkg"],
    )
    assert cli.main(["plugins"]) == 0
    (row,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("noisy")]
    assert "hookloop-noisy" in row and "0.1" in row and "missing: surely-not-installed-pkg" in row
    assert "observer" in row.split()  # the role, read from the source
    assert not marker.exists()


def test_roles_read_from_source_are_the_roles_the_plugins_declare(site):
    """Every installed plugin's role, read without importing it, equals the role of the
    imported plugin; re-exports, inheritance, tuple assignments and modules included."""
    from hookloop.contract import registry
    from hookloop.contract.sourcescan import declared_role

    (site / "hl_pkg").mkdir()
    (site / "hl_pkg" / "__init__.py").write_text("from .impl import Child as Exported\nraise SystemExit('ran')\n")
    (site / "hl_pkg" / "impl.py").write_text(
        "class Base:\n    hookloop_name, hookloop_role = 'base', 'precision'\n"
        "class Child(Base):\n    pass\n"
    )
    (site / "hl_mod.py").write_text("hookloop_role: str = 'observer'\n")
    (site / "hl_dynamic.py").write_text("class P:\n    hookloop_role = 'obs' + 'erver'\n")
    assert declared_role("hl_pkg:Exported") == "precision"
    assert declared_role("hl_mod") == "observer"
    assert declared_role("hl_dynamic:P") is None  # computed: only --load can tell
    assert declared_role("not_a_module_anywhere:X") is None
    infos = registry.installed_plugins()
    assert {"ddp", "ddp_spawn", "amp", "deepspeed_stage_3"} <= set(infos)
    for name, info in infos.items():
        assert declared_role(info.value) == registry.plugin_role(registry.resolve(name)), name


def test_plugins_load_shows_role(fake_site, capsys):
    installed(fake_site, "hookloop-quiet", {"quiet": "hl_quiet:Q"},
              {"hl_quiet": "class Q:\n    hookloop_role = 'observer'\n"})
    assert cli.main(["plugins", "--load"]) == 0
    (row,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("quiet")]
    assert "observer" in row and "ok" in row


def test_run_unknown_plugin_is_a_clear_error(tmp_path, capfd):
    (tmp_path / "x.py").write_text("print('should not run')")
    # capfd, not capsys: a script started by mistake would print on the file descriptor.
    assert cli.main(["run", "--plugins", "nosuchplugin", "x.py"]) == 2
    out, err = capfd.readouterr()
    assert "no plugin named 'nosuchplugin'" in err and "should not run" not in out


@pytest.mark.slow  # the option reaches the script's Trainer through the launch
def test_run_blocks_lightning_compatibility_with_no_lightning(tmp_path):
    (tmp_path / "cb.py").write_text(textwrap.dedent("""
        import hookloop
        try:
            hookloop.Trainer(callbacks=[hookloop.Callback()])
        except hookloop.ConfigurationError as error:
            print("REFUSED:", error)
        trainer = hookloop.Trainer(plugins=["lightning"], logger=False)  # naming it: on anyway
        print("PLAIN:", [t.name for t in trainer._translators])
    """))
    out = run_python(HOOKLOOP + ["run", "-p", "no:lightning", "cb.py"], cwd=tmp_path).stdout
    assert "REFUSED: Trainer(callbacks=...) is Lightning compatibility, which is blocked (no:lightning in " \
           "--plugins / HOOKLOOP_PLUGINS)" in out
    assert "PLAIN: []" in out  # blocked by the command line, though the code names it
    out = run_python(HOOKLOOP + ["run", "-p", "lightning", "cb.py"], cwd=tmp_path).stdout
    assert "REFUSED" not in out and "PLAIN: ['lightning']" in out


@pytest.mark.slow  # a real training run started by `hookloop run`
def test_digits_example_reaches_accuracy(tmp_path):
    out = run_python(HOOKLOOP + ["run", "--default-root-dir", "out", "--max-epochs", "10",
                                 str(REPO / "examples" / "digits.py")], cwd=tmp_path)
    acc = float(out.stdout.strip().splitlines()[-1].split()[-1])
    assert acc >= 0.9
    assert (tmp_path / "out" / "logs" / "version_0" / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow  # the elastic agent restarting a launched worker
def test_run_restarts_a_failed_worker_through_the_elastic_agent(tmp_path):
    """--max-restarts hands the script to torchrun, which restarts it after a failure."""
    (tmp_path / "flaky.py").write_text(textwrap.dedent(
        """
        import os, pathlib
        marker = pathlib.Path("attempts")
        n = int(marker.read_text()) + 1 if marker.exists() else 1
        marker.write_text(str(n))
        print("attempt", n, "restart", os.environ.get("TORCHELASTIC_RESTART_COUNT"))
        raise SystemExit(1 if n == 1 else 0)
        """
    ))
    run_python(HOOKLOOP + ["run", "--max-restarts", "1", "flaky.py"], cwd=tmp_path)
    assert (tmp_path / "attempts").read_text() == "2"


def test_plugins_load_reads_the_installed_metadata_once(monkeypatch, capsys):
    """`hookloop plugins --load` checks every installed plugin; each check used to read every
    distribution's metadata again (292 readings of the entry points and 41 of
    packages_distributions for this repository's plugins: 12 s). Once each now, with the
    same table."""
    import importlib.metadata as md

    from hookloop.tools import cli
    from hookloop.contract import registry

    calls = {"plugins": 0, "packages": 0}
    read, packages = registry._read_installed_plugins, md.packages_distributions

    def counted_read():
        calls["plugins"] += 1
        return read()

    def counted_packages():
        calls["packages"] += 1
        return packages()

    monkeypatch.setattr(registry, "_read_installed_plugins", counted_read)
    monkeypatch.setattr(md, "packages_distributions", counted_packages)
    assert cli.main(["plugins", "--load"]) == 0
    table = capsys.readouterr().out
    assert calls == {"plugins": 1, "packages": 1}
    assert registry.installed_plugins().keys() == {line.split()[0] for line in table.splitlines()[1:] if line.strip()}
    assert calls["plugins"] == 2  # outside the command, read afresh (a plugin installed since is seen)
