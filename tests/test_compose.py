"""Every pair of in-tree mesh plugins is tested or refused (issue 33, item 3).

The pairs are enumerated from the installed plugins' own declarations (every plugin with
``hookloop_mesh_dims``, and fsdp's variants HSDP, ``NO_SHARD`` and ``cpu_offload``): each
is either in :data:`TESTED`, naming a test that exists and compares the layout with one
process, or refused in this process before any process group exists, at construction
(``Trainer(plugins=[a, b])``: ``hookloop.distributed.mesh.check_refusals`` and the older rules) or,
for the one pair the pipeline refuses at its setup, by a 1-process ``fit``. A new mesh
plugin, or a refusal taken off, fails here until its pairs are tested or refused.
docs/configurations.md, "Every pair of mesh plugins", is the same table in words; the
test checks that every tested pair's test is named there.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO
from hookloop.distributed import mesh
from hookloop.contract import registry

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from mesh_models import MLP, data  # noqa: E402

#: fsdp's options that change its layout: each is a mesh plugin of its own here
FSDP_VARIANTS = {"fsdp[HYBRID_SHARD]": {"sharding_strategy": "HYBRID_SHARD"},
                 "fsdp[NO_SHARD]": {"sharding_strategy": "NO_SHARD"}}
#: plugins that are another one launched differently: (that plugin, the hooks they add)
SAME_LAYOUT = {"ddp_spawn": ("ddp", {"launch_command", "spawn"})}

#: each pair (sorted names) and the test that compares it with one process (<= 1e-5)
TESTED = {
    ("compile", "ddp"): "tests/test_compile.py::test_ddp_compile_on_two_processes_equals_one_eager_process",
    ("compile", "fsdp"): "tests/test_compile.py::test_fsdp_compile_per_block_on_two_processes_equals_one_eager_process",
    ("compile", "tp"): "tests/test_tp.py::test_tp_with_compile_equals_one_eager_process",
    ("cp", "ddp"): "tests/test_cp.py::test_the_data_path_on_two_cpu_processes_equals_one_process_without_attention",
    ("ddp", "pipeline"):
        "tests/test_pipeline.py::test_pipeline_x_ddp_on_a_2x2_mesh_equals_the_global_batch_loop_and_resumes",
    ("fsdp", "ft"): "tests/test_ft.py::test_hsdp_two_sharded_groups_average_their_gradients_like_one_process",
    ("fsdp", "pipeline"): "tests/test_pipeline_fsdp.py::test_pp2_x_dp_shard2_equals_the_one_process_global_batch_loop",
    ("fsdp", "tp"): "tests/test_fsdp_tp.py::test_fsdp_x_tp_on_2x2_equals_one_process",
    ("fsdp[HYBRID_SHARD]", "tp"): "tests/test_fsdp_tp.py::test_hsdp_x_tp_from_the_trainer_equals_one_process",
    ("pipeline", "tp"): "tests/test_pipeline.py::test_pipeline_x_tp_on_a_2x2_mesh_equals_one_process_and_resumes",
}
#: pairs refused once the run starts, in one process: (mesh sizes, the refusal's words)
REFUSED_AT_START = {
    ("cp", "pipeline"): ({"pp": 1, "cp": 1}, "the pipeline plugin does not compose with 'cp'"),
}


@functools.lru_cache(maxsize=None)
def mesh_plugin_names() -> tuple[str, ...]:
    """The installed plugins that declare mesh dimensions, and fsdp's layout variants."""
    names = []
    for name in sorted(registry.installed_plugins()):
        try:
            plugin = registry.resolve(name)
        except hookloop.HookloopError:
            continue  # a plugin whose dependency is missing here
        if mesh.mesh_dims(plugin) is not None:
            names.append(name)
    return tuple(sorted(names + list(FSDP_VARIANTS)))


def make(label: str):
    """A fresh instance of the plugin (or fsdp variant) ``label``."""
    if label in FSDP_VARIANTS:
        return hookloop.plugin("fsdp", **FSDP_VARIANTS[label])
    return registry.resolve(label)


def pairs() -> list[tuple[str, str]]:
    """Every pair of two plugins (variants of one plugin are no pair: a run has one fsdp)."""
    return [(a, b) for a, b in itertools.combinations(mesh_plugin_names(), 2)
            if a.split("[")[0] != b.split("[")[0]]


def _tested(pair: tuple[str, str]) -> str | None:
    """The test of ``pair``, through :data:`SAME_LAYOUT` (ddp_spawn is ddp's layout)."""
    base = tuple(sorted(SAME_LAYOUT.get(n, (n,))[0] for n in pair))
    return TESTED.get(pair) or TESTED.get(base)


def _test_exists(node: str) -> bool:
    path, name = node.split("::")
    tree = ast.parse((REPO / path).read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def test_the_mesh_plugins_are_the_ones_the_table_knows():
    assert {"compile", "cp", "ddp", "ddp_spawn", "float8", "fsdp", "fsdp_cpu_offload", "ft", "pipeline", "tp"} <= set(
        mesh_plugin_names())


def test_a_plugin_of_the_same_layout_differs_only_in_how_it_is_launched():
    for name, (base, hooks) in SAME_LAYOUT.items():
        cls, base_cls = type(make(name)), type(make(base))
        assert issubclass(cls, base_cls)
        own = {k for k in vars(cls) if getattr(getattr(cls, k), "hookloop_impl", None) is not None
               or k in {"wrap_model", "configure_sampler", "setup", "setup_environment", "teardown"}}
        assert own <= hooks, (name, own)


@pytest.mark.parametrize("pair", pairs(), ids="x".join)
def test_every_pair_is_tested_against_one_process_or_refused_before_any_process_group(pair):
    node = _tested(pair)
    plugins = [make(pair[0]), make(pair[1])]
    if node is not None:
        assert _test_exists(node), node
        hookloop.Trainer(plugins=plugins, logger=False)  # a tested pair constructs
        return
    if pair in REFUSED_AT_START:
        sizes, words = REFUSED_AT_START[pair]
        trainer = hookloop.Trainer(plugins=plugins, mesh=sizes, max_steps=1, logger=False, enable_checkpointing=False,
                                   enable_progress_bar=False, enable_model_summary=False)
        with pytest.raises(hookloop.ConfigurationError, match=re.escape(words)):
            trainer.fit(MLP(), DataLoader(data(), batch_size=8))
        assert not torch.distributed.is_initialized()
        return
    with pytest.raises(hookloop.HookloopError) as info:
        hookloop.Trainer(plugins=plugins, logger=False)
    text = str(info.value)
    names = [registry.plugin_name(p) for p in plugins]
    assert all(f"'{n}'" in text for n in names), text  # both named, in the user's words
    assert "tryfirst" not in text and "hookimpl" not in text  # nothing meant for plugin authors
    assert not torch.distributed.is_initialized()


def test_ddp_x_tp_is_refused_at_construction_naming_the_alternatives():
    with pytest.raises(hookloop.PluginConflictError) as info:
        hookloop.Trainer(plugins=["ddp", "tp"], mesh={"dp_replicate": 2, "tp": 2}, logger=False)
    text = str(info.value)
    assert text.startswith("plugins 'ddp' and 'tp' do not run together: DistributedDataParallel replicates")
    assert "--plugins fsdp,tp --mesh dp_shard=R,tp=T" in text
    assert "fsdp.sharding_strategy=HYBRID_SHARD --mesh dp_replicate=R,dp_shard=S,tp=T" in text


def test_an_fsdp_variant_given_as_an_option_is_refused_like_one_given_in_code():
    with pytest.raises(hookloop.PluginConflictError, match=r"fsdp with cpu_offload=True is not checked beside tp"):
        hookloop.Trainer(plugins=["fsdp", "tp"], plugin_options={"fsdp": {"cpu_offload": True}}, logger=False)


@pytest.mark.parametrize("listed", [["tp", "compile"], ["compile", "tp"], ["fsdp", "compile", "tp"],
                                    ["compile", "tp", "fsdp"]])
def test_tp_and_compile_run_in_transform_order_whatever_the_listed_order(listed):
    """``--plugins tp,compile`` was refused with a message for plugin authors (compile's
    wrap_model was ``tryfirst``); now both orders construct, and wrap_model runs tp, then
    compile, then the data-parallel wrapper."""
    pm = hookloop.Trainer(plugins=listed, logger=False).plugin_manager
    called = [pm.get_name(i.plugin) for i in reversed(pm.hook.wrap_model.get_hookimpls())]
    assert called[:-1] == [n for n in ("tp", "compile", "fsdp") if n in listed]


def test_compile_runs_before_a_strategy_that_owns_the_lifecycle_in_either_order():
    for listed in (["compile", "dp"], ["dp", "compile"]):
        pm = hookloop.Trainer(plugins=listed, logger=False).plugin_manager
        called = [pm.get_name(i.plugin) for i in reversed(pm.hook.wrap_model.get_hookimpls())]
        assert called == ["compile", "dp", "hookloop.defaults"]


def test_the_documented_table_names_every_tested_pair():
    section = (REPO / "docs" / "configurations.md").read_text().split("## Every pair of mesh plugins", 1)[1]
    section = section.split("\n## ", 1)[0]
    for node in TESTED.values():
        assert node.split("::")[1] in section, node
