"""hookloop-tp under `hookloop run --plugins tp --devices 2` (2 processes, gloo, CPU).

One run of tests/scripts/tp_battery.py trains an MLP block and an attention + MLP block
with SGD (momentum) and Adam, the attention block compiled beside tp, a shuffling loader
(both ranks must see the one-process order), saves a sharded checkpoint mid-run and resumes from it;
each test compares what the ranks recorded with the same model and batches trained by a
hand-written PyTorch loop in this process (tp_models.reference). Bad input is checked
in this process.

The self-check (tp.verify, issue 33): models that tp splits into another function (a fused
q/k/v projection, an attention viewing its heads with the global head count, an unpaired
gate) stop at the start of fit on every rank (in the battery, caught; one launch of its
own, tp_verify_fails.py, that exits non-zero); with the check off the wrong model trains
another function; the check changes no number. The plan table (printed on rank 0, and by
``hookloop plan``) is checked here and in the battery's output.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import hookloop
from conftest import REPO, finish_job, start_hookloop_run

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from tp_models import Attention, GlobalHeadsNet, HookedNet, Net, data, reference, reference_of, shuffled_order  # noqa: E402,E501

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
    with pytest.raises(hookloop.ConfigurationError, match="verify"):
        TP(verify="no")
    assert TP().verify is True and TP(verify=False).verify is False
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


# -- the self-check (tp.verify) and the plan table (issue 33) -------------------------------


@pytest.mark.check
@pytest.mark.parametrize("model, where, cause", [
    ("fused", "the output of 'attn.out' differs by", "attn.qkv is a fused query/key/value projection"),
    ("global_heads", "the output of 'attn.out' differs by",
     "views its heads with the global head count (its n_head = 2)"),
    ("unpaired_gate", "the split forward fails in 'mlp'", "gated MLP in 'mlp' whose gate mlp.gate is left whole"),
])
def test_a_model_that_tp_would_split_into_another_function_stops_at_start_on_every_rank(battery, model, where, cause):
    ranks, _, _ = battery
    errors = [r[("verify", model)] for r in ranks]
    assert all(e is not None for e in errors), f"{model}: fit trained without an error"
    assert errors[0]["error"] == errors[1]["error"]  # one verdict: every rank raises the same error
    text = errors[0]["error"]
    assert text.startswith("tp.verify: the tensor-parallel ")
    assert where in text and cause in text and "tp.verify=false" in text and "tensor_parallel_plan" in text
    assert all(e["steps"] == 1 for e in errors)  # stopped in the first batch's forward, before any update


@pytest.mark.check
def test_with_verify_off_the_wrong_model_trains_another_function(battery):
    """The check is what stops the global-heads model: with tp.verify=false it trains, and
    its weights leave one process's (the same model and batches, a hand-written loop)."""
    ranks, _, _ = battery
    expected = reference_of(GlobalHeadsNet, STEPS)
    for record in ranks:
        assert max_diff(record["unverified_global_heads"], expected) > 1e-3


@pytest.mark.check
def test_the_check_changes_no_number(battery):
    """A correct model with the check (the parity run) ends bit for bit where the same run
    without it does: no_grad, eval mode, the random states restored, the loader untouched."""
    ranks, _, _ = battery
    for record in ranks:
        assert max_diff(record[("parity", True, "adam")]["final"], record["unverified_parity"]) == 0.0


NET_PLAN = """hookloop-tp: the plan (automatic, tp=2) of Net: 6 module(s) split, 2 left whole
  attn.q    colwise
  attn.k    colwise
  attn.v    colwise
  attn.out  rowwise
  mlp.fc1   colwise
  mlp.fc2   rowwise
  left whole: norm, head
"""


@pytest.mark.check
def test_the_applied_plan_is_printed_on_rank_0_only(battery):
    _, _, out = battery
    rank0, rank1 = ((out / f"stdout.rank{r}.log").read_text() for r in (0, 1))
    assert NET_PLAN in rank0
    assert ("hookloop-tp: the plan (the module's configure_tensor_parallel, tp=2) of HookedNet: 2 module(s) split, "
            "2 left whole\n  mlp.fc1  colwise\n  mlp.fc2  rowwise\n  left whole: norm, head\n") in rank0
    assert "hookloop-tp: the plan (the module's tensor_parallel_plan, tp=2) of PlannedNet" in rank0
    assert "the plan" not in rank1


def test_describe_plan_groups_repeated_blocks_and_marks_what_does_not_divide():
    from torch.distributed.tensor.parallel import ColwiseParallel

    from hookloop_tp import auto_plan, describe_plan

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.attn, self.mlp = nn.LayerNorm(8), Attention(), tp_mlp()

    def tp_mlp():
        return nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))

    model = nn.Module()
    model.embed, model.layers = nn.Embedding(10, 8), nn.ModuleList(Block() for _ in range(3))
    model.head = nn.Linear(8, 4)
    assert describe_plan(model, auto_plan(model), "automatic", tp=2) == (
        "hookloop-tp: the plan (automatic, tp=2) of Module: 18 module(s) split, 5 left whole\n"
        "  layers.*.attn.q    colwise  (x3)\n"
        "  layers.*.attn.k    colwise  (x3)\n"
        "  layers.*.attn.v    colwise  (x3)\n"
        "  layers.*.attn.out  rowwise  (x3)\n"
        "  layers.*.mlp.0     colwise  (x3)\n"
        "  layers.*.mlp.2     rowwise  (x3)\n"
        "  left whole: embed, layers.*.norm (x3), head")
    text = describe_plan(model, {"layers.*.mlp.0": ColwiseParallel(use_local_output=False)}, "given", tp=5)
    assert "  layers.*.mlp.0  colwise (output a DTensor)  (x3)  ! out_features 12 is not a multiple of tp=5" in text
    assert "3 module(s) split" in text


def test_hookloop_plan_mode_prints_each_plugins_answer_and_ends_fit_before_any_run(monkeypatch, capsys, tmp_path):
    """What ``hookloop plan`` starts the script with (HOOKLOOP_PLAN=1), in this process: the
    script's fit builds the module, prints tp's plan and exits 0, before a process group,
    a run directory or a step."""
    from torch.utils.data import DataLoader

    import torch.distributed as dist

    monkeypatch.setenv("HOOKLOOP_PLAN", "1")
    module = Net(attention=True)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = hookloop.Trainer(plugins=["tp"], devices=2, max_steps=2, default_root_dir=tmp_path)
    with pytest.raises(SystemExit) as exit_:
        trainer.fit(module, DataLoader(data(), batch_size=4))
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("hookloop plan: Net (612 parameters) on 2 process(es); plugins: tp\n")
    assert NET_PLAN in out
    assert not dist.is_initialized() and list(tmp_path.iterdir()) == [] and trainer.global_step == 0
    assert max_diff(module.state_dict(), before) == 0.0
    with pytest.raises(SystemExit):
        hookloop.Trainer(plugins=["tp"], devices=2).fit(HookedNet(), DataLoader(data(), batch_size=4))
    assert "HookedNet splits itself in configure_tensor_parallel(mesh)" in capsys.readouterr().out


@pytest.mark.check
def test_hookloop_plan_prints_the_plan_and_trains_nothing(tmp_path, capfd, monkeypatch):
    """``hookloop plan --plugins tp --devices 2 train.py``: one plain interpreter runs the
    script; the plan is printed, nothing is trained or written, the status is 0."""
    from hookloop.tools import cli

    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests' / 'scripts')!r})\n"
        "from torch.utils.data import DataLoader\n"
        "import hookloop\n"
        "from tp_models import Net, data\n"
        "hookloop.Trainer(max_steps=2).fit(Net(attention=True), DataLoader(data(), batch_size=4))\n"
        "print('TRAINED')\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "--plugins", "tp", "--devices", "2", str(script)]) == 0
    out = capfd.readouterr().out
    assert "hookloop plan: Net (612 parameters) on 2 process(es); plugins: tp\n" in out and NET_PLAN in out
    assert "TRAINED" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]  # no logs, no checkpoints
    # the tp size of --mesh; a split dimension that does not divide is marked
    assert cli.main(["plan", "--plugins", "tp", "--devices", "3", str(script)]) == 0
    assert "  mlp.fc1   colwise  ! out_features 16 is not a multiple of tp=3" in capfd.readouterr().out
    assert cli.main(["plan", "--plugins", "tp", "--devices", "2", "nosuch.py"]) == 2  # run's checks


@pytest.mark.check
def test_a_wrong_model_launched_under_tp_exits_nonzero_with_the_checks_error(tmp_path):
    """tests/scripts/tp_verify_fails.py (a fused q/k/v projection), not caught: the launch
    fails at the start of fit, every rank with the check's error, and nothing hangs."""
    proc = start_hookloop_run(["--plugins", "tp", "--devices", "2", REPO / "tests" / "scripts" / "tp_verify_fails.py",
                               tmp_path], cwd=tmp_path)
    stdout, stderr = finish_job(proc, timeout=240, succeed=False)
    assert "ConfigurationError: tp.verify: the tensor-parallel FusedNet does not compute" in stderr
    assert "attn.qkv is a fused query/key/value projection" in stderr
    assert "rank 0 raised the same error" in stderr or "rank 1 raised the same error" in stderr
    assert not list(tmp_path.glob("trained*"))


def test_the_diagnosis_reads_the_cause_from_the_layers_around_the_first_difference():
    from hookloop_tp.verify import diagnose
    from tp_models import FusedAttention, GatedMLP, GlobalHeadsAttention, MLP

    model = nn.Module()
    model.fused, model.heads, model.gated, model.mlp = FusedAttention(), GlobalHeadsAttention(), GatedMLP(), MLP()
    labels = {"fused.qkv": "colwise", "fused.out": "rowwise", "heads.q": "colwise", "heads.k": "colwise",
              "heads.v": "colwise", "heads.out": "rowwise", "gated.up": "colwise", "gated.down": "rowwise",
              "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    assert "fused.qkv is a fused query/key/value projection (out_features 24 = 3 x 8)" in diagnose(
        model, "fused.out", labels)
    assert "views its heads with the global head count (its n_head = 2)" in diagnose(model, "heads.out", labels)
    assert "whose gate gated.gate is left whole while gated.up is split colwise" in diagnose(model, "gated", labels)
    generic = diagnose(model, "mlp.fc2", labels)
    assert "uses the split layers otherwise than the plan assumes" in generic and "tp.verify=false" in generic


def test_the_tolerance_is_the_dtypes_and_the_runs_compute_dtypes_loosest():
    from hookloop_tp.verify import TOLERANCES, _difference

    whole = torch.ones(4, 8)
    assert TOLERANCES[torch.float32] == (1e-5, 1e-5)
    diff, bound = _difference(whole + 1e-6, whole)
    assert diff <= bound  # rounding passes
    diff, bound = _difference(whole + 1e-3, whole)
    assert diff > bound  # a wrong function does not
    diff, bound = _difference(whole + 1e-3, whole, torch.bfloat16)
    assert diff <= bound  # a bf16 run computes a rounding that large
    assert _difference(torch.ones(4, 4), whole) is None  # a shard (another shape): not compared
