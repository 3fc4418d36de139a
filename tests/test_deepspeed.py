"""hookloop-deepspeed on 2 CPU processes (torchrun, gloo, DeepSpeed's CPU accelerator).

Every DeepSpeed run of this module happens in ONE torchrun job (the ``ds_runs`` fixture
runs tests/scripts/deepspeed_worker.py over a list of scenarios), because starting
DeepSpeed costs far more than training the digits example. Each test then compares a
scenario against a reference computed here without DeepSpeed: a hand-written loop that
emulates both ranks (each rank's share from ``DistributedSampler``, gradients averaged),
a hookloop ``ddp`` run, or an uninterrupted run.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DistributedSampler

from conftest import REPO, run_python

sys.path.insert(0, str(REPO / "examples"))
from digits import DigitsClassifier, digits_datasets  # noqa: E402

WORKER = REPO / "tests" / "scripts" / "deepspeed_worker.py"
WORLD = 2
EPOCHS = 4  # the example reaches val_acc >= 0.9 in 3-4 epochs at batch 32 x 2 ranks
STEPS_PER_EPOCH = 23  # ceil(1437 / 2 / 32)
RESUME_AT = 34  # optimizer steps before the interruption: inside the second epoch

# ZeRO-3 keeps parameters below this many elements whole on every rank; 0 partitions all
# of them (the digits model is tiny), so the partitioning is visible.
STAGE3_CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

NVME_HIDDEN = 16384  # 64 x 16384 weights: a 1 MiB fp32 partition per rank, DeepSpeed's smallest swap

LOSS_TOL = 1e-4  # fp32, the same math as the reference up to summation order

# A schedule of the DeepSpeed config itself (the engine steps it after every optimizer
# step): linear warm-up over 20 steps, then linear decay to the end of 2 epochs.
SCHED_STEPS = 2 * STEPS_PER_EPOCH
SCHED_CONFIG = {"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupDecayLR", "params": {
    "warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 20, "total_num_steps": SCHED_STEPS,
    "warmup_type": "linear"}}}
SCHED_RESUME_AT = 13  # interrupted inside the warm-up, in the first epoch

# DeepSpeedCPUAdam against torch.optim.Adam(W) after 92 steps on the digits model: the
# largest weight difference measured is 1.0e-6 (vectorised C++ vs torch: fp32 rounding
# in another order); a wrong Adam/AdamW mode moves the weights by 0.58.
OFFLOAD_TOL = 1e-5

# ZeRO-Offload with a torch optimizer DeepSpeed is told to step itself on the CPU.
FORCED_OFFLOAD_CONFIG = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                         "zero_force_ds_cpu_optimizer": False}

SCENARIOS = [
    # One run per ZeRO stage, the same data, seed and hyper-parameters.
    {"name": "stage0", "strategy": {"name": "deepspeed", "stage": 0}, "trainer": {"max_epochs": EPOCHS, "enable_checkpointing": False}},
    {"name": "stage1", "strategy": "deepspeed_stage_1", "trainer": {"max_epochs": EPOCHS, "enable_checkpointing": False}},
    {"name": "stage2", "strategy": "deepspeed_stage_2", "trainer": {"max_epochs": EPOCHS, "default_root_dir": "stage2"}},
    # Stage 3 through a preset plus a custom config, with layers built in configure_model.
    {"name": "stage3", "strategy": {"name": "deepspeed_stage_3", "config": STAGE3_CONFIG}, "module": "configure_model",
     "trainer": {"max_epochs": EPOCHS, "default_root_dir": "stage3"}},
    # Interrupted mid-epoch, then resumed by a module with other initial weights.
    {"name": "resume_first", "strategy": {"name": "deepspeed_stage_3", "config": STAGE3_CONFIG}, "module": "configure_model",
     "trainer": {"max_steps": RESUME_AT, "default_root_dir": "resume"}},
    {"name": "resume_second", "strategy": {"name": "deepspeed_stage_3", "config": STAGE3_CONFIG}, "module": "configure_model",
     "seed": 123, "ckpt_path": "resume/logs/version_0/checkpoints/last.ckpt", "trainer": {"max_epochs": EPOCHS, "default_root_dir": "resume"}},
    # A fresh module (other initial weights) validated from the sharded checkpoints.
    {"name": "validate_stage2", "strategy": "deepspeed_stage_2", "seed": 7, "validate": True,
     "ckpt_path": "stage2/logs/version_0/checkpoints/last.ckpt"},
    {"name": "validate_stage3", "strategy": {"name": "deepspeed_stage_3", "config": STAGE3_CONFIG}, "module": "configure_model",
     "seed": 7, "validate": True, "ckpt_path": "stage3/logs/version_0/checkpoints/last.ckpt"},
    # Gradient accumulation under ZeRO-2: 2 x 16 accumulated == 1 x 32.
    {"name": "accumulate2", "strategy": "deepspeed_stage_2", "batch_size": 16,
     "trainer": {"max_epochs": 1, "accumulate_grad_batches": 2, "limit_train_batches": 40, "enable_checkpointing": False}},
    {"name": "double_batch", "strategy": "deepspeed_stage_2", "batch_size": 32,
     "trainer": {"max_epochs": 1, "limit_train_batches": 20, "enable_checkpointing": False}},
    # ... and with a short last window in each epoch (23 micro-batches, windows of 2).
    {"name": "accumulate2_epochs", "strategy": "deepspeed_stage_2",
     "trainer": {"max_epochs": 2, "accumulate_grad_batches": 2, "enable_checkpointing": False}},
    # Gradient clipping through the config, activation checkpointing through the plugin.
    {"name": "clip_checkpointed", "module": "checkpointed",
     "strategy": {"name": "deepspeed", "stage": 2, "overlap_comm": False, "partition_activations": True, "cpu_checkpointing": True},
     "trainer": {"max_epochs": 2, "gradient_clip_val": 0.5, "enable_checkpointing": False}},
    # Precision handed over by hookloop-amp and mapped to DeepSpeed's bf16 section.
    {"name": "bf16", "strategy": "deepspeed_stage_2", "extra_plugins": ["amp"],
     "trainer": {"max_epochs": EPOCHS, "precision": "bf16-mixed", "enable_checkpointing": False}},
    # Optimizer offload: DeepSpeedCPUAdam replaces the user's Adam.
    {"name": "stage2_offload", "strategy": "deepspeed_stage_2_offload", "optimizer": "adam",
     "trainer": {"max_epochs": EPOCHS, "enable_checkpointing": False}},
    {"name": "stage3_offload", "strategy": "deepspeed_stage_3_offload", "optimizer": "adam",
     "trainer": {"max_epochs": EPOCHS, "enable_checkpointing": False}},
    # NVMe offload (DeepSpeed's async_io op, libaio) into a directory of the job. DeepSpeed
    # swaps only tensors of >= 1 MiB, so the hidden layer is wide enough that its partitions
    # and the optimizer state really go to disk; 4 steps keep it short.
    {"name": "stage3_nvme", "strategy": {"name": "deepspeed_stage_3_offload_nvme", "nvme_path": "nvme"},
     "module": "configure_model", "module_kwargs": {"hidden": NVME_HIDDEN}, "optimizer": "adam", "watch_dir": "nvme",
     "trainer": {"max_epochs": 1, "limit_train_batches": 4, "enable_checkpointing": False}},
    # A custom config with its own optimizer section: it replaces configure_optimizers'.
    {"name": "config_optimizer", "strategy": {"name": "deepspeed", "config": {
        "zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}},
     "trainer": {"max_epochs": 2, "enable_checkpointing": False}},
    # The config's own scheduler: straight, and interrupted then resumed (other initial weights).
    {"name": "sched_straight", "strategy": {"name": "deepspeed", "config": SCHED_CONFIG}, "optimizer": "sgd_only",
     "trainer": {"max_epochs": 2, "enable_checkpointing": False}},
    {"name": "sched_first", "strategy": {"name": "deepspeed", "config": SCHED_CONFIG}, "optimizer": "sgd_only",
     "trainer": {"max_steps": SCHED_RESUME_AT, "default_root_dir": "sched"}},
    {"name": "sched_second", "strategy": {"name": "deepspeed", "config": SCHED_CONFIG}, "optimizer": "sgd_only",
     "seed": 123, "ckpt_path": "sched/logs/version_0/checkpoints/last.ckpt", "trainer": {"max_epochs": 2, "default_root_dir": "sched"}},
    # Optimizer offload maps torch Adam / AdamW (two param groups) exactly to DeepSpeedCPUAdam ...
    {"name": "offload_adam_groups", "strategy": "deepspeed_stage_2_offload", "optimizer": "adam_groups",
     "trainer": {"max_epochs": EPOCHS, "enable_checkpointing": False}},
    {"name": "offload_adamw_groups", "strategy": "deepspeed_stage_2_offload", "optimizer": "adamw_groups",
     "trainer": {"max_epochs": EPOCHS, "enable_checkpointing": False}},
    # ... steps SGD itself when the config says zero_force_ds_cpu_optimizer: false ...
    {"name": "offload_sgd_forced", "strategy": {"name": "deepspeed", "config": FORCED_OFFLOAD_CONFIG},
     "trainer": {"max_epochs": EPOCHS, "enable_checkpointing": False}},
    # ... and refuses what DeepSpeedCPUAdam cannot reproduce (last: they stop at set-up).
    {"name": "offload_sgd_refused", "strategy": "deepspeed_stage_2_offload", "expect_error": True,
     "trainer": {"max_epochs": 1, "limit_train_batches": 2, "enable_checkpointing": False}},
    {"name": "offload_amsgrad_refused", "strategy": "deepspeed_stage_2_offload", "optimizer": "adam_amsgrad",
     "expect_error": True, "trainer": {"max_epochs": 1, "limit_train_batches": 2, "enable_checkpointing": False}},
]

SCENARIOS += [
    # Manual optimization through the engine (one optimizer: the engine has one).
    {"name": "manual_stage2", "strategy": "deepspeed_stage_2", "module": "manual",
     "trainer": {"max_epochs": EPOCHS, "enable_checkpointing": False, "process_group_timeout": 77}},
    {"name": "manual_two_optimizers", "strategy": "deepspeed_stage_2", "module": "manual",
     "module_kwargs": {"two_optimizers": True}, "expect_error": True,
     "trainer": {"max_epochs": EPOCHS, "enable_checkpointing": False}},
]

DDP_SCENARIOS = [{"name": "ddp", "strategy": "ddp", "trainer": {"max_epochs": EPOCHS, "enable_checkpointing": False}}]


def _run_job(workdir: Path, scenarios: list[dict]) -> tuple[Path, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.json"
    spec.write_text(json.dumps(scenarios))
    proc = run_python(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
         str(WORKER), str(spec), str(workdir / "out")],
        cwd=workdir,
        timeout=600,
    )
    return workdir, proc.stdout + proc.stderr


class Results:
    def __init__(self, workdir: Path, output: str):
        self.workdir, self.output = workdir, output

    def __call__(self, name: str) -> list[dict]:
        return [torch.load(self.workdir / "out" / f"{name}.rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory) -> Results:
    return Results(*_run_job(tmp_path_factory.mktemp("deepspeed"), SCENARIOS))


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Results:
    return Results(*_run_job(tmp_path_factory.mktemp("ddp"), DDP_SCENARIOS))


# ---------------------------------------------------------------------------------------
# The hand-written reference: both ranks of a data-parallel run, in one process
# ---------------------------------------------------------------------------------------


def make_optimizer(name: str, module: torch.nn.Module):
    """The optimizer and scheduler the worker's module returns for ``name``, in plain torch."""
    if name == "adam":
        opt = torch.optim.Adam(module.parameters(), lr=0.01)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
    if name in ("adam_groups", "adamw_groups"):
        cls = torch.optim.Adam if name == "adam_groups" else torch.optim.AdamW
        weights = [p for n, p in module.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in module.named_parameters() if n.endswith("bias")]
        opt = cls([{"params": weights, "lr": 0.01, "weight_decay": 0.05},
                   {"params": biases, "lr": 0.02, "weight_decay": 0.0}], betas=(0.85, 0.99), eps=1e-6)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
    if name == "sgd_only":
        return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9), None
    return module.configure_optimizers()


def warmup_decay_lr(step: int) -> float:
    """SCHED_CONFIG's learning rate at optimizer step ``step`` (0-based), in closed form.

    DeepSpeed's WarmupDecayLR sets the rate for iteration ``it`` and is stepped after each
    optimizer step, so step ``s`` runs at iteration ``s - 1`` (the first at ``min``).
    """
    params = SCHED_CONFIG["scheduler"]["params"]
    low, high, warm, total = (params[k] for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"))
    it = step - 1
    if it < 0:
        return low
    gamma = it / warm if it < warm else max(0.0, (total - it) / (total - warm))
    return low + (high - low) * gamma


@functools.lru_cache(maxsize=None)
def reference(epochs: int, batch: int = 32, accumulate: int = 1, limit: int | None = None,
              clip: float | None = None, optimizer: str = "sgd", hidden: int = 64,
              lrs: tuple[float, ...] | None = None) -> dict:
    """Plain PyTorch: rank r's batches from DistributedSampler(seed=0), the gradient of
    the mean of the ranks' losses (what an all-reduce average gives), the loss divided by
    ``accumulate`` with a step at the end of each window (or of the epoch). ``lrs`` sets
    the learning rate of every step."""
    train, val = digits_datasets()
    torch.manual_seed(0)
    module = DigitsClassifier(hidden=hidden)
    opt, scheduler = make_optimizer(optimizer, module)
    steps = 0
    samplers = [DistributedSampler(train, num_replicas=WORLD, rank=r, shuffle=True, seed=0) for r in range(WORLD)]
    x_all, y_all = train.tensors
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    for epoch in range(epochs):
        orders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        n = math.ceil(len(orders[0]) / batch)
        n = min(n, limit) if limit else n
        for i in range(n):
            total = 0.0
            for r in range(WORLD):
                index = torch.tensor(orders[r][i * batch:(i + 1) * batch])
                loss = F.cross_entropy(module(x_all[index]), y_all[index])
                losses[r].append(float(loss.detach()))
                total = total + loss
            (total / WORLD / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == n:
                if clip:
                    torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
                if lrs is not None:
                    for group in opt.param_groups:
                        group["lr"] = lrs[steps]
                opt.step()
                steps += 1
                opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    module.eval()
    with torch.no_grad():
        logits = module(val.tensors[0])
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"losses": losses, "state_dict": state, "val_logits": logits}


def max_loss_diff(runs: list[dict], ref: dict) -> float:
    diffs = []
    for r, run in enumerate(runs):
        assert len(run["losses"]) == len(ref["losses"][r]), (len(run["losses"]), len(ref["losses"][r]))
        diffs += [abs(a - b) for a, b in zip(run["losses"], ref["losses"][r])]
    return max(diffs)


def max_state_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# ---------------------------------------------------------------------------------------
# Training: every stage, against the reference and against hookloop ddp
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_trains_digits_like_the_reference(ds_runs, stage):
    runs = ds_runs(f"stage{stage}")
    for run in runs:
        assert run["zero_stage"] == stage and run["world_size"] == WORLD
        assert run["callback_metrics"]["val_acc"] >= 0.9, run["callback_metrics"]
        assert run["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert max_loss_diff(runs, reference(EPOCHS)) < LOSS_TOL
    # The engine's final weights predict what the reference's final weights predict.
    assert float((runs[0]["val_logits"] - reference(EPOCHS)["val_logits"]).abs().max()) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_curve_matches_hookloop_ddp(ds_runs, ddp_runs, stage):
    ddp = ddp_runs("ddp")
    assert ddp[0]["callback_metrics"]["val_acc"] >= 0.9
    for ds_run, ddp_run in zip(ds_runs(f"stage{stage}"), ddp):
        assert len(ds_run["losses"]) == len(ddp_run["losses"]) == EPOCHS * STEPS_PER_EPOCH
        assert max(abs(a - b) for a, b in zip(ds_run["losses"], ddp_run["losses"])) < LOSS_TOL


# ---------------------------------------------------------------------------------------
# Memory: what each rank holds
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_optimizer_state_per_rank_within_the_zero_limit(ds_runs):
    n_params = sum(p.numel() for p in DigitsClassifier().parameters())
    full = n_params * 4  # SGD momentum: one fp32 value per parameter
    for stage in (0, 1, 2, 3):
        states = [run["memory"]["optimizer_state_bytes"] for run in ds_runs(f"stage{stage}")]
        if stage == 0:
            assert states == [full] * WORLD, states  # every rank holds it all, as DDP does
        else:
            limit = full / WORLD
            # ZeRO pads each rank's partition by at most a few elements for alignment.
            assert all(limit <= s <= limit + 64 for s in states), (stage, states, limit)
            assert sum(states) >= full


@pytest.mark.slow
def test_stage3_creates_and_keeps_parameters_partitioned(ds_runs):
    runs = ds_runs("stage3")
    n_params = sum(p.numel() for p in DigitsClassifier().parameters())
    for run in runs:
        # configure_model ran inside zero.Init: each layer was partitioned as it was made.
        assert run["partitioned_at_creation"] is True
        assert run["param_numel_local"] == [0, 0, 0, 0]  # nothing whole left on any rank
        assert sum(run["param_ds_numel"]) == n_params
        assert run["memory"]["parameter_bytes"] <= n_params * 4 / WORLD + 64
    # Together the ranks' partitions cover every parameter.
    for full, parts in zip(runs[0]["param_ds_numel"], zip(*(r["param_partition_numel"] for r in runs))):
        assert full <= sum(parts) <= full + WORLD
    # Stages 0-2 keep every parameter on every rank.
    assert ds_runs("stage2")[0]["memory"]["parameter_bytes"] == n_params * 4
    assert "the custom DeepSpeed config overrides the options stage=3" in ds_runs.output


# ---------------------------------------------------------------------------------------
# Gradient accumulation, clipping, activation checkpointing, precision, offload
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_accumulating_two_half_batches_equals_one_double_batch_under_zero2(ds_runs):
    accumulated, double = ds_runs("accumulate2"), ds_runs("double_batch")
    assert accumulated[0]["global_step"] == double[0]["global_step"] == 20
    assert max_state_diff(accumulated[0]["state_dict"], double[0]["state_dict"]) < 1e-5
    # And both match the hand-written loop.
    assert max_state_diff(double[0]["state_dict"], reference(1, limit=20)["state_dict"]) < 1e-5


@pytest.mark.slow
def test_accumulation_with_a_short_last_window_matches_the_reference(ds_runs):
    runs = ds_runs("accumulate2_epochs")
    assert runs[0]["global_step"] == 2 * math.ceil(STEPS_PER_EPOCH / 2)
    ref = reference(2, accumulate=2)
    assert max_loss_diff(runs, ref) < LOSS_TOL
    assert max_state_diff(runs[0]["state_dict"], ref["state_dict"]) < 1e-5


@pytest.mark.slow
def test_gradient_clipping_and_activation_checkpointing(ds_runs):
    runs = ds_runs("clip_checkpointed")
    assert runs[0]["checkpoint_backend"] == "deepspeed"
    ref = reference(2, clip=0.5)
    assert max_loss_diff(runs, ref) < LOSS_TOL
    assert max_state_diff(runs[0]["state_dict"], ref["state_dict"]) < 1e-5
    # Clipping mattered: without it the weights differ.
    assert max_state_diff(reference(2)["state_dict"], ref["state_dict"]) > 1e-3


@pytest.mark.slow
def test_bf16_precision_is_handed_to_deepspeed(ds_runs):
    runs = ds_runs("bf16")
    assert "amp leaves it to it" in ds_runs.output  # hookloop-amp handed the setting over
    for run in runs:
        assert run["bf16"] is True and run["param_dtypes"] == ["torch.bfloat16"]
        assert run["callback_metrics"]["val_acc"] >= 0.9
    # bf16 rounding only: the curve follows the fp32 reference closely on average.
    ref = reference(EPOCHS)
    diffs = [abs(a - b) for a, b in zip(runs[0]["losses"], ref["losses"][0])]
    assert sum(diffs) / len(diffs) < 0.05, sum(diffs) / len(diffs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stage2_offload", "stage3_offload"])
def test_offload_trains_with_deepspeed_cpu_adam(ds_runs, name):
    runs = ds_runs(name)
    assert "replaced by DeepSpeedCPUAdam" in ds_runs.output
    for run in runs:
        assert run["optimizer_type"] == "DeepSpeedCPUAdam"
        assert run["callback_metrics"]["val_acc"] >= 0.9
    # DeepSpeedCPUAdam computes what torch.optim.Adam computes, and the user's StepLR
    # (re-pointed at the replacement) lowers its learning rate after epoch 2.
    assert max_loss_diff(runs, reference(EPOCHS, optimizer="adam")) < 1e-3
    n_params = sum(p.numel() for p in DigitsClassifier().parameters())
    for run in runs:  # Adam's two moments, this rank's half of them
        assert run["memory"]["optimizer_state_bytes"] <= 2 * n_params * 4 / WORLD + 128


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adam_groups", "adamw_groups"])
def test_offload_maps_torch_adam_and_adamw_exactly(ds_runs, name):
    runs = ds_runs(f"offload_{name}")
    adamw = name == "adamw_groups"
    for run in runs:
        assert run["optimizer_type"] == "DeepSpeedCPUAdam"
        assert run["adamw_mode"] is adamw
        # Every group's hyper-parameters arrive unchanged (none falls back to a default).
        assert run["optimizer_groups"] == [
            {"lr": 0.01, "betas": (0.85, 0.99), "eps": 1e-6, "weight_decay": 0.05, "amsgrad": False},
            {"lr": 0.02, "betas": (0.85, 0.99), "eps": 1e-6, "weight_decay": 0.0, "amsgrad": False},
        ]
    ref = reference(EPOCHS, optimizer=name)
    assert max_loss_diff(runs, ref) < 1e-3
    # The same weights as torch's own Adam(W) with the user's StepLR (re-pointed at the
    # replacement, it lowers the rates after epoch 2).
    assert max_state_diff(runs[0]["state_dict"], ref["state_dict"]) < OFFLOAD_TOL
    # The tolerance tells the modes apart: L2 (Adam) and decoupled (AdamW) decay differ.
    other = reference(EPOCHS, optimizer="adam_groups" if adamw else "adamw_groups")
    assert max_state_diff(ref["state_dict"], other["state_dict"]) > 100 * OFFLOAD_TOL


@pytest.mark.slow
def test_offload_refuses_an_optimizer_deepspeed_cpu_adam_cannot_reproduce(ds_runs):
    for run in ds_runs("offload_sgd_refused"):
        error = run["error"]
        assert error is not None and error.startswith("ConfigurationError"), error
        for fix in ("SGD", "torch.optim.Adam", "AdamW", "DeepSpeedCPUAdam", '"zero_force_ds_cpu_optimizer": false',
                    "offload_optimizer=False"):
            assert fix in error, (fix, error)
    for run in ds_runs("offload_amsgrad_refused"):
        error = run["error"]
        assert error is not None and error.startswith("ConfigurationError"), error
        assert "amsgrad=True" in error, error


@pytest.mark.slow
def test_zero_force_ds_cpu_optimizer_false_steps_the_users_optimizer(ds_runs):
    runs = ds_runs("offload_sgd_forced")
    for run in runs:
        assert run["optimizer_type"] == "SGD" and run["cpu_offload"] is True
    # SGD with momentum and the user's StepLR, stepped on the CPU: the non-offloaded
    # ZeRO-2 run's weights, and the hand-written loop's.
    assert max_state_diff(runs[0]["state_dict"], ds_runs("stage2")[0]["state_dict"]) < 1e-5
    assert max_state_diff(runs[0]["state_dict"], reference(EPOCHS)["state_dict"]) < 1e-5


@pytest.mark.slow
def test_nvme_offload_swaps_to_nvme_path_and_trains_like_the_reference(ds_runs):
    runs = ds_runs("stage3_nvme")
    for rank, run in enumerate(runs):
        assert run["optimizer_type"] == "DeepSpeedCPUAdam"
        assert run["memory"]["optimizer_state_bytes"] == 0  # the state lives in the swap files
        files = run["files_during_training"]
        # <param id>_param.tensor.swp: ids count on across the scenarios of this process.
        assert any(f.startswith(f"zero_stage_3/float32params/rank{rank}/") and f.endswith("_param.tensor.swp")
                   for f in files), sorted(files)
        assert any(f.startswith(f"zero_stage_3/optimizer/rank{rank}/exp_avg_sq") for f in files), sorted(files)
    # Swapping is exact: the curve is plain Adam's (losses up to ~13 at lr 0.01 on this width).
    assert max_loss_diff(runs, reference(1, limit=4, optimizer="adam", hidden=NVME_HIDDEN)) < 1e-3


@pytest.mark.slow
def test_an_optimizer_in_the_custom_config_replaces_the_users(ds_runs):
    runs = ds_runs("config_optimizer")
    assert "the DeepSpeed config defines an optimizer; it replaces SGD from configure_optimizers" in ds_runs.output
    assert "StepLR from configure_optimizers drove the replaced optimizer and is dropped" in ds_runs.output
    for run in runs:
        assert run["optimizer_type"] != "SGD"
        assert run["callback_metrics"]["val_acc"] >= 0.9


# ---------------------------------------------------------------------------------------
# Checkpoints: resume, collate
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_from_a_sharded_checkpoint_continues_like_an_uninterrupted_run(ds_runs):
    uninterrupted, first, second = ds_runs("stage3"), ds_runs("resume_first"), ds_runs("resume_second")
    assert first[0]["global_step"] == RESUME_AT
    assert (ds_runs.workdir / "resume" / "logs" / "version_0" / "checkpoints" / "last.ckpt").is_dir()
    for whole, before, after in zip(uninterrupted, first, second):
        assert after["global_step"] == EPOCHS * STEPS_PER_EPOCH
        assert len(before["losses"]) + len(after["losses"]) == len(whole["losses"])
        assert max(abs(a - b) for a, b in zip(before["losses"] + after["losses"], whole["losses"])) < LOSS_TOL
        assert float((after["val_logits"] - whole["val_logits"]).abs().max()) < 1e-4
        assert abs(after["callback_metrics"]["val_acc"] - whole["callback_metrics"]["val_acc"]) < 1e-6


@pytest.mark.slow
def test_resume_continues_the_deepspeed_config_scheduler(ds_runs):
    straight, first, second = ds_runs("sched_straight"), ds_runs("sched_first"), ds_runs("sched_second")
    expected = [warmup_decay_lr(s) for s in range(SCHED_STEPS)]
    for whole, before, after in zip(straight, first, second):
        assert before["global_step"] == SCHED_RESUME_AT and after["global_step"] == SCHED_STEPS
        assert whole["lrs"] == pytest.approx(expected, abs=1e-12)
        # After the resume the schedule goes on from step 13, not from its warm-up start.
        assert before["lrs"] + after["lrs"] == pytest.approx(expected, abs=1e-12)
        assert max_state_diff(after["state_dict"], whole["state_dict"]) < 1e-6
    # And the straight run is plain SGD at those rates.
    ref = reference(2, optimizer="sgd_only", lrs=tuple(expected))
    assert max_state_diff(straight[0]["state_dict"], ref["state_dict"]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_validate_from_a_sharded_checkpoint(ds_runs, stage):
    trained, validated = ds_runs(f"stage{stage}"), ds_runs(f"validate_stage{stage}")
    for a, b in zip(trained, validated):
        assert abs(a["callback_metrics"]["val_acc"] - b["callback_metrics"]["val_acc"]) < 1e-6
        assert abs(a["callback_metrics"]["val_loss"] - b["callback_metrics"]["val_loss"]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_collate_writes_one_state_dict_that_predicts_like_the_engine(ds_runs, tmp_path, stage):
    ckpt = ds_runs.workdir / f"stage{stage}" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    out = tmp_path / "model.pt"
    proc = run_python([str(Path(sys.executable).parent / "hookloop"), "deepspeed", "collate", str(ckpt), str(out)],
                      cwd=tmp_path, timeout=300)
    assert "optimizer state dropped" in proc.stdout
    state = torch.load(out, weights_only=True)
    plain = DigitsClassifier()  # a plain nn.Module, no DeepSpeed anywhere
    plain.load_state_dict(state)  # strict: exactly the user's keys
    assert all(v.dtype == torch.float32 for v in state.values())
    plain.eval()
    with torch.no_grad():
        logits = plain(digits_datasets()[1].tensors[0])
    assert float((logits - ds_runs(f"stage{stage}")[0]["val_logits"]).abs().max()) < 1e-5


# ---------------------------------------------------------------------------------------
# Manual optimization
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_manual_optimization_runs_through_the_engine(ds_runs):
    """manual_backward -> engine.backward, step() -> engine.step(): the automatic run's
    losses and weights."""
    manual, automatic = ds_runs("manual_stage2"), ds_runs("stage2")
    for m, a in zip(manual, automatic):
        assert m["global_step"] == a["global_step"] == EPOCHS * STEPS_PER_EPOCH
        assert m["losses"] == a["losses"]
        assert max_state_diff(m["state_dict"], a["state_dict"]) == 0.0


@pytest.mark.slow
def test_two_optimizers_are_refused_by_the_engine(ds_runs):
    for run in ds_runs("manual_two_optimizers"):
        assert "2 optimizers, and a DeepSpeed engine trains with one" in run["error"]


@pytest.mark.slow
def test_process_group_timeout_reaches_deepspeeds_group(ds_runs):
    # Trainer(process_group_timeout=77) in one scenario; gloo's default (300 s) in the others.
    assert [r["group_timeout_s"] for r in ds_runs("manual_stage2")] == [77.0, 77.0]
    assert [r["group_timeout_s"] for r in ds_runs("stage2")] == [300.0, 300.0]
