"""The loop reproduces a hand-written PyTorch loop exactly (single process, CPU)."""

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import TinyModule, max_abs_diff, reference_loop, state_of, tiny_data


def fit(module, loader, **kw):
    kw.setdefault("enable_checkpointing", False)
    trainer = hookloop.Trainer(**kw)
    trainer.fit(module, loader)
    return trainer


@pytest.mark.parametrize("accumulate,clip,scheduler", [(1, None, False), (3, None, False), (2, 0.05, True)])
def test_matches_hand_written_loop(accumulate, clip, scheduler):
    data = tiny_data(100)  # 100 / 16 -> a last partial batch and an uneven last window
    ref = TinyModule(scheduler=scheduler)
    ours = TinyModule(scheduler=scheduler)
    torch.manual_seed(3)
    reference_loop(ref, DataLoader(data, batch_size=16, shuffle=True), epochs=2, accumulate=accumulate, clip=clip)
    torch.manual_seed(3)
    trainer = fit(ours, DataLoader(data, batch_size=16, shuffle=True), max_epochs=2,
                  accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    assert max_abs_diff(state_of(ref), state_of(ours)) == 0.0
    assert trainer.global_step == 2 * -(-7 // accumulate)
    assert trainer.current_epoch == 2


def test_max_steps_stops_mid_epoch():
    trainer = fit(TinyModule(), DataLoader(tiny_data(), batch_size=8), max_steps=5)
    assert trainer.global_step == 5 and trainer.current_epoch == 0


def test_step_interval_scheduler_and_dict_return():
    class M(TinyModule):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def training_step(self, batch, batch_idx):
            return {"loss": super().training_step(batch, batch_idx)}

    trainer = fit(M(), DataLoader(tiny_data(32), batch_size=8), max_epochs=1)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 ** 4)


def test_validation_metrics_are_batch_weighted_means():
    data = tiny_data(50)
    module = TinyModule()
    trainer = hookloop.Trainer(enable_checkpointing=False)
    (metrics,) = trainer.validate(module, DataLoader(data, batch_size=16))
    x, y = data.tensors
    with torch.no_grad():
        logits = module(x)
    expected_acc = (logits.argmax(-1) == y).float().mean().item()
    expected_loss = torch.nn.functional.cross_entropy(logits, y).item()
    assert metrics["val_acc"] == pytest.approx(expected_acc, abs=1e-6)
    assert metrics["val_loss"] == pytest.approx(expected_loss, abs=1e-6)


def test_training_step_must_return_scalar():
    class Bad(TinyModule):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            return self(x)  # per-sample logits, not a loss

    with pytest.raises(TypeError, match="scalar loss"):
        fit(Bad(), DataLoader(tiny_data(), batch_size=8), max_epochs=1)

    class NoTensor(TinyModule):
        def training_step(self, batch, batch_idx):
            return 1.0

    with pytest.raises(TypeError, match="got float"):
        fit(NoTensor(), DataLoader(tiny_data(), batch_size=8), max_epochs=1)


def test_buffers_and_params_follow_the_model_and_batches_need_no_device_code():
    class WithBuffer(TinyModule):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))

        def training_step(self, batch, batch_idx):
            self.seen += batch[0].shape[0]
            return super().training_step(batch, batch_idx)

    m = WithBuffer()
    fit(m, DataLoader(tiny_data(40), batch_size=8), max_epochs=2)
    assert m.seen.item() == 80


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"devices": 0}, "positive number"),
        ({"devices": [0, 0]}, "twice"),
        ({"devices": 2}, "no strategy plugin"),
        ({"accelerator": "cuda"}, "no CUDA GPU"),
        ({"accumulate_grad_batches": 0}, ">= 1"),
        ({"precision": "8"}, "precision"),
        ({"nodes": 2, "plugins": ["ddp"]}, "rdzv"),  # at the launch, before torchrun starts
    ],
)
def test_bad_configuration_is_refused_early(kwargs, match):
    if kwargs.get("accelerator") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(hookloop.ConfigurationError, match=match):
        fit(TinyModule(), DataLoader(tiny_data(), batch_size=8), max_epochs=1, **kwargs)


@pytest.mark.parametrize("name", ["enable_checkpointing", "enable_progress_bar", "use_distributed_sampler",
                                  "autoload_plugins", "requeue_on_preemption"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_switches_must_be_booleans(name, value):
    # "no" is truthy: it would silently have meant True.
    with pytest.raises(hookloop.ConfigurationError, match=f"^{name}={value!r} must be True or False$"):
        hookloop.Trainer(**{name: value})


@pytest.mark.parametrize("value", ["no", 0])
def test_logger_must_be_a_switch_or_loggers(value):
    # logger= takes True/False/None (Lightning's default) or logger objects; "no" and 0
    # would silently have meant something
    with pytest.raises(hookloop.ConfigurationError, match=rf"^Trainer\(logger=\.\.\.\) got builtins\.{type(value).__name__}, "
                                                           r"which is not a hookloop logger"):
        hookloop.Trainer(logger=value)


@pytest.mark.parametrize("value", ["1.0", True, 0.0, float("nan"), float("inf")])
def test_gradient_clip_val_must_be_a_positive_number(value):
    with pytest.raises(hookloop.ConfigurationError, match="must be a finite number > 0"):
        hookloop.Trainer(gradient_clip_val=value)


def test_module_without_required_methods():
    with pytest.raises(hookloop.ConfigurationError, match="configure_optimizers"):
        hookloop.Trainer().fit(torch.nn.Linear(2, 2), DataLoader(tiny_data(), batch_size=8))


def test_apply_to_tensors_keeps_the_batch_structure():
    from collections import namedtuple

    Pair = namedtuple("Pair", "x y")
    x, y, z = torch.ones(2), torch.arange(3), torch.zeros(1, dtype=torch.float64)
    batch = {"pair": Pair(x, y), "rest": [z, "label", (x,)]}
    out = hookloop.apply_to_tensors(batch, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
    assert type(out["pair"]) is Pair and out["rest"][1] == "label" and type(out["rest"][2]) is tuple
    assert out["pair"].x.dtype == torch.bfloat16 and out["rest"][0].dtype == torch.bfloat16
    assert out["pair"].y is y  # integer tensors left alone by this function
    moved = hookloop.move_to_device(batch, torch.device("meta"))
    assert moved["pair"].x.device.type == "meta" and moved["rest"][2][0].device.type == "meta"
