"""hookloop-pipeline on real gloo processes (CPU), against a hand-written one-process loop.

One 2-process run of tests/scripts/pipeline_battery.py (`hookloop run --plugins pipeline
--devices 2`) trains a 4-block MLP under every schedule with SGD (momentum) and Adam,
accumulates over batches, and saves a checkpoint under pp=2 that a second run resumes;
4-process runs train under `--plugins pipeline,ddp --mesh pp=2,dp_replicate=2` and
`--plugins pipeline,tp --mesh pp=2,tp=2` (with a resume through tp's DCP checkpoint).
Each is compared with the same model and batches trained by a plain loop in this
process (pipeline_models.reference): the micro-batches of a step add up to the one
full-batch step. The refusals (docs/configurations.md, "Pipeline schedules") are raised
for real in this process.
"""

from __future__ import annotations

import ast
import re
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, run_python

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from pipeline_models import BATCH, Net, data, indices, reference  # noqa: E402
from hookloop_pipeline import Pipeline  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "pipeline_battery.py"
CONFIGURATIONS = REPO / "docs" / "configurations.md"
STEPS = 3
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv_zero_bubble")
CLIPS = ("1f1b:norm", "zbv_zero_bubble:norm", "1f1b:value")
PARITY = [(s, o) for s in SCHEDULES for o in ("sgd", "adam")] + [("looped_bfs", "sgd"), ("interleaved_zero_bubble", "sgd")]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def battery(tmp_path_factory, name: str, args: list[str], cases: list[str], ranks: int) -> list[dict]:
    out = tmp_path_factory.mktemp(name)
    run_python([sys.executable, "-m", "hookloop", "run", *args, str(SCRIPT), str(out), ",".join(cases)],
               cwd=out, timeout=400)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    cases = [f"parity:{s}:{o}" for s, o in PARITY] + ["accumulate:1f1b", "validate:gpipe", "resume:1f1b"] + [f"clip:{c}" for c in CLIPS]
    return battery(tmp_path_factory, "pp2", ["--plugins", "pipeline", "--devices", "2"], cases, 2)


@pytest.mark.check
@pytest.mark.parametrize("schedule,optimizer", PARITY)
def test_two_stages_equal_the_one_process_full_batch_loop(two, schedule, optimizer):
    expected, losses = reference(optimizer, STEPS)
    for record in two:
        run = record[f"parity:{schedule}:{optimizer}"]
        assert max_diff(run["final"], expected) <= 1e-5  # the module is whole on every rank after fit
        # the loss the loop saw: the mean over the micro-batches, the batch's loss
        assert max(abs(a - b) for a, b in zip(run["losses"], losses)) <= 1e-5 and len(run["losses"]) == STEPS
    # every rank logs the same loss (the last stage's, broadcast)
    assert two[0][f"parity:{schedule}:{optimizer}"]["losses"] == two[1][f"parity:{schedule}:{optimizer}"]["losses"]


@pytest.mark.check
def test_both_stages_see_the_users_batches_in_order(two):
    for record in two:
        seen = record["parity:1f1b:sgd"]["batches"]
        assert [indices(b) for b in seen] == [list(range(s * BATCH, (s + 1) * BATCH)) for s in range(STEPS)]


@pytest.mark.check
def test_accumulating_two_batches_is_one_step_on_both(two):
    batches = [list(range(s * 2 * BATCH, (s + 1) * 2 * BATCH)) for s in range(STEPS)]
    expected, _ = reference("adam", STEPS, batches=batches)
    for record in two:
        assert max_diff(record["accumulate:1f1b"]["final"], expected) <= 1e-5


@pytest.mark.check
@pytest.mark.parametrize("case", CLIPS)
def test_clipping_is_over_the_whole_model_as_in_one_process(two, case):
    """The norm is every stage's (a per-stage norm was 3.0e-3 off after 3 steps)."""
    expected, _ = reference("sgd", STEPS, clip=case.split(":")[1])
    unclipped, _ = reference("sgd", STEPS)
    assert max_diff(unclipped, expected) > 1e-2  # the clipping changes the run
    for record in two:
        assert max_diff(record[f"clip:{case}"]["final"], expected) <= 1e-5


@pytest.mark.check
def test_validation_runs_the_users_step_on_the_whole_trained_module(two):
    expected, _ = reference("sgd", STEPS)
    model = Net()
    model.load_state_dict(expected)
    x, y = data().tensors
    with torch.no_grad():  # the mean of the batch means (the logged val_loss's reduction)
        want = torch.stack([model.pipeline_loss(model(x[i:i + BATCH]), y[i:i + BATCH]) for i in range(0, len(x), BATCH)]).mean()
    for record in two:
        assert abs(record["validate:gpipe"]["val_loss"] - float(want)) <= 1e-5


@pytest.mark.check
def test_a_checkpoint_saved_under_pp2_resumes_under_pp2_like_an_uninterrupted_run(two):
    expected, losses = reference("adam", 4)  # 4 steps without interruption, one process
    assert "resume.ckpt" in two[0]["resume_files"] and not two[0]["resume_is_dir"]  # one whole-model file
    for record in two:
        run = record["resume:1f1b"]
        assert max_diff(run["final"], expected) <= 1e-5
        assert max(abs(a - b) for a, b in zip(run["losses"], losses[2:])) <= 1e-5 and len(run["losses"]) == 2


@pytest.mark.check
def test_the_pp2_checkpoint_loads_into_one_process(two, tmp_path_factory):
    """The file holds every stage's weights and both stages' Adam state (2 steps)."""
    path = next(p for p in tmp_path_factory.getbasetemp().glob("pp2*/resume.ckpt"))
    saved = hookloop.safe_load(path)
    expected, _ = reference("adam", 2)
    assert max_diff(saved["state_dict"], expected) <= 1e-5
    state = saved["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(8)) and all(int(s["step"]) == 2 for s in state.values())


@pytest.mark.slow
def test_pipeline_x_ddp_on_a_2x2_mesh_equals_the_global_batch_loop_and_resumes(tmp_path_factory):
    ranks = battery(tmp_path_factory, "ppdp", ["--plugins", "pipeline,ddp", "--mesh", "pp=2,dp_replicate=2",
                                               "--devices", "4"], ["parity:1f1b:adam", "whole:1f1b", "resume:1f1b"], 4)
    runs = [r["parity:1f1b:adam"] for r in ranks]
    # mesh (pp, dp_replicate): ranks 0, 2 are one pipeline (replica 0), ranks 1, 3 the other
    seen = [[indices(b) for b in run["batches"]] for run in runs]
    assert seen[0] == seen[2] and seen[1] == seen[3]
    steps = [seen[0][s] + seen[1][s] for s in range(STEPS)]
    assert all(sorted(b) == sorted(set(b)) and len(b) == 2 * BATCH for b in steps)  # the replicas' shares
    expected, _ = reference("adam", STEPS, batches=steps)
    for run in runs:
        assert max_diff(run["final"], expected) <= 1e-5
    # a checkpoint at step 2 resumes like the uninterrupted run (which crosses into the
    # next epoch's shuffle; checked against the one-process loop on its batches first)
    whole = [r["whole:1f1b"] for r in ranks]
    seen = [[indices(b) for b in run["batches"]] for run in whole]
    expected, _ = reference("adam", 4, batches=[seen[0][s] + seen[1][s] for s in range(4)])
    for rank, record in enumerate(ranks):
        assert max_diff(whole[rank]["final"], expected) <= 1e-5
        assert max_diff(record["resume:1f1b"]["final"], expected) <= 1e-5


@pytest.mark.slow
def test_pipeline_x_tp_on_a_2x2_mesh_equals_one_process_and_resumes(tmp_path_factory):
    ranks = battery(tmp_path_factory, "pptp", ["--plugins", "pipeline,tp", "--mesh", "pp=2,tp=2", "--devices", "4"],
                    ["tp:1f1b:adam", "tp:interleaved_1f1b:sgd", "tpclip:1f1b:norm", "tpresume:1f1b"], 4)
    for case in ("tp:1f1b:adam", "tp:interleaved_1f1b:sgd"):
        expected, losses = reference(case.split(":")[2], STEPS)
        for record in ranks:
            run = record[case]
            assert run["layouts"]["blocks.0.0.weight"] == ("S(0)",) and run["layouts"]["blocks.1.0.weight"] == ("S(1)",)
            assert max_diff(run["final"], expected) <= 1e-5  # whole, plain tensors after fit
            assert max(abs(a - b) for a, b in zip(run["losses"], losses)) <= 1e-5
    clipped, _ = reference("sgd", STEPS, clip="norm")  # the norm over stages and tp shards
    for record in ranks:
        assert max_diff(record["tpclip:1f1b:norm"]["final"], clipped) <= 1e-5
    expected, _ = reference("adam", 4)
    for record in ranks:
        assert "tpresume.ckpt" in record["tpresume_files"] and record["tpresume_is_dir"]  # tp's DCP directory
        assert max_diff(record["tpresume:1f1b"]["final"], expected) <= 1e-5


# -- refusals and the split, in this process ------------------------------------------------


def refusal_rows() -> list[tuple]:
    """``(id, plugins, options, mesh, when, raises, message)`` of the pipeline's refusals."""
    text = CONFIGURATIONS.read_text()
    section = text.split("## Pipeline schedules (hookloop-pipeline)", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and re.fullmatch(r"P\d\d", cells[0]):
            plugins = [p.strip() for p in cells[1].strip("`").split(",")]
            rows.append((cells[0], plugins, ast.literal_eval(cells[2].strip("`") or "{}"), cells[3].strip("`"),
                         cells[4], cells[5].strip("`"), cells[6].strip("`")))
    return rows


def test_the_table_has_the_pipeline_refusals():
    assert [r[0] for r in refusal_rows()] == [f"P0{i}" for i in range(1, 9)]


@pytest.mark.parametrize("row", refusal_rows(), ids=lambda r: r[0])
def test_each_documented_pipeline_refusal_is_raised_with_its_message(row):
    _, plugins, options, mesh, when, raises, message = row
    with pytest.raises(hookloop.HookloopError) as info:
        made = [Pipeline(**options) if p == "pipeline" else p for p in plugins]  # the object, in code
        trainer = hookloop.Trainer(plugins=made, mesh=mesh or None, max_steps=1, enable_checkpointing=False,
                                   logger=False, enable_progress_bar=False, enable_model_summary=False)
        assert when == "at start", f"{row[0]} was not refused at construction"
        trainer.fit(Net(), DataLoader(data(), batch_size=BATCH))
    assert type(info.value).__name__ == raises
    assert " ".join(str(info.value).split()) == " ".join(message.split())
    assert not torch.distributed.is_initialized()


def test_one_process_is_one_stage_the_users_own_step_and_the_name_resolves():
    """pp = 1: no pipeline to run; the user's training_step trains as without the plugin."""
    assert isinstance(hookloop.plugin("pipeline"), Pipeline)  # the entry point (make install)
    module = Net("adam")
    trainer = hookloop.Trainer(plugins=[Pipeline(schedule="gpipe", microbatches=4)], max_steps=STEPS,
                               enable_checkpointing=False, logger=False, enable_progress_bar=False,
                               enable_model_summary=False)
    trainer.fit(module, DataLoader(data(), batch_size=BATCH))
    expected, _ = reference("adam", STEPS)
    assert max_diff(module.state_dict(), expected) <= 1e-6
    assert "training_step" not in module.__dict__


def test_one_process_leaves_clipping_to_the_default():
    """With one stage the plugin's optimizer_step and clip_gradients step aside: the core
    steps and clips as without it (an autoloaded pipeline must not change a run)."""
    from pipeline_models import blocks, make_optimizer
    from torch.nn import functional as F

    module = Net("sgd")
    trainer = hookloop.Trainer(plugins=[Pipeline()], max_steps=STEPS, gradient_clip_val=0.05,
                               enable_checkpointing=False, logger=False, enable_progress_bar=False,
                               enable_model_summary=False)
    trainer.fit(module, DataLoader(data(), batch_size=BATCH))
    model = blocks(0)
    opt = make_optimizer("sgd", model.parameters())
    x, y = data().tensors
    for step in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x[step * BATCH:(step + 1) * BATCH]), y[step * BATCH:(step + 1) * BATCH]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    assert max_diff(module.state_dict(), {f"blocks.{k}": v for k, v in model.state_dict().items()}) <= 1e-6


def test_the_automatic_split_and_the_modules_own_stages():
    from hookloop_pipeline import split_blocks, stage_modules

    assert split_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert split_blocks(4, 2, [1]) == split_blocks(4, 2, ["blocks.1"], "blocks") == [range(0, 1), range(1, 4)]
    net = Net()
    stages = stage_modules(net, 4)
    assert [s[0] is b for s, b in zip(stages, net.blocks)] == [True] * 4  # the module's own layers
    with pytest.raises(hookloop.ConfigurationError, match=r"split_points=\[3, 2\]: each must be a block index"):
        stage_modules(net, 3, [3, 2])

    class Own(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

        def configure_pipeline(self, num_stages):
            return [self.a, nn.Sequential(self.b, self.head)][:num_stages]

    own = Own()
    assert stage_modules(own, 2)[0] is own.a
    with pytest.raises(hookloop.ConfigurationError, match=r"Own.configure_pipeline\(num_stages\) gave 2 object\(s\), "
                                                         r"and the pipeline has 4 stages"):
        stage_modules(own, 4)
    own.configure_pipeline = lambda n: [own.a, own.b]
    with pytest.raises(hookloop.ConfigurationError, match=r"trainable parameters in no stage \(head.weight, head.bias\)"):
        stage_modules(own, 2)


def test_a_module_without_a_container_or_loss_is_refused_clearly():
    from hookloop_pipeline import stage_modules
    from hookloop_pipeline.strategy import _loss_function

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    with pytest.raises(hookloop.ConfigurationError, match=r"needs exactly one: it has none"):
        stage_modules(Flat(), 2)
    with pytest.raises(hookloop.ConfigurationError, match=r"neither a pipeline_loss\(self, output, target\) method nor a "
                                                         r"loss_fn attribute"):
        _loss_function(Flat())
    assert _loss_function(Net()).__name__ == "pipeline_loss"


@pytest.mark.parametrize("name,canonical", [("1F1B", "1f1b"), ("ScheduleGPipe", "gpipe"),
                                            ("Interleaved1F1B", "interleaved_1f1b"), ("ZBVZeroBubble", "zbv_zero_bubble"),
                                            ("interleaved-zero-bubble", "interleaved_zero_bubble")])
def test_torchs_schedule_names_are_accepted(name, canonical):
    from hookloop_pipeline.strategy import schedule_name

    assert schedule_name(name) == canonical
