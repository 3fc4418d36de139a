"""hookloop-compile: torch.compile as a plugin, against the hand-written eager loop.

Most runs compile with ``backend="aot_eager"`` (Dynamo and AOTAutograd, no code
generation: exact and fast on CPU); one compiles a tiny MLP with inductor. Every run is
compared with tests/scripts/compile_models.eager_reference, a plain PyTorch loop that
never compiles: one process, ``ddp,compile`` and ``fsdp,compile`` on 2 processes (gloo)
launched from the command line as a user would.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import ExtensionConformance
from conftest import REPO, install_fake_distribution, max_abs_diff, run_python, state_of

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from compile_models import Block, Encoder, Net, data, data_parallel_batches, eager_reference  # noqa: E402
from hookloop_compile import REPORT_FILE, Compile  # noqa: E402

SCRIPTS = REPO / "tests" / "scripts"
EPOCHS = 2


def compiled_now(module) -> list[str]:
    """The names of the modules of ``module`` whose calls go through torch.compile."""
    return sorted(n for n, m in module.named_modules() if m.__dict__.get("_compiled_call_impl") is not None)


def reports(output: str) -> int:
    """How many reports a run printed (their first line)."""
    return sum(line.startswith("compile: ") for line in output.splitlines())


class Seen:
    """Records which modules were compiled while the run trained."""

    hookloop_name, hookloop_role = "seen", "observer"

    def __init__(self):
        self.compiled = None

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        self.compiled = compiled_now(trainer.module)


def trainer(tmp_path, *plugins, epochs=EPOCHS, **kwargs):
    return hookloop.Trainer(max_epochs=epochs, plugins=list(plugins), default_root_dir=tmp_path,
                            enable_progress_bar=False, enable_model_summary=False, logger=False,
                            enable_checkpointing=False, **kwargs)


def loader(batch_size=16):
    return DataLoader(data(), batch_size=batch_size)


def fit(tmp_path, module, *plugins, epochs=EPOCHS, val=False, ckpt_path=None):
    seen = Seen()
    t = trainer(tmp_path, *plugins, seen, epochs=epochs)
    t.fit(module, loader(), loader() if val else None, ckpt_path=ckpt_path)
    return t, seen


# -- one process ------------------------------------------------------------------------


def test_whole_model_compiled_equals_the_eager_loop_and_reports_once(tmp_path, capfd):
    module = Net()
    plugin = Compile(backend="aot_eager")
    t, seen = fit(tmp_path, module, plugin, epochs=3, val=True)
    reference = eager_reference(Net(), loader(), 3)
    assert max_abs_diff(state_of(module), reference) <= 1e-5
    assert seen.compiled == [""]  # the LightningModule itself, in place
    assert compiled_now(module) == []  # given back uncompiled after fit
    # the original parameter names everywhere: no _orig_mod. prefix
    assert list(module.state_dict()) == list(reference)
    assert plugin.report["graphs"] >= 1 and plugin.report["epoch"] == 0
    assert plugin.report["compiled"] == ["Net"]
    on_disk = json.loads((t.log_dir / REPORT_FILE).read_text())
    assert on_disk == plugin.report
    err = capfd.readouterr().err
    assert reports(err) == 1, err  # once, at the end of the first epoch of 3
    assert "in the first training epoch (backend aot_eager; compiled: Net)" in err


def test_per_block_compiles_each_block_in_place(tmp_path):
    module = Net()
    plugin = Compile(backend="aot_eager", blocks=["Block"])
    _, seen = fit(tmp_path, module, plugin)
    assert seen.compiled == ["blocks.0", "blocks.1"]  # not the head, not the whole model
    assert plugin.report["compiled"] == ["blocks.0", "blocks.1"] and plugin.report["graphs"] >= 1
    assert max_abs_diff(state_of(module), eager_reference(Net(), loader(), EPOCHS)) <= 1e-5
    # by qualified name too, and a block inside a chosen block is not compiled again
    nested = Compile(backend="aot_eager", blocks=[f"{Block.__module__}.Block", "Linear"])
    assert list(nested.targets(Net())) == ["blocks.0", "blocks.1", "head"]


def test_per_block_compiles_blocks_whose_forward_is_torchs_own(tmp_path):
    """nn.TransformerEncoderLayer's forward is torch's code: Dynamo starts no frame in it,
    so Module.compile() alone compiled nothing there (0 graphs) and it ran eagerly."""
    module = Encoder()
    plugin = Compile(backend="aot_eager", blocks=["TransformerEncoderLayer"])
    _, seen = fit(tmp_path, module, plugin)
    assert seen.compiled == ["layers.0", "layers.1"]
    assert plugin.report["graphs"] >= 1, plugin.report
    assert max_abs_diff(state_of(module), eager_reference(Encoder(), loader(), EPOCHS)) <= 1e-5


def test_a_graph_break_is_reported_with_its_reason(tmp_path, capfd):
    module = Net(graph_break=True)
    plugin = Compile(backend="aot_eager")
    t, _ = fit(tmp_path, module, plugin)
    report = json.loads((t.log_dir / REPORT_FILE).read_text())
    assert report["graph_breaks"] >= 1
    assert any("item()" in b["reason"] for b in report["graph_break_reasons"]), report
    assert "graph break (x" in capfd.readouterr().err
    assert max_abs_diff(state_of(module), eager_reference(Net(graph_break=True), loader(), EPOCHS)) <= 1e-5


class StepOnly(Net):
    """A training step that calls its layers, never ``self(x)`` (a forward of its own:
    Net's may be compiled already by an earlier test in this process)."""

    def forward(self, x):
        return self.head(self.blocks(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(self.blocks(x)), y)


def test_nothing_compiled_is_said_only_when_forward_was_never_compiled(tmp_path):
    with pytest.warns(UserWarning, match=r"compile: nothing was compiled in the first training epoch: the training "
                                         r"step never called StepOnly itself \(self\(x\)\); name the modules"):
        fit(tmp_path / "a", StepOnly(), Compile(backend="aot_eager"), epochs=1)
    import warnings

    fit(tmp_path / "b", Net(), Compile(backend="aot_eager"), epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second fit of Net reuses the compiled graph: 0 new, no warning
        plugin = Compile(backend="aot_eager")
        fit(tmp_path / "c", Net(), plugin, epochs=1)
    assert plugin.report["graphs"] == 0


def test_checkpoints_load_between_compiled_and_uncompiled_runs(tmp_path):
    """Compiled for an epoch -> saved -> resumed uncompiled, and the other way round:
    both equal the uninterrupted eager loop."""
    reference = eager_reference(Net(), loader(), EPOCHS)
    for first, second in (([Compile(backend="aot_eager")], []), ([], [Compile(backend="aot_eager")])):
        root = tmp_path / f"{len(first)}{len(second)}"
        t, _ = fit(root, Net(), *first, epochs=1)
        path = t.save_checkpoint(root / "one.ckpt")
        saved = torch.load(path, weights_only=False)["state_dict"]
        assert list(saved) == list(reference)  # the plain model's names
        resumed = Net(seed=5)  # other weights: the checkpoint must bring them
        fit(root, resumed, *second, epochs=EPOCHS, ckpt_path=str(path))
        assert max_abs_diff(state_of(resumed), reference) <= 1e-5


@pytest.mark.slow
def test_inductor_on_a_tiny_mlp_equals_the_eager_loop(tmp_path):
    module = Net()
    plugin = Compile()  # inductor, the default
    fit(tmp_path, module, plugin, epochs=1)
    assert plugin.report["backend"] == "inductor" and plugin.report["graphs"] >= 1
    assert max_abs_diff(state_of(module), eager_reference(Net(), loader(), 1)) <= 1e-5


@pytest.mark.parametrize("options, message", [
    ({"mode": "fast"}, "option mode='fast' is not one of"),
    ({"mode": "max-autotune", "options": {"trace.enabled": True}}, "cannot both be given"),
    ({"blocks": []}, "must be None or a non-empty list of module class names"),
    ({"blocks": [3]}, "must be None or a non-empty list of module class names"),
    ({"fullgraph": "yes"}, "option fullgraph='yes' must be True or False"),
    ({"dynamic": "auto"}, "option dynamic='auto' must be None, True or False"),
    ({"options": "x"}, "must be a dict"),
    ({"backend": ""}, "must be a backend name"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(hookloop.ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Compile(**options)


def test_blocks_naming_no_module_and_an_unknown_backend_are_refused_at_wrap(tmp_path):
    with pytest.raises(hookloop.ConfigurationError, match=r"no module of class 'TransformerBlock' in Net; "
                                                          r"its module classes are: Block, LayerNorm, Linear, Net"):
        trainer(tmp_path, Compile(backend="aot_eager", blocks="TransformerBlock")).fit(Net(), loader())
    module = Net()
    with pytest.raises(hookloop.ConfigurationError, match=r"torch.compile\(.*backend='no_such_backend'.*\) failed"):
        trainer(tmp_path, Compile(backend="no_such_backend")).fit(module, loader())
    assert compiled_now(module) == []


# -- with a data-parallel strategy, 2 processes ---------------------------------------------


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    """The environment in which ``hookloop run --plugins ...,compile`` finds the plugin:
    as installed, or (a checkout whose venv predates the plugin) its entry point laid
    out in a site directory on PYTHONPATH."""
    if any(ep.name == "compile" for ep in md.entry_points(group="hookloop.plugins")):
        return {}
    site = tmp_path_factory.mktemp("site")
    install_fake_distribution(site, "hookloop-compile", {"compile": "hookloop_compile:Compile"}, {})
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def run_two_processes(tmp_path, cli_env, strategy: str, *options: str):
    out = tmp_path / strategy
    out.mkdir()
    args = [sys.executable, "-m", "hookloop", "run", "--plugins", f"{strategy},compile", "--devices", "2",
            "--plugin-option", "compile.backend=aot_eager"]
    for option in options:
        args += ["--plugin-option", option]
    proc = run_python([*args, str(SCRIPTS / "compile_job.py"), str(out)], cwd=out, env=cli_env, timeout=500)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    reference = eager_reference(Net(), data_parallel_batches(data(), world=2, per_rank=8), EPOCHS)
    return ranks, reference, proc.stdout + proc.stderr


@pytest.mark.slow
def test_ddp_compile_on_two_processes_equals_one_eager_process(tmp_path, cli_env):
    ranks, reference, output = run_two_processes(tmp_path, cli_env, "ddp")
    for record in ranks:
        assert record["model_type"] == "DistributedDataParallel"
        assert record["compiled_during_fit"] == [""] and record["compiled_after_fit"] == []
        assert list(record["final"]) == list(reference)
        assert max_abs_diff(record["final"], reference) <= 1e-5
        assert record["report"]["graphs"] >= 1
    assert reports(output) == 1, output  # global rank 0 only
    assert json.loads((tmp_path / "ddp" / ranks[0]["log_dir"] / REPORT_FILE).read_text())["graphs"] >= 1


@pytest.mark.slow
def test_fsdp_compile_per_block_on_two_processes_equals_one_eager_process(tmp_path, cli_env):
    ranks, reference, output = run_two_processes(tmp_path, cli_env, "fsdp", "compile.blocks=Block",
                                                  "fsdp.auto_wrap_policy=Block")
    for record in ranks:
        assert record["compiled_during_fit"] == ["blocks.0", "blocks.1"]
        assert list(record["final"]) == list(reference)
        assert max_abs_diff(record["final"], reference) <= 1e-5
    assert reports(output) == 1, output


@pytest.mark.full  # one more 2-process launch (~30 s)
def test_in_place_compile_of_a_tensor_parallel_mlp_equals_the_eager_mlp(tmp_path):
    """torch's DTensor tensor parallelism (the transform tp applies before compile) under
    hookloop-compile's in-place compile, on 2 gloo processes, against the MLP trained whole."""
    run_python([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                str(SCRIPTS / "compile_tp_job.py"), str(tmp_path)], cwd=tmp_path, timeout=300)
    for rank in (0, 1):
        record = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert record["names"] == ["up.weight", "up.bias", "down.weight", "down.bias"]
        assert record["graphs"] >= 1
        assert record["diff"] <= 1e-5


# -- the kit's extension suite ------------------------------------------------------------


class TestCompileConformance(ExtensionConformance):
    """The kit's checks of an extension: trains beside the default observers, keeps no
    checkpoint state outside its name, resumes exactly. Its ddp check (one more 2-process
    launch; ddp,compile is tested above) runs under make test-full."""

    plugin = Compile
    options = {"backend": "aot_eager"}

    @pytest.mark.full  # ddp,compile is tested above; the kit's ddp check too
    def test_under_ddp_the_ranks_agree_and_a_resume_ends_as_an_uninterrupted_run(self, ddp):
        super().test_under_ddp_the_ranks_agree_and_a_resume_ends_as_an_uninterrupted_run(ddp)
