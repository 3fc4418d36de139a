"""``hookloop.Tuner`` (issue 22, item 7): the learning-rate finder and the batch-size
finder, against a hand-written PyTorch loop, against pytorch-lightning 2.6.6's ``Tuner``,
and under ddp (2 processes, gloo), where every rank must take the same decisions.

The module and data are tests/scripts/tuner_job.py's (also the ddp run, in the shared ddp
job of tests/jobs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.lightning.tuner import lr_schedule

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import tuner_job as job  # noqa: E402

BETA = 0.98


def hand_lr_find(batch: int, num_training: int, min_lr: float, max_lr: float, mode: str = "exponential",
                 threshold: float | None = 4.0) -> tuple[list[float], list[float]]:
    """The range test written out: SGD on ``job.net()`` over the data in order, the lr of
    step k set before it, Lightning's bias-corrected running mean (beta 0.98, step k+1)
    and its stop rule."""
    model = job.net()
    opt = torch.optim.SGD(model.parameters(), lr=min_lr)
    lrs_planned = lr_schedule(mode, min_lr, max_lr, num_training)
    lrs, losses, avg, best = [], [], 0.0, 0.0
    loader = DataLoader(job.data(), batch_size=batch, shuffle=False)
    for k, (x, y) in enumerate(loader):
        if k == num_training:
            break
        for g in opt.param_groups:
            g["lr"] = lrs_planned[k]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step = k + 1
        avg = BETA * avg + (1 - BETA) * loss.item()
        smoothed = avg / (1 - BETA ** (step + 1))
        lrs.append(lrs_planned[k])
        stop = threshold is not None and step > 1 and smoothed > threshold * best
        if smoothed < best or step == 1:
            best = smoothed
        losses.append(smoothed)
        if stop:
            break
    return lrs, losses


def hand_suggestion(lrs: list[float], losses: list[float], skip_begin: int = 10, skip_end: int = 1) -> int:
    """The index of the steepest negative slope (second-order central differences on
    uneven spacing, one-sided at the ends: numpy's gradient), over the kept points."""
    idx = list(range(len(losses)))[skip_begin:-skip_end]
    idx = [i for i in idx if np.isfinite(losses[i])]
    x = np.array([lrs[i] for i in idx], dtype=np.float32)
    y = np.array([losses[i] for i in idx], dtype=np.float32)
    return idx[int(np.argmin(np.gradient(y, x)))]


def _trainer(tmp_path, **kw):
    return hookloop.Trainer(max_epochs=1, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path), **kw)


@pytest.mark.parametrize("mode,max_lr", [("exponential", 1.0), ("linear", 0.5)])
def test_lr_find_equals_a_hand_written_loop_and_restores_the_weights(tmp_path, mode, max_lr):
    model = job.Regression()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path)
    found = hookloop.Tuner(trainer).lr_find(model, num_training=job.NUM_TRAINING, min_lr=1e-4, max_lr=max_lr,
                                            mode=mode)
    lrs, losses = hand_lr_find(job.BATCH, job.NUM_TRAINING, 1e-4, max_lr, mode)
    assert found.results["lr"] == lrs
    assert found.results["loss"] == losses  # exact: the same float32 steps, the same float64 smoothing
    best = hand_suggestion(lrs, losses)
    assert found.suggestion() == lrs[best]
    assert model.lr == lrs[best]  # update_attr
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the trainer is back where it was: the next fit starts at step 0 and trains a whole epoch
    trainer.fit(model)
    assert trainer.global_step == len(job.data()) // job.BATCH


def test_lr_find_plot_draws_the_results_and_the_suggestion(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    found = hookloop.Tuner(_trainer(tmp_path)).lr_find(job.Regression(), num_training=job.NUM_TRAINING,
                                                       min_lr=1e-4, max_lr=1.0)
    ax = found.plot(suggest=True).axes[0]
    curve, point = ax.lines
    assert list(curve.get_xdata()) == found.results["lr"] and list(curve.get_ydata()) == found.results["loss"]
    assert list(point.get_xdata()) == [found.suggestion()] and ax.get_xscale() == "log"


def test_lr_find_stops_on_divergence_as_the_hand_loop_does(tmp_path):
    model = job.Regression()
    found = hookloop.Tuner(trainer := _trainer(tmp_path)).lr_find(
        model, num_training=40, min_lr=1e-3, max_lr=50.0, update_attr=False)
    lrs, losses = hand_lr_find(job.BATCH, 40, 1e-3, 50.0)
    assert len(losses) < 40, "the reference did not diverge: the test needs a larger max_lr"
    assert found.results == {"lr": lrs, "loss": losses}
    assert model.lr == 0.01 and trainer.should_stop is False


def test_lr_find_refuses_bad_input(tmp_path):
    tuner = hookloop.Tuner(_trainer(tmp_path))
    with pytest.raises(hookloop.ConfigurationError, match="mode"):
        tuner.lr_find(job.Regression(), mode="cosine")
    with pytest.raises(hookloop.ConfigurationError, match="min_lr > 0 and max_lr > 0"):
        tuner.lr_find(job.Regression(), min_lr=0.0, max_lr=0.1)
    model = job.Regression()
    del model.lr
    # Lightning's AttributeError (and its wording), still a ConfigurationError
    with pytest.raises(AttributeError, match="should have one of these fields: \\('lr', 'learning_rate'\\)"):
        tuner.lr_find(model)
    with pytest.raises(hookloop.ConfigurationError, match="could not find this as a field"):
        tuner.lr_find(model, attr_name="rate")
    # ddp_spawn would run the search in workers it spawns and lose its results there
    spawning = hookloop.Tuner(_trainer(tmp_path, plugins=["ddp_spawn"], devices=2))
    with pytest.raises(hookloop.ConfigurationError, match="'ddp_spawn' spawns its workers"):
        spawning.lr_find(job.Regression())
    with pytest.raises(hookloop.ConfigurationError, match="'ddp_spawn' spawns its workers"):
        spawning.scale_batch_size(job.Regression())


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lr_find_matches_lightning(tmp_path, accumulate):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.tuner import Tuner as LightningTuner

    class LitRegression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = job.net()
            self.lr = 0.01

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    loader = DataLoader(job.data(), batch_size=job.BATCH, shuffle=False)
    lit = LitRegression()
    lt = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    accumulate_grad_batches=accumulate,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path / "pl"))
    expected = LightningTuner(lt).lr_find(lit, train_dataloaders=loader, num_training=job.NUM_TRAINING,
                                          min_lr=1e-4, max_lr=1.0)
    model = job.Regression()
    found = hookloop.Tuner(_trainer(tmp_path, accumulate_grad_batches=accumulate)).lr_find(
        model, loader, num_training=job.NUM_TRAINING,
                                                       min_lr=1e-4, max_lr=1.0)
    assert found.results["lr"] == pytest.approx(expected.results["lr"], rel=1e-12)
    assert found.results["loss"] == pytest.approx(expected.results["loss"], rel=1e-6)
    assert found.suggestion() == pytest.approx(expected.suggestion(), rel=1e-12)
    assert model.lr == pytest.approx(lit.lr, rel=1e-12)
    assert len(found.results["loss"]) == job.NUM_TRAINING


def test_lr_find_min_lr_above_max_lr_sweeps_down_as_lightning(tmp_path):
    """Lightning takes min_lr > max_lr (a sweep downwards); hookloop refused it before."""
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.tuner import Tuner as LightningTuner

    class LitRegression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = job.net()
            self.lr = 0.01

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    loader = DataLoader(job.data(), batch_size=job.BATCH, shuffle=False)
    lt = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path / "pl"))
    expected = LightningTuner(lt).lr_find(LitRegression(), train_dataloaders=loader, num_training=6,
                                          min_lr=0.5, max_lr=1e-4, update_attr=False)
    found = hookloop.Tuner(_trainer(tmp_path)).lr_find(job.Regression(), loader, num_training=6,
                                                       min_lr=0.5, max_lr=1e-4, update_attr=False)
    assert found.results["lr"] == pytest.approx(expected.results["lr"], rel=1e-12)
    assert found.results["loss"] == pytest.approx(expected.results["loss"], rel=1e-6)
    assert found.results["lr"][-1] < found.results["lr"][0]


@pytest.mark.parametrize("losses, skip_begin, skip_end", [([0.0, 1.0, 2.0], 1, 1), ([], 10, 1)])
def test_lr_finder_suggestion_without_enough_points_logs_lightnings_error(caplog, losses, skip_begin, skip_end):
    """Lightning logs an error (not a warning) and returns None; the same on the same results."""
    pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.tuner.lr_finder import _LRFinder

    suggestions = []
    for finder_class in (_LRFinder, hookloop.LRFinder):
        finder = finder_class(mode="exponential", lr_min=1e-8, lr_max=1.0, num_training=100)
        finder.results = {"lr": [float(i) for i in range(len(losses))], "loss": list(losses)}
        caplog.clear()
        with caplog.at_level("ERROR"):
            suggestions.append(finder.suggestion(skip_begin=skip_begin, skip_end=skip_end))
        assert "Failed to compute suggestion for learning rate" in caplog.text, finder_class
    assert suggestions == [None, None]


def test_lr_find_with_several_optimizers_is_lightnings_refusal(tmp_path):
    class TwoOptimizers(job.Regression):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=self.lr), torch.optim.Adam(self.parameters())]

    with pytest.raises(hookloop.ConfigurationError, match="only works with single optimizer"):
        hookloop.Tuner(_trainer(tmp_path)).lr_find(TwoOptimizers())


def test_scale_batch_size_refuses_what_it_cannot_scale(tmp_path):
    tuner = hookloop.Tuner(_trainer(tmp_path))
    with pytest.raises(hookloop.ConfigurationError, match="train_dataloader"):
        tuner.scale_batch_size(job.Regression(), DataLoader(job.data(), batch_size=2))
    with pytest.raises(hookloop.ConfigurationError, match="'bs'"):
        tuner.scale_batch_size(job.Regression(), batch_arg_name="bs")
    with pytest.raises(hookloop.ConfigurationError, match="mode"):
        tuner.scale_batch_size(job.Regression(), mode="linear")


class _OOMAbove(job.Regression):
    """Runs out of memory (torch's own exception type) above ``limit`` samples a batch."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def training_step(self, batch, batch_idx):
        if len(batch[0]) > self.limit:
            raise torch.OutOfMemoryError(f"out of memory: {len(batch[0])} samples")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("mode,limit,expected", [("power", 20, 16), ("binsearch", 20, 19), ("power", 1000, 64)])
def test_scale_batch_size_finds_the_largest_size_that_fits(tmp_path, mode, limit, expected):
    model = _OOMAbove(limit)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    size = hookloop.Tuner(_trainer(tmp_path)).scale_batch_size(
        model, mode=mode, init_val=2, steps_per_trial=1, max_val=64)
    # power: 2, 4, 8, 16 fit, 32 does not: 16. binsearch: 32 fails, then 24 fails, 20 fits,
    # 22 and 21 fail: 20, less the 5% margin: 19. No OOM: capped at max_val.
    assert size == expected == model.batch_size
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "training_step" not in model.__dict__


def test_scale_batch_size_raises_other_errors(tmp_path):
    class Broken(job.Regression):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("not a memory problem")

    with pytest.raises(RuntimeError, match="not a memory problem"):
        hookloop.Tuner(_trainer(tmp_path)).scale_batch_size(Broken(), init_val=2, steps_per_trial=1)


@pytest.mark.check  # reads the shared ddp job
def test_finders_under_ddp_agree_on_every_rank(jobs):
    """2 processes, gloo: the lr finder records the mean of the two ranks' losses (the
    one-process reference: the same steps on the union of the two ranks' batches), both
    ranks hold the same results and suggestion; the batch-size finder, with rank 1 alone
    running out of memory above 8 samples, ends at 8 on both ranks. tests/scripts/tuner_job.py
    in the shared ddp job (tests/jobs.py)."""
    out = jobs.run("ddp").dir("tuner_job")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    result = ranks[0]
    # rank r's batch k holds samples r, r + 2, ... of the sequential batch k of 2 * BATCH:
    # the mean of the two ranks' means is that batch's mean
    lrs, losses = hand_lr_find(2 * job.BATCH, job.NUM_TRAINING, 1e-4, 1.0)
    assert result["lr"] == lrs
    assert result["loss"] == pytest.approx(losses, rel=1e-5)
    assert result["suggestion"] == lrs[hand_suggestion(lrs, result["loss"])] == result["model_lr"]
    assert result["global_step_after_fit"] == job.N // (2 * job.BATCH)
    assert result["batch_size"] == result["model_batch_size"] == job.OOM_ABOVE


@pytest.mark.full  # two launched runs (~80 s on 2 busy cores)
def test_hookloop_tune_prints_the_suggestion_and_the_table(tmp_path):
    """``hookloop tune lr SCRIPT`` runs the finder at the script's fit, prints the table
    and the suggestion (the hand loop's), and ends the script there; ``hookloop tune
    batch-size`` prints each trial and the size found."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    lr = subprocess.run([sys.executable, "-m", "hookloop", "tune", "lr", "--num-training", str(job.NUM_TRAINING),
                         "--min-lr", "1e-4", "--max-lr", "1", "--default-root-dir", str(tmp_path),
                         str(SCRIPTS / "tuner_cli_script.py")], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=300)
    assert lr.returncode == 0, lr.stdout + lr.stderr
    lrs, losses = hand_lr_find(job.BATCH, job.NUM_TRAINING, 1e-4, 1.0)
    assert f"hookloop tune lr: suggested learning rate {lrs[hand_suggestion(lrs, losses)]!r} (24 of 24 steps)" \
        in lr.stdout
    rows = [line.split() for line in lr.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [float(r[2]) for r in rows] == pytest.approx(losses, rel=1e-5)
    assert "trained" not in lr.stdout
    bs = subprocess.run([sys.executable, "-m", "hookloop", "tune", "batch-size", "--steps-per-trial", "1",
                         "--default-root-dir", str(tmp_path), str(SCRIPTS / "tuner_cli_script.py"), "--oom"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bs.returncode == 0, bs.stdout + bs.stderr
    assert "hookloop tune batch-size: batch size 8" in bs.stdout
    assert [line.split()[:2] for line in bs.stdout.splitlines() if line.strip()[:1].isdigit()] == \
        [["2", "fits"], ["4", "fits"], ["8", "fits"], ["16", "out"]]
    assert "trained" not in bs.stdout


def test_scale_batch_size_sets_the_datamodule_and_the_model(tmp_path):
    """The loaders come from the DataModule's batch size; like Lightning's
    ``lightning_setattr``, every holder of ``batch_arg_name`` gets the size found."""

    class Data(hookloop.DataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 1

        def train_dataloader(self):
            return DataLoader(job.data(), batch_size=self.batch_size)

    model, dm = _OOMAbove(12), Data()
    size = hookloop.Tuner(_trainer(tmp_path)).scale_batch_size(model, datamodule=dm, init_val=3, steps_per_trial=1)
    assert size == dm.batch_size == model.batch_size == 12  # 3, 6, 12 fit; 24 does not
