"""fsdp x tp (2D) and HSDP x tp on one device mesh, and DCP checkpoints across layouts.

Real gloo processes on the CPU, the attention + MLP block of tests/scripts/tp_models.py,
full-batch steps (every layout's global batch is the whole 8-sample data set, so the
samplers' shuffling changes nothing but the order of a sum). Each run is compared with
the same model trained by a hand-written one-process PyTorch loop (:func:`reference`):
weights and the optimizer's state after 6 steps within 1e-5.

* 2x2: ``hookloop run --plugins fsdp,tp --devices 4 --mesh dp_shard=2,tp=2`` (the CLI
  path): SGD (fsdp's default ``state_dict_type="full"``: the module whole after fit) and
  Adam (``"sharded"``), saving a DCP checkpoint at step 2; Adam with two micro-batches a
  step and the gradients clipped by norm;
* 4x1: ``--plugins fsdp --mesh dp_shard=4`` resumes that checkpoint, saves at step 4;
* 1 process (in this process): resumes the 4x1 checkpoint to step 6;
* HSDP x tp (the Trainer path: ``Trainer(plugins=[fsdp HYBRID_SHARD, "tp"], devices=4,
  mesh=...)`` in the script): ``dp_replicate=2,dp_shard=1,tp=2`` on 4 processes, the
  smallest layout where HSDP's 2-D data-parallel mesh (replicas all-reduce, shard group
  reduce-scatter) wraps an already tensor-parallel model; its shard group has one
  process. The real ``dp_replicate=2,dp_shard=2,tp=2`` needs 8 processes:
  ``make test-full`` only.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, run_python

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from tp_models import Net, data  # noqa: E402
from tiers import at_least  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "fsdp_tp_job.py"
STEPS, SAMPLES = 6, 8
FULL = at_least("full")


def reference(optimizer: str, steps: int, clip: float | None = None) -> tuple[dict, dict]:
    """The same model trained by a hand-written loop in one process, full batch:
    (weights, optimizer state by parameter name) after ``steps`` steps; ``clip``: the
    gradients clipped to that total norm."""
    model = Net(attention=True, optimizer=optimizer)
    opt = model.make_optimizer(model.parameters())
    batch = data(SAMPLES)[:]
    for _ in range(steps):
        opt.zero_grad()
        model.loss(batch).backward()
        if clip is not None:
            assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) > 5 * clip  # it clips
        opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items() if k != "step"}
             for n, p in model.named_parameters() if p in opt.state}
    return weights, state


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def state_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(max_diff(a[n], b[n]) for n in a)


def ranks(out, mode: str, world: int = 4) -> list[dict]:
    return [torch.load(out / f"{mode}.rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2x2 run, then the 4x1 run resuming its checkpoint (one module: one launch each)."""
    out = tmp_path_factory.mktemp("fsdp_tp")
    launch = [sys.executable, "-m", "hookloop", "run", "--devices", "4"]
    p1 = run_python(launch + ["--plugins", "fsdp,tp", "--mesh", "dp_shard=2,tp=2", str(SCRIPT), str(out), "2x2"],
                    cwd=out, timeout=600)
    p2 = run_python(launch + ["--plugins", "fsdp", "--mesh", "dp_shard=4", str(SCRIPT), str(out), "4x1"],
                    cwd=out, timeout=600)
    return out, p1.stdout + p1.stderr + p2.stdout + p2.stderr


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fsdp_x_tp_on_2x2_equals_one_process(runs, optimizer):
    out, _ = runs
    weights, state = reference(optimizer, STEPS)
    for record in ranks(out, "2x2"):
        run = record[optimizer]
        assert run["mesh"] == (("dp_shard", "tp"), (2, 2))
        assert run["global_step"] == STEPS
        assert max_diff(run["weights"], weights) <= 1e-5
        assert state_diff(run["optimizer"], state) <= 1e-5
        # 2D: split layers on (dp_shard, tp), replicated-by-tp ones sharded on dp_shard only
        assert run["layouts"]["attn.q.weight"][1] == ("dp_shard", "tp")
        assert run["layouts"]["mlp.fc2.weight"] == (("S(0)", "S(1)"), ("dp_shard", "tp"))
        assert run["layouts"]["head.weight"] == (("S(0)",), ("dp_shard",))


@pytest.mark.slow
def test_accumulation_and_clipping_by_norm_across_the_two_meshes_equal_one_process(runs):
    """Two micro-batches a step (fsdp's no-sync accumulation, tp following), the gradients
    clipped by their total norm although they are DTensors on two meshes (split layers'
    on (dp_shard, tp), the others' on dp_shard): torch's clip_grad_norm_ refuses them."""
    out, _ = runs
    weights, state = reference("adam", STEPS, clip=0.05)
    for record in ranks(out, "2x2"):
        run = record["clipped"]
        assert run["global_step"] == STEPS and len(run["batches"]) == 2 * STEPS
        assert max_diff(run["weights"], weights) <= 1e-5
        assert state_diff(run["optimizer"], state) <= 1e-5


@pytest.mark.slow
def test_the_tp_processes_of_a_data_parallel_rank_see_its_batches(runs):
    out, output = runs
    seen = [r["sgd"]["batches"] for r in ranks(out, "2x2")]
    x = data(SAMPLES).tensors[0]
    for step in range(STEPS):
        # ranks (0, 1) and (2, 3) are tp groups: the same batch; the two groups, halves
        assert torch.equal(seen[0][step], seen[1][step]) and torch.equal(seen[2][step], seen[3][step])
        both = torch.cat([seen[0][step], seen[2][step]])
        assert sorted(both.sum((1, 2)).tolist()) == sorted(x.sum((1, 2)).tolist())
    assert "the lifecycle led by 'fsdp'" in output


@pytest.mark.slow
def test_state_dict_type_full_leaves_the_module_whole_after_fit(runs):
    out, _ = runs
    weights, _ = reference("sgd", STEPS)
    for record in ranks(out, "2x2"):
        assert record["sgd"]["after_fit_types"] == ["Parameter"]
        assert max_diff(record["sgd"]["after_fit"], {k: v for k, v in weights.items()}) <= 1e-5


@pytest.mark.slow
def test_a_2x2_checkpoint_resumes_on_4x1_like_an_uninterrupted_run(runs):
    out, _ = runs
    assert {"latest", "step2"} <= {p.name for p in (out / "2x2.ckpt").iterdir()}
    assert len(list((out / "2x2.ckpt" / "step2" / "model").glob("*.distcp"))) == 4
    weights, state = reference("adam", STEPS)
    for record in ranks(out, "4x1"):
        run = record["adam"]
        assert run["mesh"] == (("dp_shard",), (4,))
        assert len(run["batches"]) == STEPS - 2  # resumed at step 2
        assert max_diff(run["weights"], weights) <= 1e-5
        assert state_diff(run["optimizer"], state) <= 1e-5


class _Probe:
    hookloop_name, hookloop_role = "probe", "observer"

    @hookloop.hookimpl
    def on_train_end(self, trainer):
        full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()  # noqa: E731
        module, optimizer = trainer.module, trainer.optimizers[0]
        self.weights = {n: full(p) for n, p in module.named_parameters()}
        self.state = {n: {k: full(v) for k, v in optimizer.state[p].items() if k != "step"}
                      for n, p in module.named_parameters() if p in optimizer.state}


@pytest.mark.slow
def test_the_4x1_checkpoint_resumes_on_one_process_like_an_uninterrupted_run(runs, tmp_path):
    import torch.distributed as dist

    out, _ = runs
    probe = _Probe()
    module = Net(attention=True, optimizer="adam", seed=9)  # other weights: the checkpoint's must win
    trainer = hookloop.Trainer(plugins=["fsdp", probe], max_steps=STEPS, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data(SAMPLES), batch_size=SAMPLES), ckpt_path=out / "4x1.ckpt")
    assert not dist.is_initialized()
    weights, state = reference("adam", STEPS)
    assert max_diff(probe.weights, weights) <= 1e-5
    assert state_diff(probe.state, state) <= 1e-5


def _hsdp(tmp_path, sizes: str, world: int):
    env = {**os.environ, "HSDP_MESH": sizes}
    run_python([sys.executable, str(SCRIPT), str(tmp_path), "hsdp"], cwd=tmp_path, env=env, timeout=600)
    names = ("dp_replicate", "dp_shard", "tp")
    shape = tuple(int(dict(p.split("=") for p in sizes.split(","))[n]) for n in names)
    for optimizer in ("sgd", "adam"):
        weights, state = reference(optimizer, STEPS)
        for record in ranks(tmp_path, "hsdp", world):
            run = record[optimizer]
            assert run["mesh"] == (names, shape)
            assert run["layouts"]["head.weight"][1] == ("dp_replicate", "dp_shard")
            assert run["layouts"]["attn.out.weight"][1] == names
            assert max_diff(run["weights"], weights) <= 1e-5
            assert state_diff(run["optimizer"], state) <= 1e-5


@pytest.mark.slow
def test_hsdp_x_tp_from_the_trainer_equals_one_process(tmp_path):
    _hsdp(tmp_path, "dp_replicate=2,dp_shard=1,tp=2", 4)


@pytest.mark.full  # 8 processes
def test_hsdp_x_tp_on_2x2x2_equals_one_process(tmp_path):
    _hsdp(tmp_path, "dp_replicate=2,dp_shard=2,tp=2", 8)


# -- refused: docs/configurations.md, "fsdp x tp", in one process (a 1 x 1 mesh) ----------


class LateMLP(Net):
    """``Net`` whose MLP ``configure_model`` creates (fsdp's meta-device creation)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mlp = None

    def configure_model(self):
        from tp_models import MLP

        if self.mlp is None:
            self.mlp = MLP()


def _fit_one_process(module, plugins, tmp_path, steps=2):
    trainer = hookloop.Trainer(plugins=plugins, mesh={"dp_shard": 1, "tp": 1}, max_steps=steps,
                               enable_checkpointing=False, logger=False, enable_progress_bar=False,
                               num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data(SAMPLES), batch_size=SAMPLES))
    return trainer


def test_ft1_meta_init_beside_tp_is_refused_at_start_naming_the_fix(tmp_path):
    import torch.distributed as dist

    with pytest.raises(hookloop.ConfigurationError) as info:
        _fit_one_process(LateMLP(optimizer="adam"), ["fsdp", "tp"], tmp_path)
    text = " ".join(str(info.value).split())
    assert "--plugin-option fsdp.meta_init=false" in text
    # the documented row, word for word
    section = (REPO / "docs" / "configurations.md").read_text().split("## fsdp x tp", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith("| FT1 |"))
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    assert cells[4] == "`ConfigurationError`" and cells[3] == "at start"
    assert text == " ".join(cells[5].strip("`").split())
    assert not dist.is_initialized()


def test_with_meta_init_off_configure_model_trains_under_fsdp_x_tp_like_one_process(tmp_path):
    module = LateMLP(optimizer="adam")
    _fit_one_process(module, [hookloop.plugin("fsdp", meta_init=False), "tp"], tmp_path, steps=3)
    expected = LateMLP(optimizer="adam")  # the same construction, then a hand-written loop
    expected.configure_model()
    opt = expected.make_optimizer(expected.parameters())
    for _ in range(3):
        opt.zero_grad()
        expected.loss(data(SAMPLES)[:]).backward()
        opt.step()
    got = {k: v.detach() for k, v in module.state_dict().items()}
    assert max_diff(got, expected.state_dict()) <= 1e-5


def test_the_data_parallel_plugin_leads_whatever_the_listed_order(tmp_path):
    """``Trainer(plugins=["tp", "fsdp"])``: fsdp is ``trainer.strategy`` (the checkpoint
    observer reads the format from it): under fsdp's default ``state_dict_type="full"``
    ``last.ckpt`` is one file, which a second run into the same directory accepts, and it
    holds the one-process loop's weights."""
    from hookloop.distributed import mesh

    assert mesh.lifecycle_lead([hookloop.plugin("tp"), hookloop.plugin("fsdp")]).hookloop_name == "fsdp"
    weights, _ = reference("sgd", 3)
    for _ in range(2):
        module = Net(attention=True, optimizer="sgd")
        trainer = hookloop.Trainer(plugins=["tp", "fsdp", hookloop.ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)],
                                   mesh={"dp_shard": 1, "tp": 1}, max_steps=3, logger=False,
                                   enable_progress_bar=False, num_sanity_val_steps=0, default_root_dir=tmp_path)
        assert trainer.strategy.hookloop_name == "fsdp"
        trainer.fit(module, DataLoader(data(SAMPLES), batch_size=SAMPLES))
        assert (tmp_path / "ck" / "last.ckpt").is_file()
        saved = hookloop.safe_load(tmp_path / "ck" / "last.ckpt")["state_dict"]
        assert max_diff({k: saved[k] for k in weights}, weights) <= 1e-5


@pytest.mark.slow
def test_tps_self_check_stops_a_global_heads_attention_beside_fsdp_on_every_rank(runs):
    """Issue 33: fsdp x tp trained another function with an attention that views its heads
    with the global head count; tp.verify stops it at the start of fit, every rank alike."""
    out, _ = runs
    errors = [record["global_heads"] for record in ranks(out, "2x2")]
    assert errors[0] is not None and len(set(errors)) == 1
    assert "the output of 'attn.out' differs by" in errors[0]
    assert "views its heads with the global head count" in errors[0]
