"""hookloop-fairscale's ddp_sharded (OSS + ShardedDataParallel), on 2 gloo processes.

One launch of tests/scripts/fairscale_sharded_battery.py runs every multi-process check
(ddp_sharded and the ddp runs it is held to, in the same workers); the tests compare its
records with ddp, with a greedy partition worked out here by hand, and with one-process
runs made here from its checkpoint. ddp_sharded_spawn spawns from this process.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, max_abs_diff, tiny_data

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from ddp_reference import concatenated_batches_run  # noqa: E402
from fairscale_sharded_battery import DATA, Net  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "fairscale_sharded_battery.py"
PARTITION_LINE = ("hookloop-fairscale: optimizer state sharded by whole parameters over 2 ranks, elements "
                  "per rank (x total/2 = 97.5): rank 0 128 (1.31 x), rank 1 67 (0.69 x)")


@pytest.fixture(scope="module")
def battery(jobs):
    run = jobs.run("ddp_sharded")  # tests/jobs.py
    return run.ranks(SCRIPT.name), run.stdout(SCRIPT.name), run.dir(SCRIPT.name)


def greedy_partition(sizes: list[int], world: int) -> list[int]:
    """OSS's rule, by hand: each parameter, in order, to the rank holding the fewest elements."""
    held = [0] * world
    for size in sizes:
        held[held.index(min(held))] += size
    return held


@pytest.mark.check
def test_weights_equal_ddp_with_sgd_adam_accumulation_clipping_and_schedulers(battery):
    ranks, _, _ = battery
    for record in ranks:
        assert len(record["parity"]) == 4
        for (optimizer, accumulate, clip), runs in record["parity"].items():
            ddp, sharded = runs["ddp"], runs["ddp_sharded"]
            assert sharded["seen"]["optimizer_type"] == "ShardedOptimizer"
            assert sharded["seen"]["model_type"] == "ShardedDataParallel"
            assert sharded["global_step"] == ddp["global_step"] == (8 if accumulate == 1 else 4)
            assert max_abs_diff(sharded["state"], ddp["state"]) <= 1e-6, (optimizer, accumulate, clip)
            # The StepLR built on the user's SGD drives OSS's groups: 0.1 halved twice.
            assert sharded["seen"]["lr"] == ddp["seen"]["lr"] == (0.025 if optimizer == "sgd" else 0.01)
            if clip:  # clipping was active: ddp saw larger norms than the threshold
                assert max(ddp["seen"]["norms"]) > 2 * clip
    # Both ranks hold the same weights (OSS broadcasts each shard after its step).
    for key in ranks[0]["parity"]:
        assert max_abs_diff(ranks[0]["parity"][key]["ddp_sharded"]["state"],
                            ranks[1]["parity"][key]["ddp_sharded"]["state"]) == 0.0


@pytest.mark.check
def test_each_rank_holds_its_partition_of_the_optimizer_state(battery):
    ranks, stdout, _ = battery
    sizes = [p.numel() for p in Net().parameters()]  # 128, 16, 48, 3
    expected = greedy_partition(sizes, 2)
    assert expected == [128, 67]
    for optimizer, bytes_per_element in (("sgd", 4), ("adam", 8)):  # momentum; exp_avg + exp_avg_sq
        runs = [record["parity"][(optimizer, 1, None)] for record in ranks]
        total = runs[0]["ddp"]["seen"]["state_bytes"]
        assert total == bytes_per_element * sum(sizes)
        measured = [run["ddp_sharded"]["seen"]["state_bytes"] for run in runs]
        assert measured == [bytes_per_element * n for n in expected]
        assert sum(measured) == total  # nothing kept twice, nothing lost
        for rank, run in enumerate(runs):
            assert run["ddp_sharded"]["seen"]["partition"] == expected
            assert run["ddp_sharded"]["seen"]["inner_params"] == expected[rank]
        # OSS moves whole parameters: the 128-element weight cannot be split, so rank 0
        # holds 1.31 x total/2 and rank 1 0.69 x.
        ratios = [m / (total / 2) for m in measured]
        assert ratios == pytest.approx([128 / 97.5, 67 / 97.5])
    assert PARTITION_LINE in stdout  # what rank 0 prints when a ddp_sharded fit builds OSS


@pytest.mark.check
def test_sync_dist_metrics_and_validate(battery):
    ranks, _, _ = battery
    for record in ranks:
        metrics = record["parity"][("sgd", 1, None)]["ddp_sharded"]["seen"]["metrics"]
        assert metrics["rank_mean"] == pytest.approx(1.5)  # (1 + 2) / 2, the same on every rank
        assert record["validate"][0]["rank_mean"] == pytest.approx(1.5)
    assert ranks[0]["validate"][0]["val_loss"] == pytest.approx(ranks[1]["validate"][0]["val_loss"])


@pytest.mark.check
def test_bf16_composes_and_fp16_uses_the_sharded_grad_scaler(battery):
    ranks, stdout, _ = battery
    assert "the loss scaler is fairscale's ShardedGradScaler" in stdout
    for record in ranks:
        assert max_abs_diff(record["bf16"]["ddp"], record["bf16"]["ddp_sharded"]) <= 1e-6
        fp16 = record["fp16"]
        assert fp16["ddp"]["scaler"] == "GradScaler" and fp16["ddp_sharded"]["scaler"] == "ShardedGradScaler"
        # The inf reached only the owner of net.2.bias (rank 1): both ranks skipped that
        # step and lowered the scale, as ddp (whose all-reduce spreads the inf) does.
        assert fp16["ddp_sharded"]["skipped"] == fp16["ddp"]["skipped"] == 1
        assert fp16["ddp_sharded"]["scale"] == fp16["ddp"]["scale"] == 2.0**9
        assert max_abs_diff(fp16["ddp_sharded"]["state"], fp16["ddp"]["state"]) <= 1e-6
    assert max_abs_diff(ranks[0]["fp16"]["ddp_sharded"]["state"], ranks[1]["fp16"]["ddp_sharded"]["state"]) == 0.0


@pytest.mark.check
def test_activation_checkpointing_composes_with_ddp_sharded(battery):
    ranks, _, _ = battery
    for record in ranks:
        assert max_abs_diff(record["checkpointed"], record["not_checkpointed"]) <= 1e-6


@pytest.mark.check
def test_checkpoint_holds_the_consolidated_state_in_the_plain_format(battery):
    ranks, _, out = battery
    checkpoint = torch.load(ranks[0]["last_ckpt"], weights_only=True)
    assert not any(k.startswith("module.") for k in checkpoint["state_dict"])
    assert max_abs_diff(checkpoint["state_dict"], ranks[0]["one_epoch_state"]) == 0.0
    saved = checkpoint["optimizer_states"][0]
    reference = ranks[0]["ddp_one_epoch_optimizer"]  # a plain Adam after the same epoch under ddp
    assert sorted(saved["state"]) == sorted(reference["state"]) == [0, 1, 2, 3]
    for index, state in reference["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(saved["state"][index][key], state[key], atol=1e-6, rtol=0), (index, key)
    plain = Net(optimizer="adam")
    optimizer = plain.configure_optimizers()
    optimizer.load_state_dict(saved)  # a plain torch optimizer takes it as it is
    plain.load_state_dict(checkpoint["state_dict"])
    # trainer.save_checkpoint after fit (the process group is gone): rank 0 wrote it whole.
    after = torch.load(out / "after_fit.ckpt", weights_only=True)
    assert sorted(after["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    for index, state in saved["state"].items():
        assert torch.equal(after["optimizer_states"][0]["state"][index]["exp_avg"], state["exp_avg"])


@pytest.mark.check
def test_checkpoint_resumes_under_ddp_and_ddp_sharded_like_an_uninterrupted_run(battery):
    ranks, _, _ = battery
    for record in ranks:
        assert max_abs_diff(record["resumed_ddp"], record["straight"]) <= 1e-6
        assert max_abs_diff(record["resumed_ddp_sharded"], record["straight"]) <= 1e-6


@pytest.mark.check
@pytest.mark.parametrize("plugins", [[], ["ddp_sharded"]], ids=["one-process", "ddp_sharded-one-process"])
def test_checkpoint_resumes_in_one_process_like_the_uninterrupted_two_process_run(battery, plugins):
    ranks, _, _ = battery
    # 2 ranks x 8 unshuffled samples per step are, together, one process's batches of 16.
    trainer = hookloop.Trainer(plugins=plugins, max_epochs=2, enable_checkpointing=False, num_sanity_val_steps=0)
    module = Net(seed=5, optimizer="adam")  # other weights: the checkpoint's must be loaded
    trainer.fit(module, DataLoader(DATA, batch_size=16), ckpt_path=ranks[0]["last_ckpt"])
    assert trainer.global_step == 8
    assert max_abs_diff(dict(module.state_dict()), ranks[0]["straight"]) <= 1e-5


@pytest.mark.slow
def test_ddp_sharded_spawn_trains_like_one_process_on_the_concatenated_batches():
    module = Net(seed=0)
    trainer = hookloop.Trainer(plugins=["ddp_sharded_spawn"], devices=2, max_epochs=2, enable_checkpointing=False,
                               num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(tiny_data(96), batch_size=8, shuffle=True))
    assert trainer.global_step == 12
    reference = concatenated_batches_run(tiny_data(96), epochs=2, batch=8)  # TinyModule: the same net and SGD
    assert max_abs_diff(dict(module.state_dict()), reference) <= 1e-5


# -- bad input: each a clear error, raised before anything runs --------------------------------


def test_ddp_sharded_with_another_strategy_is_refused_naming_both():
    with pytest.raises(hookloop.PluginConflictError) as info:
        hookloop.Trainer(plugins=["ddp_sharded", "ddp"])
    assert "'ddp_sharded'" in str(info.value) and "'ddp'" in str(info.value)


def test_fairscale_not_installed_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "fairscale", None)  # what a missing package looks like to import
    for name in ("ddp_sharded", "ddp_sharded_spawn", "pipe", "activation_checkpointing"):
        with pytest.raises(hookloop.MissingDependencyError) as info:
            hookloop.Trainer(plugins=[name])
        assert "pip install 'fairscale==0.4.13'" in str(info.value), name


def test_ddp_options_that_sharding_does_not_use_are_refused():
    with pytest.raises(hookloop.ConfigurationError, match=r"no option 'comm_hook' \(an option of its base class DDP that"):
        hookloop.Trainer(plugins=["ddp_sharded"], plugin_options={"ddp_sharded": {"comm_hook": "fp16"}})
    with pytest.raises(hookloop.ConfigurationError, match="reduce_buffer_size"):
        hookloop.plugin("ddp_sharded", reduce_buffer_size=-1)


class ManualNet(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        self.manual_backward(super().training_step(batch, batch_idx))


class SyncBNNet(Net):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.SyncBatchNorm(16), nn.Linear(16, 3))


@pytest.mark.parametrize("module, message", [
    (ManualNet, "does not support manual optimization"),
    (SyncBNNet, r"SyncBatchNorm layers \(net.1\).*CUDA only"),
])
def test_what_sharding_cannot_run_is_refused_at_start(module, message):
    trainer = hookloop.Trainer(plugins=["ddp_sharded"], max_epochs=1, enable_checkpointing=False)
    with pytest.raises(hookloop.ConfigurationError, match=message):
        trainer.fit(module(), DataLoader(DATA, batch_size=8))
