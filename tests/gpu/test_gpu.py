"""hookloop-gpus, hookloop-amp, hookloop-dp and hookloop-ddp on real GPUs.

Every test is marked ``gpu`` and skipped, with the reason, on a machine without CUDA
(see conftest.py); on a GPU machine ``make test`` runs them, ``pytest -m gpu`` only them.

1. ``hookloop devices`` on this machine, with the real NVML reader.
2. gpus: an auto-selected GPU is published as CUDA_VISIBLE_DEVICES and is the one the
   run trains on (a fresh process: tests/scripts/gpu_auto_select.py).
3. NVML: the real reader sees the GPUs torch sees.
4. amp on CUDA: fp16 against a hand-written GradScaler loop (same weights, scale and
   skipped steps; scaler state in the checkpoint), bf16 against a hand-written autocast
   loop.
5. dp: DataParallel over every GPU, fp16 and bf16 autocast inside each replica.
6. ddp + fp16 on 2 GPUs with NCCL, against torch's own DDP + GradScaler loop
   (tests/scripts/gpu_ddp_amp.py).

The tests of 1 and 2 come first: auto-selection takes GPUs that run no
process, and this process holds a CUDA context on a GPU once a test has trained on it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, max_abs_diff, run_python

from .gpu_check_model import Net, data

HOOKLOOP = [sys.executable, "-m", "hookloop"]
SCRIPTS = REPO / "tests" / "scripts"


def state(module) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def bare_uuid(text) -> str:
    # NVML writes "GPU-<uuid>", torch the bare uuid.
    return str(text).lower().removeprefix("gpu-")


# -- 1. hookloop devices ------------------------------------------------------------------


@pytest.mark.gpu
def test_devices_command_lists_every_gpu_torch_sees(tmp_path):
    n = torch.cuda.device_count()
    out = run_python(HOOKLOOP + ["devices", "-1"], cwd=tmp_path).stdout
    assert f"this machine: {n} GPU(s) visible (from nvml)" in out, out
    assert f"gpus=-1 (int) -> {list(range(n))}: all available GPUs ({n})" in out, out
    (selection,) = re.findall(r"^selection: (\[.*\]) -> CUDA_VISIBLE_DEVICES=(.*)$", out, re.M)
    assert selection[0] == str(list(range(n))) and len(selection[1].split(",")) == n, out
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert selection[1] == ",".join(str(i) for i in range(n)), out  # NVML's indices
    assert [f"local rank {r} -> cuda:{r} = " in out for r in range(n)] == [True] * n, out

    out = run_python(HOOKLOOP + ["devices", '"0"'], cwd=tmp_path).stdout
    assert "gpus='0' (str) -> [0]: GPU 0" in out, out
    assert f"CUDA_VISIBLE_DEVICES={selection[1].split(',')[0]}" in out, out


@pytest.mark.gpu
def test_devices_auto_select_takes_the_first_free_gpu_it_lists(tmp_path):
    # Exit status 2 is the documented answer when no GPU is free, so no run_python here.
    proc = subprocess.run(HOOKLOOP + ["devices", "1", "--auto-select"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    listed = re.findall(r"^  \[(\d+)\].*: (free|busy|\?)$", proc.stdout, re.M)
    assert len(listed) == torch.cuda.device_count(), proc.stdout
    free = [int(position) for position, status in listed if status == "free"]
    if proc.returncode == 0:
        assert free and f"auto-selected free GPUs: [{free[0]}] -> CUDA_VISIBLE_DEVICES=" in proc.stdout, proc.stdout
    else:
        assert proc.returncode == 2 and not free, proc.stdout + proc.stderr
        assert "auto_select_gpus=True" in proc.stderr, proc.stderr


# -- 2. gpus, end to end ------------------------------------------------------------------


@pytest.mark.gpu
def test_auto_selected_gpu_is_published_and_trained_on(tmp_path):
    from hookloop_gpus import is_free, read_machine

    machine = read_machine()
    free = [g for g in machine.gpus if is_free(g)]
    if not free:
        pytest.skip(f"no GPU runs no process, so there is none to auto-select: {machine.gpus}")
    out = tmp_path / "where.json"
    proc = run_python(HOOKLOOP + ["run", str(SCRIPTS / "gpu_auto_select.py"), str(out)], cwd=tmp_path)
    where = json.loads(out.read_text())
    chosen = free[0]  # what auto-selection takes: the first GPU that runs no process
    assert where["selected"] == [chosen.index] and where["visible"] == str(chosen.index), where
    assert bare_uuid(where["uuid"]) == bare_uuid(chosen.uuid), (where, chosen)
    assert where["device_count"] == 1 and where["root_device"] == "cuda:0", where
    assert where["batch_devices"] == ["cuda:0"] and where["weight_device"] == "cuda:0", where
    assert f"hookloop-gpus: using GPUs [{chosen.index}] (cuda:0 = GPU {chosen.index})" in proc.stdout


# -- 3. NVML ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_nvml_reader_sees_the_gpus_torch_sees():
    from hookloop_gpus import read_machine

    machine = read_machine()
    assert machine.source == "nvml", machine.note
    n = torch.cuda.device_count()
    # As sets: NVML numbers GPUs in PCI bus order, torch fastest first.
    assert sorted(bare_uuid(g.uuid) for g in machine.gpus) == sorted(
        bare_uuid(torch.cuda.get_device_properties(i).uuid) for i in range(n)
    )
    assert all(g.memory_total_mib > 0 and g.name for g in machine.gpus), machine.gpus


# -- 4. amp on CUDA -----------------------------------------------------------------------


def amp_reference(module, loader, epochs, dtype, clip=None, **scaler_options):
    """PyTorch's documented autocast recipe on cuda:0, with a GradScaler for fp16, written
    out; returns (scale, skipped steps), (None, 0) without a scaler.

    A step counts as skipped when a gradient is not finite after unscaling, found
    independently of the scaler's own bookkeeping.
    """
    module.cuda()
    opt = module.configure_optimizers()
    scaler = torch.amp.GradScaler("cuda", **scaler_options) if dtype is torch.float16 else None
    skipped = 0
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.cuda(), y.cuda()
            with torch.autocast("cuda", dtype=dtype):
                loss = F.cross_entropy(module(x), y)
            if scaler is None:
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                skipped += not all(torch.isfinite(p.grad).all() for p in module.parameters())
                if clip:
                    torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
    return (scaler.get_scale(), skipped) if scaler is not None else (None, 0)


@pytest.mark.gpu
def test_fp16_on_cuda_matches_the_gradscaler_loop_and_checkpoints_the_scaler(tmp_path):
    loader = DataLoader(data(), batch_size=32)  # 8 steps per epoch
    # A scale too large for fp16 at first, growing back every 3 steps: steps get skipped.
    options = {"init_scale": 2.0**24, "growth_interval": 3}
    module = Net()
    trainer = hookloop.Trainer(precision="16-mixed", max_epochs=3, gradient_clip_val=0.5, accelerator="cuda",
                               plugin_options={"amp": options}, default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    amp = next(p for p in trainer.plugins if p.hookloop_name == "amp")
    saved = hookloop.safe_load(tmp_path / "logs" / "version_0" / "checkpoints" / "last.ckpt")

    reference = Net()
    scale, skipped = amp_reference(reference, loader, 3, torch.float16, clip=0.5, **options)
    assert max_abs_diff(state(module), state(reference)) < 1e-5
    assert amp.scaler.get_scale() == scale and amp.skipped_steps == skipped
    assert 0 < skipped < 24  # both paths ran: skipped steps and taken ones
    assert {(device, on, dtype) for device, _, on, dtype in module.seen} == {("cuda:0", True, torch.float16)}
    assert saved["plugins"]["amp"]["scaler"]["scale"] == scale
    assert saved["plugins"]["amp"]["skipped_steps"] == skipped


@pytest.mark.gpu
def test_bf16_on_cuda_matches_the_autocast_loop():
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name(0)} has no bf16")
    loader = DataLoader(data(), batch_size=32)
    module = Net()
    trainer = hookloop.Trainer(precision="bf16-mixed", max_epochs=1, accelerator="cuda", enable_checkpointing=False)
    trainer.fit(module, loader)
    amp = next(p for p in trainer.plugins if p.hookloop_name == "amp")
    reference = Net()
    amp_reference(reference, loader, 1, torch.bfloat16)
    assert max_abs_diff(state(module), state(reference)) < 1e-5
    assert amp.scaler is None  # bf16 has fp32's range: nothing to scale
    assert {(device, on, dtype) for device, _, on, dtype in module.seen} == {("cuda:0", True, torch.bfloat16)}


# -- 5. dp on real GPUs -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("precision,dtype", [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_dp_splits_every_batch_over_every_gpu_under_autocast(precision, dtype):
    if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name(0)} has no bf16")
    n = torch.cuda.device_count()
    module = Net()
    trainer = hookloop.Trainer(plugins=["dp"], devices=n, precision=precision, max_epochs=1,
                               enable_checkpointing=False)
    loader = DataLoader(data(32 * n * 4), batch_size=32 * n)  # 4 steps, 32 samples per GPU
    trainer.fit(module, loader)
    # One forward per replica per step, each on its own GPU with its 32 samples, each
    # under the run's autocast: replica threads do not inherit it from the loop's thread.
    assert len(module.seen) == 4 * n
    assert sorted({device for device, *_ in module.seen}) == [f"cuda:{i}" for i in range(n)]
    assert {(size, on, dt) for _, size, on, dt in module.seen} == {(32, True, dtype)}
    assert trainer.global_step == 4 and trainer.root_device == torch.device("cuda", 0)


# -- 6. ddp + amp fp16 --------------------------------------------------------------------


@pytest.mark.gpu(count=2)
def test_ddp_fp16_on_two_gpus_matches_torchs_ddp_gradscaler_loop(tmp_path):
    run_python(HOOKLOOP + ["run", "--plugins", "ddp", "--devices", "2", str(SCRIPTS / "gpu_ddp_amp.py"), str(tmp_path)],
               cwd=tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r, record in enumerate(ranks):
        assert (record["backend"], record["root_device"], record["world_size"]) == ("nccl", f"cuda:{r}", 2)
        assert record["forwards"] == [(f"cuda:{r}", True, "torch.float16")]
        assert record["steps"] == 12  # 256 samples / 2 ranks / 32, 3 epochs
        assert max_abs_diff(record["hookloop"], record["raw"]) <= 1e-6
        assert (record["scale"], record["skipped"]) == (record["raw_scale"], record["raw_skipped"])
        assert 0 < record["raw_skipped"] < 12
    # All-reduced gradients: every rank takes the same steps to the same weights.
    assert max_abs_diff(ranks[0]["hookloop"], ranks[1]["hookloop"]) == 0.0


# -- 7. ddp2: DataParallel inside the node -------------------------------------------------


@pytest.mark.gpu(count=2)
def test_ddp2_splits_each_batch_over_the_nodes_gpus_and_gathers_for_training_step_end(tmp_path):
    """One node of ddp2: one process, DataParallel over GPUs 0 and 1, DDP outside it (a
    world of one node here; tests/test_ddp_multinode.py runs two nodes on the CPU)."""
    from conftest import TinyModule, reference_loop, state_of, tiny_data

    run_python(HOOKLOOP + ["run", "--plugins", "ddp2", "--devices", "2", str(SCRIPTS / "gpu_ddp2.py"),
                           str(tmp_path)], cwd=tmp_path, timeout=300)
    result = torch.load(tmp_path / "ddp2.pt", weights_only=False)
    assert result["strategy"] == "DDP2" and result["world_size"] == 1
    assert result["devices_seen"] == ["cuda:0", "cuda:1"]
    assert result["gathered_sizes"] == [16] * 12  # the node's whole batch, 6 steps x 2 epochs
    reference = TinyModule(seed=0)
    reference_loop(reference, DataLoader(tiny_data(96), batch_size=16), epochs=2)
    assert max_abs_diff(result["state"], state_of(reference)) < 1e-5


# -- 8. device_stats and throughput (hookloop-monitor) ---------------------------------------


@pytest.mark.gpu
def test_device_stats_reads_the_real_gpu_through_nvml(tmp_path):
    """device_stats on a CUDA run, through the real pynvml: plausible readings of the GPU
    the run trains on (its total memory as torch reports it, within 1 %)."""
    import csv
    import warnings

    from hookloop_monitor import DeviceStats, Throughput

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = hookloop.Trainer(accelerator="cuda", devices=1, max_epochs=2, enable_checkpointing=False,
                                   enable_progress_bar=False, default_root_dir=str(tmp_path),
                                   plugins=[DeviceStats(every_n_steps=2), Throughput(every_n_steps=2)])
        trainer.fit(Net(), DataLoader(data(256), batch_size=32))  # 8 steps an epoch
    assert not [str(w.message) for w in caught if "device_stats" in str(w.message)]
    assert trainer.root_device == torch.device("cuda", 0)
    with open(trainer.log_dir / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("rank0/gpu_util")]
    assert [int(row["step"]) for row in rows] == [2, 4, 6, 8, 10, 12, 14, 16]
    total_mib = torch.cuda.get_device_properties(0).total_memory / 2**20
    for row in rows:
        value = {k.removeprefix("rank0/"): float(v) for k, v in row.items() if k.startswith("rank0/") and v}
        assert 0 <= value["gpu_util"] <= 100, row
        assert 0 < value["gpu_mem_used_mib"] <= value["gpu_mem_total_mib"], row
        assert value["gpu_mem_total_mib"] == pytest.approx(total_mib, rel=0.01), row
        assert 0 < value["cuda_max_allocated_mib"] <= value["gpu_mem_used_mib"], row
        assert 0 < value["gpu_temp_c"] < 120, row
        assert value.get("gpu_power_w", 1.0) > 0, row  # absent where the board does not report power
        assert value["rss_mib"] > 0, row
    metrics = trainer.callback_metrics  # throughput, on the same GPU run: 8 batches of 32 an epoch
    assert 0 < metrics["rank0/batches_per_sec"] and metrics["rank0/samples_per_sec"] == pytest.approx(
        32 * metrics["rank0/batches_per_sec"])
