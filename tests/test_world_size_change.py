"""Resuming a ddp checkpoint on another number of processes (issue 12, item 5).

scikit-learn's digits, batches of 32 per process (tests/scripts/world_size_job.py):
3 epochs on 2 processes and, beside it, 3 on 1; then each checkpoint resumes on the
other world size up to epoch 6. Each resumed run must reach the accuracy of an
uninterrupted 6-epoch run on one process (computed here, in this process), take the
optimizer steps the new world size makes, and say on one line how the effective batch
size changed. A checkpoint without the world size (written before it was saved)
resumes as before, silently.
"""

from __future__ import annotations

import json
import shutil
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.resume import checkpoint as ckpt
from conftest import REPO, finish_job, start_hookloop_run

sys.path.insert(0, str(REPO / "examples"))
from digits import DigitsClassifier, digits_datasets  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "world_size_job.py"
# 1437 training digits: 45 steps per epoch on 1 process, 23 on 2 (batches of 32 each).
STEPS = {1: 45, 2: 23}
MARGIN = 0.03  # accuracy points a resumed run may lose against the uninterrupted one


def start(devices: int, out, *args, strategy: str = "ddp"):
    out.mkdir(exist_ok=True)
    return start_hookloop_run(["--plugins", strategy, "--devices", devices, SCRIPT, out, *args], out)


def finish(proc, timeout: float = 120) -> str:
    return finish_job(proc, timeout)[0]


def last_of(out):
    return out / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"


def result(out) -> dict:
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both first halves side by side, then both resumes side by side."""
    root = tmp_path_factory.mktemp("world_size")
    started = time.monotonic()
    first = {2: start(2, root / "two", "--epochs", "3"), 1: start(1, root / "one", "--epochs", "3")}
    finish(first[2]), finish(first[1])
    resumed = {
        "2->1": start(1, root / "two_to_one", "--epochs", "6", "--ckpt", str(last_of(root / "two"))),
        "1->2": start(2, root / "one_to_two", "--epochs", "6", "--ckpt", str(last_of(root / "one"))),
    }
    outputs = {name: finish(proc) for name, proc in resumed.items()}
    print(f"four jobs: {time.monotonic() - started:.1f}s")
    return root, outputs


@pytest.fixture(scope="module")
def uninterrupted():
    """The validation accuracy of 6 epochs on one process, never stopped."""
    hookloop.seed_everything(0)
    train, val = digits_datasets()
    module = DigitsClassifier()
    trainer = hookloop.Trainer(max_epochs=6, num_sanity_val_steps=0, enable_checkpointing=False,
                               enable_progress_bar=False, logger=False)
    trainer.fit(module, DataLoader(train, batch_size=32, shuffle=True))
    with torch.no_grad():
        x, y = val.tensors
        return float((module(x).argmax(-1) == y).float().mean())


@pytest.mark.slow
def test_the_checkpoint_records_what_its_position_means(runs):
    root, _ = runs
    loop = ckpt.safe_load(last_of(root / "two"))["loop"]
    assert (loop["world_size"], loop["batch_size"], loop["accumulate_grad_batches"]) == (2, 32, 1)
    assert loop["epoch_batches"] == STEPS[2] and loop["stage"] == "epoch_end"


@pytest.mark.slow
@pytest.mark.parametrize("change, out, old, new", [("2->1", "two_to_one", 2, 1), ("1->2", "one_to_two", 1, 2)])
def test_training_continues_on_the_new_world_size_to_the_expected_accuracy(runs, uninterrupted, change, out,
                                                                           old, new):
    root, outputs = runs
    done = result(root / out)
    # 3 epochs of the old world size's steps, then 3 of the new one's: nothing trained twice.
    assert done["epoch"] == 6 and done["global_step"] == 3 * STEPS[old] + 3 * STEPS[new]
    assert uninterrupted > 0.93  # the reference itself learned the digits
    assert done["val_acc"] >= uninterrupted - MARGIN, (done["val_acc"], uninterrupted)
    # One line, from global rank 0 only, saying how the effective batch size changed.
    lines = [line for line in outputs[change].splitlines() if "resuming a checkpoint of" in line]
    plural = {1: "1 process", 2: "2 processes"}
    assert lines == [
        f"hookloop: resuming a checkpoint of {old} processes on {new}: effective batch size "
        f"{32 * old} (32 per device x {plural[old]} x 1 accumulated batch) -> "
        f"{32 * new} (32 per device x {plural[new]} x 1 accumulated batch); the checkpoint is at the end of "
        f"epoch 2, so the position carries over as it is"
    ]


@pytest.mark.slow
def test_a_checkpoint_without_a_world_size_resumes_as_before(runs, tmp_path, capsys):
    """Checkpoints written before the world size was saved: taken as this world size's."""
    root, _ = runs
    checkpoint = ckpt.safe_load(last_of(root / "two"))
    for key in ("world_size", "batch_size", "accumulate_grad_batches", "epoch_batches"):
        del checkpoint["loop"][key]
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    hookloop.seed_everything(0)
    train, _ = digits_datasets()
    trainer = hookloop.Trainer(max_epochs=4, num_sanity_val_steps=0, enable_checkpointing=False,
                               enable_progress_bar=False, logger=False, default_root_dir=str(tmp_path))
    trainer.fit(DigitsClassifier(), DataLoader(train, batch_size=32, shuffle=True), ckpt_path=str(old))
    assert trainer.global_step == 3 * STEPS[2] + STEPS[1]
    assert "resuming a checkpoint of" not in capsys.readouterr().out


@pytest.fixture(scope="module")
def zero2_of_two(tmp_path_factory):
    """One epoch of ZeRO-2 on 2 processes: its last.ckpt (a DeepSpeed directory)."""
    pytest.importorskip("hookloop_deepspeed")
    root = tmp_path_factory.mktemp("zero2")
    finish(start(2, root / "two", "--epochs", "1", strategy="deepspeed_stage_2"))
    return last_of(root / "two")


@pytest.mark.slow
def test_a_zero_checkpoint_of_sgd_on_another_world_size_is_refused_naming_why(zero2_of_two, tmp_path):
    """A ZeRO checkpoint of another world size resumes through DeepSpeed's universal
    conversion (tests/test_deepspeed_universal.py), which carries Adam's moments only: the
    digits' SGD momentum cannot be re-partitioned, so hookloop refuses before the engine
    loads (or converts) anything, says why, and how to carry the weights over."""
    checkpoint = zero2_of_two
    proc = start(1, tmp_path / "one", "--epochs", "2", "--ckpt", str(checkpoint), strategy="deepspeed_stage_2")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert (f"CheckpointError: {str(checkpoint)!r} is a ZeRO-2 checkpoint of 2 processes and this run has 1: "
            f"DeepSpeed's universal checkpoint converter (ds_to_universal) carries Adam's optimizer state only "
            f"(exp_avg and exp_avg_sq: torch's Adam and AdamW, DeepSpeedCPUAdam; this one holds momentum_buffer), "
            f"so the optimizer state cannot be re-partitioned. Resume it on 2 processes (--devices 2), or start "
            f"from its weights here: `hookloop deepspeed collate {checkpoint} OUT.pt`") in stdout + stderr
    assert not (tmp_path / "one" / "result.json").exists()
    assert not any(p.name.startswith((".universal", "universal")) for p in checkpoint.rglob("*"))


@pytest.mark.slow
def test_a_zero_checkpoint_missing_an_optimizer_shard_names_it_and_its_world_size(zero2_of_two, tmp_path):
    """Rank 1's optimizer shard lost: before, resuming on the 2 processes it was written
    with was refused as "a ZeRO-2 checkpoint of 1 processes ... resume it on 1 process"
    (which then failed too). Now the missing file and the world size are named, by the
    resume and by ``hookloop deepspeed collate`` (which reads nothing before)."""
    from hookloop_deepspeed.cli import collate

    broken = tmp_path / "copied" / "last.ckpt"
    shutil.copytree(zero2_of_two, broken)
    tag = broken / (broken / "latest").read_text().strip()
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    expected = (f"{str(broken)!r} is a ZeRO-2 checkpoint written by 2 processes, and its tag {tag.name!r} lacks "
                f"zero_pp_rank_1_mp_rank_00_optim_states.pt: every process writes its own shard, so the checkpoint "
                f"is incomplete (a file lost in a copy, or a save that did not finish) and no number of processes "
                f"can resume it. Resume from an earlier checkpoint (last.prev.ckpt is the one before last.ckpt)")
    with pytest.raises(hookloop.CheckpointError) as raised:
        collate(broken, tmp_path / "out.pt")
    assert str(raised.value) == expected
    proc = start(2, tmp_path / "two", "--epochs", "2", "--ckpt", str(broken), strategy="deepspeed_stage_2")
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert f"CheckpointError: {expected}" in stdout + stderr, stdout + stderr
    assert "checkpoint of 1 processes" not in stdout + stderr


@pytest.mark.slow
def test_a_deepspeed_resume_works_under_torch_force_no_weights_only_load(zero2_of_two, tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (a common torch >= 2.6 workaround) beside the
    TORCH_FORCE_WEIGHTS_ONLY_LOAD that hookloop sets while DeepSpeed reads its shards made
    every torch.load raise ("Only one of ... should be set"): the resume failed as
    "neither checkpoint can be loaded". Now it resumes, and the loads stay weights-only."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    finish(start(2, tmp_path / "two", "--epochs", "2", "--ckpt", str(zero2_of_two), strategy="deepspeed_stage_2"))
    done = result(tmp_path / "two")
    assert done["epoch"] == 2 and done["global_step"] == 2 * STEPS[2]


@pytest.mark.slow
def test_a_mid_epoch_position_is_converted_by_samples_seen(tmp_path, uninterrupted):
    """Stopped after 10 of epoch 2's 23 two-process batches (640 samples), resumed on one
    process: it goes on at batch 20 of that epoch's 45, so the epoch trains 25 more steps."""
    stopped = 2 * STEPS[2] + 10
    finish(start(2, tmp_path / "two", "--epochs", "6", "--steps", str(stopped)))
    out = finish(start(1, tmp_path / "one", "--epochs", "6", "--ckpt", str(last_of(tmp_path / "two"))))
    assert ("the mid-epoch position (10 batches per process = 640 samples of epoch 2) becomes 20 batches "
            "per process") in out
    done = result(tmp_path / "one")
    assert done["epoch"] == 6 and done["global_step"] == stopped + (STEPS[1] - 20) + 3 * STEPS[1]
    assert done["val_acc"] >= uninterrupted - MARGIN, (done["val_acc"], uninterrupted)
