"""hookloop-ddp under `hookloop run --plugins ddp --devices 2` (2 processes, gloo, CPU).

One run of tests/scripts/ddp_battery.py does every multi-process check (starting
processes is what costs time); each test below reads what the ranks recorded and
compares it with a reference: torch's own DDP loop run in the same workers, a
single-process run on the concatenated batches, or a value worked out by hand.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import DistributedSampler, WeightedRandomSampler

from conftest import REPO, TinyModule, max_abs_diff, tiny_data

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from ddp_reference import concatenated_batches_run  # noqa: E402


pytestmark = pytest.mark.check  # every test reads the shared ddp job (tests/jobs.py): the ddp family's job in make check


@pytest.fixture(scope="module")
def battery(jobs):
    run = jobs.run("ddp")  # tests/jobs.py: ddp_battery.py in the shared ddp job
    return run.ranks("ddp_battery"), run.stdout("ddp_battery"), run.dir("ddp_battery")


def test_parity_with_hand_written_torchrun_loop_and_concatenated_batches(battery):
    ranks, _, _ = battery
    reference = concatenated_batches_run(tiny_data(96), epochs=2, batch=8)
    for record in ranks:
        # Each rank started from its own random weights: DDP broadcast rank 0's.
        assert max_abs_diff(record["hookloop"], record["raw"][None]) <= 1e-6
        assert max_abs_diff(record["hookloop"], reference) <= 1e-5
    assert max_abs_diff(ranks[0]["hookloop"], ranks[1]["hookloop"]) == 0.0


def test_ranks_device_and_wrapper(battery):
    ranks, _, _ = battery
    for r, record in enumerate(ranks):
        assert record["ranks"] == dict(world_size=2, global_rank=r, local_rank=r, node_rank=0,
                                       root_device="cpu", model_type="DistributedDataParallel")
        # After fit the group is gone, and so is the wrapper that needed it.
        assert record["unwrapped_after_fit"] == "_StepModule"


def test_training_sampler_shards_are_disjoint_complete_and_reshuffled_each_epoch(battery):
    ranks, _, _ = battery
    for epoch in (0, 1):
        seen = [record["shuffled"]["train"][epoch] for record in ranks]
        assert not set(seen[0]) & set(seen[1])
        assert sorted(seen[0] + seen[1]) == list(range(20))
        for r in (0, 1):
            expected = DistributedSampler(range(20), num_replicas=2, rank=r, shuffle=True, seed=0)
            expected.set_epoch(epoch)
            assert seen[r] == list(expected)
    assert ranks[0]["shuffled"]["train"][0] != ranks[0]["shuffled"]["train"][1]


def test_validation_sampler_is_sharded_without_shuffling(battery):
    ranks, _, _ = battery
    for r, record in enumerate(ranks):
        shard = list(range(r, 20, 2))
        # the sanity check (num_sanity_val_steps=2 batches of 3), then two epochs
        assert record["shuffled"]["val"] == shard[:6] + shard * 2


def test_user_sampler_is_wrapped_not_replaced(battery):
    ranks, _, _ = battery
    weights = torch.zeros(20)
    weights[::2] = 1.0
    torch.manual_seed(0)  # the wrapper draws the user's sampler with seed + epoch on every rank
    drawn = list(WeightedRandomSampler(weights, 16))
    for r, record in enumerate(ranks):
        assert record["weighted"]["train"][0] == drawn[r::2]
        assert all(i % 2 == 0 for i in record["weighted"]["train"][0])  # the weighting survived


def test_iterable_dataset_and_opt_out_are_left_alone(battery):
    ranks, _, _ = battery
    for record in ranks:
        # each rank reads the whole stream (after the sanity check's 2 batches of 4)
        assert record["weighted"]["val"] == list(range(8)) + list(range(10))
        assert record["opt_out"]["train"][0] == list(range(20))  # use_distributed_sampler=False


def test_sync_dist_reduces_and_every_rank_reports_the_same(battery):
    ranks, _, _ = battery
    m0, m1 = ranks[0]["metrics"], ranks[1]["metrics"]
    # Validation sees 0..19 split 10/10 in 4 batches per rank; rank r logs r + 1.
    expected = {"x_mean": 9.5, "r_mean": 1.5, "r_sum": 4 * 1.0 + 4 * 2.0, "r_max": 2.0, "r_min": 1.0, "step_max": 2.0}
    for name, value in expected.items():
        assert m0[name] == pytest.approx(value, abs=1e-6) and m0[name] == m1[name], name
    assert (m0["x_mean_local"], m1["x_mean_local"]) == (pytest.approx(9.0), pytest.approx(10.0))


def test_collectives_reduce_broadcast_barrier(battery):
    ranks, _, _ = battery
    for record in ranks:
        assert record["reduce"] == {"mean": 1.5, "sum": 3.0, "max": 2.0, "min": 1.0}
        assert record["reduce_int_mean"] == 2.5
        assert record["broadcast"] == "from rank 0"
        assert record["broadcast_src1"] == "from rank 1"
        assert record["broadcast_none"] is None  # rank 0's None, not the local "x"


def test_checkpoint_written_once_without_module_prefix(battery):
    ranks, _, out = battery
    files = sorted(p.name for p in (out / "ckpt" / "logs" / "version_0" / "checkpoints").iterdir())
    # the top-1 and last.ckpt of the checkpoint plugin, no temporary files of a second writer
    assert files == ["epoch=1-step=12.ckpt", "last.ckpt", "last.prev.ckpt"]
    checkpoint = torch.load(out / "ckpt" / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert not any(k.startswith("module.") for k in checkpoint["state_dict"])
    plain = TinyModule()
    plain.load_state_dict(checkpoint["state_dict"])  # strict: a plain nn.Module takes it as is
    assert max_abs_diff(dict(plain.state_dict()), ranks[0]["ckpt_state"]) == 0.0
    for record in ranks:
        assert record["ckpt_read_diff"] == 0.0  # read right after fit: complete and current


def test_resume_under_ddp_equals_uninterrupted_run(battery):
    ranks, _, _ = battery
    for record in ranks:
        assert record["resumed_step"] == 12
        assert max_abs_diff(record["resumed"], record["hookloop"]) <= 1e-6


def test_accumulation_uses_no_sync_and_equals_one_step_on_the_large_batch(battery):
    ranks, stdout, _ = battery
    reference = concatenated_batches_run(tiny_data(32), epochs=1, batch=8, momentum=0.0)
    for record in ranks:
        assert record["accumulate_steps"] == 2
        assert record["accumulate_calls"] == 2  # one all-reduce per step, not per micro-batch
        assert max_abs_diff(record["accumulated"], reference) <= 1e-5
    # Rank 0 alone prints the effective batch size: 4 per device x 2 processes x 2.
    line = "hookloop: effective batch size 16 = 4 per device x 2 processes x 2 accumulated batches"
    assert stdout.count(line) == 1


def test_clipping_is_bitwise_the_hand_written_ddp_loop(battery):
    """Issue 33: nanoGPT's optimizer (two groups) with gradient_clip_val under ddp equals,
    bit for bit, torch's DDP loop calling clip_grad_norm_(model.parameters(), 0.5) after
    the same all-reduce (clipping over the optimizer's groups: 8e-4 off after 16 steps)."""
    ranks, _, _ = battery
    for record in ranks:
        assert record["clipped"].keys() == record["raw_clipped"].keys()
        assert [k for k, v in record["clipped"].items() if not torch.equal(v, record["raw_clipped"][k])] == []


def test_global_batch_size_derives_half_the_accumulation_of_one_process(battery):
    """Issue 33: global_batch_size=16 with batches of 4 on 2 processes accumulates 2 (one
    process: 4, tests/test_global_batch.py); the weights are one process's steps on the
    16 samples the two ranks' windows hold together."""
    ranks, stdout, _ = battery
    reference = concatenated_batches_run(tiny_data(32), epochs=2, batch=8)
    for record in ranks:
        assert record["global_batch"]["accumulate"] == 2 and record["global_batch"]["steps"] == 4
        assert max_abs_diff(record["global_batch"]["state"], reference) <= 1e-6
    line = ("hookloop: effective batch size 16 = 4 per device x 2 data-parallel process(es) x 2 accumulated "
            "batches (global_batch_size=16)")
    assert stdout.count(line) == 1  # rank 0 alone


@pytest.mark.parametrize("hook,tolerance", [("fp16", 1e-2), ("bf16", 5e-2)])
def test_compression_hooks_match_torch_and_stay_close_to_uncompressed(battery, hook, tolerance):
    ranks, _, _ = battery
    for record in ranks:
        assert max_abs_diff(record[hook], record["raw"][hook]) <= 1e-6
        assert 0.0 < max_abs_diff(record[hook], record["hookloop"]) <= tolerance


def test_powersgd_matches_torch_and_its_state_survives_a_checkpoint(battery):
    ranks, _, _ = battery
    for record in ranks:
        assert max_abs_diff(record["powersgd"], record["raw"]["powersgd"]) <= 1e-6
        # Each rank's own error feedback is in the file that rank 0 wrote.
        assert record["powersgd_saved"] == {"hook": "powersgd", "iter": 6, "ranks": 2, "residuals_differ": True}
        assert max_abs_diff(record["powersgd_resumed"], record["powersgd"]) <= 1e-6
        assert max_abs_diff(record["powersgd"], record["hookloop"]) > 1e-4  # it did compress


def test_post_localsgd_matches_torch_with_periodic_model_averaging(battery):
    ranks, _, _ = battery
    for record in ranks:
        assert max_abs_diff(record["post_localsgd"], record["raw"]["post_localsgd"]) <= 1e-6
    # Gradients are not all-reduced after step 4 and the last step was not an averaging
    # step, so the replicas differ: the ranks really trained locally.
    assert max_abs_diff(ranks[0]["post_localsgd"], ranks[1]["post_localsgd"]) > 1e-6


def test_subclass_overrides_process_group_init_and_wrapper(battery):
    ranks, _, _ = battery
    for r, record in enumerate(ranks):
        assert record["subclass_calls"] == [("init", r, 2), ("wrap", "_StepModule")]
        assert record["subclass_forwards"] == 12  # the loop called the subclass's wrapper
        assert max_abs_diff(record["subclass"], record["raw"][None]) <= 1e-6


def test_more_processes_than_devices_is_refused_in_every_worker(battery):
    ranks, _, _ = battery
    for record in ranks:
        # on the CPU a device list is refused before ddp counts processes (issue 32; the
        # list's count on GPUs: test_settings_refused.py)
        assert record["errors"]["[0]"].startswith("devices=[0]: device indices name GPUs, and this run is on the CPU")
        assert "devices=3 asks for 3 processes per node" in record["errors"]["3"]
