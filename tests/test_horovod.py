"""hookloop-horovod: 2 workers under horovodrun (Gloo, CPU), compared with references.

Starting processes is what costs time, so one launch of tests/scripts/horovod_checks.py
runs every multi-process scenario (and one more launch runs the same scenarios under
hookloop-ddp). Each test below reads what the ranks saved and compares it with a
reference computed here in one process with plain PyTorch (the batches of both ranks
concatenated), with the ddp run, or with a value worked out by hand.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import re
import sys
import types

import pytest
import torch
from torch.nn import functional as F
from torch.optim import lr_scheduler as schedulers
from torch.optim.swa_utils import SWALR
from torch.utils.data import DataLoader, DistributedSampler

import hookloop
from conftest import REPO, TinyModule, max_abs_diff, run_python, state_of, tiny_data
from hookloop_horovod.strategy import scale_learning_rate

SCRIPT = REPO / "tests" / "scripts" / "horovod_checks.py"
EPOCHS, BATCH, SAMPLES, WORLD = 2, 8, 96, 2  # as in the script


# ---------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def horovod_run(tmp_path_factory):
    """``python horovod_checks.py OUT horovod``: Trainer.fit re-launches it through horovodrun;
    then one process resumes its two-worker checkpoint (``rescale``)."""
    out = tmp_path_factory.mktemp("horovod_checks")
    proc = run_python([sys.executable, str(SCRIPT), str(out), "horovod"], cwd=out, timeout=300)
    run_python([sys.executable, str(SCRIPT), str(out), "rescale"], cwd=out, timeout=300)
    ranks = [json.loads((out / f"horovod_rank{r}.json").read_text()) for r in range(WORLD)]
    return out, ranks, proc.stdout


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """The parity scenarios of the same script under hookloop-ddp (torchrun)."""
    out = tmp_path_factory.mktemp("horovod_vs_ddp")
    run_python([sys.executable, str(SCRIPT), str(out), "ddp"], cwd=out, timeout=300)
    return out


def weights(out, name):
    return torch.load(out / f"{name}.pt", weights_only=True)


def concatenated_reference(lr=0.1, accumulate=1, clip=None, scheduler=False, autocast=None) -> dict:
    """One process, plain PyTorch, trained on both ranks' batches put together.

    Rank r of a 2-worker run draws ``DistributedSampler(shuffle=True, seed=0)``'s share;
    the mean loss over the concatenation of both ranks' i-th batches has the gradient
    that the workers' averaged gradients must equal.
    """
    data = tiny_data(SAMPLES)
    module = TinyModule(seed=0, lr=lr, scheduler=scheduler)
    optimizer = module.configure_optimizers()
    schedule = None
    if isinstance(optimizer, tuple):
        optimizer, schedule = optimizer
    samplers = [DistributedSampler(data, num_replicas=WORLD, rank=r, shuffle=True, seed=0) for r in range(WORLD)]
    x_all, y_all = data.tensors
    for epoch in range(EPOCHS):
        orders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        n = math.ceil(len(orders[0]) / BATCH)
        for i in range(n):
            index = torch.tensor([j for order in orders for j in order[i * BATCH : (i + 1) * BATCH]])
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = F.cross_entropy(module(x_all[index]), y_all[index])
            (loss / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == n:
                if clip:
                    torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if schedule is not None:
            schedule.step()
    return state_of(module)


# ---------------------------------------------------------------------------------------
# Under horovodrun
# ---------------------------------------------------------------------------------------


@pytest.mark.check
def test_workers_are_horovod_ranks_with_unwrapped_model(horovod_run):
    _, ranks, _ = horovod_run
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["world_size"] == 2 and r["device"] == "cpu"
        assert r["optimizer"] == "horovod.torch.optimizer"  # hvd.DistributedOptimizer
        assert r["model"] == "_StepModule"  # the user's steps, not wrapped


@pytest.mark.check
def test_matches_single_process_on_concatenated_batches(horovod_run):
    out, _, _ = horovod_run
    reference = concatenated_reference()
    # The ranks were initialised with different seeds: rank 0's weights were broadcast.
    for r in range(WORLD):
        assert max_abs_diff(weights(out, f"horovod_plain_rank{r}"), reference) <= 1e-5
    assert max_abs_diff(weights(out, "horovod_plain_rank0"), weights(out, "horovod_plain_rank1")) == 0.0


@pytest.mark.check
def test_accumulation_and_clipping_of_averaged_gradients(horovod_run):
    out, ranks, _ = horovod_run
    trained = weights(out, "horovod_accum_clip")
    # 6 micro-batches per epoch in windows of 4: an uneven last window, synchronised at the step.
    assert ranks[0]["accum_clip_steps"] == 4
    assert max_abs_diff(trained, concatenated_reference(accumulate=4, clip=0.5, scheduler=True)) <= 1e-5
    # The clip was active (so clipping local instead of averaged gradients would show).
    assert max_abs_diff(trained, concatenated_reference(accumulate=4, scheduler=True)) > 1e-3


@pytest.mark.check
def test_learning_rate_scaled_by_world_size(horovod_run):
    out, ranks, _ = horovod_run
    base = TinyModule().lr
    for r in ranks:
        # StepLR(gamma=0.5) per epoch, from base * world size.
        assert r["scaled_epoch_lrs"] == pytest.approx([base * WORLD, base * WORLD * 0.5])
        assert r["scaled_base_lrs"] == pytest.approx([base * WORLD])
    reference = concatenated_reference(lr=base * WORLD, scheduler=True)
    assert max_abs_diff(weights(out, "horovod_scaled"), reference) <= 1e-5


@pytest.mark.check
def test_resume_mid_epoch_equals_uninterrupted_run(horovod_run):
    out, ranks, _ = horovod_run
    # Stopped at step 9 of 12 (mid-epoch), resumed into a differently seeded module.
    assert max_abs_diff(weights(out, "horovod_resumed"), weights(out, "horovod_scaled")) <= 1e-6
    assert all(r["resumed_step"] == 12 for r in ranks)
    assert (out / "resume" / "logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.check
def test_resume_on_one_worker_rescales_the_learning_rate(horovod_run):
    out, _, _ = horovod_run
    one = json.loads((out / "rescale_rank0.json").read_text())
    assert one["world_size"] == 1
    assert one["lr"] == pytest.approx(one["saved_lr"] / WORLD)
    assert one["base_lrs"] == pytest.approx([lr / WORLD for lr in one["saved_base_lrs"]])


@pytest.mark.check
def test_fp16_compression_stays_close(horovod_run):
    out, _, _ = horovod_run
    difference = max_abs_diff(weights(out, "horovod_compressed"), weights(out, "horovod_plain_rank0"))
    assert 0.0 < difference <= 1e-3  # float16 rounding of the gradients, and nothing more


@pytest.mark.check
def test_sync_dist_and_collectives(horovod_run):
    _, ranks, _ = horovod_run
    for r in ranks:
        # Each rank logged rank + 1 on 2 samples.
        assert r["sync_dist"] == {"rank_mean": 1.5, "rank_sum": 3.0, "rank_max": 2.0, "rank_min": 1.0}
        assert r["reduce"] == {"mean": [1.5, 15.0], "sum": [3.0, 30.0], "max": [2.0, 20.0], "min": [1.0, 10.0]}
        assert r["broadcast_from_0"] == {"from": 0}
        assert r["broadcast_from_1"] == ["rank1"]


@pytest.mark.check
def test_composes_with_amp_bf16_and_fp16_scaler(horovod_run):
    out, ranks, _ = horovod_run
    assert ranks[0]["amp_plugins"] == ["amp", "horovod", "horovodrun"]  # horovodrun: its launcher
    bf16 = concatenated_reference(autocast=torch.bfloat16)
    assert max_abs_diff(weights(out, "horovod_bf16"), bf16) <= 5e-3  # bf16 rounding of 2 vs 1 batch
    # fp16 through the GradScaler, clipping the unscaled averaged gradients.
    fp16 = concatenated_reference(clip=0.5, autocast=torch.float16)
    assert max_abs_diff(weights(out, "horovod_fp16_clip"), fp16) <= 1e-3


@pytest.mark.check
@pytest.mark.parametrize("scenario", ["plain", "accum_clip", "bf16", "fp16_clip", "refit", "manual_fp16_clip"])
def test_parity_with_ddp(horovod_run, ddp_run, scenario):
    out, _, _ = horovod_run
    assert max_abs_diff(weights(out, f"horovod_{scenario}"), weights(ddp_run, f"ddp_{scenario}")) <= 1e-5


@pytest.mark.check
@pytest.mark.parametrize("strategy", ["horovod", "ddp"])
def test_manual_optimization_steps_through_the_strategy_and_scaler(horovod_run, ddp_run, strategy):
    """self.manual_backward / opt.step() / self.clip_gradients under each strategy with
    fp16: the same weights as the automatic loop with gradient_clip_val."""
    out = horovod_run[0] if strategy == "horovod" else ddp_run
    assert max_abs_diff(weights(out, f"{strategy}_manual_fp16_clip"), weights(out, f"{strategy}_fp16_clip")) == 0.0


@pytest.mark.slow
def test_horovodrun_started_by_hand_trains_in_place(tmp_path):
    # No hookloop launcher around it: Trainer(devices=2) must not start a nested horovodrun.
    command = [sys.executable, "-m", "horovod.runner.launch", "-np", "2", "-H", "localhost:2", "--gloo",
               sys.executable, str(SCRIPT), str(tmp_path), "byhand"]
    run_python(command, cwd=tmp_path, timeout=300)
    ranks = [json.loads((tmp_path / f"byhand_rank{r}.json").read_text()) for r in range(WORLD)]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert max_abs_diff(weights(tmp_path, "byhand_plain"), concatenated_reference()) <= 1e-5


@pytest.mark.slow
def test_digits_example_under_hookloop_run(tmp_path):
    proc = run_python(
        [sys.executable, "-m", "hookloop", "run", "--plugins", "horovod", "--devices", "2",
         "--max-epochs", "5", "--default-root-dir", str(tmp_path), str(REPO / "examples" / "digits.py")],
        cwd=tmp_path, timeout=300,
    )
    accuracy = float(re.search(r"validation accuracy: ([0-9.]+)", proc.stdout).group(1))
    assert accuracy >= 0.9, proc.stdout
    assert (tmp_path / "logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


# ---------------------------------------------------------------------------------------
# In this process: launching, errors, packaging
# ---------------------------------------------------------------------------------------


def config(**kw) -> hookloop.TrainerConfig:
    return hookloop.TrainerConfig(**kw)  # not validated: nodes > 1 needs no rendezvous here


def test_launch_command_on_one_and_several_hosts(monkeypatch):
    strategy = hookloop.plugin("horovod")
    launcher = [sys.executable, "-m", "horovod.runner.launch"]
    assert strategy.hookloop_launcher.launch_command(config=config(devices=2), script="train.py", script_args=["--x", "1"]) == [
        *launcher, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "train.py", "--x", "1"]
    strategy.hosts, strategy.launcher_args = "node1:4, node2", "--start-timeout 120"
    assert strategy.hookloop_launcher.launch_command(config=config(devices=4), script="t.py", script_args=[]) == [
        *launcher, "-np", "8", "-H", "node1:4,node2:4", "--gloo", "--start-timeout", "120", sys.executable, "t.py"]
    strategy.hosts, strategy.launcher_args = None, None
    monkeypatch.setenv("HOOKLOOP_HOROVOD_HOSTS", "a:1,b:3")
    assert strategy.hookloop_launcher.launch_command(config=config(), script="t.py", script_args=[])[3:7] == ["-np", "4", "-H", "a:1,b:3"]


@pytest.mark.parametrize("options,kw,message", [
    ({}, {"devices": 2, "nodes": 2}, "hosts"),
    ({"hosts": "a:4,b:4,c:4"}, {"devices": 4, "nodes": 2}, "names 3 host"),
    ({"hosts": "a:0"}, {"devices": 2}, "SLOTS >= 1"),
    ({"hosts": "a,a"}, {"devices": 2}, "twice"),
    ({"compression": "int8"}, {"devices": 2}, "compression"),
    ({"scale_lr": "yes"}, {"devices": 2}, "scale_lr"),
])
def test_bad_launch_options_are_clear_errors(options, kw, message):
    strategy = hookloop.plugin("horovod")
    for key, value in options.items():
        setattr(strategy, key, value)
    with pytest.raises(hookloop.ConfigurationError, match=message):
        strategy.hookloop_launcher.launch_command(config=config(**kw), script="t.py", script_args=[])


def test_another_strategy_is_refused_at_start():
    class OtherStrategy:
        hookloop_name = "other"
        hookloop_role = "strategy"

    with pytest.raises(hookloop.PluginConflictError, match=r"'horovod', 'other'.*strategy"):
        hookloop.Trainer(plugins=["horovod", OtherStrategy()], devices=2)


def test_horovod_and_ddp_on_the_command_line_are_refused(capsys):
    from hookloop.tools.cli import main

    assert main(["run", "--plugins", "horovod,ddp", "--devices", "2", "train.py"]) == 2
    assert re.search(r"'horovod', 'ddp'.*only one strategy", capsys.readouterr().err)


def _fake_horovod(monkeypatch, torch_module):
    package = types.ModuleType("horovod")
    package.__version__ = "0.28.1"
    package.__path__ = []
    if torch_module is not None:
        package.torch = torch_module
    monkeypatch.setitem(sys.modules, "horovod", package)
    monkeypatch.setitem(sys.modules, "horovod.torch", torch_module)


def test_missing_horovod_fails_before_any_worker_starts(monkeypatch, tmp_path):
    _fake_horovod(monkeypatch, None)  # `import horovod.torch` raises ImportError
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    trainer = hookloop.Trainer(plugins=["horovod"], devices=2)
    with pytest.raises(hookloop.MissingDependencyError, match=r"import horovod\.torch.*build_horovod\.sh.*make install"):
        trainer.fit(TinyModule(), DataLoader(tiny_data(8), batch_size=4))
    # The same error in a worker (one process: no launcher involved).
    trainer = hookloop.Trainer(plugins=["horovod"], enable_checkpointing=False)
    with pytest.raises(hookloop.MissingDependencyError, match="build_horovod.sh"):
        trainer.fit(TinyModule(), DataLoader(tiny_data(8), batch_size=4))


def test_horovod_built_without_gloo_is_a_clear_error(monkeypatch):
    no_gloo = types.ModuleType("horovod.torch")
    no_gloo.gloo_built = lambda: False
    _fake_horovod(monkeypatch, no_gloo)
    trainer = hookloop.Trainer(plugins=["horovod"], enable_checkpointing=False)
    with pytest.raises(hookloop.MissingDependencyError, match=r"without Gloo.*HOROVOD_WITH_GLOO=1.*build_horovod\.sh"):
        trainer.fit(TinyModule(), DataLoader(tiny_data(8), batch_size=4))


@pytest.mark.slow
def test_plugin_imports_no_horovod_and_its_requirement_is_the_built_wheel(tmp_path):
    check = (
        "import sys, hookloop; p = hookloop.plugin('horovod'); "
        "assert p.hookloop_role == 'strategy'; "
        "assert not [m for m in sys.modules if m.split('.')[0] == 'horovod'], 'horovod imported'"
    )
    run_python([sys.executable, "-c", check], cwd=tmp_path)
    # pip finds horovod==0.28.1 satisfied by the wheel build_horovod.sh installed.
    assert "horovod==0.28.1" in [r.replace(" ", "") for r in md.requires("hookloop-horovod")]
    assert md.version("horovod") == "0.28.1"


# ---------------------------------------------------------------------------------------
# scale_learning_rate: a pure function of an optimizer and a scheduler, no Horovod needed
# ---------------------------------------------------------------------------------------

LR, STEPS = 0.1, 24  # group 0 at LR, group 1 at LR / 4; 24 steps cover every phase below


def _optimizer(scale: float) -> torch.optim.SGD:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    return torch.optim.SGD(
        [{"params": [params[0]], "lr": scale * LR}, {"params": [params[1]], "lr": scale * LR / 4}],
        momentum=0.9,
    )


# Each builds optimizer + scheduler with every absolute learning rate times `s`: s=1 is
# what configure_optimizers wrote, s=W is the schedule written by hand for W workers.
SCHEDULES = {
    "OneCycleLR": lambda o, s: schedulers.OneCycleLR(o, max_lr=[s * 1.0, s * 0.5], total_steps=STEPS),
    "OneCycleLR-3phase": lambda o, s: schedulers.OneCycleLR(
        o, max_lr=s * 0.8, total_steps=STEPS, pct_start=0.25, three_phase=True, anneal_strategy="linear"),
    "CyclicLR": lambda o, s: schedulers.CyclicLR(
        o, base_lr=[s * 0.01, s * 0.005], max_lr=[s * 0.1, s * 0.04], step_size_up=3, step_size_down=5,
        mode="triangular2"),
    "CyclicLR-exp_range": lambda o, s: schedulers.CyclicLR(
        o, base_lr=s * 0.01, max_lr=s * 0.1, step_size_up=4, mode="exp_range", gamma=0.9),
    "CosineAnnealingLR": lambda o, s: schedulers.CosineAnnealingLR(o, T_max=7, eta_min=s * 0.002),
    "CosineAnnealingWarmRestarts": lambda o, s: schedulers.CosineAnnealingWarmRestarts(
        o, T_0=3, T_mult=2, eta_min=s * 0.002),
    "ReduceLROnPlateau": lambda o, s: schedulers.ReduceLROnPlateau(
        o, factor=0.5, patience=1, min_lr=[s * 0.01, s * 0.002]),
    "ReduceLROnPlateau-scalar": lambda o, s: schedulers.ReduceLROnPlateau(o, factor=0.5, patience=1, min_lr=s * 0.004),
    "LinearLR": lambda o, s: schedulers.LinearLR(o, start_factor=0.25, total_iters=6),
    "StepLR": lambda o, s: schedulers.StepLR(o, step_size=5, gamma=0.5),
    "ExponentialLR": lambda o, s: schedulers.ExponentialLR(o, gamma=0.85),
    "LambdaLR": lambda o, s: schedulers.LambdaLR(o, lambda e: min(1.0, (e + 1) / 5) * 0.9**e),
    "SWALR": lambda o, s: SWALR(o, swa_lr=s * 0.03, anneal_epochs=6),
    "SequentialLR": lambda o, s: schedulers.SequentialLR(
        o, [schedulers.LinearLR(o, start_factor=0.1, total_iters=5),
            schedulers.CosineAnnealingLR(o, T_max=12, eta_min=s * 0.001)], milestones=[5]),
    "ChainedScheduler": lambda o, s: schedulers.ChainedScheduler(
        [schedulers.ConstantLR(o, factor=0.5, total_iters=4),
         schedulers.CosineAnnealingWarmRestarts(o, T_0=5, eta_min=s * 0.003)]),
    "SequentialLR-of-ChainedScheduler": lambda o, s: schedulers.SequentialLR(
        o, [schedulers.ChainedScheduler([schedulers.ConstantLR(o, factor=0.5, total_iters=3),
                                         schedulers.CosineAnnealingLR(o, T_max=5, eta_min=s * 0.002)]),
            schedulers.ExponentialLR(o, gamma=0.9)],
        milestones=[9]),
}


def _build(name: str, scale: float):
    optimizer = _optimizer(scale)
    return optimizer, SCHEDULES[name](optimizer, scale)


def _trace(optimizer, scheduler, steps: int) -> list[list[float]]:
    """The learning rate of each group that every optimizer step uses, as the loop steps
    (flat: step 0's groups, then step 1's...)."""
    trace = []
    for _ in range(steps):
        trace.extend(float(group["lr"]) for group in optimizer.param_groups)
        optimizer.step()  # no gradients: nothing moves, but the schedulers see a step
        if isinstance(scheduler, schedulers.ReduceLROnPlateau):
            scheduler.step(1.0)  # never improves: a reduction every patience + 1 steps, down to min_lr
        else:
            scheduler.step()
    return trace


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_scaled_schedule_equals_the_schedule_written_for_the_scaled_rate(name):
    workers = 3
    optimizer, scheduler = _build(name, 1.0)
    scale_learning_rate(optimizer, scheduler, workers)
    reference = _trace(*_build(name, workers), STEPS)
    scaled = _trace(optimizer, scheduler, STEPS)
    assert len(set(reference)) > 4  # the schedule really moves over these steps
    assert scaled == pytest.approx(reference, rel=1e-12, abs=0)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_resume_on_another_world_size_rescales_the_whole_schedule(name):
    # Saved by 2 workers after `split` steps, resumed on 3: hookloop builds the
    # optimizer and scheduler afresh, the strategy scales them for 3, the checkpoint's
    # state (scaled for 2) replaces theirs, and on_load_checkpoint rescales by 3 / 2.
    split = 9
    optimizer, scheduler = _build(name, 1.0)
    scale_learning_rate(optimizer, scheduler, 2)
    _trace(optimizer, scheduler, split)
    saved = {"optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict()}
    optimizer, scheduler = _build(name, 1.0)
    scale_learning_rate(optimizer, scheduler, 3)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["lr_scheduler"])
    scale_learning_rate(optimizer, scheduler, 3 / 2)
    resumed = _trace(optimizer, scheduler, STEPS - split)
    reference = _trace(*_build(name, 3.0), STEPS)[2 * split:]  # 2 groups a step
    assert resumed == pytest.approx(reference, rel=1e-12, abs=0)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_scaling_by_two_then_three_halves_equals_scaling_by_three(name):
    once, twice = _build(name, 1.0), _build(name, 1.0)
    scale_learning_rate(*once, 3)
    scale_learning_rate(*twice, 2)
    scale_learning_rate(*twice, 3 / 2)
    reference = _trace(*_build(name, 3.0), STEPS)
    assert _trace(*twice, STEPS) == pytest.approx(reference, rel=1e-12, abs=0)
    assert _trace(*once, STEPS) == pytest.approx(reference, rel=1e-12, abs=0)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_get_last_lr_reports_the_scaled_rate_before_the_first_step(name):
    optimizer, scheduler = _build(name, 1.0)
    scale_learning_rate(optimizer, scheduler, 3)
    _, reference = _build(name, 3.0)
    assert [float(lr) for lr in scheduler.get_last_lr()] == pytest.approx(
        [float(lr) for lr in reference.get_last_lr()], rel=1e-12, abs=0)
    assert [float(lr) for lr in scheduler.get_last_lr()] == [float(g["lr"]) for g in optimizer.param_groups]


@pytest.mark.parametrize("factor", [0, -2, float("nan"), float("inf"), "2", True])
def test_scale_factor_must_be_a_positive_number(factor):
    optimizer, scheduler = _build("StepLR", 1.0)
    with pytest.raises(ValueError, match=r"scale factor=.* must be a positive finite number"):
        scale_learning_rate(optimizer, scheduler, factor)
    assert [g["lr"] for g in optimizer.param_groups] == [LR, LR / 4]  # untouched
