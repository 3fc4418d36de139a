"""Sequence parallelism in hookloop-tp (``sequence_parallel=True``), 2 processes, gloo, CPU.

One run of tests/scripts/tp_sp_battery.py trains a two-block transformer (LayerNorm,
causal attention, dropout, MLP, a final LayerNorm and a per-position head) with SGD
(momentum) and Adam under ``tp`` with ``sequence_parallel=True``, and once more with the
module's own sequence-parallel plan; the tests compare what the ranks recorded with the
same model and batches trained by a hand-written PyTorch loop in this process
(tp_sp_models.reference). The plan's shape and bad input are checked in this process.
"""

from __future__ import annotations

import sys

import pytest
import torch

import hookloop
from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from tp_models import SEQ  # noqa: E402
from tp_sp_models import Transformer, data, reference  # noqa: E402

STEPS = 4
NORMS = {"blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def battery(jobs):
    return jobs.run("tp").ranks("tp_sp_battery")  # tests/jobs.py: the tp job, after test_tp's script


@pytest.mark.check
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_process_sequence_parallel_equals_one_process_training(battery, optimizer):
    expected, grads = reference(optimizer, STEPS)
    for record in battery:
        run = record[optimizer]
        assert max_diff(run["final"], expected) <= 1e-5
        # the last step's gradients: the replicated norms' and head's summed over the ranks
        assert max_diff(run["grads"], grads) <= 1e-5
    assert max_diff(battery[0][optimizer]["final"], battery[1][optimizer]["final"]) == 0.0


@pytest.mark.check
def test_the_activations_between_the_blocks_are_sharded_on_the_sequence(battery):
    for record in battery:
        seen = record["sgd"]["norm_inputs"]
        assert {name for name, _, _ in seen} == NORMS
        assert len(seen) == len(NORMS) * STEPS
        for name, local, placements in seen:
            # batch 4, half of the sequence of 6 on each process, the whole width
            assert local == (4, SEQ // 2, 8), (name, local)
            assert placements == ("S(1)",), (name, placements)


@pytest.mark.check
def test_the_plan_splits_the_blocks_and_replicates_the_norms_and_head_as_dtensors(battery):
    layouts = battery[0]["sgd"]["layouts"]
    for b in (0, 1):
        for name in ("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.fc1.weight"):
            assert layouts[f"blocks.{b}.{name}"] == ("S(0)",)
        assert layouts[f"blocks.{b}.attn.out.weight"] == layouts[f"blocks.{b}.mlp.fc2.weight"] == ("S(1)",)
    # SequenceParallel: replicated DTensors (gradients reduced over tp), not plain tensors
    for name in ("blocks.0.norm1.weight", "blocks.1.norm2.bias", "norm.weight", "head.weight", "head.bias"):
        assert layouts[name] == ("R",), name


@pytest.mark.check
def test_the_modules_own_sequence_parallel_plan_equals_one_process_training(battery):
    expected, grads = reference("sgd", STEPS)
    for record in battery:
        run = record["planned"]
        assert {local for _, local, _ in run["norm_inputs"]} == {(4, SEQ // 2, 8)}
        assert max_diff(run["final"], expected) <= 1e-5
        assert max_diff(run["grads"], grads) <= 1e-5


# -- the plan and bad input, in this process -------------------------------------------


def test_the_sequence_parallel_plan_has_torchtitans_layouts():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel)

    from hookloop_tp import auto_plan

    plan = auto_plan(Transformer(), sequence_parallel=True)
    root = plan[""]
    assert isinstance(root, PrepareModuleInputOutput)
    assert root.prepare_module_input.desired_input_layouts == (Shard(1),)
    assert root.prepare_module_output.desired_output_layouts == (Replicate(),)
    attn = plan["blocks.0.attn"]  # gathered once on entry: its forward reads the sequence length
    assert isinstance(attn, PrepareModuleInput) and attn.input_layouts == (Shard(1),)
    assert attn.desired_input_layouts == (Replicate(),)
    assert isinstance(plan["blocks.0.attn.q"], ColwiseParallel) and plan["blocks.0.attn.q"].input_layouts == (Replicate(),)
    assert plan["blocks.0.mlp.fc1"].input_layouts == (Shard(1),)  # an MLP pair gathers at its colwise layer
    for name in ("blocks.0.attn.out", "blocks.0.mlp.fc2"):
        assert isinstance(plan[name], RowwiseParallel) and plan[name].output_layouts == (Shard(1),)
    for name in (*NORMS, "blocks.0.drop", "head"):
        assert isinstance(plan[name], SequenceParallel), name
    assert "blocks.0.mlp.act" not in plan
    # without the option the plan is the plain one: nothing sequence parallel
    plain = auto_plan(Transformer())
    assert "" not in plain and not any(isinstance(s, SequenceParallel) for s in plain.values())


def test_a_module_with_parameters_and_children_is_refused_by_the_automatic_plan():
    from torch import nn

    from hookloop_tp import auto_plan

    class Scaled(nn.Module):  # a parameter of its own beside a child: no position-wise style fits
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))
            self.norm = nn.LayerNorm(8)

    model = Transformer()
    model.extra = Scaled()
    with pytest.raises(hookloop.ConfigurationError, match="sequence_parallel.*'extra'.*tensor_parallel_plan"):
        auto_plan(model, sequence_parallel=True)


def test_a_bad_sequence_parallel_option_is_refused():
    from hookloop_tp import TP

    with pytest.raises(hookloop.ConfigurationError, match="sequence_parallel='yes' must be True or False"):
        TP(sequence_parallel="yes")
    assert TP(sequence_parallel=True).sequence_parallel is True


@pytest.mark.check
def test_a_sequence_that_does_not_split_evenly_is_refused_on_every_rank(battery):
    for record in battery:
        assert record["uneven"] is not None
        assert "sequence length is a multiple of the tp size 2" in record["uneven"]
        assert "(4, 5, 8)" in record["uneven"]


@pytest.mark.check
def test_after_fit_the_module_is_whole_and_runs_alone(battery):
    expected, _ = reference("adam", STEPS)
    model = Transformer()
    model.load_state_dict(expected)
    with torch.no_grad():
        whole = model(data().tensors[0][:2])
    for record in battery:
        run = record["adam"]
        assert set(run["after_fit"].values()) == {"Parameter"}  # no DTensor left
        assert run["after_fit_output"].shape == (2, SEQ, 4)  # the whole sequence: no split on entry
        assert float((run["after_fit_output"] - whole).abs().max()) <= 1e-5


def test_an_attention_that_is_the_module_itself_is_refused_by_the_automatic_plan():
    from cp_models import CausalNet  # its fused qkv and out projections are the module's own children
    from tp_models import Attention  # q, k, v and out: the module's own children

    from hookloop_tp import auto_plan

    assert set(auto_plan(Attention())) == {"q", "k", "v", "out"}  # plain tp splits it
    with pytest.raises(hookloop.ConfigurationError, match="Attention's attention projections are its own children"):
        auto_plan(Attention(), sequence_parallel=True)
    # a fused q/k/v (view(b, t, 3, heads, -1)) is never split contiguously: left whole, and then the
    # sequence-parallel plan would hand that attention each process's share of the sequence only
    assert auto_plan(CausalNet()) == {}
    with pytest.raises(hookloop.ConfigurationError, match="sequence_parallel: the automatic plan leaves CausalNet "
                                                          "whole .*'qkv'.*drop sequence_parallel"):
        auto_plan(CausalNet(), sequence_parallel=True)
