"""The environment made explicit (issue 32): every variable hookloop reads is in one
table (docs/environment.md), the ones that change a run are said in its first lines, the
launcher's private channels are honoured only in the processes that launcher started, and
a run's identity is never inherited by an unrelated process.

In-process where the behaviour allows; the launched checks are marked slow."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest
from torch.utils.data import DataLoader

import hookloop
from hookloop.contract import registry
from hookloop.resume import rundir
from conftest import REPO, TinyModule, install_fake_distribution, tiny_data

TABLE = REPO / "docs" / "environment.md"
#: the names of the variables hookloop and other programs (launchers, schedulers, libraries)
#: own, as a whole string literal
OUTSIDE = re.compile(r"^(?:(?:HOOKLOOP|TORCHELASTIC|SLURM|PBS|LSB|FLUX|MASTER|LOCAL|GROUP|NODE|WORLD|HOROVOD|"
                     r"OMPI|PMI|PMIX|MPI|JSM|PET|PL|TORCH|TORCHFT|CUDA|CUBLAS|DS|OMP|TQDM|MLFLOW|WANDB|NCCL|GLOO)_[A-Z0-9_]+|RANK)$")
VARIABLE = re.compile(r"^[A-Z][A-Z0-9_]*[A-Z0-9]$")
#: calls whose first argument is a variable's name: os.environ.get/pop/setdefault, os.getenv,
#: hookloop.env_int, an environment mapping's get
READERS = {"get", "getenv", "env_int", "pop", "setdefault", "_restart_count", "putenv", "unsetenv"}


def table_rows() -> list[tuple[set[str], list[str]]]:
    """``(variables, read-by modules)`` per row of the tables."""
    rows = []
    for line in TABLE.read_text().splitlines():
        if line.startswith("| `"):
            cells = line.split("|")
            rows.append((set(re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[1])), re.findall(r"`([^`]+)`", cells[2])))
    return rows


def documented() -> set[str]:
    return {name for names, _ in table_rows() for name in names}


def sources():
    for folder in (REPO / "core", REPO / "plugins"):
        for path in sorted([*folder.rglob("*.py"), *folder.rglob("*.sh")]):
            if "tests" not in path.relative_to(folder).parts:
                yield path


def variables_in(path) -> set[str]:
    """The environment variables ``path`` reads or sets: ``os.environ.get("X")``,
    ``os.environ["X"]``, ``os.getenv("X")``, ``env_int("X")``, ``environ.get("X")``, and any
    string literal that is a variable's whole name (``LAUNCHER_ENV = "HOOKLOOP_LAUNCHER_PID"``;
    in a shell script, every ``HOOKLOOP_`` name)."""
    import ast

    text = path.read_text()
    if path.suffix == ".sh":
        return set(re.findall(r"HOOKLOOP_[A-Z0-9_]*[A-Z0-9]", text))
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and OUTSIDE.match(node.value):
            found.add(node.value)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            first = node.args[0].value
            if (func.rsplit(".", 1)[-1] in READERS and isinstance(first, str) and VARIABLE.match(first)
                    and ("env" in func.lower() or func in ("getenv", "_restart_count"))):
                found.add(first)
        elif (isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value)
              and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            found.add(node.slice.value)
    return found


def module_of(path) -> str:
    """``core/hookloop/engine/resolution.py`` -> ``hookloop.engine.resolution``;
    ``plugins/ddp/src/hookloop_ddp/__init__.py`` -> ``hookloop_ddp``; a script: its path."""
    rel = path.relative_to(REPO)
    if path.suffix != ".py":
        return str(rel)
    parts = list(rel.with_suffix("").parts)
    parts = parts[1:] if parts[0] == "core" else parts[3:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def variables_read() -> dict[str, set[str]]:
    """``{variable: the modules that read or set it}`` over core/ and plugins/."""
    found: dict[str, set[str]] = {}
    for path in sources():
        for name in variables_in(path):
            found.setdefault(name, set()).add(module_of(path))
    return found


@pytest.mark.check
def test_the_table_lists_exactly_the_variables_hookloop_reads():
    table, found = documented(), variables_read()
    missing = {name: sorted(found[name]) for name in sorted(set(found) - table)}
    stale = sorted(table - set(found))
    assert not missing, f"add these to docs/environment.md (read by): {missing}"
    assert not stale, f"docs/environment.md lists variables nothing in core/ or plugins/ reads: {stale}"
    for names, modules in table_rows():
        readers = set().union(*(found[n] for n in names))
        assert modules and set(modules) <= readers, (
            f"docs/environment.md, the row of {sorted(names)}: 'read by' names {sorted(set(modules) - readers)} "
            f"which do not read it; its readers: {sorted(readers)}")
    # the scan finds what it should (a scan that found nothing would pass too)
    assert {"HOOKLOOP_PLUGINS", "HOOKLOOP_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID"} <= table


@pytest.mark.check
def test_the_scan_sees_each_way_of_reading_a_variable(tmp_path):
    source = tmp_path / "x.py"
    source.write_text('import os\nLAUNCHER_ENV = "HOOKLOOP_LAUNCHER_PID"\nos.environ.get("A_VAR")\n'
                      'os.environ["B_VAR"]\nos.getenv("C_VAR")\nenv_int("D_VAR", 0)\nenviron.get("E_VAR")\n'
                      'x = {}.get("NOT_ONE")\n"RANK"\n')
    assert variables_in(source) == {"HOOKLOOP_LAUNCHER_PID", "A_VAR", "B_VAR", "C_VAR", "D_VAR", "E_VAR", "RANK"}


@pytest.mark.check
def test_only_the_settings_resolution_reads_the_trainer_setting_variables_in_the_engine():
    """The variables that set a Trainer's settings (and their readers) appear in engine/ only
    in resolution.py (which is handed the environment) and settings.py (which defines
    ``HOOKLOOP_TRAINER_DEFAULTS``'s reader)."""
    names = re.compile(r"\b(HOOKLOOP_(?:TRAINER_DEFAULTS|PLUGINS|PLUGIN_OPTIONS|AUTOLOAD_PLUGINS|MESH)|"
                       r"(?:DEFAULTS|PLUGINS|OPTIONS|AUTOLOAD|MESH)_ENV|environment_(?:plugins|plugin_options|"
                       r"autoload|mesh)|env_defaults)\b")
    import ast

    def code_names(path) -> set[str]:
        """The names above in the identifiers and strings of the code, not its docstrings."""
        tree = ast.parse(path.read_text())
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        words = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                words.append(node.id)
            elif isinstance(node, ast.Attribute):
                words.append(node.attr)
            elif isinstance(node, ast.alias):
                words.append(node.name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                words.append(node.value)
        return {m for w in words for m in names.findall(w)}

    engine = REPO / "core" / "hookloop" / "engine"
    elsewhere = {str(p.relative_to(REPO)): sorted(code_names(p))
                 for p in sorted(engine.glob("*.py")) if p.name not in ("resolution.py", "settings.py")}
    assert not {k: v for k, v in elsewhere.items() if v}, elsewhere
    assert names.findall((engine / "resolution.py").read_text())


def fit(epochs: int = 1, **kwargs) -> hookloop.Trainer:
    trainer = hookloop.Trainer(max_epochs=epochs, enable_progress_bar=False, enable_model_summary=False, **kwargs)
    trainer.fit(TinyModule(), DataLoader(tiny_data(32), batch_size=8))
    return trainer


# -- item 4: the run's first lines say what came from the environment -------------------


def test_plugin_options_from_the_environment_are_said_in_the_first_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOOKLOOP_PLUGIN_OPTIONS", "checkpoint.save_last=false")
    trainer = fit(default_root_dir=str(tmp_path))
    out = capsys.readouterr().out
    assert not (trainer.log_dir / "checkpoints" / "last.ckpt").exists()  # what the variable did
    assert out.splitlines()[0] == ("hookloop: from the environment: HOOKLOOP_PLUGIN_OPTIONS="
                                   "'checkpoint.save_last=false': plugin options (--plugin-option and code win per option)")
    fit(default_root_dir=str(tmp_path))  # a second Trainer says it again, in its own first lines
    assert "HOOKLOOP_PLUGIN_OPTIONS=" in capsys.readouterr().out


def test_a_run_without_such_variables_says_nothing_of_the_environment(tmp_path, capsys):
    fit(default_root_dir=str(tmp_path))
    assert "from the environment" not in capsys.readouterr().out


def test_plugins_mesh_and_run_id_from_the_environment_are_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOOKLOOP_PLUGINS", "lr_monitor")
    monkeypatch.setenv("HOOKLOOP_RUN_ID", "exp-7")
    fit(default_root_dir=str(tmp_path))
    lines = [line for line in capsys.readouterr().out.splitlines() if "from the environment" in line]
    assert lines == [
        "hookloop: from the environment: HOOKLOOP_PLUGINS='lr_monitor': plugins added to the run",
        "hookloop: from the environment: HOOKLOOP_RUN_ID='exp-7': this job's id (its runs take the run "
        "directories an earlier job of that id marked)",
    ]


# -- item 5: a leftover HOOKLOOP_TRAINER_DEFAULTS -----------------------------------------


def test_leftover_trainer_defaults_are_ignored_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("HOOKLOOP_TRAINER_DEFAULTS", '{"max_epochs": 1, "enable_checkpointing": false}')
    monkeypatch.delenv("HOOKLOOP_LAUNCHER_PID", raising=False)
    with pytest.warns(UserWarning, match=r"HOOKLOOP_TRAINER_DEFAULTS is set, but no hookloop launcher started this "
                                         r"process .*ignored.*`unset HOOKLOOP_TRAINER_DEFAULTS`"):
        trainer = hookloop.Trainer(max_epochs=3, default_root_dir=str(tmp_path))
        assert hookloop.Trainer().max_epochs != 1
    assert trainer.max_epochs == 3 and trainer.checkpoint_callback is not None


def test_trainer_defaults_are_honoured_in_a_process_the_launcher_started(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HOOKLOOP_TRAINER_DEFAULTS", '{"max_epochs": 1}')
    monkeypatch.setenv("HOOKLOOP_LAUNCHER_PID", str(os.getppid()))  # this process's parent "launched" it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = fit(epochs=hookloop.default(5), default_root_dir=str(tmp_path))
    assert trainer.current_epoch == 1
    # the launcher's options are the user's own command line: not repeated as "from the environment"
    assert "from the environment" not in capsys.readouterr().out


# -- item 6: HOOKLOOP_AUTOLOAD_PLUGINS ------------------------------------------------------

NEEDY_STRATEGY = '''
import hookloop

class Needy:
    """A strategy that cannot be constructed here (as ddp2 without hookloop-dp)."""
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"

    def __init__(self):
        raise hookloop.MissingDependencyError("Needy needs hookloop-notinstalled")
'''

WRITER = '''
import hookloop

class Writer:
    hookloop_role = "observer"
    hookloop_requires = ">=2,<3"
'''


@pytest.fixture
def autoload_site(site):
    install_fake_distribution(site, "hookloop-needy", {"needy": "hl_needy:Needy"}, {"hl_needy": NEEDY_STRATEGY})
    install_fake_distribution(site, "hookloop-writer", {"writer": "hl_writer:Writer"}, {"hl_writer": WRITER})
    yield
    for name in ("hl_needy", "hl_writer"):
        sys.modules.pop(name, None)


def test_autoload_skips_strategies_unbuilt_and_says_which_plugins_it_added(autoload_site, monkeypatch, capsys,
                                                                        tmp_path):
    monkeypatch.setenv("HOOKLOOP_AUTOLOAD_PLUGINS", "1")
    trainer = fit(default_root_dir=str(tmp_path))  # Needy() would raise: never constructed
    names = [registry.plugin_name(p) for p in trainer.plugins]
    assert "writer" in names and "needy" not in names
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "HOOKLOOP_AUTOLOAD_PLUGINS" in x]
    assert line.startswith("hookloop: from the environment: HOOKLOOP_AUTOLOAD_PLUGINS='1': added the installed plugins ")
    added = line.split("added the installed plugins ")[1].split(" (block one")[0].split(", ")
    assert "writer" in added and "needy" not in added
    assert set(added) <= set(names) and "ddp2" not in added


def test_autoload_given_in_code_is_not_said_to_come_from_the_environment(autoload_site, monkeypatch, capsys,
                                                                       tmp_path):
    monkeypatch.setenv("HOOKLOOP_AUTOLOAD_PLUGINS", "1")
    fit(default_root_dir=str(tmp_path), autoload_plugins=False)
    assert "HOOKLOOP_AUTOLOAD_PLUGINS" not in capsys.readouterr().out


# -- item 8: an unknown plugin name from HOOKLOOP_PLUGINS ----------------------------------


def test_an_unknown_plugin_from_the_environment_says_where_it_came_from(monkeypatch):
    monkeypatch.setenv("HOOKLOOP_PLUGINS", "ddpp")
    with pytest.raises(hookloop.PluginNotFoundError) as raised:
        hookloop.Trainer()
    message = str(raised.value)
    assert message.startswith("no plugin named 'ddpp' is installed. Did you mean 'ddp'")
    assert message.endswith("The name comes from the environment variable HOOKLOOP_PLUGINS='ddpp', not from the "
                            "code or the command line: correct it there, or unset it (`unset HOOKLOOP_PLUGINS`)")


# -- run identity (defect 3): never exported into the environment --------------------------


def test_a_fit_does_not_export_its_run_id(tmp_path, monkeypatch):
    monkeypatch.delenv(rundir.TOKEN_ENV, raising=False)
    fit(default_root_dir=str(tmp_path))
    assert rundir.TOKEN_ENV not in os.environ


def test_an_inherited_run_token_is_not_this_jobs_id(monkeypatch):
    monkeypatch.setenv(rundir.TOKEN_ENV, "the parent's job")
    monkeypatch.delenv("HOOKLOOP_LAUNCHER_PID", raising=False)
    for name in ("TORCHELASTIC_RUN_ID", rundir.RUN_ID_ENV, "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert rundir.run_token() != "the parent's job"
    monkeypatch.setenv("HOOKLOOP_LAUNCHER_PID", str(os.getppid()))  # handed by the launcher that started it
    assert rundir.run_token() == "the parent's job"


def test_a_first_attempt_never_takes_a_marked_directory(tmp_path, monkeypatch):
    for name in ("TORCHELASTIC_RESTART_COUNT", rundir.RUN_ID_ENV):
        monkeypatch.delenv(name, raising=False)
    first = rundir.claim(tmp_path, "hookloop", 0)  # torchrun's default rendezvous id, shared by two jobs
    second = rundir.claim(tmp_path, "hookloop", 0)
    assert (first.name, second.name) == ("version_0", "version_1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the second job's restarted worker
    assert rundir.claim(tmp_path, "hookloop", 0) == second  # its own: the newest marked
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # a requeued job: a new run (ckpt_path="last" resumes)
    assert rundir.claim(tmp_path, "hookloop", 0).name == "version_2"
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    monkeypatch.setenv(rundir.RUN_ID_ENV, "named")  # a job named by the user: its runs continue
    named = rundir.claim(tmp_path, "named", 0)
    assert rundir.claim(tmp_path, "named", 0) == named != second


# -- item 7: a stale HOOKLOOP_LAUNCHER_PID --------------------------------------------------


@pytest.mark.slow  # `import hookloop` in a fresh interpreter: the check runs at import
def test_a_stale_launcher_pid_is_ignored_with_a_warning_naming_it(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no process has now
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKLOOP_", "TORCHELASTIC_"))}
    env["HOOKLOOP_LAUNCHER_PID"] = str(gone.pid)
    code = "import os, hookloop; print('imported', os.environ.get('HOOKLOOP_LAUNCHER_PID'))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported None"  # nor do its children inherit it
    assert (f"HOOKLOOP_LAUNCHER_PID={gone.pid} is set, but process {gone.pid} did not start this one") in proc.stderr
    assert "`unset HOOKLOOP_LAUNCHER_PID`" in proc.stderr
