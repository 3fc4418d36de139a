"""hookloop-ddp in one process: bad input is refused early, environments are read right,
and a world of one trains exactly like the hand-written loop."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import hookloop
from conftest import TinyModule, max_abs_diff, reference_loop, state_of, tiny_data
from hookloop_ddp import DDP, ClusterEnvironment
from hookloop_ddp.environment import first_host


class OtherStrategy:
    hookloop_name, hookloop_role = "other-strategy", "strategy"


def test_ddp_with_another_strategy_is_refused_at_construction():
    with pytest.raises(hookloop.PluginConflictError, match="'ddp', 'other-strategy' are all strategy plugins"):
        hookloop.Trainer(plugins=["ddp", OtherStrategy()])


@pytest.mark.parametrize("make", [
    lambda: DDP(process_group_backend="nope"),
    lambda: hookloop.plugin("ddp", process_group_backend="nope"),
    lambda: hookloop.Trainer(plugins=["ddp"], plugin_options={"ddp": {"process_group_backend": "nope"}}),
    lambda: hookloop.Trainer(plugins=["ddp_spawn"], plugin_options={"ddp_spawn": {"process_group_backend": "cpu:nope"}}),
])
def test_unknown_backend_is_a_configuration_error_before_any_process_starts(make):
    with pytest.raises(hookloop.ConfigurationError, match=r"'nope' is not a torch.distributed backend. Known: gloo, nccl"):
        make()


def test_backend_missing_from_this_torch_build():
    if dist.is_nccl_available():  # a CUDA build has it: then the name is accepted
        assert DDP(process_group_backend="nccl").process_group_backend == "nccl"
    else:
        with pytest.raises(hookloop.ConfigurationError, match="has no 'nccl' backend. Use 'gloo'"):
            DDP(process_group_backend="nccl")


@pytest.mark.parametrize("option,value,match", [
    ("comm_hook", "zip", "must be None, one of 'fp16', 'bf16', 'powersgd', 'post_localsgd'"),
    ("powersgd_start_iter", 1, "PowerSGD can only start after DDP's first two steps"),
    ("bucket_cap_mb", -1, "must be a finite number of MiB > 0"),
    ("find_unused_parameters", "yes", "must be True or False"),
    ("model_averaging_period", 0, "must be an integer >= 1"),
])
def test_bad_option_values(option, value, match):
    with pytest.raises(hookloop.ConfigurationError, match=match):
        DDP(**{option: value})
    with pytest.raises(hookloop.ConfigurationError, match=match):
        hookloop.Trainer(plugins=["ddp"], plugin_options={"ddp": {option: value}})


class BackendProbe:
    hookloop_name, hookloop_role = "backend-probe", "observer"
    seen: dict = {}

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        self.seen.update(backend=dist.get_backend(), world=dist.get_world_size(), model=type(trainer.model).__name__)


def test_world_of_one_trains_like_the_hand_written_loop_and_cleans_up():
    data = tiny_data(100)
    ref, ours = TinyModule(), TinyModule()
    torch.manual_seed(3)
    reference_loop(ref, DataLoader(data, batch_size=16, shuffle=True), epochs=2)
    torch.manual_seed(3)
    trainer = hookloop.Trainer(plugins=[DDP(process_group_backend="gloo"), BackendProbe()], max_epochs=2,
                               enable_checkpointing=False)
    trainer.fit(ours, DataLoader(data, batch_size=16, shuffle=True))
    assert max_abs_diff(state_of(ref), state_of(ours)) <= 1e-6
    assert BackendProbe.seen == {"backend": "gloo", "world": 1, "model": "DistributedDataParallel"}
    assert not dist.is_initialized()  # the group the plugin made is gone


def test_process_group_made_by_the_user_is_used_and_left_alone():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        hookloop.Trainer(plugins=["ddp"], max_epochs=1, enable_checkpointing=False).fit(
            TinyModule(), DataLoader(tiny_data(), batch_size=8))
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_torchrun_environment(monkeypatch):
    for key, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="1",
                           MASTER_ADDR="10.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(key, value)
    assert ClusterEnvironment.detect() == ClusterEnvironment(4, 3, 1, 2, 1, "10.0.0.1", 29500, "torchrun")


def test_slurm_environment(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_NODEID="2",
                           SLURM_NTASKS_PER_NODE="2(x4)", SLURM_JOB_NODELIST="gpu[07-10],cpu1",
                           SLURM_JOB_ID="123456").items():
        monkeypatch.setenv(key, value)
    # Every task derives the same address (first node) and port (from the job id).
    assert ClusterEnvironment.detect() == ClusterEnvironment(8, 5, 1, 2, 2, "gpu07", 10000 + 123456 % 20000, "slurm")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: a plain process, no process group to join
    assert ClusterEnvironment.detect().source == "single"


@pytest.mark.parametrize("nodelist,host", [("node1", "node1"), ("node[3-5]", "node3"), ("a[09,11-12],b2", "a09"), ("x-1,y", "x-1")])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host
