"""Issue 19, item 2: every rank resumes with its own random generators, and the checkpoint
observer's "saved at this step" marker survives a resume.

End to end (tests/scripts/rank_state_job.py, ``hookloop run --max-restarts 2``, gloo): two
ddp workers with per-rank seeds (different dropout masks, Python and NumPy draws),
``accumulate_grad_batches=2`` and ``ModelCheckpoint(every_n_train_steps=2)``; rank 1 is
SIGKILLed and the agent restarts both. The reference is the same job uninterrupted.
"""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import pytest
import torch

import hookloop
from hookloop.resume import checkpoint as ckpt
from conftest import REPO, finish_job, start_hookloop_run

SCRIPT = REPO / "tests" / "scripts" / "rank_state_job.py"


def start_job(out, *args, strategy: str = "ddp"):
    out.mkdir()
    return start_hookloop_run(["--plugins", strategy, "--devices", "2", "--max-restarts", "2", SCRIPT, out, *args], out)


def draws(out, rank: int, attempt: int) -> dict[tuple[int, int], str]:
    """(epoch, batch_idx) -> the three draws that rank made at that batch's start."""
    path = out / f"draws.rank{rank}.attempt{attempt}"
    if not path.exists():
        return {}
    rows = [line.split(" ", 2) for line in path.read_text().splitlines()]
    return {(int(e), int(b)): d for e, b, d in rows}


def max_difference(out, reference) -> float:
    resumed = torch.load(out / "weights.pt")
    assert resumed.keys() == reference.keys()
    return max(float((resumed[k] - reference[k]).abs().max()) for k in reference)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The uninterrupted job, one killed once (at the start of epoch 0's batch 5, inside
    step 3's accumulation window: resumed from step 2's checkpoint, after batch 3) and one
    killed there twice (the second time after the resume trained batch 4), side by side."""
    root = tmp_path_factory.mktemp("rank_state")
    procs = {
        "straight": start_job(root / "straight"),
        "killed": start_job(root / "killed", "--kill-at-batch", "5"),
        "twice": start_job(root / "twice", "--kill-at-batch", "5", "--kills", "2"),
    }
    outputs = {name: finish_job(proc, 240)[0] for name, proc in procs.items()}
    return root, outputs


@pytest.mark.slow
def test_the_ranks_draw_different_numbers(jobs):
    root, _ = jobs
    rank0, rank1 = draws(root / "straight", 0, 0), draws(root / "straight", 1, 0)
    assert len(rank0) == len(rank1) == 12  # 2 epochs of 6 batches
    assert all(rank0[k] != rank1[k] for k in rank0)


@pytest.mark.slow
def test_a_killed_ddp_run_with_per_rank_randomness_resumes_bit_identical(jobs):
    root, outputs = jobs
    straight, killed = root / "straight", root / "killed"
    reference = torch.load(straight / "weights.pt")
    difference = max_difference(killed, reference)
    assert difference == 0.0, f"resumed weights differ from the uninterrupted run's by up to {difference}"
    assert "at epoch 0, global step 2" in outputs["killed"] and outputs["killed"].count("resumed from") == 1
    for rank in (0, 1):
        resumed = draws(killed, rank, 1)
        # Resumed after step 2 (4 batches of epoch 0): each rank draws what it drew then.
        assert min(resumed) == (0, 4)
        assert resumed == {k: v for k, v in draws(straight, rank, 0).items() if k >= (0, 4)}, f"rank {rank}"


@pytest.mark.slow
def test_the_checkpoint_holds_every_ranks_rng_state_loadable_weights_only(jobs):
    root, _ = jobs
    last = root / "straight" / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint = hookloop.safe_load(last)  # weights_only=True
    per_rank = checkpoint["rng_per_rank"]
    assert len(per_rank) == 2
    assert not torch.equal(per_rank[0]["rng"]["torch"], per_rank[1]["rng"]["torch"])
    assert torch.equal(per_rank[0]["rng"]["torch"], checkpoint["rng"]["torch"])  # rank 0's, for older readers


@pytest.mark.slow
def test_a_second_kill_inside_the_accumulation_window_after_a_resume_loses_nothing(jobs):
    """Before the fix, the first micro-batch after the resume saved last.ckpt again
    (global step 2 still), in the middle of the window; the second kill then resumed
    from there without that micro-batch's gradient."""
    root, outputs = jobs
    twice, straight = root / "twice", root / "straight"
    difference = max_difference(twice, torch.load(straight / "weights.pt"))
    assert difference == 0.0, f"resumed weights differ from the uninterrupted run's by up to {difference}"
    assert outputs["twice"].count("at epoch 0, global step 2") == 2
    # Attempt 1 trained batch 4 and died at batch 5's start; attempt 2 starts at batch 4 again.
    assert sorted(draws(twice, 1, 1)) == [(0, 4), (0, 5)]
    assert min(draws(twice, 0, 2)) == min(draws(twice, 1, 2)) == (0, 4)
    last = twice / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert hookloop.safe_load(last)["plugins"]["checkpoint"]["last_global_step_saved"] == 6


# The sharded strategies write the loop state through the same checkpoint_dict (fsdp's
# single file or hookloop.pt, DeepSpeed's client state): the same kill resumes exactly.
@pytest.mark.full  # long matrix
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_2"])
def test_sharded_strategies_resume_each_ranks_rng_state(tmp_path, strategy):
    pytest.importorskip(f"hookloop_{strategy.split('_')[0]}")
    straight = start_job(tmp_path / "straight", strategy=strategy)
    killed = start_job(tmp_path / "killed", "--kill-at-batch", "5", strategy=strategy)
    finish_job(straight, 300), finish_job(killed, 300)
    for rank in (0, 1):
        resumed = draws(tmp_path / "killed", rank, 1)
        assert resumed == {k: v for k, v in draws(tmp_path / "straight", rank, 0).items() if k >= (0, 4)}
    assert max_difference(tmp_path / "killed", torch.load(tmp_path / "straight" / "weights.pt")) == 0.0


# ---------------------------------------------------------------------------------------
# In one process: what a rank takes from a checkpoint of another world size
# ---------------------------------------------------------------------------------------


def test_a_rank_the_checkpoint_has_no_state_of_draws_its_own_deterministic_stream():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    base = ckpt.rng_state()

    def stream(rank: int) -> tuple:
        ckpt.set_rng_state(base)
        ckpt.derive_rng_state(base, rank)
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    assert stream(2) == stream(2)  # deterministic
    assert stream(2) != stream(3)
    ckpt.set_rng_state(base)
    assert stream(2)[0] != torch.rand(3).tolist()  # not the stream it was derived from


def test_a_checkpoint_with_cuda_device_states_loads_on_the_cpu(tmp_path):
    """A rank's section keeps its own CUDA devices' generators by index (``rank_cuda_devices``:
    none on the CPU); a machine without CUDA, or without that index, skips them."""
    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(tmp_path))
    assert ckpt.rank_cuda_devices(trainer) == []
    state = ckpt.rng_state(cuda_devices=[])
    assert "cuda" not in state
    state["cuda_devices"] = {7: torch.zeros(16, dtype=torch.uint8)}
    hookloop.atomic_save({"rng": state}, tmp_path / "rng.ckpt")
    loaded = hookloop.safe_load(tmp_path / "rng.ckpt")["rng"]  # weights_only=True
    ckpt.set_rng_state(loaded)
    first = torch.rand(4)
    ckpt.set_rng_state(loaded)
    assert torch.equal(torch.rand(4), first)


def rank_view(tmp_path, rank: int, world: int) -> hookloop.Trainer:
    """A trainer as global rank ``rank`` of ``world`` sees itself when it restores."""
    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(tmp_path))
    trainer.global_rank, trainer.world_size = rank, world
    return trainer


def test_a_checkpoint_of_fewer_processes_gives_the_extra_ranks_derived_streams_with_one_warning(tmp_path):
    from hookloop.resume import run as loops

    state = ckpt.rng_state()
    one = {"rng": state, "epoch_rng": None, "loop": {"world_size": 1}}
    with pytest.warns(UserWarning, match=r"holds the RNG states of 1 process, resumed on 2: the generators of "
                                         r"rank 1 are seeded anew from the state of rank \(r mod 1\)"):
        assert loops._rank_rng(rank_view(tmp_path, 0, 2), one, one["loop"]) == (state, None, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rank 1 says nothing: rank 0 warned
        rng, _, derive = loops._rank_rng(rank_view(tmp_path, 1, 2), one, one["loop"])
    assert rng is state and derive
    # An older checkpoint of 2 processes (global rank 0's state only): the same, said so.
    legacy = {"rng": state, "epoch_rng": None, "loop": {"world_size": 2}}
    with pytest.warns(UserWarning, match="written before checkpoints held every rank's RNG state"):
        loops._rank_rng(rank_view(tmp_path, 0, 2), legacy, legacy["loop"])
    # Same world size: each rank its own entry, nothing said.
    other = ckpt.rng_state(cuda_devices=[])
    two = {"rng": state, "rng_per_rank": [{"rng": state, "epoch_rng": None}, {"rng": other, "epoch_rng": None}],
           "loop": {"world_size": 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loops._rank_rng(rank_view(tmp_path, 1, 2), two, two["loop"])[0] is other
    # Fewer processes than entries: rank r takes entry r, the rest are not used.
    with pytest.warns(UserWarning, match=r"holds the RNG states of 2 processes, resumed on 1: each rank takes its "
                                         r"own; the states of rank 1 are not used"):
        assert loops._rank_rng(rank_view(tmp_path, 0, 1), two, two["loop"])[0] is state
