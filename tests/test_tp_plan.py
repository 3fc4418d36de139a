"""hookloop-tp's plans for the common shapes of outside code (issue 33, item 2).

In this process: the automatic plan on a fused q/k/v attention (left whole, with a note),
a nanoGPT block, gated MLPs (Llama's, torchtitan's, unknown names), an attention beside
an MLP pair; plans as strings with wildcards; a Hugging Face model's
``config.base_model_tp_plan``; the option ``plan``; bad input refused.

In the "tp" job (tests/jobs.py, tests/scripts/tp_plan_battery.py, 2 gloo processes): a
nanoGPT-shaped model under the automatic plan and a Hugging Face LlamaForCausalLM under
its own plan and under the automatic one, trained 4 steps, equal to the same model and
batches trained by a hand-written loop in one process (tp_plan_models.reference).
"""

from __future__ import annotations

import sys

import pytest
from torch import nn

import hookloop
from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from tp_models import Attention, Net  # noqa: E402
from tp_plan_models import CASES, GPT, LM, reference  # noqa: E402


def _styles(plan: dict) -> dict:
    return {k: type(v).__name__ for k, v in plan.items()}


COL, ROW = "ColwiseParallel", "RowwiseParallel"


def _linears(names_shapes, parent=None):
    parent = parent if parent is not None else nn.Module()
    for name, (i, o) in names_shapes:
        setattr(parent, name, nn.Linear(i, o))
    return parent


# -- the automatic plan ----------------------------------------------------------------------


def test_a_fused_qkv_attention_is_left_whole_with_a_note_never_split_contiguously():
    from hookloop_tp import auto_plan

    timm = _linears([("qkv", (8, 24)), ("proj", (8, 8))])  # timm's Attention: both default names
    notes: list = []
    assert auto_plan(timm, notes=notes) == {}
    assert len(notes) == 1 and "'qkv' (8 -> 24) is fused" in notes[0] and "left whole" in notes[0]
    assert auto_plan(timm) == {}  # the dict alone, as before


def test_a_nanogpt_model_splits_its_mlps_and_leaves_its_fused_attention_whole_saying_so():
    from hookloop_tp import auto_plan

    notes: list = []
    plan = auto_plan(GPT(), notes=notes)
    assert _styles(plan) == {f"transformer.h.{i}.mlp.{n}": s for i in (0, 1) for n, s in (("c_fc", COL),
                                                                                      ("c_proj", ROW))}
    assert len(notes) == 2 and all("'c_attn' (32 -> 96) is fused" in n for n in notes)
    assert notes[0].startswith("CausalSelfAttention 'transformer.h.0.attn'")
    # the workaround: naming c_proj rowwise split c_attn contiguously (a wrong function)
    assert _styles(auto_plan(GPT(), rowwise=("c_proj",))) == _styles(plan)
    # sequence parallel around a whole attention would attend over each process's positions only
    with pytest.raises(hookloop.ConfigurationError, match="leaves CausalSelfAttention 'transformer.h.0.attn', "
                                                          "CausalSelfAttention 'transformer.h.1.attn' whole"):
        auto_plan(GPT(), sequence_parallel=True)


def test_separate_projections_with_a_wider_one_count_as_fused():
    from hookloop_tp import auto_plan

    block = _linears([("q", (8, 8)), ("kv", (8, 16)), ("o", (8, 8))])  # q separate, k and v fused
    notes: list = []
    assert auto_plan(block, notes=notes) == {} and "'kv'" in notes[0]


def test_gated_mlps_split_gate_and_up_colwise_and_down_rowwise():
    from hookloop_tp import auto_plan

    llama = _linears([("gate_proj", (8, 16)), ("up_proj", (8, 16)), ("down_proj", (16, 8))])
    assert _styles(auto_plan(llama)) == {"gate_proj": COL, "up_proj": COL, "down_proj": ROW}
    titan = _linears([("w1", (8, 16)), ("w2", (16, 8)), ("w3", (8, 16))])  # torchtitan's order: w1, w2, w3
    assert _styles(auto_plan(titan)) == {"w1": COL, "w3": COL, "w2": ROW}


def test_a_gated_shape_under_unknown_names_is_left_whole_with_a_note():
    from hookloop_tp import auto_plan

    block = _linears([("a", (8, 16)), ("b", (8, 16)), ("c", (16, 8))])
    notes: list = []
    assert auto_plan(block, notes=notes) == {}
    assert "'a' and 'b' have the same shape and 'c' the reverse" in notes[0]
    # in an nn.Sequential the order is the computation: a chain, not a gate
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 16))
    assert _styles(auto_plan(seq)) == {"0": COL, "2": ROW}


def test_query_key_value_projections_are_never_paired_as_an_mlp():
    from hookloop_tp import auto_plan

    # no output projection among the names: q and k (8 -> 8, one after the other) once made an "MLP"
    block = _linears([("q", (8, 8)), ("k", (8, 8)), ("v", (8, 8)), ("mix", (8, 8))])
    notes: list = []
    assert auto_plan(block, notes=notes) == {}
    assert "q, k, v look like query/key/value projections" in notes[0] and "rowwise" in notes[0]
    # an attention holding an MLP pair too: each split by its own rule
    both = Attention()
    both.fc1, both.act, both.fc2 = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)
    assert _styles(auto_plan(both)) == {"q": COL, "k": COL, "v": COL, "out": ROW, "fc1": COL, "fc2": ROW}


# -- plans as strings, wildcards ---------------------------------------------------------------


def test_a_module_plan_takes_strings_and_wildcards_one_level_at_a_time():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    from hookloop_tp import module_plan

    module = Net(attention=True)
    module.tensor_parallel_plan = {"attn.[qkv]": "colwise", "attn.out": RowwiseParallel(), "norm": "replicate",
                                   "mlp.fc*": "colwise_rep", "head": "sequence_parallel"}
    plan = module_plan(module)
    assert _styles(plan) == {"attn.q": COL, "attn.k": COL, "attn.v": COL, "attn.out": ROW,
                             "mlp.fc1": COL, "mlp.fc2": COL, "head": "SequenceParallel"}  # "replicate": left whole
    assert plan["mlp.fc1"].output_layouts == (Replicate(),) and plan["head"].use_local_output
    module.tensor_parallel_plan = {"*.q": "colwise"}  # one level: attn.q, not a deeper q
    assert list(module_plan(module)) == ["attn.q"]
    module.tensor_parallel_plan = {"*q": "colwise"}  # no top-level name ends in q
    with pytest.raises(hookloop.ConfigurationError, match=r"'\*q', which is no submodule.*one level"):
        module_plan(module)


@pytest.mark.parametrize("value", ["colwize", "local_colwise", "gather", 3])
def test_bad_plan_strings_are_refused_naming_the_key(value):
    from hookloop_tp import module_plan

    module = Net(attention=True)
    module.tensor_parallel_plan = {"attn.q": value}
    with pytest.raises(hookloop.ConfigurationError, match=r"Net.tensor_parallel_plan\['attn.q'\] = .*'colwise'"):
        module_plan(module)


def test_two_keys_naming_one_module_are_refused():
    from hookloop_tp import module_plan

    module = Net(attention=True)
    module.tensor_parallel_plan = {"attn.*": "colwise", "attn.out": "rowwise"}
    with pytest.raises(hookloop.ConfigurationError, match="'attn.out' and 'attn.\\*' both name the module 'attn.out'"):
        module_plan(module)


# -- Hugging Face plans, the option ----------------------------------------------------------------


class FakeConfig:
    base_model_tp_plan = {"layers.*.q": "colwise", "layers.*.o": "rowwise"}


class FakeBase(nn.Module):
    """A Hugging Face-shaped base model: ``config.base_model_tp_plan``, ``base_model_prefix``."""

    base_model_prefix = "model"

    def __init__(self):
        super().__init__()
        self.config = FakeConfig()
        self.layers = nn.ModuleList(_linears([("q", (8, 8)), ("o", (8, 8))]) for _ in range(2))


class FakeForCausalLM(nn.Module):
    base_model_prefix = "model"

    def __init__(self):
        super().__init__()
        self.config = FakeConfig()
        self.model, self.lm_head = FakeBase(), nn.Linear(8, 4)


def test_a_hugging_face_plan_is_read_relative_to_the_base_model_and_translated():
    from hookloop_tp import hf_plan, resolve

    wrapper = nn.Module()
    wrapper.net = FakeForCausalLM()
    assert _styles(hf_plan(wrapper)) == {"net.model.layers.0.q": COL, "net.model.layers.1.q": COL,
                                         "net.model.layers.0.o": ROW, "net.model.layers.1.o": ROW}
    assert resolve(wrapper).source == "hf" and resolve(wrapper, "hf").source == "hf"
    assert resolve(wrapper, "infer").source == "automatic"
    assert hf_plan(Net()) is None
    with pytest.raises(hookloop.ConfigurationError, match="plan='hf': Net holds no Hugging Face model"):
        resolve(Net(), "hf")
    FakeConfig.base_model_tp_plan = {"layers.*.q": "local_colwise"}
    try:
        with pytest.raises(hookloop.ConfigurationError, match=r"base_model_tp_plan\['net.model.layers.\*.q'\] = "
                                                              r"'local_colwise'"):
            hf_plan(wrapper)
    finally:
        FakeConfig.base_model_tp_plan = {"layers.*.q": "colwise", "layers.*.o": "rowwise"}


def test_a_transformers_llama_plan_and_the_automatic_plan_agree():
    from hookloop_tp import auto_plan, hf_plan

    module = LM("llama")
    hf = _styles(hf_plan(module))
    assert hf == {f"net.model.layers.{i}.{n}": s for n, s in (
        ("self_attn.q_proj", COL), ("self_attn.k_proj", COL), ("self_attn.v_proj", COL), ("self_attn.o_proj", ROW),
        ("mlp.gate_proj", COL), ("mlp.up_proj", COL), ("mlp.down_proj", ROW)) for i in (0, 1)}
    notes: list = []
    assert _styles(auto_plan(module, notes=notes)) == hf and notes == []


def test_a_hugging_face_plan_torch_cannot_follow_is_refused_or_by_default_replaced_by_the_automatic_one():
    from hookloop_tp import hf_plan, resolve

    module = LM("qwen3")  # base_model_tp_plan: q_norm/k_norm "replicated_with_grad_allreduce"
    with pytest.raises(hookloop.ConfigurationError, match=r"\['net.model.layers.\*.self_attn.q_norm'\] = "
                                                          r"'replicated_with_grad_allreduce'"):
        hf_plan(module)
    with pytest.raises(hookloop.ConfigurationError, match="replicated_with_grad_allreduce"):
        resolve(module, "hf")
    plan = resolve(module)
    assert plan.source == "automatic" and "the automatic plan instead" in plan.notes[0]
    # the attention's q_norm/k_norm see its heads: on split heads their gradients would be partial
    assert "q_norm, k_norm hold parameters" in plan.notes[1]
    assert _styles(plan.styles) == {f"net.model.layers.{i}.mlp.{n}": s for i in (0, 1) for n, s in (
        ("gate_proj", COL), ("up_proj", COL), ("down_proj", ROW))}


def test_a_phi3_plan_gathers_its_fused_projections():
    from torch.distributed.tensor import Replicate

    from hookloop_tp import resolve

    module = LM("phi3")  # qkv_proj and gate_up_proj fused: "colwise_gather_output", "rowwise_split_input"
    plan = resolve(module, "hf").styles
    assert plan["net.model.layers.0.self_attn.qkv_proj"].output_layouts == (Replicate(),)
    assert plan["net.model.layers.0.mlp.down_proj"].input_layouts == (Replicate(),)
    assert "'qkv_proj' (32 -> 64) is fused" in resolve(module, "infer").notes[0]  # the automatic plan: whole


def test_grouped_query_heads_a_tp_size_cannot_share_are_refused_at_start():
    from hookloop_tp import expand_plan, hf_plan
    from hookloop_tp.plan import check_sizes

    module = LM("llama")  # 4 query heads, 2 key/value heads of 8 features
    check_sizes(module, hf_plan(module), 2)
    with pytest.raises(hookloop.ConfigurationError, match="'net.model.layers.0.self_attn.k_proj' computes 2 heads "
                                                          "of 8 features, which 4 tp processes"):
        check_sizes(module, hf_plan(module), 4)
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    odd = _linears([("fc1", (8, 9)), ("fc2", (9, 8)), ("head", (8, 9))])
    with pytest.raises(hookloop.ConfigurationError, match="'fc1' is split colwise on its 9 output features"):
        check_sizes(odd, {"fc1": ColwiseParallel()}, 2)
    with pytest.raises(hookloop.ConfigurationError, match="'fc2' is split rowwise on its 9 input features"):
        check_sizes(odd, expand_plan(odd, {"fc2": "rowwise"}, "plan"), 2)
    # a gathered output, or one left a DTensor (loss_parallel), may be uneven
    check_sizes(odd, {"head": ColwiseParallel(use_local_output=False), "fc1": ColwiseParallel(
        output_layouts=Replicate())}, 2)


def test_the_plan_option_is_checked_when_set():
    from hookloop_tp import TP, expand_plan

    assert TP().plan == "auto" and TP(plan="hf").plan == "hf"
    assert TP(plan={"mlp.fc1": "colwise"}).plan == {"mlp.fc1": "colwise"}
    with pytest.raises(hookloop.ConfigurationError, match="tp option plan='hugging'.*'auto'.*'hf'.*'infer'"):
        TP(plan="hugging")
    with pytest.raises(hookloop.ConfigurationError, match=r"tp option plan\['mlp.fc1'\] = 'col'"):
        TP(plan={"mlp.fc1": "col"})
    # the command line: a name, or the plan as JSON
    from hookloop.contract.registry import parse_plugin_options

    given = parse_plugin_options(["tp.plan=hf", 'tp.plan={"attn.[qkv]": "colwise", "attn.out": "rowwise"}'])
    plan = TP(**given["tp"]).plan
    assert _styles(expand_plan(Net(attention=True), plan, "tp option plan")) == {
        "attn.q": COL, "attn.k": COL, "attn.v": COL, "attn.out": ROW}
    assert TP(**parse_plugin_options(["tp.plan=hf"])["tp"]).plan == "hf"


# -- 2 processes: outside models equal one process ---------------------------------------------


@pytest.fixture(scope="module")
def battery(jobs):
    run = jobs.run("tp")
    return run.ranks("tp_plan_battery"), run.stdout("tp_plan_battery")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.check
@pytest.mark.parametrize("kind, plan", CASES)
def test_outside_models_under_tp2_equal_one_process_training(battery, kind, plan):
    ranks, _ = battery
    assert "missing" not in ranks[0][(kind, plan)], ranks[0][(kind, plan)].get("missing")
    expected, losses = reference(kind)
    for record in ranks:
        run = record[(kind, plan)]
        assert _max_diff(run["final"], expected) <= 1e-5
        assert max(abs(a - b) for a, b in zip(run["losses"], losses, strict=True)) <= 1e-5
    layouts = ranks[0][(kind, plan)]["layouts"]
    layer = "net.model.layers.1." if kind != "nanogpt" else "net.transformer.h.1."
    split = {"llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
             "qwen3": ("mlp.gate_proj", "mlp.up_proj"),  # the attention whole: q_norm/k_norm on the heads
             "phi3": ("self_attn.qkv_proj", "mlp.gate_up_proj"),  # colwise_gather_output
             "nanogpt": ("mlp.c_fc",)}[kind]
    whole = {"llama": (), "qwen3": ("self_attn.q_proj", "self_attn.q_norm"), "phi3": (),
             "nanogpt": ("attn.c_attn", "attn.c_proj")}[kind]
    for name in split:
        assert layouts[f"{layer}{name}.weight"] == ("S(0)",), name
    for name in whole:
        assert layouts[f"{layer}{name}.weight"] == "plain", name


@pytest.mark.check
def test_the_runs_say_what_the_automatic_plan_left_whole_and_why(battery):
    _, output = battery
    assert output.count("hookloop-tp: CausalSelfAttention 'net.transformer.h.0.attn': attention left whole") == 1
    assert "'replicated_with_grad_allreduce' is a Hugging Face style" in output  # qwen3's plan, refused
    assert "Qwen3Attention 'net.model.layers.0.self_attn': attention left whole" in output
    assert "q_norm, k_norm hold parameters" in output
