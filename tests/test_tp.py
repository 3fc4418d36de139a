"""hookloop-tp under `hookloop run --plugins tp --devices 2` (2 processes, gloo, CPU).

One run of tests/scripts/tp_battery.py trains an MLP block and an attention + MLP block
with SGD (momentum) and Adam, the attention block compiled beside tp, a shuffling loader
(both ranks must see the one-process order), saves a sharded checkpoint mid-run and resumes from it;
each test compares what the ranks recorded with the same model and batches trained by a
hand-written PyTorch loop in this process (tp_models.reference). Bad input is checked
in this process.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import hookloop
from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from tp_models import Attention, Net, data, reference, shuffled_order  # noqa: E402

STEPS = 4


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def battery(jobs):
    run = jobs.run("tp")  # tests/jobs.py: tp_battery.py, then test_tp_sp's script in the same workers
    return run.ranks("tp_battery"), run.stdout("tp_battery") + run.stderr("tp_battery"), run.dir("tp_battery")


@pytest.mark.check
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("attention", [False, True], ids=["mlp", "attention"])
def test_two_process_tensor_parallel_equals_one_process_training(battery, attention, optimizer):
    ranks, _, _ = battery
    expected, grads = reference(attention, optimizer, STEPS)
    for record in ranks:
        run = record[("parity", attention, optimizer)]
        assert max_diff(run["final"], expected) <= 1e-5
        # the last step's gradients, the replicated parameters' (norm, head) included
        assert max_diff(run["grads"], grads) <= 1e-5
    assert max_diff(ranks[0][("parity", attention, optimizer)]["final"],
                    ranks[1][("parity", attention, optimizer)]["final"]) == 0.0


@pytest.mark.check
def test_the_automatic_plan_splits_the_blocks_and_replicates_the_rest(battery):
    ranks, _, _ = battery
    layouts = ranks[0][("parity", True, "sgd")]["layouts"]
    for name in ("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.fc1.weight", "mlp.fc1.bias"):
        assert layouts[name] == ("S(0)",), name  # colwise: output features split
    assert layouts["attn.out.weight"] == layouts["mlp.fc2.weight"] == ("S(1)",)  # rowwise
    assert layouts["mlp.fc2.bias"] == ("R",)
    for name in ("norm.weight", "norm.bias", "head.weight", "head.bias"):
        assert layouts[name] == "plain"


@pytest.mark.check
def test_every_tp_rank_sees_the_same_batches_in_the_users_order(battery):
    ranks, output, _ = battery
    x = data().tensors[0]
    for attention in (False, True):
        seen = [r[("parity", attention, "sgd")]["batches"] for r in ranks]
        assert len(seen[0]) == STEPS
        for i in range(STEPS):
            assert torch.equal(seen[0][i], x[4 * i:4 * (i + 1)])
            assert torch.equal(seen[1][i], seen[0][i])
    # a tp group is one data-parallel replica: the batch is the per-device one (no note)
    assert "effective batch size" not in output
    # a shuffling loader: every rank trains on the order one process draws (issue 33: it
    # was DistributedSampler(1, 0, seed=0)'s, another order)
    expected = shuffled_order(STEPS)
    for record in ranks:
        assert len(record["shuffled"]) == STEPS
        assert all(torch.equal(got, want) for got, want in zip(record["shuffled"], expected))


@pytest.mark.check
def test_tp_with_compile_equals_one_eager_process(battery):
    """``compile`` beside ``tp`` (refused before issue 33: compile's wrap_model ran first):
    the split attention + MLP block compiled in place trains like the eager one-process loop."""
    ranks, _, _ = battery
    expected, grads = reference(True, "adam", STEPS)
    for record in ranks:
        run = record["compiled"]
        assert run["layouts"]["attn.q.weight"] == ("S(0)",)  # split, then compiled
        assert max_diff(run["final"], expected) <= 1e-5
        assert max_diff(run["grads"], grads) <= 1e-5
        assert run["graphs"] >= 1  # Dynamo compiled the module


@pytest.mark.check
def test_the_modules_own_plan_with_loss_parallel_equals_one_process_training(battery):
    ranks, _, _ = battery
    expected, grads = reference(True, "adam", STEPS)
    for record in ranks:
        run = record["planned"]
        assert run["layouts"]["head.weight"] == ("S(0)",)  # the plan's, not the automatic one
        assert run["layouts"]["attn.q.weight"] == "plain"
        assert max_diff(run["final"], expected) <= 1e-5
        assert max_diff(run["grads"], grads) <= 1e-5


@pytest.mark.check
def test_configure_tensor_parallel_gets_the_tp_mesh_and_the_module_is_whole_after_fit(battery):
    ranks, _, out = battery
    expected, _ = reference(False, "sgd", STEPS)
    model = Net()
    model.load_state_dict(expected)
    for rank, record in enumerate(ranks):
        run = record["hooked"]
        assert run["mesh"] == (("tp",), 2)
        assert run["layouts"]["mlp.fc1.weight"] == ("S(0)",) and run["layouts"]["head.weight"] == "plain"
        assert max_diff(run["final"], expected) <= 1e-5
        assert set(run["after_fit"].values()) == {"Parameter"}  # plain tensors again, not DTensors
        with torch.no_grad():  # the plan's hooks are gone: the whole module runs alone
            assert float((record["after_fit_output"] - model(data().tensors[0][:2])).abs().max()) <= 1e-5
    # after fit, trainer.save_checkpoint is the core's single file (rank 0)
    saved = hookloop.safe_load(out / "after_fit0.ckpt")
    assert max_diff(saved["state_dict"], expected) <= 1e-5
    assert [r["after_fit_file"] for r in ranks] == [True, False]


@pytest.mark.check
def test_a_sharded_checkpoint_resumes_under_tp2_like_an_uninterrupted_run(battery):
    ranks, _, _ = battery
    assert {"latest", "step2/model/.metadata", "step2/model/__0_0.distcp", "step2/model/__1_0.distcp",
            "step2/optimizer/.metadata", "step2/hookloop.pt"} <= set(ranks[0]["ckpt_files"])
    expected, _ = reference(True, "adam", STEPS)  # 4 steps without interruption, one process
    for record in ranks:
        assert max_diff(record["resumed"], expected) <= 1e-5


@pytest.mark.check
def test_one_process_loads_the_full_weights_of_a_tp2_checkpoint(battery):
    import torch.distributed.checkpoint as dcp

    _, _, out = battery
    module = Net(attention=True, optimizer="adam", seed=7)
    state = module.state_dict()
    dcp.load(state, checkpoint_id=str(out / "tp.ckpt" / "step2" / "model"))  # no process group
    module.load_state_dict(state)
    expected, _ = reference(True, "adam", 2)  # saved at step 2
    assert max_diff(module.state_dict(), expected) <= 1e-5


# -- the automatic plan and bad input, in this process -------------------------------------


def _styles(plan: dict) -> dict:
    return {k: type(v).__name__ for k, v in plan.items()}


def test_auto_plan_pairs_linears_only_across_elementwise_modules():
    from hookloop_tp import auto_plan

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(), nn.Linear(8, 4),  # a pair
                          nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8),  # a norm between: no pair
                          nn.Linear(8, 5), nn.Linear(6, 3))  # shapes that do not chain: no pair
    assert _styles(auto_plan(model)) == {"0": "ColwiseParallel", "3": "RowwiseParallel",
                                         "6": "ColwiseParallel", "7": "RowwiseParallel"}


def test_auto_plan_splits_attention_projections_by_name_and_the_names_are_options():
    from hookloop_tp import auto_plan

    assert _styles(auto_plan(Attention())) == {"q": "ColwiseParallel", "k": "ColwiseParallel",
                                               "v": "ColwiseParallel", "out": "RowwiseParallel"}
    block = nn.Module()
    block.to_q, block.to_k, block.to_v, block.to_o = (nn.Linear(8, 8) for _ in range(4))
    assert _styles(auto_plan(block, colwise=("to_[qkv]",), rowwise=("to_o",))) == {
        "to_q": "ColwiseParallel", "to_k": "ColwiseParallel", "to_v": "ColwiseParallel", "to_o": "RowwiseParallel"}


def test_a_module_plan_naming_no_submodule_is_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel

    from hookloop_tp import module_plan

    module = Net()
    module.tensor_parallel_plan = {"mlp.fc9": ColwiseParallel()}
    with pytest.raises(hookloop.ConfigurationError, match="mlp.fc9.*no submodule"):
        module_plan(module)
    module.tensor_parallel_plan = {"mlp.fc1": "colwize"}
    with pytest.raises(hookloop.ConfigurationError, match=r"\['mlp.fc1'\] = 'colwize'.*ParallelStyle"):
        module_plan(module)


def test_bad_options_are_refused_when_set():
    from hookloop_tp import TP

    with pytest.raises(hookloop.ConfigurationError, match="loss_parallel"):
        TP(loss_parallel="yes")
    with pytest.raises(hookloop.ConfigurationError, match="colwise"):
        TP(colwise=3)
    assert TP(colwise="a, b").colwise == "a, b"
    with pytest.raises(TypeError):
        TP(find_unused_parameters=True)  # DistributedDataParallel's, not tp's
    assert TP.hookloop_mesh_dims == ("tp",) and TP.hookloop_requires == ">=2,<3"


@pytest.mark.check
def test_a_tp2_checkpoint_resumes_under_one_process_like_an_uninterrupted_run(battery, tmp_path):
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    _, _, out = battery
    module = Net(attention=True, optimizer="adam", seed=9)  # other weights: the checkpoint's must win
    trainer = hookloop.Trainer(plugins=["tp"], max_steps=STEPS, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data(), batch_size=4), ckpt_path=out / "tp.ckpt")  # DCP reshards 2 -> 1
    assert not dist.is_initialized()
    expected, _ = reference(True, "adam", STEPS)
    assert max_diff({k: v.detach() for k, v in module.state_dict().items()}, expected) <= 1e-5
