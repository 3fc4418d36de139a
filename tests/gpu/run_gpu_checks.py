"""GPU checks for hookloop-gpus, hookloop-amp and hookloop-dp: run on a machine with GPUs.

    .venv/bin/python tests/gpu/run_gpu_checks.py            # needs a CUDA build of torch

Not collected by pytest (the build machines have no GPU). Each check prints PASS, FAIL
or SKIP (with why) and what it saw; the exit status is 1 if any check failed.

1. NVML: the real reader's inventory, `hookloop devices -1` and `... 1 --auto-select`.
2. gpus: `hookloop run --plugins gpus` with auto-selection in a fresh process: the chosen
   GPU is published as CUDA_VISIBLE_DEVICES and is the one the run trains on.
3. amp fp16 on CUDA: hookloop against a hand-written GradScaler loop (same weights, same
   scale, same skipped steps), scaler state in the checkpoint; bf16 where supported.
4. dp: DataParallel over every GPU, with fp16 and bf16 autocast inside each replica.
5. ddp + amp fp16 on 2 GPUs (needs 2 GPUs and hookloop-ddp).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import traceback
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_model import Net, data  # noqa: E402  (also imported by the subprocess scripts)
HOOKLOOP = [sys.executable, "-m", "hookloop"]
RESULTS: list[tuple[str, str, str]] = []


def check(name):
    def run(fn):
        try:
            detail = fn()
            status = "SKIP" if isinstance(detail, str) and detail.startswith("skip:") else "PASS"
        except Exception as exc:  # report every check, not just the first failure
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        RESULTS.append((status, name, str(detail)))
        print(f"[{status}] {name}: {detail}", flush=True)
        return fn

    return run


def state(module):
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def run(cmd, env=None, cwd=None):
    full = dict(os.environ)
    for key in ("HOOKLOOP_TRAINER_DEFAULTS", "HOOKLOOP_WORKER", "LOCAL_RANK", "HOOKLOOP_PLUGINS", "HOOKLOOP_GPUS_SELECTED"):
        full.pop(key, None)
    full.update(env or {})
    return subprocess.run(cmd, env=full, cwd=cwd, capture_output=True, text=True, timeout=300)


CUDA = torch.cuda.is_available()
N_GPUS = torch.cuda.device_count() if CUDA else 0
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {N_GPUS} GPU(s) visible, "
      f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}", flush=True)


# -- 1. NVML ------------------------------------------------------------------------------


@check("nvml: real reader")
def _():
    from hookloop_gpus import read_machine, read_nvml

    gpus = read_nvml()
    lines = [f"[{g.index}] {g.describe()} uuid={g.uuid}" for g in gpus]
    machine = read_machine()
    assert machine.source == "nvml", machine
    if CUDA:
        assert len(machine.gpus) == N_GPUS, f"NVML sees {len(machine.gpus)} visible GPUs, torch {N_GPUS}"
    return f"{len(gpus)} GPU(s): " + "; ".join(lines)


@check("nvml: hookloop devices -1 / 1 --auto-select")
def _():
    outs = []
    for args in (["-1"], ["1", "--auto-select"], ['"0"']):
        proc = run(HOOKLOOP + ["devices", *args])
        outs.append(f"$ hookloop devices {' '.join(args)} (rc={proc.returncode})\n{proc.stdout}{proc.stderr}")
        assert proc.returncode in (0, 2), proc
    assert "CUDA_VISIBLE_DEVICES=" in outs[0], outs[0]
    return "\n" + "\n".join(outs)


# -- 2. gpus, end to end ------------------------------------------------------------------


@check("gpus: auto-selected GPU is the one the run uses")
def _():
    if not CUDA:
        return "skip: no CUDA"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "where.py"
        script.write_text(textwrap.dedent(
            f"""
            import os, sys, torch, hookloop
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from gpu_check_model import Net, data
            from torch.utils.data import DataLoader
            t = hookloop.Trainer(plugins=["gpus"], plugin_options={{"gpus": {{"auto_select_gpus": True}}}},
                                 devices=1, max_steps=2, enable_checkpointing=False)
            m = Net()
            t.fit(m, DataLoader(data(64), batch_size=32))
            print("WHERE", os.environ.get("CUDA_VISIBLE_DEVICES"), t.root_device, torch.cuda.device_count(),
                  torch.cuda.get_device_name(0), m.seen[0][0])
            """
        ))
        proc = run(HOOKLOOP + ["run", str(script)])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (line,) = [l for l in proc.stdout.splitlines() if l.startswith("WHERE")]
        _, visible, root, count, *rest = line.split()
        assert root == "cuda:0" and count == "1" and visible.isdigit(), line
        return line + " | " + " ".join(l for l in proc.stdout.splitlines() if "hookloop-gpus" in l)


# -- 3. amp on CUDA -----------------------------------------------------------------------


def scaler_reference(module, loader, epochs, clip, init_scale, growth_interval):
    module.cuda()
    opt = module.configure_optimizers()
    scaler = torch.amp.GradScaler("cuda", init_scale=init_scale, growth_interval=growth_interval)
    skipped = 0
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.cuda(), y.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(module(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            skipped += not all(torch.isfinite(p.grad).all() for p in module.parameters())
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return scaler.get_scale(), skipped


@check("amp: fp16 + GradScaler on CUDA matches the hand-written loop; scaler in checkpoint")
def _():
    if not CUDA:
        return "skip: no CUDA"
    loader = DataLoader(data(), batch_size=32)
    options = {"amp": {"init_scale": 2.0**24, "growth_interval": 3}}
    with tempfile.TemporaryDirectory() as tmp:
        module = Net()
        trainer = hookloop.Trainer(precision="16-mixed", max_epochs=3, gradient_clip_val=0.5, accelerator="cuda",
                                   plugin_options=options, default_root_dir=tmp)
        trainer.fit(module, loader)
        amp = [p for p in trainer.plugins if p.hookloop_name == "amp"][0]
        saved = hookloop.safe_load(Path(tmp) / "checkpoints" / "last.ckpt")
    reference = Net()
    ref_scale, ref_skipped = scaler_reference(reference, loader, 3, 0.5, 2.0**24, 3)
    diff = max_diff(state(module), state(reference))
    assert diff < 1e-5, diff
    assert amp.scaler.get_scale() == ref_scale and amp.skipped_steps == ref_skipped > 0
    assert all(on and dt == torch.float16 and dev.startswith("cuda") for dev, _, on, dt in module.seen)
    assert saved["plugins"]["amp"]["scaler"]["scale"] == ref_scale
    return f"max |w - w_ref| = {diff:.2e}, scale {ref_scale}, skipped {ref_skipped} steps"


@check("amp: bf16 on CUDA")
def _():
    if not CUDA:
        return "skip: no CUDA"
    if not torch.cuda.is_bf16_supported():
        return "skip: this GPU has no bf16"
    module = Net()
    trainer = hookloop.Trainer(precision="bf16-mixed", max_epochs=1, accelerator="cuda", enable_checkpointing=False)
    trainer.fit(module, DataLoader(data(), batch_size=32))
    assert all(on and dt == torch.bfloat16 for _, _, on, dt in module.seen), module.seen[:3]
    return f"{len(module.seen)} steps under bf16 autocast"


# -- 4. dp on real GPUs -------------------------------------------------------------------


@check("dp: DataParallel over every GPU, autocast inside each replica (fp16, bf16)")
def _():
    if not CUDA:
        return "skip: no CUDA"
    notes = []
    for precision, dtype in (("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)):
        if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            continue
        module = Net()
        trainer = hookloop.Trainer(plugins=["dp"], devices=N_GPUS, precision=precision, max_epochs=1,
                                   enable_checkpointing=False)
        loader = DataLoader(data(32 * N_GPUS * 4), batch_size=32 * N_GPUS)
        trainer.fit(module, loader)
        steps = len(loader)
        devices = sorted({d for d, *_ in module.seen})
        assert len(module.seen) == steps * N_GPUS, (len(module.seen), steps)  # one call per replica
        assert devices == [f"cuda:{i}" for i in range(N_GPUS)], devices
        assert all(n == 32 for _, n, _, _ in module.seen)  # the batch was split evenly
        assert all(on and dt == dtype for _, _, on, dt in module.seen), module.seen[:4]
        notes.append(f"{precision}: {len(module.seen)} replica forwards on {devices}, all {dtype}")
    return "; ".join(notes) + ("" if N_GPUS > 1 else " (1 GPU: no replica threads; run on >= 2 GPUs for those)")


# -- 5. ddp + amp fp16 --------------------------------------------------------------------


@check("ddp + amp fp16 on 2 GPUs")
def _():
    if N_GPUS < 2:
        return f"skip: {N_GPUS} GPU(s), needs 2"
    if "ddp" not in hookloop.installed_plugins():
        return "skip: hookloop-ddp is not installed"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ddp_amp.py"
        script.write_text(textwrap.dedent(
            f"""
            import sys, torch, hookloop
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from gpu_check_model import Net, data
            from torch.utils.data import DataLoader
            t = hookloop.Trainer(precision="16-mixed", max_epochs=2, enable_checkpointing=False)
            m = Net()
            t.fit(m, DataLoader(data(), batch_size=32, shuffle=True))
            w = torch.cat([p.detach().double().flatten().cpu() for p in m.parameters()])
            amp = [p for p in t.plugins if p.hookloop_name == "amp"][0]
            print("DDPAMP", t.global_rank, t.root_device, m.seen[0][2], m.seen[0][3],
                  repr(float(w.sum())) + "/" + repr(float(w.norm())), amp.scaler.get_scale(), flush=True)
            """
        ))
        proc = run(HOOKLOOP + ["run", "--plugins", "ddp", "--devices", "2", str(script)])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = sorted(l for l in proc.stdout.splitlines() if l.startswith("DDPAMP"))
        assert len(lines) == 2, proc.stdout
        fields = [line.split() for line in lines]
        for _, rank, device, on, dtype, checksum, scale in fields:
            assert device == f"cuda:{rank}" and on == "True" and dtype == "torch.float16", lines
        assert fields[0][5:] == fields[1][5:], lines  # same weights and scale on both ranks
        return " | ".join(lines)


if __name__ == "__main__":
    failed = [r for r in RESULTS if r[0] == "FAIL"]
    print("\nsummary: " + ", ".join(f"{s} {n}" for s, n, _ in RESULTS))
    print(f"{sum(r[0] == 'PASS' for r in RESULTS)} passed, {len(failed)} failed, {sum(r[0] == 'SKIP' for r in RESULTS)} skipped")
    sys.exit(1 if failed else 0)
