"""Atomic sharded checkpoints (issue 19, item 4): a kill anywhere inside the save of a
checkpoint *directory* (DeepSpeed, FSDP's DCP) leaves one that the restart resumes from.

* ``last.ckpt`` as a directory is installed complete under a temporary name, the one it
  replaces kept as ``last.prev.ckpt`` (``hookloop.atomic_copy_tree``): a kill between the
  two renames resumes from ``last.prev.ckpt``, not from scratch.
* DeepSpeed's ``latest`` is written by hookloop, atomically, after every rank's shards
  (``hookloop.TaggedCheckpointDir``): a rank killed in the middle of its shard leaves the
  previous tag committed, and the restart resumes from it with a warning.
* Loading falls back to the newest complete tag when ``latest`` names an incomplete one
  (DeepSpeed's own ``latest``, written by rank 0 before the other ranks' shards).

The faults are injected by the job script (tests/scripts/sharded_kill_job.py) wrapping
``os.rename``/``torch.save`` in its own process; the reference is the same job, never
interrupted (its final weights, bit for bit).
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

import hookloop
from conftest import REPO, finish_job, start_hookloop_run

SCRIPT = REPO / "tests" / "scripts" / "sharded_kill_job.py"
COMPLETE_MARKER = ".hookloop-complete"  # documented: the file that marks a tag complete
JOBS = {"straight": [], "last_rename": ["--fault", "last-rename"],
        "shard_write": ["--fault", "shard-write", "--save-top-k", "0"],
        "async_shard_write": ["--async-save", "--fault", "shard-write", "--save-top-k", "0"]}


def steps(out, rank: int, attempt: int) -> list[int]:
    path = out / f"steps.rank{rank}.attempt{attempt}"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


#: The four DeepSpeed jobs behind ``jobs`` (8 processes, ~75 s on 2 cores) run in ``make
#: test-full``; the DCP kill and the unit tests of the tag directory run in ``make test``.
JOBS_FULL = pytest.mark.full  # four 2-process DeepSpeed jobs


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The three deepspeed (ZeRO-2, 2 processes, gloo) jobs, run at once: (out dir,
    stdout, stderr) by name."""
    pytest.importorskip("hookloop_deepspeed")
    root = tmp_path_factory.mktemp("sharded_jobs")
    started = {}
    for name, args in JOBS.items():
        out = root / name
        out.mkdir()
        started[name] = (out, start_hookloop_run(
            ["--plugins", "deepspeed_stage_2", "--devices", "2", "--max-restarts", "1", SCRIPT, out, *args], out))
    return {name: (out, *finish_job(proc, timeout=400)) for name, (out, proc) in started.items()}


def same_weights(out, reference) -> None:
    resumed, expected = torch.load(out / "weights.pt"), torch.load(reference / "weights.pt")
    assert resumed.keys() == expected.keys()
    differing = {k: float((resumed[k] - expected[k]).abs().max()) for k in expected if not torch.equal(resumed[k], expected[k])}
    assert not differing, f"max abs difference per tensor: {differing}"


@JOBS_FULL
def test_a_kill_between_the_renames_of_last_ckpt_resumes_from_last_prev_ckpt(jobs):
    out, stdout, stderr = jobs["last_rename"]
    assert (out / "killed_at_rename").exists()  # the kill happened where meant: installing step 4's last.ckpt
    assert steps(out, 0, 0) == [1, 2, 3, 4]
    checkpoints = out / "root" / "logs" / "version_0" / "checkpoints"
    # Not "no last.ckpt ... starting from scratch": the previous one, of step 2.
    assert "starting from scratch" not in stdout
    assert (f"resumed from {checkpoints / 'last.prev.ckpt'} at epoch 0, global step 2") in stdout
    assert "resuming from the previous checkpoint" in stderr
    assert steps(out, 0, 1) == steps(out, 1, 1) == [3, 4, 5, 6, 7, 8]
    same_weights(out, jobs["straight"][0])
    # The run went on saving: a whole last.ckpt and its previous, no temporary left behind.
    assert (checkpoints / "last.ckpt").is_dir() and (checkpoints / "last.prev.ckpt").is_dir()
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]


def resumed_from_global_step2(job, straight):
    """A deepspeed job whose rank 1 was killed inside its shard of step 4 (rank 0 done,
    at the barrier after): the restart loaded the committed step-2 tag, with the warning,
    redid steps 3-8 and ended bit-identical to ``straight``. Its ``last.ckpt``."""
    out, stdout, stderr = job
    assert (out / "killed_in_shard").exists() and (out / "rank0_at_barrier").exists()
    assert steps(out, 1, 0) == [1, 2, 3, 4]
    last = out / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"resumed from {last} at epoch 0, global step 2" in stdout
    assert "a save was interrupted, leaving global_step4 incomplete; loading the committed tag 'global_step2'" in stderr
    assert steps(out, 0, 1) == steps(out, 1, 1) == [3, 4, 5, 6, 7, 8]
    same_weights(out, straight[0])
    return last


@JOBS_FULL
def test_a_rank_killed_inside_its_deepspeed_shard_resumes_from_the_previous_tag(jobs):
    last = resumed_from_global_step2(jobs["shard_write"], jobs["straight"])
    # The later saves pruned the interrupted tag: one complete tag, the one latest names.
    tags = [p.name for p in last.iterdir() if p.is_dir()]
    assert tags == [(last / "latest").read_text().strip()] and (last / tags[0] / COMPLETE_MARKER).is_file()


@JOBS_FULL
def test_saved_asynchronously_a_rank_killed_inside_its_background_shard_write_resumes_from_the_previous_tag(jobs):
    """``async_save=True`` under deepspeed: the engine's shard writes are CPU snapshots
    written by the background writer, the tag committed there after a barrier on a gloo
    group of its own. Rank 1 killed in the middle of its background shard write of step 4
    (rank 0's shards done, waiting at that barrier): ``latest`` still names step 2, and the
    restart ends bit-identical to the synchronous job never interrupted. Before, deepspeed
    warned and saved synchronously."""
    out, _, stderr = jobs["async_shard_write"]
    assert "writes its checkpoints itself and does not declare" not in stderr
    assert "hookloop checkpoint writer" in (out / "killed_in_shard").read_text()  # the background thread
    resumed_from_global_step2(jobs["async_shard_write"], jobs["straight"])


@JOBS_FULL
def test_the_uninterrupted_job_keeps_last_and_prev_as_complete_tags(jobs):
    out, stdout, _ = jobs["straight"]
    assert "done: epoch 2, global step 8" in stdout and "resumed from" not in stdout
    checkpoints = out / "root" / "logs" / "version_0" / "checkpoints"
    for name in ("last.ckpt", "last.prev.ckpt"):
        d = hookloop.TaggedCheckpointDir(checkpoints / name, prefix="global_step")
        assert d.is_complete(d.committed().name)


# ---------------------------------------------------------------------------------------
# TaggedCheckpointDir, on files alone
# ---------------------------------------------------------------------------------------


def make_tag(root, name: str, complete: bool = True):
    (root / name).mkdir(parents=True)
    (root / name / "shard.pt").write_bytes(b"x")
    if complete:
        (root / name / COMPLETE_MARKER).write_text(name)


FSDP_SHARDED = ["--plugins", "fsdp", "--plugin-option", "fsdp.state_dict_type=sharded", "--devices", "2",
                "--max-restarts", "1", SCRIPT]


@pytest.mark.slow
def test_a_rank_killed_inside_its_background_dcp_write_resumes_from_the_previous_checkpoint(tmp_path):
    """fsdp's sharded directories saved asynchronously (``async_save=True``: DCP's
    ``async_save``): global rank 1 is SIGKILLed in DCP's background thread as it starts
    writing its shards of step 4, while training went on. The tag of step 4 is never
    committed; the restart resumes from ``last.ckpt`` of step 2 and ends bit-identical to
    the same job never interrupted (saving synchronously)."""
    pytest.importorskip("hookloop_fsdp")
    started = {}
    for name, args in {"straight": [], "killed": ["--async-save", "--fault", "dcp-background-write"]}.items():
        out = tmp_path / name
        out.mkdir()
        started[name] = (out, start_hookloop_run([*FSDP_SHARDED, out, *args], out))
    (straight, _), (killed, proc) = started["straight"], started["killed"]
    finish_job(started["straight"][1], timeout=400)
    stdout, stderr = finish_job(proc, timeout=400)
    assert "MainThread" not in (killed / "killed_in_background_write").read_text()  # the background thread
    first, second = steps(killed, 1, 0), steps(killed, 1, 1)
    assert first[:4] == [1, 2, 3, 4] and second[0] == 3, (first, second)  # resumed at step 2
    same_weights(killed, straight)


def test_latest_naming_an_incomplete_tag_falls_back_to_the_newest_complete_one(tmp_path):
    # DeepSpeed's own writer: rank 0 wrote 'latest' for step 4 before rank 1 finished.
    make_tag(tmp_path, "global_step2")
    make_tag(tmp_path, "global_step4", complete=False)
    (tmp_path / "latest").write_text("global_step4")
    d = hookloop.TaggedCheckpointDir(tmp_path, prefix="global_step")
    with pytest.warns(UserWarning, match="names tag 'global_step4', which is incomplete.*newest complete tag 'global_step2'"):
        assert d.committed() == tmp_path / "global_step2"
    assert d.newest_complete() == "global_step2"


def test_commit_marks_then_points_latest_and_prune_removes_the_rest(tmp_path):
    d = hookloop.TaggedCheckpointDir(tmp_path, prefix="step")
    make_tag(tmp_path, "step2")
    make_tag(tmp_path, "step3", complete=False)  # an interrupted save's
    assert d.new_tag(4) == "step4" and d.new_tag(3) == "step3.1"
    make_tag(tmp_path, "step4", complete=False)
    d.commit("step4")
    assert (tmp_path / "latest").read_text() == "step4\n" and d.is_complete("step4")
    assert d.prune() == ["step2", "step3"] and d.tags() == ["step4"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert d.committed() == tmp_path / "step4"
    # Saves at one step (or a run restarted from an earlier one) never reuse a name, and
    # the newest is the one committed last, whatever its step.
    for expected in ("step4.1", "step4.2"):
        tag = d.new_tag(4)
        assert tag == expected
        make_tag(tmp_path, tag, complete=False)
        d.commit(tag)
        d.prune()
    assert d.tags() == ["step4.2"]
    time.sleep(0.05)  # a later commit than step4.2's, as the file system's clock sees it
    make_tag(tmp_path, "step1", complete=False)
    d.commit("step1")
    assert d.prune(keep=2) == [] and d.tags() == ["step4.2", "step1"] and d.newest_complete() == "step1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # step4.2 is complete: no interrupted save to warn of
        assert d.committed() == tmp_path / "step1"


def test_a_directory_without_any_complete_tag_is_an_error_naming_it(tmp_path):
    make_tag(tmp_path, "step2", complete=False)
    (tmp_path / "latest").write_text("step2")
    d = hookloop.TaggedCheckpointDir(tmp_path, prefix="step", legacy_complete=lambda tag: False)
    with pytest.raises(hookloop.CheckpointError, match="names tag 'step2' as the latest, and it is incomplete"):
        d.committed()
    # A tag of an older hookloop (no markers anywhere) is trusted when the strategy says it is whole.
    assert hookloop.TaggedCheckpointDir(tmp_path, prefix="step").committed() == tmp_path / "step2"


def test_atomic_copy_tree_keeps_the_replaced_directory_as_last_prev(tmp_path):
    for step in (2, 4):
        src = tmp_path / f"epoch=0-step={step}.ckpt"
        make_tag(src, f"step{step}")
        hookloop.atomic_copy_tree(src, tmp_path / "checkpoints" / "last.ckpt")
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "last.prev.ckpt"]
    assert (checkpoints / "last.ckpt" / "step4").is_dir() and (checkpoints / "last.prev.ckpt" / "step2").is_dir()
    # Shards are hard links (no bytes copied); small files (latest, markers) are copies.
    src = tmp_path / "epoch=0-step=6.ckpt"
    make_tag(src, "step6")
    (src / "step6" / "big.pt").write_bytes(b"\0" * (1 << 20))
    (src / "latest").write_text("step6")
    hookloop.atomic_copy_tree(src, checkpoints / "last.ckpt")
    inode = lambda p: p.stat().st_ino  # noqa: E731
    assert inode(checkpoints / "last.ckpt" / "step6" / "big.pt") == inode(src / "step6" / "big.pt")
    assert inode(checkpoints / "last.ckpt" / "latest") != inode(src / "latest")
    assert (checkpoints / "last.prev.ckpt" / "step4").is_dir()
