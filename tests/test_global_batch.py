"""``Trainer(global_batch_size=N)`` (issue 33): the accumulation derived once the
data-parallel size is known, ``N / (batch_size x data-parallel processes)``, or a refusal
at start naming the numbers. One process here, against the hand-written loop; two
processes under ddp in tests/scripts/ddp_battery.py (test_ddp.py)."""

from __future__ import annotations

import os

import pytest
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import hookloop
from conftest import TinyModule, max_abs_diff, reference_loop, state_of, tiny_data
from hookloop.tools.cli import main


def _fit(loader, **kwargs):
    module = TinyModule(seed=0)
    trainer = hookloop.Trainer(max_epochs=2, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                               **kwargs)
    trainer.fit(module, loader)
    return trainer, module


def test_one_process_derives_the_accumulation_and_trains_as_the_hand_written_loop(capsys):
    trainer, module = _fit(DataLoader(tiny_data(32), batch_size=4), global_batch_size=16)
    assert trainer.accumulate_grad_batches == 4 and trainer.global_step == 4  # 2 epochs of 8 batches / 4
    out = capsys.readouterr().out
    assert ("hookloop: effective batch size 16 = 4 per device x 1 data-parallel process(es) x 4 accumulated "
            "batches (global_batch_size=16)") in out
    reference = TinyModule(seed=0)
    reference_loop(reference, DataLoader(tiny_data(32), batch_size=4), epochs=2, accumulate=4)
    assert max_abs_diff(state_of(module), state_of(reference)) == 0.0


def test_a_batch_sampler_with_a_batch_size_is_enough():
    loader = DataLoader(tiny_data(32), batch_sampler=BatchSampler(SequentialSampler(range(32)), 4, drop_last=False))
    trainer, _ = _fit(loader, global_batch_size=8, max_steps=1)
    assert trainer.accumulate_grad_batches == 2


@pytest.mark.parametrize("wanted, match", [
    (10, r"global_batch_size=10 is not a multiple of batch_size 4 \(the training loader's\) x 1 data-parallel "
         r"process\(es\) = 4 samples per batch: give a global_batch_size that is a multiple of 4 \(e\.g\. 8\)"),
    (2, r"global_batch_size=2 is not a multiple of batch_size 4 .* \(e\.g\. 4\), or change the loader's batch_size"),
])
def test_a_global_batch_that_does_not_divide_is_refused_at_start(wanted, match):
    module = TinyModule(seed=0)
    before = state_of(module)
    with pytest.raises(hookloop.ConfigurationError, match=match):
        _fit(DataLoader(tiny_data(32), batch_size=4), global_batch_size=wanted)
    with pytest.raises(hookloop.ConfigurationError, match=match):
        hookloop.Trainer(global_batch_size=wanted, max_steps=1, enable_checkpointing=False,
                         logger=False).fit(module, DataLoader(tiny_data(32), batch_size=4))
    assert max_abs_diff(state_of(module), before) == 0.0  # nothing trained


def test_a_loader_without_a_batch_size_is_refused():
    uneven = DataLoader(tiny_data(32), batch_sampler=[list(range(0, 5)), list(range(5, 32))])
    with pytest.raises(hookloop.ConfigurationError,
                       match=r"global_batch_size=16 needs the training loader's batch size, and the loader has "
                             r"a batch_sampler .*give DataLoader\(batch_size=\.\.\.\), or accumulate_grad_batches"):
        _fit(uneven, global_batch_size=16)


@pytest.mark.parametrize("value", [0, -4, 1.5, "16", True])
def test_bad_values_are_refused(value):
    with pytest.raises(hookloop.ConfigurationError, match=rf"global_batch_size={value!r} must be an integer >= 1"):
        hookloop.Trainer(global_batch_size=value)


def test_given_with_accumulate_grad_batches_it_is_refused():
    with pytest.raises(hookloop.ConfigurationError,
                       match=r"global_batch_size=16 and accumulate_grad_batches=2 are both set: .*give one of the two"):
        hookloop.Trainer(global_batch_size=16, accumulate_grad_batches=2)


def test_given_with_the_accumulation_scheduler_it_is_refused():
    with pytest.raises(hookloop.ConfigurationError,
                       match=r"global_batch_size=16\) and GradientAccumulationScheduler are both set"):
        _fit(DataLoader(tiny_data(32), batch_size=4), global_batch_size=16,
             callbacks=[hookloop.GradientAccumulationScheduler({0: 2})])


def test_hookloop_run_option_and_environment_reach_the_trainer(monkeypatch, capsys, tmp_path):
    # hookloop run --global-batch-size: checked before any process starts
    assert main(["run", "--global-batch-size", "16", "--accumulate-grad-batches", "2", "train.py"]) == 2
    assert "global_batch_size=16 and accumulate_grad_batches=2 are both set" in capsys.readouterr().err
    assert main(["run", "--global-batch-size", "0", str(tmp_path / "train.py")]) == 2
    assert "global_batch_size=0 must be an integer >= 1" in capsys.readouterr().err
    # ... and handed to the script's Trainer through the environment, as the other options
    monkeypatch.setenv("HOOKLOOP_TRAINER_DEFAULTS", '{"global_batch_size": 8}')
    monkeypatch.setenv("HOOKLOOP_LAUNCHER_PID", str(os.getppid()))  # as in a process `hookloop run` started
    trainer, _ = _fit(DataLoader(tiny_data(32), batch_size=4), max_steps=1)
    assert trainer.config.global_batch_size == 8 and trainer.accumulate_grad_batches == 2
