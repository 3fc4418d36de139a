"""``hookloop.Tuner`` beyond ddp (issue 22, item 7): the learning-rate and batch-size
finders under fsdp (plugins/fsdp) and DeepSpeed ZeRO-2 (plugins/deepspeed, CPU), on 2
processes (gloo) with the same global batch as one process: the lr finder's lrs and
smoothed losses equal the hand-written one-process loop of tests/test_tuner.py on the
union of the ranks' batches (1e-6), the batch-size finder gives the same answer on both
ranks, and the weights after each finder are the weights before (``torch.equal``).
DeepSpeed ZeRO-3, which cannot wrap the same module twice in a process, is refused.

The module and data are tests/scripts/tuner_job.py's (as tests/test_tuner.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hookloop

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import tuner_job as job  # noqa: E402
from test_tuner import hand_lr_find, hand_suggestion  # noqa: E402

FULL = pytest.mark.full  # 2-process fsdp/deepspeed launches (~15-60 s each on 2 busy cores)
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False)


def _trainer(strategy: str, root: str, **kw) -> hookloop.Trainer:
    # use_distributed_sampler=False: rank r trains on samples r, r + W, ... in order
    # (tuner_job.Regression.train_dataloader), so the ranks' batch k together are the
    # sequential batch k of W * BATCH samples
    return hookloop.Trainer(plugins=[strategy], max_epochs=1, use_distributed_sampler=False,
                            default_root_dir=root, **QUIET, **kw)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(before: dict, model: torch.nn.Module) -> bool:
    after = model.state_dict()
    return set(before) == set(after) and all(
        type(after[k]) is torch.Tensor and torch.equal(before[k], after[k]) for k in before)


def finders_rank(strategy: str, root: str, lr: bool = True) -> dict:
    """One rank: lr_find (then a fit from step 0), and scale_batch_size with rank 1 alone
    out of memory above ``job.OOM_ABOVE`` samples; whether each put the weights back."""
    out: dict = {}
    if lr:
        trainer = _trainer(strategy, os.path.join(root, "lr"))
        model = job.Regression()
        before = _weights(model)
        found = hookloop.Tuner(trainer).lr_find(model, num_training=job.NUM_TRAINING, min_lr=1e-4, max_lr=1.0)
        out.update(lr=found.results["lr"], loss=found.results["loss"], suggestion=found.suggestion(),
                   model_lr=model.lr, lr_restored=_equal(before, model))
        trainer.fit(model)  # the trainer is back at step 0; the model trains as before the search
        out["global_step_after_fit"] = trainer.global_step
    trainer = _trainer(strategy, os.path.join(root, "bs"))
    model = job.Regression(oom_rank=1)
    before = _weights(model)
    tuner = hookloop.Tuner(trainer)
    out["batch_size"] = tuner.scale_batch_size(model, mode="power", init_val=2, steps_per_trial=2)
    out.update(model_batch_size=model.batch_size, trials=tuner.trials, bs_restored=_equal(before, model))
    return json.loads(json.dumps(out))


def _check_lr(result: dict) -> None:
    lrs, losses = hand_lr_find(2 * job.BATCH, job.NUM_TRAINING, 1e-4, 1.0)
    assert result["lr"] == lrs
    assert result["loss"] == pytest.approx(losses, rel=0, abs=1e-6)
    assert result["suggestion"] == lrs[hand_suggestion(lrs, result["loss"])] == result["model_lr"]
    assert result["lr_restored"]
    assert result["global_step_after_fit"] == job.N // (2 * job.BATCH)


def _check_bs(result: dict) -> None:
    # 2, 4, 8 fit; 16 runs out of memory on rank 1 alone: both ranks end at 8
    assert result["trials"] == [[2, True], [4, True], [8, True], [16, False]]
    assert result["batch_size"] == result["model_batch_size"] == job.OOM_ABOVE
    assert result["bs_restored"]


def test_scale_batch_size_under_fsdp_puts_the_weights_back(tmp_path):
    """fsdp's teardown after a failed fit (the out-of-memory trial) leaves each parameter
    as this rank's DTensor shard (here on a mesh of one process; the 2-process run is the
    FULL test below); the finder used to fail putting the weights back
    (``load_state_dict``: "got mixed torch.Tensor and DTensor"). It ends with the plain
    weights it started with and the size that fitted."""
    trainer = _trainer("fsdp", str(tmp_path))
    model = job.Regression(oom_rank=0)
    before = _weights(model)
    tuner = hookloop.Tuner(trainer)
    assert tuner.scale_batch_size(model, mode="power", init_val=4, steps_per_trial=1) == job.OOM_ABOVE
    assert tuner.trials == [(4, True), (8, True), (16, False)]
    assert _equal(before, model)
    trainer.fit(model)  # the next fit shards the plain weights afresh
    assert trainer.global_step == job.N // job.OOM_ABOVE


@FULL
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_2"])
def test_finders_under_sharded_strategies_equal_one_process(hookloop_processes, tmp_path, strategy):
    results = hookloop_processes(finders_rank, nprocs=2, args=(strategy, str(tmp_path)), timeout=500)
    assert results[0] == results[1]
    _check_lr(results[0])
    _check_bs(results[0])


def test_fsdp_sharded_state_dict_lr_find_puts_the_weights_back(tmp_path):
    """fsdp with ``state_dict_type="sharded"`` does not gather at teardown even when the
    search ends well: the parameters stay DTensor shards (here a mesh of one process),
    and lr_find must still leave the plain weights it started with."""
    trainer = hookloop.Trainer(plugins=[hookloop.plugin("fsdp", state_dict_type="sharded")], max_epochs=1,
                               use_distributed_sampler=False, default_root_dir=str(tmp_path), **QUIET)
    model = job.Regression()
    before = _weights(model)
    found = hookloop.Tuner(trainer).lr_find(model, num_training=8, min_lr=1e-4, max_lr=1.0, update_attr=False)
    lrs, losses = hand_lr_find(job.BATCH, 8, 1e-4, 1.0)
    assert found.results["lr"] == lrs
    assert found.results["loss"] == pytest.approx(losses, rel=0, abs=1e-6)
    assert _equal(before, model)


@pytest.mark.parametrize("plugin", [
    "deepspeed_stage_3", "deepspeed_stage_3_offload",
    hookloop.plugin("deepspeed", config={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4}),
])
def test_finders_refuse_deepspeed_zero3_naming_the_strategy(tmp_path, plugin):
    """A module that went through one ZeRO-3 engine cannot be wrapped by a second in the
    same process (seen: the second trial, or the fit after lr_find, fails in
    ``deepspeed.initialize`` with "Group ... is not registered"), and a finder needs
    several. Refused before anything runs, with the strategy named and what to do."""
    trainer = hookloop.Trainer(plugins=[plugin], max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    name = plugin if isinstance(plugin, str) else "deepspeed"
    for finder, call in (("lr_find", lambda t: t.lr_find(job.Regression())),
                         ("scale_batch_size", lambda t: t.scale_batch_size(job.Regression()))):
        with pytest.raises(hookloop.ConfigurationError) as caught:
            call(hookloop.Tuner(trainer))
        message = str(caught.value)
        assert message.startswith(f"{finder} under {name!r} (DeepSpeed ZeRO stage 3) is not supported")
        assert "Run the finder under 'deepspeed_stage_2'" in message and f"then train with {name!r}" in message


@FULL
def test_hookloop_tune_under_fsdp_and_refused_under_zero3(tmp_path):
    """``hookloop tune batch-size --plugins fsdp --devices 2``: each trial, then the size
    (rank 0 alone out of memory above 8); ``hookloop tune lr --plugins deepspeed_stage_3``
    fails with the refusal, naming the strategy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    env.pop("LOCAL_RANK", None)
    script = str(SCRIPTS / "tuner_cli_script.py")
    bs = subprocess.run([sys.executable, "-m", "hookloop", "tune", "batch-size", "--steps-per-trial", "1",
                         "--plugins", "fsdp", "--devices", "2", "--default-root-dir", str(tmp_path / "bs"),
                         script, "--oom"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert bs.returncode == 0, bs.stdout + bs.stderr
    assert [line.split()[:2] for line in bs.stdout.splitlines() if line.strip()[:1].isdigit()] == \
        [["2", "fits"], ["4", "fits"], ["8", "fits"], ["16", "out"]]
    assert "hookloop tune batch-size: batch size 8" in bs.stdout and "trained" not in bs.stdout
    lr = subprocess.run([sys.executable, "-m", "hookloop", "tune", "lr", "--plugins", "deepspeed_stage_3",
                         "--devices", "2", "--default-root-dir", str(tmp_path / "lr"), script],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert lr.returncode != 0
    # the failure summary: the refusal once, not once per rank
    assert (lr.stdout + lr.stderr).count("lr_find under 'deepspeed_stage_3' (DeepSpeed ZeRO stage 3) is not supported") == 1
    assert "trained" not in lr.stdout
