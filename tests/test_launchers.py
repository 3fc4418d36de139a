"""The ``launcher`` role (contract 2.6): a launcher composes with any strategy.

A launcher starts the workers (torchrun, spawn, horovodrun, a third party's); a strategy
only runs inside them. References: the one-process run over the ranks' concatenated
batches (tests/scripts/ddp_reference.py) and the uninterrupted run.
"""

from __future__ import annotations

import sys

import pytest
import torch

import hookloop
from hookloop.contract import registry
from torch.utils.data import DataLoader

from conftest import REPO, TinyModule, max_abs_diff, run_python, tiny_data

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from ddp_reference import concatenated_batches_run  # noqa: E402

JOB = REPO / "tests" / "scripts" / "launcher_job.py"


def launchers_of(trainer: hookloop.Trainer) -> list[str]:
    return [registry.plugin_name(p) for p in trainer.plugins if registry.plugin_role(p) == "launcher"]


def test_a_run_gets_the_launcher_it_names_else_its_strategys_else_none():
    # ddp_spawn names the core's spawn launcher, with its start_method and its own name
    trainer = hookloop.Trainer(plugins=[hookloop.plugin("ddp_spawn", start_method="fork")])
    (spawn,) = [p for p in trainer.plugins if registry.plugin_role(p) == "launcher"]
    assert (registry.plugin_name(spawn), spawn.start_method, spawn.label) == ("spawn", "fork", "ddp_spawn")
    # a launcher named in the run replaces the strategy's
    assert launchers_of(hookloop.Trainer(plugins=["ddp_spawn", "torchrun"])) == ["torchrun"]
    assert launchers_of(hookloop.Trainer(plugins=["fsdp", "spawn"])) == ["spawn"]
    # ddp names none: the built-in default (torchrun's command, hookloop.defaults) answers
    assert launchers_of(hookloop.Trainer(plugins=["ddp"])) == []
    # dp and ddp2 drive several devices from one process per node
    assert launchers_of(hookloop.Trainer(plugins=["dp"])) == ["in_process"]
    assert launchers_of(hookloop.Trainer(plugins=["ddp2"])) == ["torchrun"]


def test_a_strategy_that_trains_in_the_calling_process_refuses_restarts():
    # dp ignored max_restarts before it named the in_process launcher
    with pytest.raises(hookloop.ConfigurationError, match=r"dp trains in the calling process, which cannot start itself again \(max_restarts=2\)"):
        hookloop.Trainer(plugins=["dp"], max_restarts=2, enable_progress_bar=False).fit(
            TinyModule(), DataLoader(tiny_data(), batch_size=8))


def test_two_launchers_are_refused_naming_both():
    with pytest.raises(hookloop.PluginConflictError, match=r"'torchrun', 'spawn' are all launcher plugins"):
        hookloop.Trainer(plugins=["ddp", "torchrun", "spawn"])


class LegacyStrategy(hookloop.DistributedSampling):
    """A strategy written for contract 2.5, which still answers launch_command itself."""

    hookloop_name, hookloop_role = "legacy", "strategy"

    @hookloop.hookimpl
    def launch_command(self, config, script, script_args):
        return ["legacy-launcher", script]


class Recording:
    """A third party's launcher: says what it would run."""

    hookloop_name, hookloop_role = "recording", "launcher"

    @hookloop.hookimpl
    def launch_command(self, config, script, script_args):
        return ["recording-launcher", str(config.num_processes()), script, *script_args]


def test_the_launcher_answers_before_the_strategy_and_composes_without_a_combined_class():
    config = hookloop.TrainerConfig(devices=2)
    trainer = hookloop.Trainer(plugins=[Recording(), LegacyStrategy()], devices=2)
    assert trainer.hook.launch_command(config=config, script="t.py", script_args=["a"]) == [
        "recording-launcher", "2", "t.py", "a"]
    # without a launcher, the 2.5 strategy's own answer stands (nothing it wrote breaks)
    trainer = hookloop.Trainer(plugins=[LegacyStrategy()], devices=2)
    assert trainer.hook.launch_command(config=config, script="t.py", script_args=[]) == ["legacy-launcher", "t.py"]


def test_a_strategy_that_names_a_plugin_of_another_role_as_launcher_is_refused():
    class Odd(LegacyStrategy):
        hookloop_name = "odd"
        hookloop_launcher = "checkpoint"

    with pytest.raises(hookloop.PluginValidationError, match=r"names 'checkpoint' as its launcher .* role is 'observer'"):
        hookloop.Trainer(plugins=[Odd()])


@pytest.mark.slow
@pytest.mark.parametrize("plugins", ["ddp,spawn", "fsdp,spawn"])
def test_the_spawn_launcher_runs_any_strategy_and_returns_its_weights(tmp_path, plugins):
    """Two spawned processes per strategy (~10 s each): the weights the caller's module
    holds equal the one-process run over both ranks' batches."""
    run_python([sys.executable, str(JOB), str(tmp_path), plugins], cwd=tmp_path, timeout=300)
    record = torch.load(tmp_path / "parent.pt", weights_only=False)
    assert record["launchers"] == ["spawn"] and record["global_step"] == 12
    reference = concatenated_batches_run(tiny_data(96), epochs=2, batch=8)
    assert max_abs_diff(record["state"], reference) <= 1e-5


@pytest.mark.slow
def test_spawn_restarts_a_failed_attempt_from_last_ckpt_and_ends_where_the_uninterrupted_run_ends(tmp_path):
    """Two attempts of two spawned processes (~15 s): rank 1 dies at step 5 of the first,
    the second resumes from the run's last.ckpt (HOOKLOOP_ATTEMPT=1) in the same run
    directory, and the weights equal the uninterrupted run's reference."""
    proc = run_python([sys.executable, str(JOB), str(tmp_path), "ddp,spawn", "1", "5"], cwd=tmp_path,
                      timeout=300)
    assert "starting attempt 1 of 1 restart(s)" in proc.stderr
    assert "restart 1 of this run (HOOKLOOP_ATTEMPT=1): resumed from" in proc.stdout + proc.stderr
    record = torch.load(tmp_path / "parent.pt", weights_only=False)
    assert record["global_step"] == 12
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["version_0"]
    reference = concatenated_batches_run(tiny_data(96), epochs=2, batch=8)
    assert max_abs_diff(record["state"], reference) <= 1e-5


@pytest.mark.slow
def test_spawn_without_restarts_raises_the_workers_failure(tmp_path):
    """One attempt of two spawned processes (~8 s): a worker that dies fails the fit, in
    the caller, with the surviving rank's explained error naming the dead one, or (when
    torch.multiprocessing stopped the survivor before its collective failed) saying that
    a worker died without a report."""
    expected = (r"CollectiveTimeoutError: global rank 0: .*Suspected rank\(s\): 1"
                r"|a spawn worker process died before it could report an error")
    with pytest.raises(AssertionError, match=expected) as info:
        run_python([sys.executable, str(JOB), str(tmp_path), "ddp,spawn", "0", "3"], cwd=tmp_path, timeout=300)
    assert "starting attempt" not in str(info.value)


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not this one")


def test_a_workers_error_comes_back_as_its_own_exception_with_its_traceback():
    import pickle

    try:
        raise KeyError("missing column")
    except KeyError as exc:
        report = pickle.loads(pickle.dumps(hookloop.worker_error(exc)))  # plain data, as a file carries it
    back = hookloop.adopt_worker_error(report, "spawn worker process 1", "spawn worker 1 failed")
    assert type(back) is KeyError and back.args == ("missing column",)
    assert back.__notes__[0].startswith("(raised in spawn worker process 1:)\nTraceback") and "missing column" in back.__notes__[0]
    try:
        raise Unpicklable("x")
    except Unpicklable as exc:
        report = hookloop.worker_error(exc)
    assert report["exception"] is None
    back = hookloop.adopt_worker_error(report, "the ray worker of rank 0", "a ray worker failed")
    assert type(back) is RuntimeError and str(back) == "a ray worker failed" and "Unpicklable" in back.__notes__[0]
