"""The ``ledger`` observer (issue 22): per-step time, Python calls, host-device syncs and
collectives of each ``plugin.hook``, checked against numbers known in closed form (what a
test plugin does per step), not against another output of the ledger."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.observers.ledger import CORE, TOTAL, Ledger

from conftest import REPO, TinyModule, tiny_data

K_SYNCS, N_CALLS = 3, 50


def _noop():
    pass


class Probe:
    """Per training batch: ``K_SYNCS`` ``Tensor.item()`` calls and ``N_CALLS`` calls of a
    Python function, and nothing else that calls (tuples iterate without a call)."""

    hookloop_name = "probe"
    hookloop_role = "observer"

    def __init__(self):
        self.items = (torch.ones(()),) * K_SYNCS
        self.loop = (None,) * N_CALLS

    @hookloop.hookimpl
    def on_train_batch_end(self):
        for t in self.items:
            t.item()
        for _ in self.loop:
            _noop()


def fit_with_ledger(tmp_path, batches: int = 8, **kwargs):
    ledger = Ledger()
    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                               plugins=[ledger, Probe()], **kwargs)
    trainer.fit(TinyModule(), DataLoader(tiny_data(8 * batches), batch_size=8))
    return ledger, trainer


def test_a_hooks_syncs_and_calls_are_billed_to_it_exactly(tmp_path, capsys):
    ledger, trainer = fit_with_ledger(tmp_path)
    rows = ledger.rows
    # 8 optimizer steps: the first is the warm-up, steps 2 and 6 are counted, the rest timed
    assert (ledger._counted, ledger._timed) == (2, 5)
    probe = rows["probe.on_train_batch_end"]
    # its own call, N_CALLS calls of _noop, K_SYNCS c_calls of Tensor.item
    assert probe["calls/step"] == 1 + N_CALLS + K_SYNCS
    assert probe["syncs/step"] == K_SYNCS
    assert probe["collectives/step"] == 0
    assert probe["ms/step"] > 0
    for key, values in rows.items():
        if key not in ("probe.on_train_batch_end", CORE, TOTAL):
            assert values["syncs/step"] == 0 and values["collectives/step"] == 0, key
    # the total is every row's sum; the core's time is what no hook took
    hooks = [v for k, v in rows.items() if k != TOTAL]
    for column in ("calls/step", "syncs/step", "collectives/step"):
        assert rows[TOTAL][column] == pytest.approx(sum(v[column] for v in hooks))
    assert rows[TOTAL]["ms/step"] == pytest.approx(sum(v["ms/step"] for v in hooks))
    assert rows[CORE]["ms/step"] > 0 and rows[CORE]["calls/step"] > 0
    # rank 0 printed the table and wrote it to the run directory
    out = capsys.readouterr().out
    assert "hookloop ledger: per optimizer step (5 timed, 2 counted steps)" in out
    assert "probe.on_train_batch_end" in out and CORE in out and TOTAL in out
    saved = json.loads((trainer.log_dir / "ledger.json").read_text())
    assert saved["rows"]["probe.on_train_batch_end"]["syncs/step"] == K_SYNCS
    assert saved["counted_steps"] == 2 and saved["timed_steps"] == 5
    assert "probe.on_train_batch_end" in (trainer.log_dir / "ledger.txt").read_text()


def test_gradient_accumulation_bills_per_optimizer_step(tmp_path):
    # 16 batches, 2 per optimizer step: 8 steps, each with two on_train_batch_end calls
    ledger, _ = fit_with_ledger(tmp_path, batches=16, accumulate_grad_batches=2)
    assert (ledger._counted, ledger._timed) == (2, 5)
    probe = ledger.rows["probe.on_train_batch_end"]
    assert probe["syncs/step"] == 2 * K_SYNCS
    assert probe["calls/step"] == 2 * (1 + N_CALLS + K_SYNCS)


def test_every_step_counted_with_count_every_1(tmp_path):
    ledger = Ledger(count_every=1)
    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                               plugins=[ledger, Probe()])
    trainer.fit(TinyModule(), DataLoader(tiny_data(64), batch_size=8))
    assert (ledger._counted, ledger._timed) == (7, 0)
    assert ledger.rows["probe.on_train_batch_end"]["syncs/step"] == K_SYNCS


@pytest.mark.parametrize("count_every", [0, 1.5, True])
def test_bad_count_every(count_every):
    with pytest.raises(hookloop.ConfigurationError, match="count_every"):
        Ledger(count_every=count_every)


def test_the_run_is_left_as_it_was(tmp_path):
    # the implementations are unwrapped at teardown and the profile hook is off
    ledger, trainer = fit_with_ledger(tmp_path)
    assert sys.getprofile() is None
    for caller in vars(trainer.plugin_manager.hook).values():
        for impl in getattr(caller, "get_hookimpls", lambda: [])():
            assert not hasattr(impl.function, "_hookloop_ledger")


@pytest.mark.check  # reads the shared ddp job
def test_two_all_reduces_per_step_under_ddp(jobs):
    # tests/scripts/ledger_collectives.py in the shared ddp job (tests/jobs.py)
    tmp_path = jobs.run("ddp").dir("ledger_collectives")
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (record["counted"], record["timed"]) == (2, 5)
        rows = record["rows"]
        assert rows["two_all_reduces.on_train_batch_end"]["collectives/step"] == 2
        assert rows["two_all_reduces.on_train_batch_end"]["syncs/step"] == 0
        for key, values in rows.items():
            if key not in ("two_all_reduces.on_train_batch_end", CORE, TOTAL):
                assert values["collectives/step"] == 0, key
    log_dir = json.loads((tmp_path / "rank0.json").read_text())["log_dir"]
    from pathlib import Path

    text = (Path(log_dir) / "ledger.txt").read_text()
    assert "two_all_reduces.on_train_batch_end" in text and CORE in text and TOTAL in text


@pytest.mark.check  # reads the shared ddp job
def test_the_stop_agreement_costs_the_core_nothing_between_its_boundaries_under_ddp(jobs):
    # tests/scripts/ledger_collectives.py: the ledger counts optimizer steps 2 and 6 of 8.
    # Before issue 33 every step of a ddp run started the agreement's all-reduce and read
    # the previous one (.item()): 1 collective and 1 host read per step in the core.
    tmp_path = jobs.run("ddp").dir("ledger_collectives")
    for rank in (0, 1):
        def core(every):
            record = json.loads((tmp_path / f"agreement{every}.rank{rank}.json").read_text())
            assert record["counted"] == 2
            return record["every"], record["rows"][CORE]["collectives/step"], record["rows"][CORE]["syncs/step"]

        # every 4 (steps 4 and 8): none of the counted steps is an agreement boundary
        assert core(4) == (4, 0, 0)
        assert json.loads((tmp_path / f"agreement4.rank{rank}.json").read_text())["agreements"] == [4, 8]
        # the default, auto: agreements at boundaries 1 and 2 (no pace known yet), then
        # about a second of steps later (far beyond these 8 steps of milliseconds): the
        # core's collectives and host reads are exactly the counted steps that are in the
        # schedule (each of which starts one all-reduce and reads the one before)
        auto = json.loads((tmp_path / f"agreementdefault.rank{rank}.json").read_text())["agreements"]
        assert auto[:2] == [1, 2] and len(auto) <= 3, auto
        share = len({2, 6} & set(auto)) / 2
        assert core("default") == ("auto", share, share)
        # every 2: both counted steps are; the ledger sees the all-reduce started at each,
        # and the read of the one before at step 6 (step 2 is the first: nothing to read)
        assert core(2) == (2, 1, 0.5)


@pytest.mark.filterwarnings("ignore::hookloop.HookloopContractWarning")  # the stand-in distribution is not "hookloop"
def test_enabled_by_name_through_the_core_entry_point(site):
    # pyproject.toml declares `ledger`; an installed copy of that entry point (what pip
    # writes from it) loads the observer by name.
    import importlib
    import tomllib

    from conftest import install_fake_distribution

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["hookloop.plugins"]
    assert declared["ledger"] == "hookloop.observers.ledger:Ledger"
    module, name = declared["ledger"].split(":")
    assert getattr(importlib.import_module(module), name) is hookloop.Ledger
    if "ledger" not in hookloop.installed_plugins():  # an install older than the entry point
        install_fake_distribution(site, "hookloop-ledger-entry", {"ledger": declared["ledger"]}, {})
    trainer = hookloop.Trainer(plugins=["ledger"], enable_progress_bar=False)
    assert isinstance(trainer.plugin_manager.get_plugin("ledger"), hookloop.Ledger)


class FSDPStyleCollectives:
    """Per training batch: FSDP2's two collectives (torch 2.13's ``all_gather_single`` and
    ``reduce_scatter_single``), and with ``functional`` one of DTensor's functional
    collectives (its first call takes ~4 s here: the full tier only)."""

    hookloop_name = "fsdp_style"
    hookloop_role = "observer"

    def __init__(self, functional: bool):
        self.functional = functional

    @hookloop.hookimpl
    def on_train_batch_end(self):
        import torch.distributed as dist

        x = torch.ones(2)
        out = torch.empty(2)
        dist.all_gather_single(out, x)
        dist.reduce_scatter_single(out, x)
        if self.functional:
            import torch.distributed._functional_collectives as funcol

            funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))


@pytest.mark.parametrize("functional", [
    False, pytest.param(True, marks=pytest.mark.full)])
def test_fsdp2_and_functional_collectives_are_counted(tmp_path, functional):
    # One process of its own gloo group (world size 1): real collectives, no launcher.
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ledger = Ledger()
        trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                                   plugins=[ledger, FSDPStyleCollectives(functional)])
        trainer.fit(TinyModule(), DataLoader(tiny_data(64), batch_size=8))
    finally:
        dist.destroy_process_group()
    assert ledger.rows["fsdp_style.on_train_batch_end"]["collectives/step"] == 2 + functional
