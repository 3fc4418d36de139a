"""The built-in observers on real single-process runs: progress, csv, checkpoint,
early_stopping, lr_monitor, and the run directories they write into.

Every expected value is worked out here by hand or recorded by the module itself as it
trains (the loss of each batch, its weights at each epoch's end), never read back from
the observer under test. The 2-process checks are in tests/test_observers_ddp.py.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
import hookloop.tools.cli
from conftest import REPO, TinyModule, run_python, state_of, tiny_data

BATCHES = 7  # tiny_data(100) in batches of 16


def train_loader():
    return DataLoader(tiny_data(100), batch_size=16, shuffle=True)


def val_loader():
    return DataLoader(tiny_data(40, seed=5), batch_size=16)


class Scripted(TinyModule):
    """Logs ``val_loss`` from a script (one value per epoch) and records, as it trains,
    each step's loss and its weights at each epoch's end: the references."""

    def __init__(self, val_values=(), prog_bar=False, **kw):
        super().__init__(**kw)
        self.val_values = list(val_values)
        self.prog_bar = prog_bar
        self.step_losses: dict[int, float] = {}  # global step the batch made -> its loss
        self.epoch_weights: dict[int, dict] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=self.prog_bar)
        self.step_losses[self.global_step + 1] = float(loss.detach())
        return loss

    def validation_step(self, batch, batch_idx):
        if self.val_values:
            self.log("val_loss", torch.tensor(self.val_values[self.current_epoch]))
        else:
            super().validation_step(batch, batch_idx)

    def on_train_epoch_end(self):
        self.epoch_weights[self.current_epoch] = state_of(self)


def fit(module, epochs=2, val=True, **kw):
    kw.setdefault("default_root_dir", os.getcwd())
    trainer = hookloop.Trainer(max_epochs=epochs, **kw)
    trainer.fit(module, train_loader(), val_loader() if val else None)
    return trainer


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# -- run directories ------------------------------------------------------------------------


def test_each_run_gets_its_own_version_directory_and_last_finds_the_newest(tmp_path):
    first = fit(Scripted(), epochs=1)
    second = fit(Scripted(), epochs=1)
    assert Path(first.log_dir) == tmp_path / "logs" / "version_0"
    assert Path(second.log_dir) == tmp_path / "logs" / "version_1"
    # the second run did not overwrite the first's checkpoint
    for run in (first, second):
        assert (Path(run.log_dir) / "checkpoints" / "last.ckpt").is_file()
    # ckpt_path="last": the newest run's last checkpoint (version_1's, one epoch in)
    module = Scripted()
    resumed = hookloop.Trainer(max_epochs=2, default_root_dir=str(tmp_path))
    resumed.fit(module, train_loader(), ckpt_path="last")
    assert resumed.global_step == 2 * BATCHES and module.step_losses.keys() == set(range(BATCHES + 1, 2 * BATCHES + 1))
    assert Path(resumed.log_dir) == tmp_path / "logs" / "version_2"


def test_an_unwritable_log_directory_is_refused_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    module = Scripted()
    with pytest.raises(hookloop.ConfigurationError, match="default_root_dir") as info:
        fit(module, default_root_dir=str(blocker / "runs"))
    assert str(blocker) in str(info.value)
    assert module.step_losses == {}  # refused before the first step


# -- progress -------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_without_a_terminal_prints_one_line_per_epoch_with_prog_bar_metrics(capsys):
    module = Scripted(prog_bar=True)
    trainer = fit(module, epochs=3, val=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch ")]
    assert [line.split(":")[0] for line in lines] == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    assert all(f"{BATCHES} batches in" in line for line in lines)
    # the value shown is the last step's loss, which the module recorded itself
    assert lines[-1].endswith(f"train_loss={module.step_losses[3 * BATCHES]:.4g}")
    assert float(trainer.progress_bar_metrics["train_loss"]) == pytest.approx(module.step_losses[3 * BATCHES])


def test_progress_on_a_terminal_draws_bars_with_totals_rate_and_metrics():
    out = Terminal()
    fit(Scripted(prog_bar=True), epochs=2, callbacks=[hookloop.ProgressBar(refresh_seconds=0, file=out)])
    text = out.getvalue()
    assert "Epoch 1/2" in text and "Epoch 2/2" in text
    assert f"{BATCHES}/{BATCHES}" in text and "it/s" in text and "train_loss=" in text
    assert "Validation" in text


def test_progress_reads_the_logged_values_only_when_it_redraws():
    class Counting(hookloop.ProgressBar):
        reads = 0

        def _postfix(self, trainer, extra=None):
            Counting.reads += 1
            return super()._postfix(trainer, extra)

    fit(Scripted(prog_bar=True), epochs=2, val=False,
        callbacks=[Counting(refresh_seconds=3600, file=Terminal())])
    assert Counting.reads == 2  # once per epoch end: never on the 14 steps
    Counting.reads = 0
    fit(Scripted(prog_bar=True), epochs=2, val=False, callbacks=[Counting(refresh_seconds=0, file=Terminal())])
    assert Counting.reads == 2 * BATCHES + 2


@pytest.mark.parametrize("off", [dict(enable_progress_bar=False), dict(plugins=["no:progress"])])
def test_progress_bar_off(off, capsys):
    trainer = fit(Scripted(), epochs=1, val=False, **off)
    assert "Epoch 1/1" not in capsys.readouterr().out
    assert "progress" not in [hookloop.contract.registry.plugin_name(p) for p in trainer.plugins]


def test_without_a_terminal_the_bar_adds_no_call_per_step():
    seen = []

    class Probe:
        hookloop_role = "observer"

        @hookloop.hookimpl
        def on_train_epoch_start(self, trainer):
            seen.extend(impl.plugin_name for impl in trainer.hook.on_train_batch_end.get_hookimpls())

    hookloop.Trainer(max_epochs=1, default_root_dir=os.getcwd(), plugins=[Probe()]).fit(Scripted(), train_loader())
    assert seen == []


# -- csv ------------------------------------------------------------------------------------


def test_csv_writes_every_logging_event_with_step_and_epoch(tmp_path):
    module = Scripted(val_values=[0.9, 0.7])
    module.save_hyperparameters({"hidden": 16, "lr": 0.1})
    trainer = fit(module, epochs=2, log_every_n_steps=3)
    rows = read_csv(Path(trainer.log_dir) / "metrics.csv")
    step_rows = [r for r in rows if r["train_loss"]]
    val_rows = [r for r in rows if r["val_loss"]]
    # a step row every 3 optimizer steps, carrying the loss of the batch that made it
    assert [int(r["step"]) for r in step_rows] == [3, 6, 9, 12]
    assert [int(r["epoch"]) for r in step_rows] == [0, 0, 1, 1]
    for r in step_rows:
        assert float(r["train_loss"]) == pytest.approx(module.step_losses[int(r["step"])], rel=1e-6)
    # one row per validation, at the step it ran
    assert [(int(r["step"]), int(r["epoch"]), float(r["val_loss"])) for r in val_rows] == [
        (BATCHES, 0, pytest.approx(0.9)), (2 * BATCHES, 1, pytest.approx(0.7))]
    assert float(val_rows[-1]["val_loss"]) == pytest.approx(float(trainer.callback_metrics["val_loss"]))
    assert len(rows) == len(step_rows) + len(val_rows)
    hparams = yaml.safe_load((Path(trainer.log_dir) / "hparams.yaml").read_text())
    assert hparams["module"] == {"hidden": 16, "lr": 0.1}
    assert hparams["trainer"]["max_epochs"] == 2 and hparams["trainer"]["log_every_n_steps"] == 3


def test_csv_epoch_metrics_and_logger_false():
    class EpochLogs(Scripted):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss_mean", loss, on_step=False, on_epoch=True)
            self.log("hidden", 1.0, logger=False)
            return loss

    module = EpochLogs()
    trainer = fit(module, epochs=2, val=False, log_every_n_steps=50)
    rows = read_csv(Path(trainer.log_dir) / "metrics.csv")
    assert "hidden" not in rows[0]
    # no step row (50 > 14 steps); one epoch row each with the mean of its 7 batch losses
    # (batches of 16 but the last of 4: Lightning weights the mean by batch size)
    sizes = [16] * 6 + [4]
    for epoch, row in enumerate(rows):
        losses = [module.step_losses[epoch * BATCHES + i + 1] for i in range(BATCHES)]
        mean = sum(w * v for w, v in zip(sizes, losses)) / sum(sizes)
        assert (int(row["epoch"]), int(row["step"])) == (epoch, (epoch + 1) * BATCHES)
        assert float(row["loss_mean"]) == pytest.approx(mean, rel=1e-5)
    assert len(rows) == 2


def test_what_the_module_logs_in_on_train_epoch_end_is_in_that_epochs_row():
    class LogsAtEpochEnd(Scripted):
        def on_train_epoch_end(self):
            super().on_train_epoch_end()
            self.log("weight_norm", sum(p.detach().norm() ** 2 for p in self.parameters()) ** 0.5)

    module = LogsAtEpochEnd()
    trainer = fit(module, epochs=2, val=False)
    rows = read_csv(Path(trainer.log_dir) / "metrics.csv")
    norms = [sum(float(w.norm()) ** 2 for k, w in module.epoch_weights[e].items()) ** 0.5 for e in (0, 1)]
    assert [(int(r["epoch"]), float(r["weight_norm"])) for r in rows] == [
        (0, pytest.approx(norms[0], rel=1e-5)), (1, pytest.approx(norms[1], rel=1e-5))]


def test_logger_false_and_no_csv_write_nothing(tmp_path):
    fit(Scripted(), epochs=1, logger=False, default_root_dir=str(tmp_path / "a"))
    fit(Scripted(), epochs=1, plugins=["no:csv"], default_root_dir=str(tmp_path / "b"))
    # Lightning's layout without a logger: no run directory, the checkpoints in
    # default_root_dir/checkpoints and no resume last.ckpt (docs/decisions.md)
    assert not list(tmp_path.glob("*/logs"))
    assert [p.name for p in sorted(tmp_path.glob("*/checkpoints/*"))] == ["epoch=0-step=7.ckpt"] * 2


RESTART = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
import hookloop
from test_observers import Scripted, train_loader, val_loader

class Crashes(Scripted):
    def training_step(self, batch, batch_idx):
        if os.environ.get("CRASH_AT") and self.global_step == int(os.environ["CRASH_AT"]):
            raise SystemExit(3)  # the worker dies
        return super().training_step(batch, batch_idx)

torch.manual_seed(0)
trainer = hookloop.Trainer(max_epochs=3, log_every_n_steps=2, enable_progress_bar=False, default_root_dir=sys.argv[1],
                           callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=4, every_n_epochs=0)])
trainer.fit(Crashes(val_values=[0.5, 0.4, 0.3]), train_loader(), val_loader(), ckpt_path=sys.argv[2] if len(sys.argv) > 2 else None)
print(trainer.log_dir)
"""


@pytest.mark.slow  # a real crash (the process exits mid-run) and its restart
def test_csv_after_a_restart_has_every_row_once(tmp_path):
    script = tmp_path / "restart.py"
    script.write_text(RESTART.format(tests=str(REPO / "tests")))
    straight = run_python([sys.executable, str(script), str(tmp_path / "a")], cwd=tmp_path)
    reference = read_csv(Path(straight.stdout.strip().splitlines()[-1]) / "metrics.csv")
    # the same job restarted (same run id): crashes after step 13, whose checkpoint is at
    # step 12 and whose csv already has the row of step 12 (and those of 2..12 before it)
    env = {"HOOKLOOP_RUN_ID": "job-42"}
    crashed = subprocess_returncode([sys.executable, str(script), str(tmp_path / "b")], tmp_path, {**env, "CRASH_AT": "13"})
    assert crashed == 3
    written = read_csv(tmp_path / "b" / "logs" / "version_0" / "metrics.csv")
    assert int(written[-1]["step"]) == 12
    resumed = run_python([sys.executable, str(script), str(tmp_path / "b"), "last"], cwd=tmp_path, env=env)
    assert Path(resumed.stdout.strip().splitlines()[-1]) == tmp_path / "b" / "logs" / "version_0"
    rows = read_csv(tmp_path / "b" / "logs" / "version_0" / "metrics.csv")
    assert [(r["step"], r["epoch"]) for r in rows] == [(r["step"], r["epoch"]) for r in reference]
    for got, want in zip(rows, reference):
        assert {k: float(v) for k, v in got.items() if v} == pytest.approx({k: float(v) for k, v in want.items() if v})


def subprocess_returncode(args, cwd, env):
    import subprocess

    full = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
    return subprocess.run(args, cwd=cwd, env={**full, **env}, capture_output=True, text=True, timeout=300).returncode


# -- checkpoint -----------------------------------------------------------------------------


VALS = [5.0, 3.0, 4.0, 1.0, 2.0]


@pytest.mark.parametrize("mode, best_epochs", [("min", [3, 4]), ("max", [0, 2])])
def test_top_k_keeps_the_best_files_by_the_monitored_metric(mode, best_epochs):
    module = Scripted(val_values=VALS)
    callback = hookloop.ModelCheckpoint(monitor="val_loss", mode=mode, save_top_k=2, filename="{epoch}-{val_loss:.2f}")
    trainer = fit(module, epochs=5, callbacks=[callback])
    directory = Path(trainer.log_dir) / "checkpoints"
    expected = {f"epoch={e}-val_loss={VALS[e]:.2f}.ckpt" for e in best_epochs}
    assert {p.name for p in directory.iterdir()} == expected | {"last.ckpt", "last.prev.ckpt"}
    best = best_epochs[0] if VALS[best_epochs[0]] == (min if mode == "min" else max)(VALS) else best_epochs[1]
    assert trainer.checkpoint_callback is callback
    assert callback.best_model_path == str(directory / f"epoch={best}-val_loss={VALS[best]:.2f}.ckpt")
    assert callback.best_model_score == VALS[best]
    # each file holds the weights of its epoch, last.ckpt those of the last one
    for e in best_epochs:
        saved = hookloop.safe_load(directory / f"epoch={e}-val_loss={VALS[e]:.2f}.ckpt")["state_dict"]
        assert all(torch.equal(saved[k], module.epoch_weights[e][k]) for k in saved)
    last = hookloop.safe_load(directory / "last.ckpt")["state_dict"]
    assert all(torch.equal(last[k], module.epoch_weights[4][k]) for k in last)


def test_ckpt_path_best_loads_the_best_weights():
    module = Scripted(val_values=VALS)
    trainer = fit(module, epochs=5, callbacks=[hookloop.ModelCheckpoint(monitor="val_loss", save_top_k=1)])
    probe = Scripted(val_values=VALS, seed=3)
    trainer.validate(probe, val_loader(), ckpt_path="best")
    assert all(torch.equal(probe.state_dict()[k], module.epoch_weights[3][k]) for k in probe.state_dict())


def test_a_resumed_run_continues_the_top_k_bookkeeping(tmp_path):
    def callback():
        return hookloop.ModelCheckpoint(dirpath=tmp_path / "ck", monitor="val_loss", save_top_k=2)

    straight = fit(Scripted(val_values=VALS), epochs=5, callbacks=[callback()], default_root_dir=str(tmp_path / "a"))
    reference = {Path(p).name for p in straight.checkpoint_callback.best_k_models}
    import shutil

    shutil.rmtree(tmp_path / "ck")
    fit(Scripted(val_values=VALS), epochs=3, callbacks=[callback()], default_root_dir=str(tmp_path / "b"))
    again = callback()
    trainer = hookloop.Trainer(max_epochs=5, default_root_dir=str(tmp_path / "b"), callbacks=[again])
    # hookloop's own last.ckpt is in the run directory (dirpath holds what Lightning writes)
    trainer.fit(Scripted(val_values=VALS), train_loader(), val_loader(), ckpt_path="last")
    # epoch 2's file (4.0) from the first run was pushed out by epoch 3's (1.0) in the second
    assert reference == {"epoch=3-step=28.ckpt", "epoch=4-step=35.ckpt"}
    assert {p.name for p in (tmp_path / "ck").iterdir()} == reference
    assert again.best_model_path == str(tmp_path / "ck" / "epoch=3-step=28.ckpt") and again.best_model_score == 1.0


def test_every_n_train_steps_saves_at_those_steps():
    trainer = fit(Scripted(), epochs=2, val=False,
                  callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=3, every_n_epochs=0, save_top_k=-1)])
    names = {p.name for p in (Path(trainer.log_dir) / "checkpoints").iterdir()}
    assert names == {f"epoch={(s - 1) // BATCHES}-step={s}.ckpt" for s in (3, 6, 9, 12)} | {"last.ckpt", "last.prev.ckpt"}
    # training ended at step 14, between two saves: last.ckpt is where it stopped
    assert hookloop.safe_load(Path(trainer.log_dir) / "checkpoints" / "last.ckpt")["loop"]["global_step"] == 14


def test_no_checkpoint_plugin_writes_no_checkpoint(tmp_path):
    fit(Scripted(), epochs=1, enable_checkpointing=False, default_root_dir=str(tmp_path / "a"))
    fit(Scripted(), epochs=1, plugins=["no:checkpoint"], default_root_dir=str(tmp_path / "b"))
    assert not list(tmp_path.glob("**/*.ckpt"))


class SavesAt:
    """A plugin that calls trainer.save_checkpoint where the issue says resuming broke."""

    hookloop_role = "observer"

    def __init__(self, directory: Path, step: int):
        self.directory, self.step = directory, step

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer):
        if trainer.global_step == self.step and not (self.directory / "batch.ckpt").exists():
            trainer.save_checkpoint(self.directory / "batch.ckpt")

    @hookloop.hookimpl
    def on_train_epoch_end(self, trainer, epoch):
        if epoch == 0:
            trainer.save_checkpoint(self.directory / "epoch.ckpt")


@pytest.mark.parametrize("where", ["batch", "epoch"])
def test_save_checkpoint_from_a_plugin_resumes_exactly(tmp_path, where):
    """Written from on_train_batch_end it used to re-train its batch; from
    on_train_epoch_end it stepped the epoch scheduler twice on resume."""
    torch.manual_seed(0)
    straight = Scripted(scheduler=True)
    fit(straight, epochs=3, val=False, plugins=[SavesAt(tmp_path, step=10)], default_root_dir=str(tmp_path / "a"))
    torch.manual_seed(5)
    resumed = Scripted(seed=8, scheduler=True)
    trainer = hookloop.Trainer(max_epochs=3, default_root_dir=str(tmp_path / "b"))
    trainer.fit(resumed, train_loader(), ckpt_path=tmp_path / f"{where}.ckpt")
    first = 11 if where == "batch" else BATCHES + 1
    assert sorted(resumed.step_losses) == list(range(first, 3 * BATCHES + 1))  # no batch trained twice
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    a, b = state_of(straight), state_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_monitor_never_logged_fails_at_the_first_check_listing_the_logged_metrics():
    module = Scripted()
    with pytest.raises(hookloop.ConfigurationError, match=r"monitor='val_accuracy'.*logged: train_loss, val_acc, val_loss"):
        fit(module, epochs=3, callbacks=[hookloop.ModelCheckpoint(monitor="val_accuracy")])
    assert max(module.step_losses) == BATCHES  # at the end of the first epoch


@pytest.mark.parametrize("factory", [
    lambda: hookloop.ModelCheckpoint(monitor="val_loss", mode="lowest"),
    lambda: hookloop.EarlyStopping(monitor="val_loss", mode="minimum"),
])
def test_mode_must_be_min_or_max(factory):
    # Lightning's words first, then what each means
    with pytest.raises(hookloop.ConfigurationError, match="`mode` can be min, max.*'min'.*lower val_loss is better"):
        factory()


def test_mode_from_the_command_line_is_checked_before_training(tmp_path, capfd):
    script = tmp_path / "s.py"
    script.write_text("import sys\nsys.path.insert(0, %r)\nfrom test_observers import Scripted, fit\n"
                      "fit(Scripted(), epochs=1)\n" % str(REPO / "tests"))
    # In this process; capfd, not capsys: a script started by mistake would print on the file descriptor.
    code = hookloop.tools.cli.main(["run", "--plugins", "early_stopping", "--plugin-option", "early_stopping.mode=up",
                              str(script)])
    out, err = capfd.readouterr()
    assert code != 0 and "`mode` can be min, max, got up ('min': lower val_loss is better" in err
    assert "Epoch 1/1" not in out


def test_a_file_checkpoint_where_a_directory_strategy_would_write_is_refused_before_training(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "last.ckpt").mkdir()  # what a sharded (DeepSpeed) run left there
    module = Scripted()
    with pytest.raises(hookloop.ConfigurationError, match="is a directory, and this run's strategy writes single-file"):
        fit(module, epochs=1, callbacks=[hookloop.ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)])
    assert module.step_losses == {}


# -- early stopping -------------------------------------------------------------------------


VALS_ES = [5.0, 3.0, 4.0, 4.5, 1.0, 2.0, 2.5, 3.0]


@pytest.mark.parametrize("options, stop_epoch", [
    # Lightning 2: the patience-th check without improvement stops (wait_count >= patience)
    (dict(patience=1), 2),  # best 3.0 at epoch 1; 4.0: the first check without improvement
    (dict(patience=0), 2),  # an improvement never stops, even with patience 0
    (dict(patience=3), 7),  # 4.0, 4.5, then 1.0 improves; 2.0, 2.5, 3.0: stops at the last epoch
    (dict(stopping_threshold=3.5), 1),  # 3.0 is below the threshold
    (dict(patience=1, min_delta=2.5), 1),  # 3.0 is not 2.5 better than 5.0
    (dict(divergence_threshold=4.9), 0),  # 5.0 is worse than the threshold
])
def test_early_stopping_stops_at_the_expected_epoch(options, stop_epoch):
    module = Scripted(val_values=VALS_ES)
    stopper = hookloop.EarlyStopping(monitor="val_loss", **options)
    trainer = fit(module, epochs=8, callbacks=[stopper])
    assert sorted(module.epoch_weights) == list(range(stop_epoch + 1))
    assert trainer.current_epoch == stop_epoch + 1 and stopper.stopped_epoch == stop_epoch


def test_early_stopping_on_a_non_finite_metric():
    module = Scripted(val_values=[1.0, float("nan"), 0.5])
    fit(module, epochs=3, callbacks=[hookloop.EarlyStopping(monitor="val_loss", patience=5)])
    assert len(module.epoch_weights) == 2


def test_early_stopping_without_validation_checks_at_epoch_end():
    class Logs(Scripted):
        def on_train_epoch_end(self):
            super().on_train_epoch_end()
            self.log("score", [1.0, 2.0, 3.0, 3.0, 3.0, 3.0][self.current_epoch])

    module = Logs()
    fit(module, epochs=6, val=False, callbacks=[hookloop.EarlyStopping(monitor="score", mode="max", patience=1)])
    assert len(module.epoch_weights) == 4  # 3.0 at epochs 2, 3 (1st without improvement: stop)


def test_should_stop_set_inside_an_epoch_stops_at_the_next_step():
    class Stops:
        hookloop_role = "observer"

        @hookloop.hookimpl
        def on_train_batch_end(self, trainer):
            if trainer.global_step == 3:
                trainer.should_stop = True

    module = Scripted()
    trainer = fit(module, epochs=2, val=False, plugins=[Stops()])
    assert trainer.global_step == 3 and max(module.step_losses) == 3


def test_early_stopping_monitor_never_logged():
    with pytest.raises(hookloop.ConfigurationError, match=r"EarlyStopping\(monitor='val_los'\).*logged: .*val_loss"):
        fit(Scripted(), epochs=2, callbacks=[hookloop.EarlyStopping(monitor="val_los")])


def test_early_stopping_state_resumes():
    vals = [5.0, 3.0, 4.0, 4.5, 4.6]
    straight = Scripted(val_values=vals)
    fit(straight, epochs=5, callbacks=[hookloop.EarlyStopping(monitor="val_loss", patience=2)])
    assert len(straight.epoch_weights) == 4
    first = fit(Scripted(val_values=vals), epochs=3, callbacks=[hookloop.EarlyStopping(monitor="val_loss", patience=2)])
    resumed = Scripted(val_values=vals)
    trainer = hookloop.Trainer(max_epochs=5, default_root_dir=os.getcwd(),
                               callbacks=[hookloop.EarlyStopping(monitor="val_loss", patience=2)])
    trainer.fit(resumed, train_loader(), val_loader(), ckpt_path=first.checkpoint_callback.last_model_path)
    assert sorted(resumed.epoch_weights) == [3]  # the wait count of epoch 2 came back


# -- lr_monitor -----------------------------------------------------------------------------


class StepScheduled(Scripted):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_lr_monitor_logs_the_schedulers_values_per_step():
    module = StepScheduled()
    trainer = fit(module, epochs=1, val=False, log_every_n_steps=2,
                  plugins=[hookloop.plugin("lr_monitor", log_momentum=True)])
    rows = [r for r in read_csv(Path(trainer.log_dir) / "metrics.csv") if r.get("lr-SGD")]
    # as Lightning: before the batch whose row the loggers take ((s + 1) % 2 == 0), the lr
    # that batch's step uses (the scheduler has stepped s times): 0.1 / (1 + s), at step s
    assert [(int(r["step"]), float(r["lr-SGD"])) for r in rows] == [
        (s, pytest.approx(0.1 / (1 + s))) for s in (1, 3, 5)]
    assert all(float(r["lr-SGD-momentum"]) == 0.9 for r in rows)


def test_lr_monitor_per_epoch_with_two_optimizers_and_groups():
    class Two(Scripted):
        def configure_optimizers(self):
            a = torch.optim.SGD([{"params": self.net[0].parameters()}, {"params": self.net[2].parameters(), "lr": 0.5}],
                                lr=0.1)
            b = torch.optim.Adam(self.net.parameters(), lr=0.01)
            return [a, b], [torch.optim.lr_scheduler.StepLR(a, 1, gamma=0.5)]

        def training_step(self, batch, batch_idx):
            opt_a, _ = self.optimizers()
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.manual_backward(loss)
            opt_a.step()
            opt_a.zero_grad()
            self.log("train_loss", loss)
            return loss

        def on_train_epoch_end(self):
            super().on_train_epoch_end()
            self.lr_schedulers().step()

    module = Two()
    module.automatic_optimization = False
    trainer = fit(module, epochs=3, val=False, plugins=["lr_monitor"])
    rows = [r for r in read_csv(Path(trainer.log_dir) / "metrics.csv") if r.get("lr-SGD/pg1")]
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert [float(r["lr-SGD/pg1"]) for r in rows] == pytest.approx([0.1 * 0.5**e for e in range(3)])
    assert [float(r["lr-SGD/pg2"]) for r in rows] == pytest.approx([0.5 * 0.5**e for e in range(3)])
    assert [float(r["lr-Adam"]) for r in rows] == pytest.approx([0.01] * 3)
