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
#: the names of other programs' variables (launchers, schedulers, libraries) as string literals
OUTSIDE = re.compile(r"[\"']((?:TORCHELASTIC|SLURM|PBS|LSB|FLUX|MASTER|LOCAL|GROUP|NODE|WORLD|HOROVOD|OMPI|PMI|PL|"
                     r"TORCH|CUDA|CUBLAS|DS|OMP|TQDM|MLFLOW|WANDB|NCCL|GLOO)_[A-Z0-9_]+|RANK)[\"']")


def documented() -> set[str]:
    names: set[str] = set()
    for line in TABLE.read_text().splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


def sources():
    for folder in (REPO / "core", REPO / "plugins"):
        for path in sorted(folder.rglob("*.py")):
            if "tests" not in path.relative_to(folder).parts:
                yield path


def test_every_variable_hookloop_reads_is_in_the_table():
    table = documented()
    missing: dict[str, str] = {}
    for path in sources():
        text = path.read_text()
        for name in re.findall(r"HOOKLOOP_[A-Z_]+", text) + OUTSIDE.findall(text):
            if name.rstrip("_") not in table:
                missing.setdefault(name, str(path.relative_to(REPO)))
    assert not missing, f"add these to docs/environment.md: {missing}"
    # the scan finds what it should (a scan that found nothing would pass too)
    assert {"HOOKLOOP_PLUGINS", "HOOKLOOP_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID"} <= table


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
