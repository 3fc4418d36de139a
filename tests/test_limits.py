"""Issue 22 item 7: ``max_time``, ``OnExceptionCheckpoint`` and the rank-agreed NaN/spike
guard (``nan_guard``).

Each is compared with a reference: pytorch-lightning 2.6.6 running the same module with the
same arguments, an uninterrupted run, a hand-written loop, or a closed-form sequence. The
2-process cases are one ``hookloop run --plugins ddp --devices 2`` of
tests/scripts/limits_battery.py (starting processes is what costs).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop
from conftest import run_python



def _data(n: int = 64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def _module_class(base):
    class Net(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Net


def _lightning_steps(tmp_path, **kw) -> int:
    import pytorch_lightning as pl

    trainer = pl.Trainer(accelerator="cpu", devices=1, default_root_dir=str(tmp_path / "pl"), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         max_epochs=3, **kw)
    trainer.fit(_module_class(pl.LightningModule)(), DataLoader(_data(), batch_size=8))
    return trainer.global_step


def _hookloop_trainer(tmp_path, **kw) -> hookloop.Trainer:
    kw = {"max_epochs": 3, **kw}
    return hookloop.Trainer(default_root_dir=str(tmp_path / "hl"), logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, **kw)


# ---------------------------------------------------------------------------------------
# max_time
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_time, steps", [("00:00:00:00", 0), ({"microseconds": 1}, 1), (timedelta(days=1), 24)])
def test_max_time_stops_fit_at_the_step_lightning_stops_at(tmp_path, max_time, steps):
    # 0: time is up at fit start (nothing trained); 1 us: up at the first check, after the
    # first batch; a day: never (3 epochs of 8 batches). Lightning 2.6.6 is the reference.
    expected = _lightning_steps(tmp_path, max_time=max_time)
    trainer = _hookloop_trainer(tmp_path, max_time=max_time)
    trainer.fit(_module_class(hookloop.Module)(), DataLoader(_data(), batch_size=8))
    assert trainer.global_step == expected
    assert expected == steps
    timers = [p for p in trainer.plugins if isinstance(p, hookloop.Timer)]
    assert len(timers) == 1 and timers[0]._interval == "step"


def test_max_time_beside_a_timer_is_ignored_as_lightning_ignores_it(tmp_path):
    # Lightning's: the Timer given wins, an info line says so at setup
    # (tests/test_lightning_callback_checks.py compares the two)
    timer = hookloop.Timer(duration="00:02:00:00")
    trainer = _hookloop_trainer(tmp_path, max_time="00:01:00:00", callbacks=[timer])
    assert [p for p in trainer.plugins if isinstance(p, hookloop.Timer)] == [timer]
    assert timer._duration == 2 * 3600


def test_a_bad_max_time_names_the_argument(tmp_path):
    with pytest.raises(hookloop.ConfigurationError, match=r"Trainer\(max_time='12:00'\) is not a valid duration"):
        _hookloop_trainer(tmp_path, max_time="12:00")


# ---------------------------------------------------------------------------------------
# OnExceptionCheckpoint
# ---------------------------------------------------------------------------------------


def _raising_class(base, at: int | None):
    class Raises(_module_class(base)):
        def training_step(self, batch, batch_idx):
            if at is not None and self.trainer.global_step == at:
                raise RuntimeError(f"boom at step {at}")
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)  # state that must resume

    return Raises


def test_on_exception_checkpoint_is_written_at_lightnings_step_and_resumes_to_the_uninterrupted_weights(tmp_path):
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import OnExceptionCheckpoint as PLOnException

    data = _data()
    loader = lambda: DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))  # noqa: E731
    # Lightning 2.6.6: the step its checkpoint records for an exception in the 6th step
    pl_trainer = pl.Trainer(accelerator="cpu", devices=1, default_root_dir=str(tmp_path / "pl"), logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            max_epochs=2, callbacks=[PLOnException(str(tmp_path / "pl"))])
    with pytest.raises(RuntimeError, match="boom at step 5"):
        pl_trainer.fit(_raising_class(pl.LightningModule, 5)(), loader())
    lightning_step = torch.load(tmp_path / "pl" / "on_exception.ckpt", weights_only=False)["global_step"]

    callback = hookloop.OnExceptionCheckpoint(tmp_path / "hl", filename="crash")
    trainer = _hookloop_trainer(tmp_path, max_epochs=2, callbacks=[callback])
    with pytest.raises(RuntimeError, match="boom at step 5"):
        trainer.fit(_raising_class(hookloop.Module, 5)(), loader())
    path = tmp_path / "hl" / "crash.ckpt"
    assert callback.ckpt_path == str(path) and path.is_file()
    saved = torch.load(path, weights_only=False)
    assert saved["loop"]["global_step"] == lightning_step == 5

    # resumed: the same weights as a run that never raised (2 epochs of 8 batches)
    resumed = _hookloop_trainer(tmp_path / "resume", max_epochs=2)
    module = _raising_class(hookloop.Module, None)()
    resumed.fit(module, loader(), ckpt_path=str(path))
    reference = _hookloop_trainer(tmp_path / "reference", max_epochs=2)
    plain = _raising_class(hookloop.Module, None)()
    reference.fit(plain, loader())
    assert resumed.global_step == reference.global_step == 16
    for a, b in zip(module.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)


def test_a_run_that_ends_well_removes_the_on_exception_checkpoint(tmp_path):
    callback = hookloop.OnExceptionCheckpoint(tmp_path)
    (tmp_path / "on_exception.ckpt").write_bytes(b"stale")
    trainer = _hookloop_trainer(tmp_path, max_epochs=1, callbacks=[callback])
    trainer.fit(_module_class(hookloop.Module)(), DataLoader(_data(), batch_size=8))
    assert not (tmp_path / "on_exception.ckpt").exists()  # as Lightning's teardown


def test_on_exception_checkpoint_refuses_an_empty_filename(tmp_path):
    with pytest.raises(hookloop.ConfigurationError, match="filename cannot be empty"):
        hookloop.OnExceptionCheckpoint(tmp_path, filename="")


# ---------------------------------------------------------------------------------------
# nan_guard
# ---------------------------------------------------------------------------------------

# The loss of each step, by construction (its gradient in w is 1 at every step).
LOSSES = [1.0, 2.0, 1.0, 2.0, 10.0, 2.0, 1.0, float("nan"), 2.0, 1.5, 7.0, 3.0]


class Sequence(hookloop.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))

    def training_step(self, batch, batch_idx):
        return torch.tensor(LOSSES[self.trainer.global_step]) + (self.w - self.w.detach())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _sequence_fit(tmp_path, guard, **kw):
    trainer = hookloop.Trainer(default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
                               enable_model_summary=False, max_epochs=1, callbacks=[guard], **kw)
    module = Sequence()
    trainer.fit(module, DataLoader(TensorDataset(torch.zeros(len(LOSSES), 1)), batch_size=1))
    return trainer, module


def test_nan_guard_skips_the_spikes_and_the_nan_of_a_closed_form_loss_sequence(tmp_path, capsys):
    # window 4, factor 3, worked by hand over the good steps' losses only:
    # step 4: 10 > 3 x median(1, 2, 1, 2) = 4.5; step 7: nan; step 10: 7 > 3 x median(2, 1, 2, 1.5) = 5.25
    guard = hookloop.NanGuard(action="skip", spike_factor=3, window=4)
    trainer, module = _sequence_fit(tmp_path, guard, enable_checkpointing=False)
    assert [(step, what) for step, what, _, _ in guard.events] == [
        (4, "a loss spike"), (7, "a non-finite value"), (10, "a loss spike")]
    assert guard.skipped_steps == 3 and trainer.global_step == 12
    assert module.w.item() == 1.0 - 0.5 * (12 - 3)  # 9 updates of lr x 1 applied
    assert guard.history == [1.0, 2.0, 1.5, 3.0]  # the last 4 good losses (steps 6, 8, 9, 11)
    out = capsys.readouterr().out
    assert "skipped the update of global step 7 on every rank (a non-finite value on global rank 0)" in out


def test_nan_guard_stop_writes_a_checkpoint_before_the_bad_update_and_stops(tmp_path, capsys):
    guard = hookloop.NanGuard(action="stop")  # non-finite only: the first bad step is 7
    trainer, module = _sequence_fit(tmp_path, guard)
    assert trainer.global_step == 8 and module.w.item() == 1.0 - 0.5 * 7
    out = capsys.readouterr().out
    assert "hookloop: nan_guard: stopping at global step 7: a non-finite value on global rank 0 (loss nan)" in out
    path = tmp_path / "checkpoints" / "nan_guard.ckpt"  # no logger: Lightning's layout
    saved = torch.load(path, weights_only=False)
    assert saved["loop"]["global_step"] == 7 and saved["state_dict"]["w"].item() == 1.0 - 0.5 * 7


def test_nan_guard_refuses_bad_options():
    with pytest.raises(hookloop.ConfigurationError, match="'skip' and 'stop'"):
        hookloop.NanGuard(action="warn")
    with pytest.raises(hookloop.ConfigurationError, match="spike_factor=0.5 must be a number > 1"):
        hookloop.NanGuard(spike_factor=0.5)


# ---------------------------------------------------------------------------------------
# 2 processes (ddp, gloo): one run of tests/scripts/limits_battery.py
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def battery(jobs):
    run = jobs.run("ddp")  # tests/jobs.py: limits_battery.py in the shared ddp job
    return run.ranks("limits_battery"), run.stdout("limits_battery"), run.stderr("limits_battery")


def _hand_written(ranks, skip: int, steps: int) -> dict:
    """SGD(lr 0.1) on Linear(8, 3) from seed 0 over both ranks' batches (the gradient is the
    mean of the ranks' gradients, as DDP's), without the update of step ``skip``."""
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 3)
    for step in range(steps):
        net.zero_grad()
        for record in ranks:
            x, y = record["skip"]["batches"][step]
            (F.cross_entropy(net(x), y) / len(ranks)).backward()
        if step != skip:
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
    return {f"net.{k}": v for k, v in net.state_dict().items()}


@pytest.mark.check
def test_max_time_under_ddp_stops_every_rank_at_the_step_rank_zeros_clock_says(battery):
    ranks, stdout, _ = battery
    # rank 1's time was up after step 1 (ignored), rank 0's after step 3; with
    # stop_check_every_n_steps=2 its vote, given at boundary 4, is read at boundary 6
    assert [r["max_time"]["global_step"] for r in ranks] == [6, 6]
    assert stdout.count("Time limit reached.") == 2  # once per run (rank 0): max_time, max_time_guard
    # rank 0's verdict rides the stop agreement: its all-reduce at boundaries 2 and 4 (the
    # one started at 6 ends the run), nothing at the others, as a run without max_time
    for record in ranks:
        calls = record["max_time"]["calls"]
        assert [b - a for a, b in zip(calls, calls[1:])] == [0, 1, 0, 1, 0], calls
    for record in ranks:  # beside nan_guard: still one collective per step
        both = record["max_time_guard"]
        assert both["global_step"] == 6 and both["skipped"] == 1
        assert [b - a for a, b in zip(both["calls"], both["calls"][1:])] == [1] * 5, both["calls"]


@pytest.mark.check
def test_nan_guard_skip_under_ddp_drops_the_update_on_every_rank(battery):
    ranks, stdout, stderr = battery
    expected = _hand_written(ranks, skip=3, steps=8)
    for record in ranks:
        assert record["skip"]["global_step"] == 8 and record["skip"]["skipped"] == 1
        assert [(s, what, rank) for s, what, rank, _ in record["skip"]["events"]] == [(3, "a non-finite value", 1)]
        for key, value in expected.items():
            torch.testing.assert_close(record["skip"]["weights"][key], value, rtol=0, atol=1e-6)
    for key in expected:
        assert torch.equal(ranks[0]["skip"]["weights"][key], ranks[1]["skip"]["weights"][key])
    assert stdout.count("skipped the update of global step 3 on every rank (a non-finite value on global rank 1)") == 1
    assert "global rank 1: a non-finite value at global step 3: loss nan" in stderr


@pytest.mark.check
def test_nan_guard_stop_under_ddp_stops_every_rank_at_the_bad_step_with_a_checkpoint(battery):
    ranks, stdout, _ = battery
    expected = _hand_written(ranks, skip=3, steps=3)  # steps 0-2 applied, step 3's dropped
    for record in ranks:
        assert record["stop"]["global_step"] == 4  # the bad step counts, its update is not applied
        for key, value in expected.items():
            torch.testing.assert_close(record["stop"]["weights"][key], value, rtol=0, atol=1e-6)
    assert stdout.count("hookloop: nan_guard: stopping at global step 3: a non-finite value on global rank 1") == 1
    saved = torch.load(Path(ranks[0]["stop"]["log_dir"]) / "checkpoints" / "nan_guard.ckpt", weights_only=False)
    assert saved["loop"]["global_step"] == 3


@pytest.mark.check
def test_nan_guard_agrees_at_every_step_and_a_plain_run_at_none_of_these(battery):
    ranks, _, _ = battery
    # Python-started collectives between consecutive training steps: with the guard, the
    # stop agreement's all-reduce at every step (blocking, carrying its flag); without it,
    # one at each boundary of the default schedule only (auto: boundaries 1 and 2, then
    # about a second of steps later, beyond these 8 steps of milliseconds; before issue 33,
    # one per step)
    for record in ranks:
        calls = record["skip"]["calls"]
        assert [b - a for a, b in zip(calls, calls[1:])] == [1] * 7, ("skip", calls)
        calls, agreements = record["plain"]["calls"], record["plain"]["agreements"]
        assert agreements[:2] == [1, 2] and len(agreements) <= 3, agreements
        assert [b - a for a, b in zip(calls, calls[1:])] == [int(b in agreements) for b in range(1, 8)], calls


@pytest.mark.check
def test_on_exception_checkpoint_when_every_rank_raises_resumes_to_the_uninterrupted_weights(battery):
    ranks, _, _ = battery
    for rank, record in enumerate(ranks):
        assert record["exception"]["raised"] == f"boom at step 5 on rank {rank}"
        assert record["exception"]["saved_step"] == 5 and record["exception"]["global_step"] == 8
        for key, value in record["plain"]["weights"].items():
            assert torch.equal(record["exception"]["weights"][key], value)


MAX_TIME_SCRIPT = ("import hookloop\nt = hookloop.Trainer()\n"
                   "print('MAX_TIME', t.config.max_time, [type(p).__name__ for p in t.plugins][-1])\n")


@pytest.mark.full  # a launch
def test_hookloop_run_max_time_reaches_the_trainer(tmp_path):
    script = tmp_path / "mt.py"
    script.write_text(MAX_TIME_SCRIPT)
    ok = run_python([sys.executable, "-m", "hookloop", "run", "--max-time", "00:00:30:00", str(script)], cwd=tmp_path)
    assert "MAX_TIME 00:00:30:00 Timer" in ok.stdout


def test_hookloop_run_refuses_a_bad_max_time_before_launching(tmp_path, capsys):
    from hookloop.tools import cli

    script = tmp_path / "mt.py"
    script.write_text(MAX_TIME_SCRIPT)
    assert cli.main(["run", "--max-time", "12:00", str(script)]) == 2
    assert "--max-time '12:00' is not a valid duration" in capsys.readouterr().err


def test_the_nan_guard_checkpoint_resumes_at_the_bad_batch(tmp_path, monkeypatch):
    trainer, _ = _sequence_fit(tmp_path, hookloop.NanGuard(action="stop"))
    path = tmp_path / "checkpoints" / "nan_guard.ckpt"  # no logger: Lightning's layout
    monkeypatch.setattr(sys.modules[__name__], "LOSSES", LOSSES[:7] + [1.0] + LOSSES[8:])  # the cause fixed: step 7 trains again, and the rest
    resumed = hookloop.Trainer(default_root_dir=str(tmp_path / "resumed"), logger=False, enable_progress_bar=False,
                               enable_model_summary=False, enable_checkpointing=False, max_epochs=1)
    module = Sequence()
    resumed.fit(module, DataLoader(TensorDataset(torch.zeros(12, 1)), batch_size=1), ckpt_path=str(path))
    assert resumed.global_step == 12 and module.w.item() == 1.0 - 0.5 * 12  # all 12 updates, step 7's once
