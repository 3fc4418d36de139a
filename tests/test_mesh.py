"""One device mesh per run (hookloop.mesh, issue 21).

In this process: the sizes (``Trainer(mesh=...)``, ``--mesh``, ``HOOKLOOP_MESH``) and
their errors, worked against closed-form layouts; the composition rule's refusals, each
row of docs/configurations.md's "Composing on one device mesh" table raised for real and
compared with its documented message; the third-party dimension example of
docs/plugin-authors.md, run as written. Real processes (gloo): fsdp on the core's mesh
(2 processes) against a hand-written full-batch SGD loop; a 2x2 mesh (4 processes) with
two mesh plugins defined in tests/scripts/mesh_run.py, whose sub-meshes' ranks are
checked against the row-major layout worked out here.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, run_python
from hookloop.distributed import mesh
from hookloop.contract.pluginspec import plugin_name

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from mesh_models import LR, STEPS, MLP, build, data  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "mesh_run.py"
CONFIGURATIONS = REPO / "docs" / "configurations.md"
AUTHORS = REPO / "docs" / "plugin-authors.md"


# -- sizes ---------------------------------------------------------------------------------


def test_sizes_from_text_dict_and_environment(monkeypatch):
    assert mesh.parse_mesh("dp_shard=2,tp=2") == {"dp_shard": 2, "tp": 2}
    assert mesh.parse_mesh("dp_shard, tp=2") == {"dp_shard": None, "tp": 2}
    assert mesh.parse_mesh({"dp_shard": -1, "tp": 2}) == {"dp_shard": None, "tp": 2}
    assert mesh.parse_mesh(None) == {} == mesh.parse_mesh("")
    monkeypatch.setenv("HOOKLOOP_MESH", "dp_shard=1")
    assert hookloop.Trainer(plugins=["fsdp"]).config.mesh == {"dp_shard": 1}
    # code wins over the environment
    assert hookloop.Trainer(plugins=["fsdp"], mesh="dp_shard=-1").config.mesh == {"dp_shard": None}


@pytest.mark.parametrize("value, message", [
    ("dp_shard=two", r"the size of 'dp_shard' is 'two', not an integer"),
    ({"tp": 0}, r"the size of 'tp' is 0; it must be an integer >= 1"),
    ({"2d": 2}, r"'2d' is not a dimension name"),
    (["tp"], r"must be a dict"),
])
def test_bad_sizes_are_refused_at_construction(value, message):
    with pytest.raises(hookloop.ConfigurationError, match=message):
        hookloop.Trainer(plugins=["fsdp"], mesh=value)


def test_an_unknown_dimension_is_refused_naming_the_claimed_ones():
    with pytest.raises(hookloop.ConfigurationError,
                       match=r"mesh dimension 'ep' is claimed by no enabled plugin \(claimed: dp_shard \(fsdp\)\)"):
        hookloop.Trainer(plugins=["fsdp"], mesh={"ep": 2})
    hookloop.Trainer(plugins=["fsdp"], mesh={"ep": 1})  # a size of one names no processes


CLAIMS = {"tp": "tp", "dp_shard": "fsdp", "pp": "pipeline", "ep": "experts"}


@pytest.mark.parametrize("sizes, world, expected", [
    ({"dp_shard": 2, "tp": 2}, 4, (("pp", "dp_shard", "tp", "ep"), None)),
    ({"tp": 2, "pp": 1, "ep": 1}, 8, (("pp", "dp_shard", "tp", "ep"), (1, 4, 2, 1))),
    ({"pp": 2, "dp_shard": 3, "tp": 1, "ep": 2}, 12, (("pp", "dp_shard", "tp", "ep"), (2, 3, 1, 2))),
])
def test_layout_orders_the_dimensions_and_sizes_the_one_left_out(sizes, world, expected):
    names, shape = expected
    if shape is None:  # pp and ep unsized: two left out
        with pytest.raises(hookloop.ConfigurationError, match=r"'pp', 'ep' have no size, and only one may take"):
            mesh.layout(sizes, CLAIMS, world)
        return
    assert mesh.layout(sizes, CLAIMS, world) == (names, shape)


def test_sizes_whose_product_is_not_the_world_are_refused():
    with pytest.raises(hookloop.ConfigurationError,
                       match=r"mesh dp_shard=2,tp=2 holds 4 processes, and the run has 2: the sizes' product"):
        mesh.layout({"dp_shard": 2, "tp": 2}, {"dp_shard": "fsdp", "tp": "tp"}, 2)
    with pytest.raises(hookloop.ConfigurationError, match=r"3 processes are not a multiple of 2"):
        mesh.layout({"tp": 2}, {"dp_shard": "fsdp", "tp": "tp"}, 3)


# -- composition: docs/configurations.md's table, row by row --------------------------------------


def refusal_rows() -> list[tuple[str, list[str], str, str, str, str]]:
    """``(id, plugins, mesh, when, raises, message)`` of every refused row."""
    text = CONFIGURATIONS.read_text()
    section = text.split("## Composing on one device mesh", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"R\d\d", cells[0]):
            plugins = [p.strip() for p in cells[1].strip("`").split(",")]
            rows.append((cells[0], plugins, cells[2].strip("`"), cells[3], cells[4].strip("`"), cells[5].strip("`")))
    return rows


def test_the_table_has_refusal_rows():
    assert len(refusal_rows()) >= 6


@pytest.mark.parametrize("row", refusal_rows(), ids=lambda r: r[0])
def test_each_documented_refusal_is_raised_with_its_message(row):
    _, plugins, sizes, when, raises, message = row
    with pytest.raises(hookloop.HookloopError) as info:
        trainer = hookloop.Trainer(plugins=plugins, mesh=sizes or None, max_steps=1, enable_checkpointing=False,
                                   logger=False, enable_progress_bar=False, enable_model_summary=False)
        assert when == "at start", f"{row[0]} was not refused at construction"
        trainer.fit(MLP(), DataLoader(data(), batch_size=8))
    assert type(info.value).__name__ == raises
    assert " ".join(str(info.value).split()) == " ".join(message.split())
    assert not torch.distributed.is_initialized()


class TpStrategy:
    hookloop_name, hookloop_role, hookloop_mesh_dims = "tp_s", "strategy", ("tp",)


def test_a_mesh_plugin_from_the_command_line_composes_with_one_in_code(monkeypatch):
    monkeypatch.setenv("HOOKLOOP_PLUGINS", "fsdp")
    names = [plugin_name(p) for p in hookloop.Trainer(plugins=[TpStrategy()], logger=False).plugins]
    assert "fsdp" in names and "tp_s" in names
    # a second data-parallel wrapper in code still replaces it (a run has one)
    names = [plugin_name(p) for p in hookloop.Trainer(plugins=["ddp"], logger=False).plugins]
    assert "ddp" in names and "fsdp" not in names


def test_two_mesh_plugins_claiming_one_dimension_are_refused_naming_both():
    class A:
        hookloop_name, hookloop_role, hookloop_mesh_dims = "tp_a", "extension", ("tp",)

    class B:
        hookloop_name, hookloop_role, hookloop_mesh_dims = "tp_b", "extension", ("tp",)

    with pytest.raises(hookloop.PluginConflictError, match="plugins 'tp_a' and 'tp_b' both claim the mesh dimension 'tp'"):
        hookloop.Trainer(plugins=[A(), B()])


def test_a_non_composable_owner_beside_a_mesh_extension_is_refused_naming_both():
    class Experts:
        hookloop_name, hookloop_role, hookloop_mesh_dims = "experts", "extension", ("ep",)

    with pytest.raises(hookloop.PluginConflictError,
                       match="plugins 'deepspeed' and 'experts' cannot run together: 'deepspeed' owns the model"):
        hookloop.Trainer(plugins=["deepspeed", Experts()])


def _transform(name: str, dims: tuple, tryfirst: bool = False):
    def wrap_model(self, model):
        return None  # a transform in place: the next plugin's wrap_model runs

    return type(name, (), {"hookloop_name": name, "hookloop_role": "extension", "hookloop_mesh_dims": dims,
                           "wrap_model": hookloop.hookimpl(tryfirst=tryfirst)(wrap_model)})()


def test_wrap_model_runs_in_transform_order_whatever_the_listed_order():
    plugins = ["fsdp", _transform("compile_x", ()), _transform("tp_x", ("tp",)), _transform("pipe_x", ("pp",))]
    for listed in (plugins, plugins[::-1]):
        pm = hookloop.Trainer(plugins=listed, logger=False).plugin_manager
        called = [pm.get_name(impl.plugin) for impl in reversed(pm.hook.wrap_model.get_hookimpls())]
        assert called == ["pipe_x", "tp_x", "compile_x", "fsdp", "hookloop.defaults"]
    # tryfirst on every transform keeps the order; on the wrapper alone it is refused
    early = [_transform(n, d, tryfirst=True) for n, d in (("compile_x", ()), ("tp_x", ("tp",)))]
    pm = hookloop.Trainer(plugins=early + ["fsdp"], logger=False).plugin_manager
    assert [pm.get_name(i.plugin) for i in reversed(pm.hook.wrap_model.get_hookimpls())][:3] == ["tp_x", "compile_x", "fsdp"]
    with pytest.raises(hookloop.PluginConflictError,
                       match=r"plugin 'compile_x'.s wrap_model \(compile\) would run before 'tp_x'.s \(tp\)"):
        hookloop.Trainer(plugins=[_transform("compile_x", (), tryfirst=True), _transform("tp_x", ("tp",))])


# -- real processes --------------------------------------------------------------------------


def hand_written_full_batch_sgd() -> dict:
    """The single-process reference: full-batch SGD on all 16 samples (2 ranks x 8 per
    step, the mean of their means), ``STEPS`` steps."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = data().tensors
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {f"net.{k}": v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_fsdp_on_the_core_mesh_matches_one_process(tmp_path):
    run_python([sys.executable, "-m", "hookloop", "run", "--plugins", "fsdp", "--devices", "2", "--mesh", "dp_shard=2",
                str(SCRIPT), "fsdp", str(tmp_path)], cwd=tmp_path, timeout=300)
    reference = hand_written_full_batch_sgd()
    for rank in (0, 1):
        record = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert record["mesh"] == {"names": ("dp_shard",), "shape": (2,), "is_trainers": True}
        assert record["fsdp_mesh"] == {"names": ("dp_shard",), "shape": (2,), "from_core": True}
        weights = record["weights"]
        assert weights.keys() == reference.keys()
        diff = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
        assert diff <= 1e-5, diff
        assert any(float((weights[k] - build().state_dict()[k.removeprefix("net.")]).abs().max()) > 1e-3
                   for k in reference)  # it trained


@pytest.mark.slow
def test_two_mesh_plugins_receive_their_sub_meshes_on_a_2x2_mesh(tmp_path):
    run_python([sys.executable, "-m", "hookloop", "run", "--devices", "4", "--mesh", "dp_shard=2,tp=2",
                str(SCRIPT), "probe", str(tmp_path)], cwd=tmp_path, timeout=400)
    grid = [[0, 1], [2, 3]]  # row-major: rank = dp_shard index * 2 + tp index
    for rank in range(4):
        record = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert record["rank"] == rank
        assert record["mesh"] == {"names": ("dp_shard", "tp"), "shape": (2, 2), "is_trainers": True}
        row, col = divmod(rank, 2)
        assert record["tp_probe"] == {"names": ("tp",), "shape": (2,), "ranks": grid[row]}
        assert record["shard_probe"] == {"names": ("dp_shard",), "shape": (2,), "ranks": [grid[0][col], grid[1][col]]}
        assert record["ddp_group"] == [grid[0][col], grid[1][col]]  # ddp replicates over its dimension only


# -- docs/plugin-authors.md's third-party dimension, as written ------------------------------------


def test_the_expert_parallel_example_of_the_guide_runs(tmp_path):
    text = AUTHORS.read_text()
    section = text.split("## Adding a mesh dimension", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {"__name__": "guide_example"}
    exec(compile(code, str(AUTHORS), "exec"), namespace)
    seen = namespace["run_example"](str(tmp_path))
    assert seen == {"names": ("dp_replicate", "ep"), "ep_size": 1, "experts_here": [0, 1, 2, 3]}
