"""Issue 18 (part): Lightning's progress bars, ModelSummary and Timer callbacks, and the
``enable_model_summary``, ``benchmark`` and ``deterministic`` Trainer flags.

Each behaviour is compared with pytorch-lightning 2.6.6 running the same module code
(written once against ``fw.LightningModule``, as tests/oracle does); the multi-process one
runs on 2 real processes (gloo): tests/scripts/bars_timer_ddp.py in the shared ddp job
(tests/jobs.py).
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from contextlib import redirect_stdout
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

sys.path.insert(0, str(Path(__file__).resolve().parent / "oracle"))
import frameworks  # noqa: E402


def _data(n: int = 20, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _callbacks(fw, name: str, *args, **kwargs):
    if fw.name == "lightning":
        return getattr(fw.pl.callbacks, name)(*args, **kwargs)
    return getattr(hookloop, name)(*args, **kwargs)


def _trainer(fw, root: str, callbacks=(), progress: bool = False, logger: bool = True, **kw):
    """One process, no checkpoints or model summary; a CSV logger unless ``logger=False``."""
    if fw.name == "lightning":
        from pytorch_lightning.loggers import CSVLogger

        return fw.pl.Trainer(accelerator="cpu", devices=1, default_root_dir=root, callbacks=list(callbacks),
                             logger=CSVLogger(root, name="lightning") if logger else False,
                             enable_progress_bar=progress, enable_model_summary=False, enable_checkpointing=False,
                             **kw)
    return hookloop.Trainer(accelerator="cpu", default_root_dir=root, callbacks=list(callbacks), logger=logger,
                            enable_progress_bar=progress, enable_model_summary=False, enable_checkpointing=False,
                            **kw)


def _module(fw, record: list | None = None):
    class Net(fw.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("loss", loss, prog_bar=True)
            self.log("hidden", 2 * loss)  # not prog_bar: not shown
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y), prog_bar=True)

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Net()


def _fit(fw, module, root, callbacks=(), epochs=2, val=True, **kw):
    kw.setdefault("max_epochs", epochs)
    trainer = _trainer(fw, root, callbacks, **kw)
    trainer.fit(module, DataLoader(_data(), batch_size=3),
                DataLoader(_data(8, seed=2), batch_size=3) if val else None)
    return trainer


FRAMEWORKS = ("lightning", "hookloop")


# ---------------------------------------------------------------------------------------
# 1. TQDMProgressBar
# ---------------------------------------------------------------------------------------


def _tqdm_run(name: str, refresh_rate: int):
    fw = frameworks.load(name)
    fw.seed_everything(0)
    module = _module(fw)
    bar = _callbacks(fw, "TQDMProgressBar", refresh_rate=refresh_rate)
    seen: list = []

    class Watch(type(module)):
        # The bar's position as each batch starts (what the previous batch's end drew) and
        # at the epoch's end: the module's hooks run where the bar does nothing.
        def on_train_batch_start(self, batch, batch_idx):
            seen.append(bar.train_progress_bar.n)

        def on_train_epoch_end(self):
            seen.append(("end", bar.train_progress_bar.n, bar.train_progress_bar.total))

    watched = Watch()
    watched.load_state_dict(module.state_dict())
    with tempfile.TemporaryDirectory() as root, redirect_stdout(io.StringIO()):
        trainer = _fit(fw, watched, root, [bar], progress=True)
        train, val = bar.train_progress_bar, bar.val_progress_bar
        return {
            "train": (train.n, train.total, train.desc, str(train.postfix)),
            "val": (val.n, val.total, val.desc),
            "metrics": bar.get_metrics(trainer, watched),
            "seen": seen,
            "enabled": bar.is_enabled,
        }


def test_tqdm_bar_shows_what_lightnings_shows():
    got = {name: _tqdm_run(name, refresh_rate=1) for name in FRAMEWORKS}
    lightning, ours = got["lightning"], got["hookloop"]
    # 20 samples / 3 = 7 batches; the last epoch's bar; v_num, then the prog_bar values
    assert ours["train"] == lightning["train"] == (7, 7, "Epoch 1: ", lightning["train"][3])
    assert lightning["train"][3].startswith("v_num=0, loss=") and "val_loss=" in lightning["train"][3]
    assert ours["val"] == lightning["val"] == (3, 3, "Validation DataLoader 0: ")
    assert list(ours["metrics"]) == list(lightning["metrics"]) == ["v_num", "loss", "val_loss"]
    assert ours["metrics"]["v_num"] == lightning["metrics"]["v_num"] == 0
    for key in ("loss", "val_loss"):
        assert ours["metrics"][key] == pytest.approx(lightning["metrics"][key], rel=1e-5)
    assert ours["seen"] == lightning["seen"]


def test_tqdm_bar_redraws_every_refresh_rate_batches_as_lightnings():
    got = {name: _tqdm_run(name, refresh_rate=3) for name in FRAMEWORKS}
    # 7 batches, redrawn after batches 3, 6 and the last
    expected = [0, 0, 0, 3, 3, 3, 6, ("end", 7, 7)] * 2
    assert got["lightning"]["seen"] == expected
    assert got["hookloop"]["seen"] == expected


def test_tqdm_bar_with_refresh_rate_0_draws_nothing_as_lightnings():
    got = {name: _tqdm_run(name, refresh_rate=0) for name in FRAMEWORKS}
    assert got["hookloop"]["seen"] == got["lightning"]["seen"]
    assert got["hookloop"]["enabled"] is got["lightning"]["enabled"] is False


def test_a_passed_bar_replaces_the_built_in_one_and_one_bar_is_allowed():
    bar = hookloop.TQDMProgressBar()
    trainer = hookloop.Trainer(callbacks=[bar], logger=False, enable_checkpointing=False)
    bars = [p for p in trainer.plugins if getattr(p, "hookloop_name", "") == "progress"]
    assert bars == [bar]
    for fw in (frameworks.load("lightning"), frameworks.load("hookloop")):
        with tempfile.TemporaryDirectory() as root:
            with pytest.raises(Exception, match="enable_progress_bar=False.*but found `TQDMProgressBar`"):
                _trainer(fw, root, [_callbacks(fw, "TQDMProgressBar")], progress=False)
            with pytest.raises(Exception, match="progress bar"):
                _trainer(fw, root, [_callbacks(fw, "TQDMProgressBar"), _callbacks(fw, "TQDMProgressBar")],
                         progress=True)


def test_tqdm_bar_test_and_predict_bars_as_lightnings():
    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        fw.seed_everything(0)
        module = _module(fw)
        module.test_step = module.validation_step
        bar = _callbacks(fw, "TQDMProgressBar", refresh_rate=2)
        with tempfile.TemporaryDirectory() as root, redirect_stdout(io.StringIO()):
            trainer = _trainer(fw, root, [bar], progress=True)
            trainer.test(module, DataLoader(_data(8), batch_size=3), verbose=False)
            trainer.predict(module, DataLoader(_data(10), batch_size=4))
        out[name] = [(b.n, b.total, b.desc) for b in (bar.test_progress_bar, bar.predict_progress_bar)]
    assert out["hookloop"] == out["lightning"] == [(3, 3, "Testing DataLoader 0: "), (3, 3, "Predicting DataLoader 0: ")]


# ---------------------------------------------------------------------------------------
# 2. RichProgressBar
# ---------------------------------------------------------------------------------------


def test_rich_bar_counts_and_metrics_as_lightnings():
    out = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        fw.seed_everything(0)
        module = _module(fw)
        bar = _callbacks(fw, "RichProgressBar", refresh_rate=2)
        seen: list = []

        class Watch(type(module)):
            def on_train_epoch_end(self):
                task = bar.progress.tasks[bar.train_progress_bar_id]
                seen.append((task.completed, task.total, task.description))

        watched = Watch()
        watched.load_state_dict(module.state_dict())
        with tempfile.TemporaryDirectory() as root:
            trainer = _fit(fw, watched, root, [bar], progress=True)
            out[name] = (seen, bar.get_metrics(trainer, watched))
    assert out["hookloop"][0] == out["lightning"][0] == [(7, 7, "Epoch 0/1 "), (7, 7, "Epoch 1/1 ")]
    ours, theirs = out["hookloop"][1], out["lightning"][1]
    assert list(ours) == list(theirs) and ours["v_num"] == theirs["v_num"]
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)


def test_a_missing_optional_package_is_named(monkeypatch):
    import hookloop.observers.bars as bars

    monkeypatch.setitem(sys.modules, "rich", None)  # as if not installed
    with pytest.raises(hookloop.MissingDependencyError, match="pip install rich"):
        bars.RichProgressBar()


# ---------------------------------------------------------------------------------------
# 3. ModelSummary and enable_model_summary
# ---------------------------------------------------------------------------------------


def _nested(fw, example: bool):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
            self.norm = nn.BatchNorm1d(8)

        def forward(self, x):
            return self.norm(self.inner(x))

    class Nested(fw.LightningModule):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(4, 8), Block())
            self.frozen = nn.Linear(8, 8)
            self.head = nn.Linear(8, 3)
            self.scale = nn.Parameter(torch.ones(5))  # "other params"
            for p in self.frozen.parameters():
                p.requires_grad_(False)
            self.frozen.eval()
            if example:
                self.example_input_array = torch.zeros(2, 4)

        def forward(self, x):
            return self.head(self.frozen(self.encoder(x)))

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1] % 3)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Nested()


@pytest.mark.parametrize("example", [False, True])
@pytest.mark.parametrize("depth", [1, 2, -1, 0])
def test_model_summary_table_is_lightnings(depth, example):
    from pytorch_lightning.utilities.model_summary import summarize as lightning_summarize

    from hookloop.observers.model_summary import summarize

    theirs = lightning_summarize(_nested(frameworks.load("lightning"), example), max_depth=depth)
    ours = summarize(_nested(frameworks.load("hookloop"), example), max_depth=depth)
    assert ours.layer_names == theirs.layer_names
    assert ours.layer_types == theirs.layer_types
    assert ours.param_nums == theirs.param_nums
    assert ours.training_modes == theirs.training_modes
    assert (ours.total_parameters, ours.trainable_parameters) == (theirs.total_parameters, theirs.trainable_parameters)
    assert ours.model_size == pytest.approx(theirs.model_size)
    assert ours.total_training_modes == theirs.total_training_modes
    assert ours.total_flops == theirs.total_flops
    assert str(ours) == str(theirs)


def _summary_printed(name: str, **kw) -> str:
    fw = frameworks.load(name)
    fw.seed_everything(0)
    module = _nested(fw, example=True)
    loader = DataLoader(_data(8), batch_size=4)
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as root, redirect_stdout(out):
        if name == "lightning":
            import logging

            handler = logging.StreamHandler(out)  # Lightning logs the table at info level
            summary_logger = logging.getLogger("pytorch_lightning.callbacks.model_summary")
            summary_logger.addHandler(handler)
            # at info level whatever an earlier test in this process set on its parents
            level, disabled = summary_logger.level, summary_logger.disabled
            summary_logger.setLevel(logging.INFO)
            summary_logger.disabled = False
            try:
                fw.pl.Trainer(accelerator="cpu", default_root_dir=root, max_steps=1, logger=False,
                              enable_progress_bar=False, enable_checkpointing=False, **kw).fit(module, loader)
            finally:
                summary_logger.removeHandler(handler)
                summary_logger.setLevel(level)
                summary_logger.disabled = disabled
        else:
            hookloop.Trainer(default_root_dir=root, max_steps=1, logger=False, enable_progress_bar=False,
                             enable_checkpointing=False, **kw).fit(module, loader)
    return out.getvalue()


def _table(text: str) -> str:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  | Name"))
    end = next(i for i, line in enumerate(lines) if line.endswith("Total Flops"))
    return "\n".join(lines[start:end + 1])


def test_fit_prints_lightnings_summary_by_default_and_the_flag_turns_it_off():
    # Lightning's default is RichModelSummary where rich is installed (as here): the
    # same rows drawn by rich; hookloop's default is the plain table (decisions.md)
    lightning = frameworks.load("lightning")
    theirs = _summary_printed("lightning", callbacks=[lightning.pl.callbacks.ModelSummary()])
    ours = _summary_printed("hookloop")
    assert _table(ours) == _table(theirs)
    assert "0 | encoder      | Sequential | 336 " in _table(ours)  # depth 1 by default
    deep = {name: _table(_summary_printed(name, callbacks=[_callbacks(frameworks.load(name), "ModelSummary", max_depth=-1)]))
            for name in FRAMEWORKS}
    assert deep["hookloop"] == deep["lightning"] and "encoder.1.inner.0" in deep["hookloop"]
    assert "Total params" not in _summary_printed("hookloop", enable_model_summary=False)


# ---------------------------------------------------------------------------------------
# 4. Timer
# ---------------------------------------------------------------------------------------


def _timer_run(name: str, interval: str, stop_at: tuple | None, duration="01:00:00:00"):
    """Fit 3 epochs of 7 batches with a Timer; at (epoch, batch_idx) ``stop_at`` the
    module makes the time up (the duration becomes 0): where both frameworks stop is
    then decided by the Timer's checks alone, not by the clock."""
    fw = frameworks.load(name)
    fw.seed_everything(0)
    timer = _callbacks(fw, "Timer", duration=duration, interval=interval, verbose=False)

    class TimeUp(type(_module(fw))):
        def training_step(self, batch, batch_idx):
            if stop_at == (self.current_epoch, batch_idx):
                timer._duration = 0.0
            return super().training_step(batch, batch_idx)

    with tempfile.TemporaryDirectory() as root:
        trainer = _fit(fw, TimeUp(), root, [timer], max_epochs=3, val=False)
    return trainer.global_step, trainer.current_epoch, timer.start_time("train") is None


@pytest.mark.parametrize("interval", ["step", "epoch"])
@pytest.mark.parametrize("stop_at", [(0, 2), (1, 6), None])
def test_timer_stops_where_lightnings_stops(interval, stop_at):
    theirs, ours = (_timer_run(name, interval, stop_at) for name in FRAMEWORKS)
    # (global_step, current_epoch, start_time("train") is None); 7 batches an epoch
    expected = {("step", (0, 2)): (3, 1, False), ("step", (1, 6)): (14, 2, False),
                ("epoch", (0, 2)): (7, 1, False), ("epoch", (1, 6)): (14, 2, False)}
    assert theirs == expected.get((interval, stop_at), (21, 3, False))
    if (interval, stop_at) == ("step", (0, 2)):
        # stopped inside the epoch: current_epoch stays (decisions.md "Stopping mid-epoch")
        theirs = (theirs[0], theirs[1] - 1, theirs[2])
    assert ours == theirs


@pytest.mark.parametrize("duration", ["00:00:00:00", timedelta(0), {"seconds": 0}])
def test_a_timer_of_zero_stops_before_any_step_as_lightnings(duration):
    theirs, ours = (_timer_run(name, "step", None, duration=duration) for name in FRAMEWORKS)
    # Lightning's Timer checks at fit start: no training at all, on_train_start not called
    assert ours == theirs == (0, 0, True)


def test_timer_queries_and_bad_input():
    timer = hookloop.Timer(duration={"minutes": 1})
    assert timer.time_remaining() == 60.0 and timer.time_elapsed() == 0 and timer.start_time() is None
    with tempfile.TemporaryDirectory() as root:
        _fit(frameworks.load("hookloop"), _module(frameworks.load("hookloop")), root, [timer], epochs=1,
             max_epochs=1, val=True)
    train, validate = timer.time_elapsed("train"), timer.time_elapsed("validate")
    assert timer.end_time("train") - timer.start_time("train") == train > 0
    assert 0 < validate < train and timer.time_remaining() == pytest.approx(60.0 - train)
    assert set(timer.state_dict()["time_elapsed"]) == {"train", "sanity_check", "validate", "test", "predict"}
    with pytest.raises(hookloop.ConfigurationError, match="DD:HH:MM:SS"):
        hookloop.Timer(duration="1 hour")
    with pytest.raises(hookloop.ConfigurationError, match="Possible choices are: step, epoch"):
        hookloop.Timer(interval="batch")


def _resume_run(name: str, root: str):
    """Fit 1 epoch with a measuring Timer, checkpoint, then resume for 3 epochs with a
    Timer whose duration is half the time already spent: the resumed run must stop at
    once, at the checkpoint's step (the elapsed time came back from the checkpoint)."""
    fw = frameworks.load(name)
    fw.seed_everything(0)
    first = _callbacks(fw, "Timer")
    trainer = _fit(fw, _module(fw), root, [first], max_epochs=1, val=False)
    path = str(Path(root) / f"{name}.ckpt")
    trainer.save_checkpoint(path)
    spent = first.time_elapsed()
    second = _callbacks(fw, "Timer", duration=timedelta(seconds=spent / 2), verbose=False)
    resumed = _trainer(fw, root, [second], max_epochs=3)
    resumed.fit(_module(fw), DataLoader(_data(), batch_size=3), ckpt_path=path)
    return resumed.global_step, resumed.current_epoch, second.time_elapsed() >= spent


def test_timer_state_is_saved_in_checkpoints_and_resumed_as_lightnings():
    with tempfile.TemporaryDirectory() as root:
        theirs, ours = (_resume_run(name, root) for name in FRAMEWORKS)
    assert ours == theirs == (7, 1, True)


@pytest.mark.check  # reads the shared ddp job
def test_under_ddp_rank_0_draws_and_the_timer_stops_every_rank(jobs):
    # tests/scripts/bars_timer_ddp.py in the shared ddp job (tests/jobs.py); each rank's bar
    # draws into the fit's redirected stdout, a buffer: what the job's console is does not matter
    rank0, rank1 = jobs.run("ddp").ranks("bars_timer_ddp")
    # rank 0's time is up in step 2; with stop_check_every_n_steps=1 its vote, given at
    # boundary 2, is read at boundary 3 (the agreement does not wait): both stop after step 3
    assert (rank0["enabled"], rank0["drew"], rank0["n"]) == (True, True, 3)
    assert (rank1["enabled"], rank1["drew"], rank1["n"]) == (False, False, 0)  # a disabled bar counts nothing
    assert rank0["step"] == rank1["step"] == 3


# ---------------------------------------------------------------------------------------
# 5. benchmark / deterministic, and what a step costs
# ---------------------------------------------------------------------------------------


@pytest.fixture
def torch_flags():
    saved = torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.backends.cudnn.benchmark = saved[0]
    torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])


@pytest.mark.parametrize("kw", [{"benchmark": True}, {"benchmark": False}, {}, {"deterministic": True},
                                {"deterministic": "warn", "benchmark": True}, {"deterministic": False}])
def test_benchmark_and_deterministic_set_torch_as_lightnings(kw, torch_flags):
    import warnings

    got = {}
    for name in FRAMEWORKS:
        torch.backends.cudnn.benchmark = True  # a value to keep or change
        torch.use_deterministic_algorithms(False)
        fw = frameworks.load(name)
        with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trainer(fw, root, **kw)
        warned = any("deterministic=True` and `benchmark=True`" in str(w.message) for w in caught)
        got[name] = (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled(), warned)
    assert got["hookloop"] == got["lightning"]


def test_the_flags_travel_from_hookloop_run_and_bad_values_are_refused(monkeypatch, torch_flags):
    torch.backends.cudnn.benchmark = False
    monkeypatch.setenv("HOOKLOOP_TRAINER_DEFAULTS", '{"benchmark": true, "enable_model_summary": false}')
    monkeypatch.setenv("HOOKLOOP_LAUNCHER_PID", str(os.getppid()))  # as in a process `hookloop run` started
    trainer = hookloop.Trainer(logger=False, enable_checkpointing=False)
    assert torch.backends.cudnn.benchmark is True
    assert not any(getattr(p, "hookloop_name", "") == "model_summary" for p in trainer.plugins)
    monkeypatch.delenv("HOOKLOOP_TRAINER_DEFAULTS")
    with pytest.raises(hookloop.ConfigurationError, match="benchmark='yes' must be True, False or None"):
        hookloop.Trainer(benchmark="yes")
    with pytest.raises(hookloop.ConfigurationError, match="deterministic=1 must be True, False, 'warn'"):
        hookloop.Trainer(deterministic=1)
    with pytest.raises(hookloop.ConfigurationError, match="max_depth=-2"):
        hookloop.ModelSummary(max_depth=-2)


def _calls_per_step(plugins, **kw) -> float:
    """Python calls per training step (tests/test_contract.py's count, with a bar allowed)."""
    from conftest import TinyModule, fit_profiled, tiny_data

    def count(steps):
        calls = 0

        def profile(frame, event, arg):
            nonlocal calls
            if event in ("call", "c_call"):
                calls += 1

        trainer = hookloop.Trainer(plugins=list(plugins), max_steps=steps, enable_checkpointing=False,
                                   num_sanity_val_steps=0, logger=False, **kw)
        with redirect_stdout(io.StringIO()):
            fit_profiled(trainer, TinyModule(), DataLoader(tiny_data(8 * 40), batch_size=8), profile)
        return calls

    count(2)
    return (count(20) - count(10)) / 10


def test_these_observers_cost_nothing_per_step_unless_they_must():
    alone = _calls_per_step([], enable_progress_bar=False)
    # measuring only, the table (at fit start): nothing on the step path
    assert _calls_per_step([hookloop.Timer(), hookloop.ModelSummary()], enable_progress_bar=False) == alone
    # a bar that draws nothing (refresh_rate=0) registers no per-batch event
    assert _calls_per_step([hookloop.TQDMProgressBar(refresh_rate=0)]) == alone
    # a step-interval time limit: its event, the check and the clock, each step
    timed = _calls_per_step([hookloop.Timer(duration="01:00:00:00")], enable_progress_bar=False)
    assert 0 < timed - alone <= 12, timed - alone
