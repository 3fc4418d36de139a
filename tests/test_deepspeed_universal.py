"""A ZeRO 1-3 checkpoint resumed on another number of processes (issue 37, item 3).

tests/scripts/deepspeed_universal_job.py trains the digits with torch's Adam and a
per-step StepLR for 15 steps on the first world size, then resumes on the second up to
step 30. hookloop-deepspeed converts the checkpoint with DeepSpeed's ``ds_to_universal``
into a universal copy inside its tag and loads that. Each resume is compared with:

* the checkpoint it resumed: the weights, Adam's two moments and step count the resumed
  run holds before its first step, gathered whole, equal the first run's at its end
  (the conversion is slicing and joining, no arithmetic: exactly equal);
* the reference, hookloop's ``ddp`` doing the same (15 steps on the first world size,
  resumed on the second), whose processes hold weights and Adam state whole, and which
  resumes on another world size by itself: the same losses, learning rates, weights and
  moments at the end, within ``TOL``.

The 2 -> 1 resume of ZeRO-2 runs in the test tier; ZeRO-1 and -3, and 1 -> 2, in the full
tier.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, finish_job

pytest.importorskip("hookloop_deepspeed")

SCRIPT = REPO / "tests" / "scripts" / "deepspeed_universal_job.py"
FIRST, TOTAL = 15, 30  # optimizer steps before the checkpoint, and in all
FULL = pytest.mark.full  # two more launches per case (~20-40 s each on 2 busy cores)

# ZeRO's reduce-scatter and ddp's all-reduce average the same two gradients (measured:
# 0.0 difference on every stage and both directions, fp32); the margin only covers a
# summation order another DeepSpeed release may pick. A lost or restarted moment or step
# count moves the weights by more than 1e-3 within the 15 steps after the resume.
TOL = 1e-6


def start(devices: int, out: Path, strategy: str, steps: int, ckpt: Path | None = None,
          extra: tuple = ()) -> subprocess.Popen:
    """The job on ``devices`` processes under torchrun; no launcher variable of this
    process reaches it."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    env.pop("LOCAL_RANK", None)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}",
            str(SCRIPT), str(out), "--strategy", strategy, "--steps", str(steps), *extra]
    return subprocess.Popen(args + (["--ckpt", str(ckpt)] if ckpt else []), cwd=out, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def last_of(out: Path) -> Path:
    return out / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"


class Jobs:
    """Each (strategy, old world size, new world size) pair of runs once per module: the
    first half beside the ddp reference's, then both resumes side by side."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def __call__(self, strategy: str, old: int, new: int, *extra: str) -> dict:
        key = (strategy, old, new, *extra)
        if key not in self.done:
            todo = [k for k in (key, ("ddp", old, new)) if k not in self.done]
            dirs = {k: self.root / "_".join(map(str, k)).replace("-", "") for k in todo}
            first = {k: start(old, dirs[k] / "first", k[0], FIRST, extra=k[3:]) for k in todo}
            for proc in first.values():
                finish_job(proc, 600)
            second = {k: start(new, dirs[k] / "second", k[0], TOTAL, last_of(dirs[k] / "first"), extra=k[3:])
                      for k in todo}
            for k, proc in second.items():
                stdout, stderr = finish_job(proc, 600)
                self.done[k] = {
                    "first": torch.load(dirs[k] / "first" / "state.pt", weights_only=True),
                    "second": torch.load(dirs[k] / "second" / "state.pt", weights_only=True),
                    "output": stdout + stderr, "checkpoint": last_of(dirs[k] / "first")}
        return self.done[key]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("universal"))


def max_diff(a: dict, b: dict) -> dict[str, float]:
    """The largest difference of each state (fp32, exp_avg, exp_avg_sq, step) over the
    parameters; both must hold the same parameters and states."""
    assert a.keys() == b.keys()
    diffs: dict[str, float] = {}
    for name in a:
        assert a[name].keys() == b[name].keys() == {"fp32", "exp_avg", "exp_avg_sq", "step"}, name
        for key in a[name]:
            d = float((a[name][key].float().reshape(-1) - b[name][key].float().reshape(-1)).abs().max())
            diffs[key] = max(diffs.get(key, 0.0), d)
    return diffs


def check_converted(ds: dict, new: int) -> None:
    """The converted state, before the first step on the new world size, is the saved one."""
    first, second = ds["first"], ds["second"]
    assert second["start_step"] == FIRST and second["global_step"] == TOTAL and second["world_size"] == new
    assert max_diff(second["start"], first["end"]) == dict.fromkeys(("fp32", "exp_avg", "exp_avg_sq", "step"), 0.0)
    assert all(float(s["exp_avg_sq"].abs().max()) > 0 for s in second["start"].values())  # Adam really has state
    assert all(float(s["step"]) == FIRST for s in second["start"].values())


def check_resume(jobs: Jobs, stage: int, old: int, new: int) -> None:
    strategy = f"deepspeed_stage_{stage}"
    ds, ref = jobs(strategy, old, new), jobs("ddp", old, new)
    first, second = ds["first"], ds["second"]
    check_converted(ds, new)
    # Both halves train as ddp does on the same world sizes.
    assert first["losses"] == pytest.approx(ref["first"]["losses"], abs=TOL)
    assert second["losses"] == pytest.approx(ref["second"]["losses"], abs=TOL)
    assert second["lrs"] == pytest.approx(ref["second"]["lrs"], abs=1e-12)
    assert second["lrs"][0] == 0.01 * 0.5  # StepLR went on from step 15, not from its start
    assert all(d <= TOL for d in max_diff(second["end"], ref["second"]["end"]).values())
    # Rank 0 says what happened: the plugin's conversion, then the core's line (as ddp's and fsdp's).
    processes = {1: "1 process", 2: "2 processes"}
    converted = [line for line in ds["output"].splitlines() if "loading its universal copy" in line]
    copy = ds["checkpoint"] / f"global_step{FIRST}" / "universal"
    assert len(converted) == 1 and converted[0].startswith(
        f"hookloop-deepspeed: {str(ds['checkpoint'])!r} is a ZeRO-{stage} checkpoint of {processes[old]} and this "
        f"run has {new}: loading its universal copy {str(copy)!r} (converted in ")
    assert converted[0].endswith("s; DeepSpeed's ds_to_universal), which re-partitions the weights and the "
                                 "optimizer state")
    resumed = [line for line in ds["output"].splitlines() if "resuming a checkpoint of" in line]
    assert resumed == [line for line in ref["output"].splitlines() if "resuming a checkpoint of" in line]
    assert len(resumed) == 1 and f"effective batch size {32 * old} " in resumed[0] and f"-> {32 * new} " in resumed[0]


@pytest.mark.full  # CI time: the conversion itself is checked in process in every tier
def test_zero2_resumes_on_fewer_processes_like_ddp(jobs):
    check_resume(jobs, 2, 2, 1)


@FULL
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_resumes_on_fewer_processes_like_ddp(jobs, stage):
    check_resume(jobs, stage, 2, 1)


@FULL
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_resumes_on_more_processes_like_ddp(jobs, stage):
    check_resume(jobs, stage, 1, 2)


@FULL
def test_a_bf16_checkpoint_converts_its_fp32_master_state_exactly(jobs):
    """bf16 ZeRO-2 writes bf16_zero_pp_rank_* shards; the fp32 master weights and moments
    are re-partitioned exactly (the training itself is bf16's, so no ddp comparison)."""
    ds = jobs("deepspeed_stage_2", 2, 1, "--precision", "bf16-mixed")
    assert any(ds["checkpoint"].glob("global_step*/bf16_zero_pp_rank_1_*optim_states.pt"))
    check_converted(ds, 1)


@FULL
def test_an_optimizer_offload_checkpoint_resumes_on_fewer_processes_like_ddp(jobs):
    """ZeRO-2 with DeepSpeedCPUAdam (offload): converted exactly; then within OFFLOAD_TOL of
    ddp's torch Adam (tests/test_deepspeed.py: its C++ step rounds in another order)."""
    ds, ref = jobs("deepspeed_stage_2_offload", 2, 1), jobs("ddp", 2, 1)
    check_converted(ds, 1)
    assert ds["second"]["lrs"] == pytest.approx(ref["second"]["lrs"], abs=1e-12)
    assert all(d <= 1e-5 for d in max_diff(ds["second"]["end"], ref["second"]["end"]).values())


# ---------------------------------------------------------------------------------------
# The universal copy itself (in this process, on the test tier's checkpoint)
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_universal_copy_holds_the_whole_adam_state_and_is_reused(jobs):
    """DeepSpeed's files beside the first run's gathered state: every parameter's fp32
    weights, moments and step, whole. A second resume reuses the copy."""
    from hookloop_deepspeed import universal

    ds = jobs("deepspeed_stage_2", 2, 1)
    tag = f"global_step{FIRST}"
    copy = ds["checkpoint"] / tag / universal.UNIVERSAL
    saved = ds["first"]["end"]
    for name, states in saved.items():
        folder = copy / "zero" / f"module.{name}"  # the engine wraps the step module, which holds the user's
        assert sorted(p.name for p in folder.iterdir()) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.load(folder / f"{key}.pt", weights_only=True)["param"], states[key]), (name, key)
        assert float(torch.load(folder / "step.pt", weights_only=True)) == FIRST
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*")}
    target, seconds = universal.timed_copy(ds["checkpoint"], tag)
    assert (target, seconds) == (copy, None)
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*")} == before


@pytest.mark.slow
def test_a_universal_directory_without_the_marker_is_converted_again(jobs, tmp_path):
    """One made by hand with ds_to_universal (perhaps interrupted: here a file short) is
    not trusted: it is replaced by a complete conversion."""
    from hookloop_deepspeed import universal

    checkpoint = tmp_path / "last.ckpt"
    shutil.copytree(jobs("deepspeed_stage_2", 2, 1)["checkpoint"], checkpoint)
    copy = checkpoint / f"global_step{FIRST}" / universal.UNIVERSAL
    (copy / universal.CONVERTED_MARKER).unlink()
    (copy / "mp_rank_00_model_states.pt").unlink()
    target, seconds = universal.timed_copy(checkpoint, copy.parent.name)
    assert target == copy and seconds is not None and universal.is_converted(copy)
    assert (copy / "mp_rank_00_model_states.pt").is_file()


@pytest.mark.slow
def test_an_interrupted_conversion_is_never_taken_for_a_complete_one(jobs, tmp_path):
    """The converter stopped half-way (a shard it cannot read, after it wrote rank 0's
    fragments; a killed conversion leaves its temporary directory): no ``universal``
    directory, nothing left behind, the error says why; once the shard is readable the
    conversion runs again from scratch and is complete."""
    import hookloop
    from hookloop_deepspeed import universal

    checkpoint = tmp_path / "last.ckpt"
    shutil.copytree(jobs("deepspeed_stage_2", 2, 1)["checkpoint"], checkpoint,
                    ignore=shutil.ignore_patterns(universal.UNIVERSAL))
    tag = checkpoint / f"global_step{FIRST}"
    killed = tag / ".universal-killed"  # what a conversion killed half-way leaves
    (killed / universal.UNIVERSAL / "zero").mkdir(parents=True)
    shard = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(hookloop.CheckpointError, match=r"\(ds_to_universal\) could not convert .* OSError"):
        universal.universal_copy(checkpoint, tag.name)
    assert sorted(p.name for p in tag.iterdir()) == sorted(
        [".hookloop-complete", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
         shard.name])
    shard.write_bytes(whole)
    target, seconds = universal.timed_copy(checkpoint, tag.name)
    assert target == tag / universal.UNIVERSAL and seconds is not None
    reference = jobs("deepspeed_stage_2", 2, 1)["checkpoint"] / tag.name / universal.UNIVERSAL
    files = sorted(p.relative_to(reference) for p in reference.rglob("*") if p.is_file())
    assert sorted(p.relative_to(target) for p in target.rglob("*") if p.is_file()) == files
    for rel in files:
        if rel.name in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
            assert torch.equal(torch.load(target / rel, weights_only=True)["param"],
                               torch.load(reference / rel, weights_only=True)["param"]), rel
