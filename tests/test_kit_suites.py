"""The conformance kit catches what it missed (issue 20, "The kit"): `hookloop check` on
roles that are not plain strings and on a ddp subclass's first version; the extension
suite and `hookloop new-plugin --role extension`; the observer suite under ddp and across
a resume; the strategy suite on a model reduced in several DDP buckets.

Each new check is shown failing a deliberately broken small plugin with its message. The
plugins are registered without installing anything: their module on PYTHONPATH, and a
``.dist-info`` folder beside it naming their entry points (what pip would write). The
suites run in a pytest subprocess, as a plugin author runs them (those tests are slow);
``hookloop check`` runs in this process, with the folder on ``sys.path``.
"""

from __future__ import annotations

import enum
import importlib
import os
import re
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hookloop.tools import cli
from hookloop.contract import versioning
from hookloop.contract.checks import role_problems

HERE = Path(__file__).resolve().parent


def run(args: list[str], cwd: Path, path: str, timeout: int = 300, check: bool = True):
    """``args`` in a clean environment with ``path`` before this process's PYTHONPATH."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOOKLOOP_", "TORCHELASTIC_")) and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def register(site: Path, distribution: str, entry_points: dict[str, str]) -> None:
    """What ``pip install`` registers: a dist-info folder with the entry points."""
    info = site / f"{distribution}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[hookloop.plugins]\n{lines}")


def check_in_process(monkeypatch, capsys, *paths: Path, names: list[str]) -> tuple[int, str]:
    """``hookloop check NAMES`` through ``cli.main`` in this process with ``paths`` first on
    sys.path, as PYTHONPATH puts them first for ``python -m hookloop``; its exit status and
    stdout. The modules it imports from ``paths`` are forgotten afterwards, and hookloop's
    once-per-process notes (versioning._TOLD) start empty and end as they were."""
    for path in reversed(paths):
        monkeypatch.syspath_prepend(str(path))
    importlib.invalidate_caches()
    monkeypatch.setattr(versioning, "_TOLD", set())
    before = set(sys.modules)
    try:
        code = cli.main(["check", *names])
    finally:
        for name in set(sys.modules) - before:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if any(file.startswith(str(path)) for path in paths):
                del sys.modules[name]
    return code, capsys.readouterr().out


def junit(path: Path) -> dict[str, str]:
    """``{test id: "" (passed) or its failure message}`` from pytest's junit xml."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        failed = [c for c in case if c.tag in ("failure", "error", "skipped")]
        results[name] = "" if not failed else f"{failed[0].tag}: {failed[0].get('message')}\n{failed[0].text}"
    return results


# -- 1. hookloop check --------------------------------------------------------------------


class Role(str, enum.Enum):
    STRATEGY = "strategy"


class TupleRole:
    hookloop_role = ("strategy",)


class EnumRole:
    hookloop_role = Role.STRATEGY


def test_a_role_that_is_not_a_plain_string_is_a_problem():
    for plugin, kind in ((TupleRole(), "tuple"), (EnumRole(), "Role")):
        (problem,) = role_problems(plugin, "thing")
        assert f"is a {kind}, not a plain string" in problem.message
        assert "hookloop_role = 'strategy'" in problem.fix


FIRST_VERSION = '''
import hookloop
from hookloop_ddp import DDP


class PowerSGD(DDP):
    """ddp with PowerSGD, a first version: its hookloop_name (copied from an example) is
    not the name it is installed under, and its option start_iter is kept under another
    attribute name (given by name, options construct the plugin: that works).

    Options: ``start_iter`` (10) the step PowerSGD starts at.
    """

    hookloop_name = "powersgd"
    hookloop_role = "strategy"

    def __init__(self, start_iter: int = 10, **ddp_options):
        super().__init__(**ddp_options)
        self._start_iter = start_iter


class TupleRole:
    """An observer whose role is a tuple."""

    hookloop_name = "kit_tuple_role"
    hookloop_role = ("observer",)
'''


def test_check_reports_the_ddp_subclass_first_version_and_a_tuple_role(tmp_path, monkeypatch, capsys):
    site = tmp_path / "site"
    site.mkdir()
    (site / "kit_first.py").write_text(FIRST_VERSION)
    register(site, "kit_first", {"kit_powersgd": "kit_first:PowerSGD", "kit_tuple_role": "kit_first:TupleRole"})
    code, out = check_in_process(monkeypatch, capsys, site, names=["kit_powersgd", "kit_tuple_role"])
    assert code == 1, out
    assert "kit_powersgd: 1 problem(s)" in out, out
    assert ("it is installed as 'kit_powersgd' but calls itself hookloop_name='powersgd': options given as "
            "kit_powersgd.<option> are not applied to it" in out and "set hookloop_name = 'kit_powersgd'" in out), out
    assert "kit_tuple_role: 1 problem(s)" in out and "hookloop_role=('observer',) is a tuple, not a plain string" in out


# -- 2. the extension template ------------------------------------------------------------


@pytest.mark.slow  # the generated tests run in a pytest subprocess, as the plugin's author runs them
def test_the_generated_extension_checks_and_passes_its_conformance_suite(tmp_path, monkeypatch, capsys):
    assert cli.main(["new-plugin", "gen_extension", "--role", "extension", "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    package = tmp_path / "hookloop-gen_extension"
    register(tmp_path / "site", "hookloop_gen_extension", {"gen_extension": "hookloop_gen_extension:GenExtension"})
    path = f"{package / 'src'}:{tmp_path / 'site'}"
    code, out = check_in_process(monkeypatch, capsys, package / "src", tmp_path / "site", names=["gen_extension"])
    assert code == 0, out  # run(..., check=True) asked for exit status 0
    assert out.strip() == "gen_extension: ok"
    tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(package / "tests")],
                tmp_path, path, timeout=600)
    summary = tests.stdout.strip().splitlines()[-1]
    assert re.search(r"\b3 passed", summary) and "skipped" not in summary, tests.stdout


# -- 3-5. broken plugins fail the suites with the expected message -------------------------

BROKEN = '''
import os
import torch
import hookloop
from hookloop_ddp import DDP


class EveryRankWriter:
    """Writes its notes on every rank (the same file name)."""

    hookloop_name = "every_rank_writer"
    hookloop_role = "observer"

    @hookloop.hookimpl
    def on_train_epoch_end(self, trainer, epoch):
        with open(os.path.join(trainer.log_dir, "notes.txt"), "a") as f:
            f.write(f"epoch {epoch}\\n")


class ForgetfulCounter:
    """Saves its count, and forgets to restore it."""

    hookloop_name = "forgetful_counter"
    hookloop_role = "observer"

    def __init__(self):
        self.batches = 0

    @hookloop.hookimpl
    def on_train_batch_end(self):
        self.batches += 1

    @hookloop.hookimpl
    def on_save_checkpoint(self, checkpoint):
        checkpoint["plugins"]["forgetful_counter"] = {"batches": self.batches}

    @hookloop.hookimpl
    def on_load_checkpoint(self, checkpoint):
        pass


class ForgetfulWarmup:
    """A learning-rate warm-up that saves its step count under "ddp" and never restores it."""

    hookloop_name = "forgetful_warmup"
    hookloop_role = "extension"

    def __init__(self):
        self.steps = 0

    @hookloop.hookimpl
    def on_before_optimizer_step(self, optimizer):
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("base", group["lr"]) * min(1.0, (self.steps + 1) / 20)
        self.steps += 1

    @hookloop.hookimpl
    def on_save_checkpoint(self, checkpoint):
        checkpoint["plugins"]["ddp_like"] = {"steps": self.steps}


def _first_bucket_only(state, bucket):
    """Reduces the first gradient bucket only: the later ones stay each rank's own."""
    buffer = bucket.buffer()
    if bucket.index() != 0:
        future = torch.futures.Future()
        future.set_result(buffer)
        return future
    work = torch.distributed.all_reduce(buffer.div_(torch.distributed.get_world_size()), async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


class FirstBucketOnly(DDP):
    """ddp whose ranks reduce only the first DDP bucket: right on a one-bucket model."""

    hookloop_name = "kit_first_bucket"
    hookloop_role = "strategy"

    def configure_ddp(self, trainer, model):
        wrapped = super().configure_ddp(trainer, model)
        wrapped.register_comm_hook(None, _first_bucket_only)
        return wrapped
'''

SUITES = '''
from hookloop.testing import ExtensionConformance, ObserverConformance, StrategyConformance
from kit_broken import EveryRankWriter, ForgetfulCounter, ForgetfulWarmup


class TestEveryRankWriter(ObserverConformance):
    plugin = EveryRankWriter


class TestForgetfulCounter(ObserverConformance):
    plugin = ForgetfulCounter


class TestForgetfulWarmup(ExtensionConformance):
    plugin = ForgetfulWarmup


class TestFirstBucketOnly(StrategyConformance):
    plugin = "kit_first_bucket"
'''

def run_broken_suites(tmp_path: Path, selected: list[str]) -> dict[str, str]:
    """Run the chosen tests of :data:`SUITES` on the broken plugins, in a pytest subprocess."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "kit_broken.py").write_text(BROKEN)
    register(site, "kit_broken", {"kit_first_bucket": "kit_broken:FirstBucketOnly"})
    (tmp_path / "test_broken_suites.py").write_text(SUITES)
    report = tmp_path / "report.xml"
    run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
         *[f"test_broken_suites.py::{t}" for t in selected]], tmp_path, str(site), timeout=900, check=False)
    results = junit(report)
    assert set(results) == set(selected), results
    return results


@pytest.mark.slow  # the suites run in a pytest subprocess on 2 processes
def test_the_new_observer_and_extension_checks_fail_broken_plugins_with_their_message(tmp_path):
    expected = {
        "TestEveryRankWriter::test_under_ddp_only_global_rank_zero_writes_files":
            "global rank 1 wrote ['logs/version_#/notes.txt'] under ddp",
        "TestForgetfulCounter::test_its_checkpoint_state_comes_back_after_a_resume":
            "'forgetful_counter': after a resume at step 11 the observer's checkpoint state is {'batches': 5}",
        "TestForgetfulWarmup::test_trains_with_the_default_observers":
            "'forgetful_warmup' saved checkpoint state under ['ddp_like'], not under its own name",
        "TestForgetfulWarmup::test_resumed_in_one_process_it_ends_as_an_uninterrupted_run":
            "'forgetful_warmup': resumed at step 11 the extension's run ends",
    }
    results = run_broken_suites(tmp_path, list(expected))
    for test, message in expected.items():
        assert message in results[test], f"{test}: expected {message!r} in:\n{results[test]}"


@pytest.mark.full  # a whole strategy suite on 2 processes
def test_the_wide_model_fails_a_strategy_that_reduces_its_first_bucket_only(tmp_path):
    wide = "TestFirstBucketOnly::test_a_model_of_several_ddp_buckets_trains_alike_and_resumes_exactly"
    # The tiny model fits in one bucket: there the broken strategy passes.
    tiny = ["TestFirstBucketOnly::test_agrees_with_the_one_process_reference",
            "TestFirstBucketOnly::test_resume_continues_like_an_uninterrupted_run"]
    results = run_broken_suites(tmp_path, [wide, *tiny])
    message = ("wide model: rank 1 ended with other weights than rank 0 in ['net.0.bias', 'net.0.weight', "
               "'net.2.bias', 'net.2.weight']")
    assert message in results[wide], results[wide]
    for test in tiny:
        assert results[test] == "", f"{test}: {results[test]}"
