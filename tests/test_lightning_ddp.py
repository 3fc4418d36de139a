"""Lightning's loops and module API on 2 real processes (gloo): predictions gathered in
dataset order, test metrics, manual optimization with DDP's gradient sync, several
optimizers, DataModules, and a script asking for ddp under ``hookloop run``.

The battery (tests/scripts/lightning_battery.py) runs in the shared ddp job (tests/jobs.py);
the script asking for ddp is a launch of its own: what it checks is how ``hookloop run``
starts the processes."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, TinyModule, max_abs_diff, run_python, state_of, tiny_data
from test_lightning_module import TwoNets

HOOKLOOP = [sys.executable, "-m", "hookloop"]


@pytest.fixture(scope="module")
def battery(jobs):
    run = jobs.run("ddp")  # tests/jobs.py: lightning_battery.py in the shared ddp job
    return run.ranks("lightning_battery"), run.dir("lightning_battery")


@pytest.mark.check  # reads the shared ddp job
def test_predict_gathers_every_sample_once_in_dataset_order(battery):
    ranks, _ = battery
    data = tiny_data(21, seed=4)
    module = TinyModule(seed=3)  # with the weights the ranks predicted with
    module.load_state_dict(ranks[0]["predict_module_state"])
    with torch.no_grad():
        logits = module(data.tensors[0])
    for record in ranks:
        batches = record["predict"]
        assert [b["logits"].shape[0] for b in batches] == [4, 4, 4, 4, 4, 1]  # as one process batches 21
        assert torch.allclose(torch.cat([b["logits"] for b in batches]), logits, atol=1e-6)
        assert torch.equal(torch.cat([b["pair"][1] for b in batches]), data.tensors[1])
        assert torch.equal(torch.cat([b["pair"][0] for b in batches]), data.tensors[0][:, :2])


@pytest.mark.check  # reads the shared ddp job
def test_predict_keeps_the_order_of_a_users_sampler(battery):
    ranks, _ = battery
    data = tiny_data(9, seed=4)
    for record in ranks:
        ys = torch.cat([b["pair"][1] for b in record["predict_user_sampler"]])
        assert torch.equal(ys, data.tensors[1].flip(0))  # Reversed(9), each sample once


@pytest.mark.check  # reads the shared ddp job
def test_test_reduces_across_ranks(battery):
    ranks, _ = battery
    module = TinyModule(seed=3)
    module.load_state_dict(ranks[0]["predict_module_state"])
    x, y = tiny_data(20, seed=5).tensors
    with torch.no_grad():
        accuracy = (module(x).argmax(-1) == y).float().mean().item()
    for record in ranks:
        assert record["test"][0]["test_acc"] == pytest.approx(accuracy, abs=1e-6)
        assert record["test"][0]["test_samples"] == 20.0


@pytest.mark.check  # reads the shared ddp job
def test_manual_optimization_synchronises_gradients_like_automatic(battery):
    ranks, _ = battery
    for record in ranks:
        assert max_abs_diff(record["automatic"], record["manual"]) == 0.0
        assert record["manual_steps"] == 8
    assert max_abs_diff(ranks[0]["manual"], ranks[1]["manual"]) == 0.0


@pytest.mark.check  # reads the shared ddp job
def test_two_optimizers_under_ddp(battery):
    ranks, _ = battery
    # different shares per rank, still the same weights: every step synchronised
    assert max_abs_diff(ranks[0]["gan_sharded"], ranks[1]["gan_sharded"]) == 0.0
    # the same data on both ranks: the mean of identical gradients is the 1-process run
    reference = TwoNets()
    hookloop.Trainer(max_epochs=2, enable_checkpointing=False).fit(reference, DataLoader(tiny_data(48), batch_size=8))
    for record in ranks:
        assert max_abs_diff(record["gan_same_data"], state_of(reference)) < 1e-6


@pytest.mark.check  # reads the shared ddp job
def test_datamodule_prepares_once_per_node_before_every_setup(battery):
    ranks, out = battery
    assert sorted(p.name for p in out.glob("prepare_data.rank*")) == ["prepare_data.rank0"]
    assert [r["datamodule_steps"] for r in ranks] == [2, 2]  # 32 samples / 2 ranks / 8


SCRIPT_ASKS_FOR_DDP = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    import hookloop
    from conftest import TinyModule, tiny_data
    from torch.utils.data import DataLoader
    t = hookloop.Trainer(plugins=["ddp"], devices=2, max_epochs=1, enable_checkpointing=False)
    t.fit(TinyModule(), DataLoader(tiny_data(32), batch_size=8))
    print(f"TRAINED rank={{t.global_rank}} world={{t.world_size}} steps={{t.global_step}}", flush=True)
    """
)


@pytest.mark.slow  # a launch of its own: how `hookloop run` starts a script that names its strategy in code
def test_hookloop_run_of_a_script_asking_for_ddp_starts_its_processes(tmp_path):
    """`hookloop run train.py` (no --devices) with Trainer(plugins=["ddp"], devices=2) in
    the script trained on one process, silently."""
    (tmp_path / "train.py").write_text(SCRIPT_ASKS_FOR_DDP.format(tests=str(REPO / "tests")))
    out = run_python(HOOKLOOP + ["run", "train.py"], cwd=tmp_path, timeout=300)
    trained = sorted(re.findall(r"TRAINED rank=\d world=\d steps=\d", out.stdout))  # ranks share stdout
    assert trained == ["TRAINED rank=0 world=2 steps=2", "TRAINED rank=1 world=2 steps=2"]
