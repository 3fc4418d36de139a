"""pipeline x fsdp on a 2x2 mesh (4 gloo processes), against a hand-written one-process loop.

`hookloop run --plugins pipeline,fsdp --mesh pp=2,dp_shard=2 --devices 4` runs
tests/scripts/pipeline_battery.py: each rank's stage module is sharded by FSDP2's
`fully_shard` on the `dp_shard` sub-mesh (torchtitan's per model part), its gradients
reduce-scattered within the stage's data-parallel group, and the schedule runs the step.
Mesh (pp, dp_shard): ranks 0, 1 run stage 0 on the two shards' batches, ranks 2, 3 stage 1
on the same batches; one step equals the one-process full-batch step on both shards'
samples together (pipeline_models.reference). A checkpoint saved at step 2 (the pipeline's
whole-model file) resumes like the uninterrupted run. The default run is 1F1B with SGD
and Adam plus the resume; make test-full adds GPipe, interleaved 1F1B, ZBV,
accumulation and clipping.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.nn import functional as F

from conftest import REPO, run_python

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from pipeline_models import BATCH, blocks, data, indices, make_optimizer, reference  # noqa: E402
from tiers import at_least  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "pipeline_battery.py"
FULL = at_least("full")
STEPS = 3
LAYOUT = ["--plugins", "pipeline,fsdp", "--mesh", "pp=2,dp_shard=2", "--devices", "4",
          "--plugin-option", "fsdp.meta_init=false"]
DEFAULT = ["parity:1f1b:sgd", "parity:1f1b:adam", "whole:1f1b", "resume:1f1b"]
EXTRA = ["parity:gpipe:adam", "parity:interleaved_1f1b:sgd", "parity:zbv_zero_bubble:adam",
         "accumulate:1f1b", "clip:1f1b:norm"]
CASES = DEFAULT + (EXTRA if FULL else [])


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppfsdp")
    run_python([sys.executable, "-m", "hookloop", "run", *LAYOUT, str(SCRIPT), str(out), ",".join(CASES)],
               cwd=out, timeout=500)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)], out


def global_batches(runs: list[dict]) -> list[list[int]]:
    """Each step's samples: the two data-parallel shards' batches together (ranks 0 and 1;
    ranks 2 and 3, the next stage of the same pipelines, see the same ones)."""
    seen = [[indices(b) for b in run["batches"]] for run in runs]
    assert seen[0] == seen[2] and seen[1] == seen[3]  # a stage's two shards, the next stage the same
    steps = [seen[0][s] + seen[1][s] for s in range(len(seen[0]))]
    assert all(len(set(b)) == len(b) == 2 * BATCH for b in steps)  # two distinct shares
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("parity:")])
def test_pp2_x_dp_shard2_equals_the_one_process_global_batch_loop(ranks, case):
    records, _ = ranks
    runs = [r[case] for r in records]
    # each rank's own stage is fsdp-sharded (Shard(0) on dp_shard), the other stage whole
    schedule = case.split(":")[1]
    for rank, run in enumerate(runs):
        pp = rank // 2  # the blocks of this rank's stage(s): 2 stages of 2 blocks, or 4 of one
        own = {"interleaved_1f1b": (pp, pp + 2), "zbv_zero_bubble": (pp, 3 - pp)}.get(schedule, (2 * pp, 2 * pp + 1))
        mine = tuple(f"blocks.{b}." for b in own)
        assert all((layout == ("S(0)",)) == name.startswith(mine) for name, layout in run["layouts"].items()), run["layouts"]
    expected, losses = reference(case.split(":")[2], STEPS, batches=global_batches(runs))
    for run in runs:
        assert max_diff(run["final"], expected) <= 1e-5
    assert runs[0]["losses"] == runs[2]["losses"] and runs[1]["losses"] == runs[3]["losses"]  # a pipeline's ranks
    # a rank's logged loss is its shard's mean: the two shards' mean is the global batch's
    assert (runs[0]["losses"][0] + runs[1]["losses"][0]) / 2 == pytest.approx(losses[0], abs=1e-5)


@pytest.mark.slow
def test_a_checkpoint_at_step_2_resumes_like_the_uninterrupted_run(ranks):
    records, out = ranks
    whole = [r["whole:1f1b"] for r in records]
    expected, _ = reference("adam", 4, batches=global_batches(whole))
    for record in records:
        assert max_diff(record["whole:1f1b"]["final"], expected) <= 1e-5
        assert max_diff(record["resume:1f1b"]["final"], expected) <= 1e-5
    # one whole-model file: full tensors, and every parameter's Adam state (both stages)
    saved = torch.load(out / "resume.ckpt", weights_only=False)
    assert {k: tuple(v.shape) for k, v in saved["state_dict"].items()} == {k: tuple(v.shape) for k, v in expected.items()}
    state = saved["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(8)) and all(int(s["step"]) == 2 for s in state.values())
    names = list(saved["state_dict"])
    assert all(tuple(state[i]["exp_avg"].shape) == tuple(saved["state_dict"][names[i]].shape) for i in range(8))


@pytest.mark.slow
@pytest.mark.full
def test_accumulation_and_clipping_under_pp_x_fsdp(ranks):
    records, _ = ranks
    runs = [r["accumulate:1f1b"] for r in records]
    # 3 optimizer steps over 5 batches: an epoch is 3 batches per shard, so the epoch's last
    # window is one batch, its loss still divided by accumulate_grad_batches (Lightning's)
    g = global_batches(runs)
    model = blocks(0)
    optimizer = make_optimizer("adam", model.parameters())
    x, y = data().tensors
    for window, scale in [(g[0] + g[1], 1.0), (g[2], 0.5), (g[3] + g[4], 1.0)]:
        optimizer.zero_grad()
        (F.cross_entropy(model(x[window]), y[window]) * scale).backward()
        optimizer.step()
    expected = {f"blocks.{k}": v.detach() for k, v in model.state_dict().items()}
    for run in runs:
        assert max_diff(run["final"], expected) <= 1e-5
    clipped = [r["clip:1f1b:norm"]["final"] for r in records]
    parity = [[indices(b) for b in r["parity:1f1b:sgd"]["batches"]] for r in records]
    batches = [parity[0][s] + parity[1][s] for s in range(STEPS)]
    expected, _ = reference("sgd", STEPS, batches=batches, clip="norm")
    assert max_diff(reference("sgd", STEPS, batches=batches)[0], expected) > 1e-2  # the clipping changes the run
    for final in clipped:
        assert max_diff(final, expected) <= 1e-5


def test_meta_init_beside_the_pipeline_is_refused_naming_the_fix(tmp_path):
    """The pipeline splits real weights (every rank takes rank 0's before fsdp shards its
    stages): fsdp's meta_init=True is refused beside it, as beside tp (FT1)."""
    import hookloop
    from torch.utils.data import DataLoader
    from pipeline_models import Net

    class Built(Net):
        def __init__(self):
            super().__init__()
            del self.blocks

        def configure_model(self):
            self.blocks = blocks(0)

    trainer = hookloop.Trainer(plugins=["pipeline", "fsdp"], mesh={"pp": 1, "dp_shard": 1}, max_steps=1,
                               default_root_dir=tmp_path, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(hookloop.ConfigurationError) as info:
        trainer.fit(Built(), DataLoader(data(), batch_size=BATCH))
    text = " ".join(str(info.value).split())
    assert "'pipeline' splits the model before fsdp shards it" in text
    assert "--plugin-option fsdp.meta_init=false" in text
    assert not torch.distributed.is_initialized()


@pytest.mark.full  # 8 processes
def test_fsdp_x_tp_x_pipeline_on_2x2x2_equals_the_one_process_loop(tmp_path):
    """fsdp,tp,pipeline on pp=2,dp_shard=2,tp=2: each rank's stage split by tp, then sharded
    by fsdp on (dp_shard, tp) (was: tp ended wrap_model's chain, fsdp never sharded and the
    shards' batches were not averaged: 5.8e-2 off)."""
    run_python([sys.executable, "-m", "hookloop", "run", "--plugins", "fsdp,tp,pipeline", "--mesh",
                "pp=2,dp_shard=2,tp=2", "--devices", "8", "--plugin-option", "fsdp.meta_init=false", str(SCRIPT),
                str(tmp_path), "tp:1f1b:adam"], cwd=tmp_path, timeout=500)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["tp:1f1b:adam"] for r in range(8)]
    # mesh (pp, dp_shard, tp): rank = 4 pp + 2 dp + tp; dp shards 0 and 1 are ranks 0 and 2
    seen = [[indices(b) for b in run["batches"]] for run in runs]
    expected, _ = reference("adam", STEPS, batches=[seen[0][s] + seen[2][s] for s in range(STEPS)])
    for rank, run in enumerate(runs):
        assert max_diff(run["final"], expected) <= 1e-5
        own = ("blocks.0", "blocks.1") if rank < 4 else ("blocks.2", "blocks.3")
        assert all((len(layout) == 2) == name.startswith(own) for name, layout in run["layouts"].items())
