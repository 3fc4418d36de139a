"""Issue 18: Lightning's ``Trainer(strategy="...")`` strings and strategy classes.

Each string resolves to the hookloop plugin and options that Lightning 2.6.6's
``StrategyRegistry`` gives the same string; two of them train on 2 real processes (gloo)
to the weights of a hand-written DDP reference.
"""

from __future__ import annotations

import sys
import tempfile

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, TinyModule, max_abs_diff, tiny_data
from hookloop.lightning import strategies
from hookloop.testing import run_processes

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from ddp_reference import concatenated_batches_run  # noqa: E402


def _lightning_registry() -> dict:
    from pytorch_lightning.strategies import StrategyRegistry

    return {name: StrategyRegistry[name] for name in StrategyRegistry.available_strategies()
            if "xla" not in name and "tpu" not in name}


#: Lightning's strategy class -> the hookloop plugin names that implement it.
PLUGINS_OF = {
    "DDPStrategy": {"ddp", "ddp_spawn"},
    "FSDPStrategy": {"fsdp", "fsdp_cpu_offload"},
    "SingleDeviceStrategy": {None},
}


def _expected_plugin(cls: str, init_params: dict) -> set:
    if cls == "DDPStrategy":
        return {"ddp"} if init_params.get("start_method", "popen") == "popen" else {"ddp_spawn"}
    if cls == "DeepSpeedStrategy":
        return {"deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
                "deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme"}
    return PLUGINS_OF[cls]


def test_every_lightning_strategy_string_is_the_plugin_with_lightnings_options():
    registry = _lightning_registry()
    assert len(registry) >= 20  # the ddp/fsdp/deepspeed families and single_device
    assert set(registry) <= set(strategies.STRATEGY_STRINGS), set(registry) - set(strategies.STRATEGY_STRINGS)
    for name, entry in registry.items():
        trainer = hookloop.Trainer(strategy=name, accelerator="cpu", enable_checkpointing=False, logger=False,
                                   enable_progress_bar=False)
        plugin = trainer.strategy
        cls = entry["strategy"].__name__
        assert (None if plugin is None else hookloop.contract.registry.plugin_name(plugin)) in _expected_plugin(cls, entry["init_params"]), name
        for option, value in entry["init_params"].items():
            if option == "start_method":
                # popen: hookloop's ddp (a process per rank started by the launcher)
                if value != "popen":
                    assert plugin.start_method == value, name
            elif option == "remote_device":
                # Lightning's zero.Init device for the parameters: hookloop's offload_params_device
                assert plugin.offload_params_device == value, name
            else:
                assert getattr(plugin, option) == value, (name, option)
        if cls == "DDPStrategy" and "find_unused_parameters" not in entry["init_params"]:
            assert plugin.find_unused_parameters is False  # Lightning's DDPStrategy default


def test_hookloops_own_strategy_strings():
    for name, plugin_name in (("dp", "dp"), ("horovod", "horovod"), ("ddp_sharded", "ddp_sharded")):
        trainer = hookloop.Trainer(strategy=name, enable_checkpointing=False, logger=False)
        assert hookloop.contract.registry.plugin_name(trainer.strategy) == plugin_name
    for name in ("auto", "single_device"):
        assert hookloop.Trainer(strategy=name, enable_checkpointing=False, logger=False).strategy is None


def test_strategy_string_options_compose_with_plugin_options():
    trainer = hookloop.Trainer(strategy="ddp_spawn_find_unused_parameters_true", logger=False,
                               enable_checkpointing=False, plugin_options={"ddp_spawn": {"static_graph": True}})
    assert (trainer.strategy.find_unused_parameters, trainer.strategy.static_graph,
            trainer.strategy.start_method) == (True, True, "spawn")


def test_an_unknown_strategy_string_names_close_matches():
    with pytest.raises(hookloop.ConfigurationError) as info:
        hookloop.Trainer(strategy="ddp_find_unused_parameter_true")
    message = str(info.value)
    assert "strategy='ddp_find_unused_parameter_true'" in message
    assert "did you mean 'ddp_find_unused_parameters_true'" in message
    with pytest.raises(hookloop.ConfigurationError, match=r"did you mean 'deepspeed_stage_2'"):
        hookloop.Trainer(strategy="deepspeed_stage2")


def test_a_strategy_whose_plugin_is_missing_gives_the_pip_line():
    with pytest.raises(hookloop.MissingDependencyError) as info:
        strategies.load_plugin("colossalai", {}, "strategy='colossalai'")
    assert "pip install hookloop-colossalai" in str(info.value)
    assert "pip install -e plugins/colossalai" in str(info.value)


def test_lightning_strategy_classes_return_the_plugin_with_options():
    ddp = strategies.DDPStrategy(find_unused_parameters=True)
    assert (hookloop.contract.registry.plugin_name(ddp), ddp.find_unused_parameters) == ("ddp", True)
    fork = strategies.DDPStrategy(start_method="fork", static_graph=True)
    assert (hookloop.contract.registry.plugin_name(fork), fork.start_method, fork.static_graph) == ("ddp_spawn", "fork", True)
    fsdp = strategies.FSDPStrategy(cpu_offload=True)
    assert (hookloop.contract.registry.plugin_name(fsdp), fsdp.cpu_offload) == ("fsdp", True)
    ds = strategies.DeepSpeedStrategy(stage=2, offload_optimizer=True)
    assert (ds.stage, ds.offload_optimizer) == (2, True)
    trainer = hookloop.Trainer(strategy=strategies.DDPStrategy(find_unused_parameters=True), logger=False,
                               enable_checkpointing=False)
    assert trainer.strategy.find_unused_parameters is True
    with pytest.raises(hookloop.ConfigurationError, match="start_method='thread'"):
        strategies.DDPStrategy(start_method="thread")
    with pytest.raises(hookloop.ConfigurationError, match="has no option 'find_unused'"):
        strategies.DDPStrategy(find_unused=True)


# -- real runs on 2 processes (gloo) -----------------------------------------------------


class WithUnusedLayer(TinyModule):
    """TinyModule (the same first weights) with a layer no step uses: DDP needs
    ``find_unused_parameters=True`` for it."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(2, 2)


def _fit_ranks(strategy: str) -> dict:
    module = WithUnusedLayer()
    with tempfile.TemporaryDirectory() as root:
        hookloop.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_epochs=2, enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, default_root_dir=root,
                         ).fit(module, DataLoader(tiny_data(64), batch_size=8))  # unshuffled: ddp shuffles it
    return {k: v.detach().clone() for k, v in module.state_dict().items() if k.startswith("net.")}


@pytest.mark.slow
def test_ddp_find_unused_parameters_true_trains_as_the_reference_on_two_processes():
    reference = concatenated_batches_run(tiny_data(64), epochs=2, batch=8)
    ranks = run_processes(_fit_ranks, nprocs=2, args=("ddp_find_unused_parameters_true",), timeout=240)
    for weights in ranks:
        assert max_abs_diff(weights, reference) <= 1e-5


@pytest.mark.slow
def test_ddp_spawn_string_trains_as_the_reference():
    module = TinyModule()
    with tempfile.TemporaryDirectory() as root:
        hookloop.Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu", max_epochs=2,
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         default_root_dir=root).fit(module, DataLoader(tiny_data(64), batch_size=8))
    assert max_abs_diff(module.state_dict(), concatenated_batches_run(tiny_data(64), epochs=2, batch=8)) <= 1e-5
