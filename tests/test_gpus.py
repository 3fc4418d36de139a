"""hookloop-gpus: Lightning's gpus table, GPU selection over NVML records, `hookloop devices`.

The machines with GPUs here are NVML answers written as records (the one stand-in
allowed: hardware that is not on this machine). The real NVML path runs on this CPU-only
machine (it finds no GPU) and, on a GPU machine, in tests/gpu/run_gpu_checks.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
import hookloop.tools.cli
from conftest import TinyModule, tiny_data
from hookloop_gpus import SELECTED_ENV, GpuInfo, GPUs, Machine, parse_gpus, select_gpus, visible_subset
from hookloop_gpus.cli import main as devices_main

ALL_FOUR = [0, 1, 2, 3]

# The "Select GPU devices" table of the Lightning docs, row by row, on a 4-GPU machine.
TABLE = [
    (None, None),       # CPU
    (0, None),          # CPU
    (3, [0, 1, 2]),     # first 3 GPUs
    (-1, ALL_FOUR),     # all available GPUs
    ([0], [0]),         # GPU 0
    ([1, 3], [1, 3]),   # GPUs 1 and 3
    ("0", [0]),         # GPU 0
    ("3", [3]),         # GPU 3
    ("1, 3", [1, 3]),   # GPUs 1 and 3
    ("-1", ALL_FOUR),   # all available GPUs
]


@pytest.mark.parametrize("spec,parsed", TABLE, ids=[repr(s) for s, _ in TABLE])
def test_lightning_table(spec, parsed):
    assert parse_gpus(spec, available=4) == parsed


def test_zero_list_zero_and_string_zero_differ():
    assert (parse_gpus(0, 4), parse_gpus([0], 4), parse_gpus("0", 4)) == (None, [0], [0])
    assert (parse_gpus(3, 4), parse_gpus("3", 4)) == ([0, 1, 2], [3])


@pytest.mark.parametrize("spec", [True, -2, 1.5, "a", "1;3", "", [1, 1], [-1], ["0"], {0: 1}])
def test_bad_specs_are_clear_errors(spec):
    with pytest.raises(hookloop.ConfigurationError, match="is not a GPU spec.*None or 0 for the CPU"):
        parse_gpus(spec, 4)


def test_all_gpus_counts_the_machine():
    assert parse_gpus(-1, 2) == [0, 1] and parse_gpus("auto", 3) == [0, 1, 2]


# ---------------------------------------------------------------------------------------
# Selection over a machine's records
# ---------------------------------------------------------------------------------------


def gpu(index, processes=0, mode="default", name="Test GPU"):
    return GpuInfo(index=index, name=name, uuid=f"GPU-{index}abc-{index}", memory_total_mib=16000,
                   memory_used_mib=500 * (processes or 0), compute_mode=mode, processes=processes)


FOUR = [gpu(0), gpu(1), gpu(2), gpu(3)]


def indices(chosen):
    return None if chosen is None else [g.index for g in chosen]


def test_select_follows_the_table():
    assert indices(select_gpus(2, FOUR)) == [0, 1]
    assert indices(select_gpus("1, 3", FOUR)) == [1, 3]
    assert indices(select_gpus(0, FOUR)) is None
    assert indices(select_gpus(-1, FOUR)) == ALL_FOUR


def test_more_gpus_than_exist():
    with pytest.raises(hookloop.ConfigurationError, match="asks for 5 GPUs, but this machine has 4"):
        select_gpus(5, FOUR)


def test_an_index_that_does_not_exist():
    with pytest.raises(hookloop.ConfigurationError, match=r"names GPU 4, which does not exist.*indices 0\.\.3"):
        select_gpus([1, 4], FOUR)
    with pytest.raises(hookloop.ConfigurationError, match="names GPU 7"):
        select_gpus("7", FOUR)


def test_gpus_on_a_cpu_only_machine_say_how_to_run_on_cpu():
    for spec in (1, -1, [0], "0"):
        with pytest.raises(hookloop.ConfigurationError, match="no GPU.*To run on the CPU, pass gpus=None or 0"):
            select_gpus(spec, [])
    assert select_gpus(None, []) is None and select_gpus(0, []) is None


def test_auto_select_takes_gpus_no_process_occupies():
    machine = [gpu(0, processes=2), gpu(1), gpu(2, mode="prohibited"), gpu(3), gpu(4, processes=1, mode="exclusive_process"), gpu(5)]
    assert indices(select_gpus(2, machine, auto_select=True)) == [1, 3]
    assert indices(select_gpus(3, machine, auto_select=True)) == [1, 3, 5]
    # Without auto-selection an int means the first k, busy or not.
    assert indices(select_gpus(2, machine)) == [0, 1]
    # auto_select applies to a count only; named GPUs are taken as named.
    assert indices(select_gpus([0], machine, auto_select=True)) == [0]


def test_auto_select_with_too_few_free_gpus_names_the_busy_ones():
    machine = [gpu(0, processes=1, mode="exclusive_process"), gpu(1), gpu(2, processes=3)]
    with pytest.raises(hookloop.ConfigurationError, match=r"only 1 of 3.*GPU 0: 1 process\(es\), exclusive_process mode; GPU 2: 3 process"):
        select_gpus(2, machine, auto_select=True)
    with pytest.raises(hookloop.ConfigurationError, match="asked for all free GPU"):
        select_gpus(-1, machine, auto_select=True)


def test_auto_select_refuses_when_nvml_cannot_tell():
    with pytest.raises(hookloop.ConfigurationError, match="nvidia-ml-py"):
        select_gpus(1, [gpu(0, processes=None)], auto_select=True)


def test_named_gpu_in_exclusive_mode_that_is_busy_is_refused():
    machine = [gpu(0, processes=1, mode="exclusive_process"), gpu(1, processes=4)]
    with pytest.raises(hookloop.ConfigurationError, match="GPU 0 .*exclusive_process.*cannot take another"):
        select_gpus([0], machine)
    assert indices(select_gpus([1], machine)) == [1]  # default mode: shared, allowed
    with pytest.raises(hookloop.ConfigurationError, match="prohibited"):
        select_gpus([0], [gpu(0, mode="prohibited")])


def test_cuda_visible_devices_narrows_and_orders_the_machine():
    eight = [gpu(i) for i in range(8)]
    assert [g.index for g in visible_subset(eight, "6,2")] == [6, 2]
    assert [g.index for g in visible_subset(eight, "GPU-3abc,1")] == [3, 1]  # UUID prefix
    assert [g.index for g in visible_subset(eight, "1,9,2")] == [1]  # CUDA stops at a bad entry
    assert visible_subset(eight, "") == []
    assert visible_subset(eight, None) == eight
    # Indices in a spec are positions among the visible GPUs.
    assert indices(select_gpus([1], visible_subset(eight, "6,2"))) == [2]


# ---------------------------------------------------------------------------------------
# The plugin: chosen once, published, inherited by every rank
# ---------------------------------------------------------------------------------------


@pytest.fixture
def cuda_env(monkeypatch):
    """Undo whatever the plugin publishes in os.environ."""
    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", SELECTED_ENV):
        monkeypatch.setenv(key, "")  # records the value to restore, then removes it
        monkeypatch.delenv(key)
    return monkeypatch


def nvml(*gpus):
    return lambda: Machine(list(gpus), "nvml")


def test_plugin_publishes_the_choice_and_narrows_devices(cuda_env):
    config = hookloop.TrainerConfig(devices=2)
    plugin = GPUs(auto_select_gpus=True, machine=nvml(gpu(0, processes=1), gpu(1), gpu(2, processes=2), gpu(3)))
    assert plugin.select_devices(config) == [1, 3]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # indices as nvidia-smi shows them
    assert (config.devices, config.accelerator) == (2, "cuda")  # 2 processes, cuda:0 and cuda:1


def test_every_rank_keeps_the_launchers_choice(cuda_env):
    launcher = GPUs(auto_select_gpus=True, machine=nvml(gpu(0, processes=1), gpu(1), gpu(2), gpu(3)))
    assert launcher.select_devices(hookloop.TrainerConfig(devices=2)) == [1, 2]
    # In a worker, NVML now shows the other ranks on GPUs 1 and 2: choosing again would
    # pick 3 (and nothing); the inherited choice is used instead.
    cuda_env.setenv("HOOKLOOP_WORKER", "1")
    for rank in range(2):
        config = hookloop.TrainerConfig(devices=2)
        worker = GPUs(auto_select_gpus=True, machine=nvml(gpu(0, processes=1), gpu(1, processes=1), gpu(2, processes=1), gpu(3)))
        assert worker.select_devices(config) == [1, 2]
        assert config.devices == 2
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,2"


def test_devices_string_names_a_gpu_with_this_plugin(cuda_env):
    config = hookloop.TrainerConfig(devices="3")  # without the plugin: 3 processes
    GPUs(machine=nvml(*FOUR)).select_devices(config)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and config.devices == 1


def test_gpus_option_zero_means_cpu_even_with_gpus(cuda_env):
    config = hookloop.TrainerConfig(devices=2)
    assert GPUs(gpus=0, machine=nvml(*FOUR)).select_devices(config) == []
    assert config.accelerator == "cpu" and config.devices == 2  # 2 CPU processes
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_trainer_asking_for_gpus_on_this_cpu_only_machine(cuda_env):
    """The real NVML path: no NVIDIA driver here, so no GPU, and a clear error."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    trainer = hookloop.Trainer(plugins=["gpus"], plugin_options={"gpus": {"gpus": 2}}, max_epochs=1, enable_checkpointing=False)
    with pytest.raises(hookloop.ConfigurationError, match=r"gpus=2 asks for GPUs, but this machine has no GPU.*To run on the CPU.*\(NVML could not start"):
        trainer.fit(TinyModule(), DataLoader(tiny_data(), batch_size=16))
    # devices=N without an explicit GPU request keeps meaning CPU processes here.
    trainer = hookloop.Trainer(plugins=["gpus"], max_epochs=1, enable_checkpointing=False)
    trainer.fit(TinyModule(), DataLoader(tiny_data(), batch_size=16))
    assert trainer.root_device == torch.device("cpu") and trainer.device_ids is None


# ---------------------------------------------------------------------------------------
# `hookloop devices`
# ---------------------------------------------------------------------------------------


def test_devices_command_shows_the_parse_and_the_machine(capsys):
    machine = nvml(gpu(0, processes=1, name="Busy GPU"), gpu(1), gpu(2), gpu(3))
    assert devices_main(['"1, 3"'], machine=machine) == 0
    out = capsys.readouterr().out
    assert "this machine: 4 GPU(s) visible (from nvml)" in out
    assert "[0] Busy GPU, 16000 MiB (500 MiB used), 1 process, compute mode default: busy" in out
    assert "gpus='1, 3' (str) -> [1, 3]: GPUs 1 and 3" in out
    assert "CUDA_VISIBLE_DEVICES=1,3" in out

    assert devices_main(["2", "--auto-select"], machine=machine) == 0
    out = capsys.readouterr().out
    assert "gpus=2 (int) -> [0, 1]: first 2 GPUs" in out
    assert "auto-selected free GPUs: [1, 2] -> CUDA_VISIBLE_DEVICES=1,2" in out

    assert devices_main(["[0, 7]"], machine=machine) == 2
    assert "names GPU 7, which does not exist" in capsys.readouterr().err


def test_devices_command_on_this_machine(capsys):
    """Through the `hookloop` entry point (``hookloop.tools.cli.main``, what the console script
    calls, finding ``devices`` among the plugins' commands), with the real NVML reader."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert hookloop.tools.cli.main(["devices", "0"]) == 0
    out = capsys.readouterr().out
    assert "this machine: no GPU (NVML could not start" in out
    assert "gpus=0 (int) -> None: CPU" in out

    code = hookloop.tools.cli.main(["devices", "-1"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "gpus=-1 (int) -> []: all available GPUs (0)" in out
    assert "asks for GPUs, but this machine has no GPU" in err and "To run on the CPU" in err
