"""hookloop-amp: bf16 and fp16 mixed precision against hand-written torch.amp loops."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, TinyModule, max_abs_diff, run_python, state_of, tiny_data

sys.path.insert(0, str(REPO / "examples"))
from digits import DigitsClassifier, digits_datasets  # noqa: E402

HOOKLOOP = [sys.executable, "-m", "hookloop"]
CPU_FP16 = {"amp": {"allow_cpu_fp16": True}}


class AutocastProbe(TinyModule):
    """TinyModule that records the autocast state its steps ran under."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(("train", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), self(batch[0]).dtype))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.seen.append(("val", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), self(batch[0]).dtype))
        return super().validation_step(batch, batch_idx)


def autocast_reference(module, loader, epochs, dtype, clip=None):
    """The hand-written bf16 loop: autocast around forward and loss, plain backward."""
    opt = module.configure_optimizers()
    for _ in range(epochs):
        for x, y in loader:
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(module(x), y)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)


def scaler_reference(module, loader, epochs, clip, init_scale, growth_interval, unscale_before_clip=True):
    """PyTorch's documented GradScaler recipe, written out; returns (scale, skipped steps).

    A step is counted as skipped when a gradient is not finite after unscaling, found
    independently of the scaler's own bookkeeping.
    """
    opt = module.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    skipped = 0
    for _ in range(epochs):
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(module(x), y)
            scaler.scale(loss).backward()
            if unscale_before_clip:
                scaler.unscale_(opt)
                skipped += not all(torch.isfinite(p.grad).all() for p in module.parameters())
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return scaler.get_scale(), skipped


def amp_of(trainer):
    (amp,) = [p for p in trainer.plugins if getattr(p, "hookloop_name", "") == "amp"]
    return amp


# ---------------------------------------------------------------------------------------
# bf16
# ---------------------------------------------------------------------------------------


def digits_accuracy(precision: str, epochs: int = 10) -> float:
    hookloop.seed_everything(0)
    train, val = digits_datasets()
    trainer = hookloop.Trainer(max_epochs=epochs, precision=precision, enable_checkpointing=False)
    trainer.fit(DigitsClassifier(), DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=128))
    return trainer.callback_metrics["val_acc"]


def test_bf16_digits_accuracy_within_one_point_of_fp32():
    fp32 = digits_accuracy("32")
    bf16 = digits_accuracy("bf16-mixed")
    print(f"digits val_acc: fp32 {fp32:.4f}, bf16-mixed {bf16:.4f}")
    assert fp32 >= 0.9
    assert abs(bf16 - fp32) <= 0.01


@pytest.mark.check  # reads the shared ddp job
def test_bf16_digits_with_ddp_on_two_processes_within_one_point_of_fp32(jobs):
    """Needs the ddp plugin (hookloop-ddp); the script (tests/scripts/amp_ddp_digits.py, 10
    epochs, in the shared ddp job of tests/jobs.py) trains fp32, then bf16, on 2 ranks."""
    stdout = jobs.run("ddp").stdout("amp_ddp_digits")  # rank 0 prints, rank 1 does not
    results = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            _, precision, world, plugins, acc = line.split()
            results[precision] = (world, plugins, float(acc.split("=")[1]))
    print(f"digits val_acc on 2 ddp processes: {results}")
    # the built-in progress bar and CSV logger come with every run
    assert results["32"][:2] == ("world=2", "plugins=ddp,progress,model_summary,csv")
    assert results["bf16-mixed"][:2] == ("world=2", "plugins=ddp,progress,model_summary,csv,amp")  # amp enabled by precision
    assert results["32"][2] >= 0.9
    assert abs(results["bf16-mixed"][2] - results["32"][2]) <= 0.01


def test_bf16_matches_hand_written_autocast_loop():
    loader = DataLoader(tiny_data(), batch_size=16)
    module = AutocastProbe()
    trainer = hookloop.Trainer(precision="bf16-mixed", max_epochs=2, gradient_clip_val=0.5, enable_checkpointing=False)
    trainer.fit(module, loader, DataLoader(tiny_data(32, seed=5), batch_size=16))
    reference = TinyModule()
    autocast_reference(reference, loader, epochs=2, dtype=torch.bfloat16, clip=0.5)
    assert max_abs_diff(state_of(module), state_of(reference)) < 1e-6
    # Every training and validation forward ran under bf16 autocast; weights stay fp32.
    assert module.seen and all(on and dt == torch.bfloat16 and out == torch.bfloat16 for _, on, dt, out in module.seen)
    assert {kind for kind, *_ in module.seen} == {"train", "val"}
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert amp_of(trainer).scaler is None  # bf16 has fp32's range: no loss scaling


def test_precision_alone_enables_amp():
    trainer = hookloop.Trainer(precision="bf16")
    assert [type(p).__name__ for p in trainer.plugins] == ["ProgressBar", "ModelSummary", "CSVLogger", "ModelCheckpoint", "AMP"]
    assert trainer.precision == "bf16-mixed"
    assert not hookloop.Trainer().has_plugin("precision")  # fp32 enables no precision plugin


def test_precision_without_amp_installed_is_a_clear_error(monkeypatch):
    from hookloop.contract import registry

    installed = registry.installed_plugins()
    monkeypatch.setattr(registry, "installed_plugins", lambda: {k: v for k, v in installed.items() if k != "amp"})
    with pytest.raises(hookloop.MissingDependencyError, match="pip install hookloop-amp"):
        hookloop.Trainer(precision="bf16-mixed")


@pytest.mark.slow  # a launch: `hookloop run --precision` reaching the script's Trainer
def test_cli_precision_option_applies_autocast(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(
        """
        import sys, torch, hookloop
        sys.path.insert(0, sys.argv[1])
        from conftest import TinyModule, tiny_data
        from torch.utils.data import DataLoader

        class Probe(TinyModule):
            def training_step(self, batch, batch_idx):
                print("AUTOCAST", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
                return super().training_step(batch, batch_idx)

        trainer = hookloop.Trainer(max_steps=1, enable_checkpointing=False)
        print("PLUGINS", [p.hookloop_name for p in trainer.plugins], trainer.precision)
        trainer.fit(Probe(), DataLoader(tiny_data(16), batch_size=16))
        """
    ))
    out = run_python(HOOKLOOP + ["run", "--precision", "bf16-mixed", "train.py", str(REPO / "tests")], cwd=tmp_path)
    assert "PLUGINS ['progress', 'model_summary', 'csv', 'amp'] bf16-mixed" in out.stdout
    assert "AUTOCAST True torch.bfloat16" in out.stdout


# ---------------------------------------------------------------------------------------
# fp16 with a GradScaler
# ---------------------------------------------------------------------------------------


def test_fp16_without_cuda_is_a_clear_error_suggesting_bf16():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the error is for CPU-only machines")
    trainer = hookloop.Trainer(precision="16-mixed", max_epochs=1, enable_checkpointing=False)
    with pytest.raises(hookloop.ConfigurationError, match="needs a CUDA GPU.*bf16-mixed"):
        trainer.fit(TinyModule(), DataLoader(tiny_data(), batch_size=16))


def test_fp16_scaler_path_matches_hand_written_gradscaler_loop():
    """Scaled backward, unscale before clipping, inf/nan steps skipped, scale updated."""
    loader = DataLoader(tiny_data(), batch_size=16)
    # 2**24 overflows fp16 gradients, so the first steps are skipped while the scale
    # backs off; a short growth interval makes it grow (and overflow) again later.
    options = {"amp": {"allow_cpu_fp16": True, "init_scale": 2.0**24, "growth_interval": 3}}
    module = AutocastProbe()
    trainer = hookloop.Trainer(precision="16-mixed", max_epochs=3, gradient_clip_val=0.5,
                               enable_checkpointing=False, plugin_options=options)
    trainer.fit(module, loader)
    amp = amp_of(trainer)

    reference = TinyModule()
    ref_scale, ref_skipped = scaler_reference(reference, loader, 3, clip=0.5, init_scale=2.0**24, growth_interval=3)
    assert ref_skipped >= 3  # the test exercises skipping
    assert max_abs_diff(state_of(module), state_of(reference)) < 1e-6
    assert amp.scaler.get_scale() == ref_scale
    assert amp.skipped_steps == ref_skipped
    assert all(on and dt == torch.float16 for _, on, dt, _ in module.seen)

    # Clipping the still-scaled gradients would be a different (wrong) computation.
    wrong = TinyModule()
    scaler_reference(wrong, loader, 3, clip=0.5, init_scale=2.0**24, growth_interval=3, unscale_before_clip=False)
    assert max_abs_diff(state_of(module), state_of(wrong)) > 1e-3


def test_optimizer_step_returns_false_when_skipped():
    """The hook's result: False for an inf/nan step (weights untouched), True otherwise."""
    from hookloop_amp import AMP

    module = TinyModule()
    trainer = hookloop.Trainer(plugins=[AMP(allow_cpu_fp16=True)], precision="16-mixed", max_steps=0,
                               enable_checkpointing=False)
    trainer.fit(module, DataLoader(tiny_data(16), batch_size=16))  # runs setup, builds the scaler
    amp, opt = amp_of(trainer), trainer.optimizer
    x, y = tiny_data(16).tensors
    results = []
    for poison in (True, False):
        before = state_of(module)
        with amp.forward_context():
            loss = F.cross_entropy(module(x), y)
        amp.backward(loss * (float("inf") if poison else 1.0))
        results.append((amp.optimizer_step(trainer, opt), max_abs_diff(before, state_of(module))))
        opt.zero_grad()
    assert results[0] == (False, 0.0)
    assert results[1][0] is True and results[1][1] > 0


def test_scaler_state_is_saved_and_restored_on_resume(tmp_path):
    options = {"amp": {"allow_cpu_fp16": True, "init_scale": 2.0**24, "growth_interval": 3}}
    loader = DataLoader(tiny_data(), batch_size=16)  # 6 steps an epoch

    whole = TinyModule()
    t_whole = hookloop.Trainer(precision="16-mixed", max_epochs=2, plugin_options=options,
                               default_root_dir=str(tmp_path / "whole"))
    t_whole.fit(whole, loader)

    first = TinyModule()
    hookloop.Trainer(precision="16-mixed", max_steps=8, plugin_options=options,
                     default_root_dir=str(tmp_path / "split")).fit(first, loader)
    saved = hookloop.safe_load(tmp_path / "split" / "logs" / "version_0" / "checkpoints" / "last.ckpt")
    scale_at_save = saved["plugins"]["amp"]["scaler"]["scale"]
    assert scale_at_save != 2.0**24  # it moved, so restoring it matters
    assert saved["plugins"]["amp"]["skipped_steps"] > 0

    resumed = TinyModule(seed=123)  # different weights: everything must come from the file
    t_resumed = hookloop.Trainer(precision="16-mixed", max_epochs=2, plugin_options=options,
                                 default_root_dir=str(tmp_path / "split"))
    t_resumed.fit(resumed, loader, ckpt_path="last")
    assert max_abs_diff(state_of(resumed), state_of(whole)) < 1e-6
    assert amp_of(t_resumed).scaler.get_scale() == amp_of(t_whole).scaler.get_scale()
    assert amp_of(t_resumed).skipped_steps == amp_of(t_whole).skipped_steps


# ---------------------------------------------------------------------------------------
# A strategy that owns precision
# ---------------------------------------------------------------------------------------


class OwnsPrecision:
    """A strategy that applies precision itself (as DeepSpeed does) and records it."""

    hookloop_name = "owner"
    hookloop_role = "strategy"
    hookloop_owns = {"precision"}

    def __init__(self):
        self.precision_seen = None

    @hookloop.hookimpl
    def setup(self, trainer):
        self.precision_seen = trainer.precision


def test_strategy_that_owns_precision_gets_it_and_amp_steps_aside(capsys):
    owner = OwnsPrecision()
    module = AutocastProbe()
    trainer = hookloop.Trainer(plugins=[owner, "amp"], precision="bf16-mixed", max_steps=2, enable_checkpointing=False)
    trainer.fit(module, DataLoader(tiny_data(), batch_size=16))
    assert owner.precision_seen == "bf16-mixed"
    assert not any(on for _, on, *_ in module.seen)  # amp did not autocast on top of it
    out = capsys.readouterr().out
    assert out.count("precision='bf16-mixed' is applied by the strategy 'owner'") == 1


def test_precision_owner_means_amp_is_not_auto_enabled():
    trainer = hookloop.Trainer(plugins=[OwnsPrecision()], precision="16-mixed")
    assert [p.hookloop_name for p in trainer.plugins] == ["owner", "progress", "model_summary", "csv", "checkpoint"]


def test_true_half_precision_is_refused_without_an_owning_strategy():
    trainer = hookloop.Trainer(precision="bf16-true", max_epochs=1, enable_checkpointing=False)
    with pytest.raises(hookloop.ConfigurationError, match="not mixed precision"):
        trainer.fit(TinyModule(), DataLoader(tiny_data(), batch_size=16))
