"""Gradient clipping is torch's own, bit for bit (issue 33).

A hand-written loop clips ``clip_grad_norm_(model.parameters(), max_norm)``; torch stacks
the per-tensor norms in that order and the total's rounding depends on it. nanoGPT's
optimizer holds the same tensors in two groups (decay, no decay), so clipping over its
groups was a rounding away (4.8e-7 after a few steps). The default ``clip_gradients``
hook clips the optimizer's parameters in the module's order. The two-process checks
(ddp, fsdp) are in tests/scripts/ddp_battery.py and fsdp_battery.py.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, state_of
from hookloop.helpers import clip_coefficient, clip_order

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from clip_models import TinyGPT, reference_loop, tokens  # noqa: E402

STEPS = 6


def _fit(clip: float | None, algorithm: str = "norm") -> dict:
    model = TinyGPT(seed=0)
    trainer = hookloop.Trainer(max_steps=STEPS, gradient_clip_val=clip, gradient_clip_algorithm=algorithm,
                               enable_checkpointing=False, logger=False, enable_progress_bar=False)
    trainer.fit(model, DataLoader(tokens(), batch_size=4))
    return state_of(model)


def _reference(clip: float | None, algorithm: str = "norm") -> tuple[dict, list[float]]:
    model = TinyGPT(seed=0)
    norms = reference_loop(model, DataLoader(tokens(), batch_size=4), clip, algorithm, steps=STEPS)
    return state_of(model), norms


def _bitwise(a: dict, b: dict) -> list[str]:
    """The tensors that are not bit for bit equal (an empty list: all are)."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_without_clipping_the_nanogpt_shape_is_bitwise_the_hand_written_loop():
    reference, _ = _reference(None)
    assert _bitwise(_fit(None), reference) == []


def test_norm_clipping_is_bitwise_clip_grad_norm_over_model_parameters():
    reference, norms = _reference(0.5)
    assert min(norms) > 0.5, "the check needs clipping to act at every step"
    assert _bitwise(_fit(0.5), reference) == []


def test_value_clipping_is_bitwise_clip_grad_value_():
    reference, _ = _reference(0.01, "value")
    assert _bitwise(_fit(0.01, "value"), reference) == []


def test_clip_order_is_module_order_restricted_to_each_optimizer():
    model = TinyGPT()
    params = list(model.parameters())
    decay, no_decay = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    both = torch.optim.AdamW([{"params": no_decay}, {"params": decay}])
    assert [id(p) for p in clip_order(both, model)] == [id(p) for p in params]
    first, second = torch.optim.SGD(decay[::-1], lr=0.1), torch.optim.SGD(no_decay[::-1], lr=0.1)
    assert [id(p) for p in clip_order(first, model)] == [id(p) for p in decay]
    assert [id(p) for p in clip_order(second, model)] == [id(p) for p in no_decay]
    # A tensor the module does not hold comes after the module's, in the optimizer's order.
    outside = nn.Parameter(torch.zeros(2))
    extra = torch.optim.SGD([outside, *decay[::-1]], lr=0.1)
    assert [id(p) for p in clip_order(extra, model)] == [id(p) for p in decay] + [id(outside)]
    assert [id(p) for p in clip_order(extra)] == [id(p) for p in [outside, *decay[::-1]]]


@pytest.mark.parametrize("norm", [0.5, 1.0, 3.0, 1e-7, float("inf")])
def test_clip_coefficient_is_torchs(norm):
    """What ``torch.nn.utils.clip_grads_with_norm_`` multiplies by, from the same norm."""
    grad = torch.ones(3)
    param = nn.Parameter(torch.zeros(3))
    param.grad = grad.clone()
    torch.nn.utils.clip_grads_with_norm_([param], 0.7, torch.tensor(norm))
    assert torch.equal(grad * clip_coefficient(torch.tensor(norm), 0.7), param.grad)


# -- Lightning's configure_gradient_clipping ----------------------------------------------


class ClipsValues(TinyGPT):
    """Clips by value in its own configure_gradient_clipping, whatever the Trainer says."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.seen = (gradient_clip_val, gradient_clip_algorithm)
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")


class NeverClips(TinyGPT):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        pass


class CallsSuper(TinyGPT):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


@pytest.mark.parametrize("cls, clip, expected", [
    (ClipsValues, None, (0.01, "value")),  # clips without gradient_clip_val too
    (ClipsValues, 0.5, (0.01, "value")),
    (NeverClips, 0.5, (None, "norm")),  # the override decides: no clipping
    (CallsSuper, 0.5, (0.5, "norm")),  # Lightning's default: the Trainer's settings
])
def test_configure_gradient_clipping_override_decides_as_in_lightning(cls, clip, expected):
    model = cls(seed=0)
    trainer = hookloop.Trainer(max_steps=STEPS, gradient_clip_val=clip, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False)
    trainer.fit(model, DataLoader(tokens(), batch_size=4))
    reference, _ = _reference(*expected)
    assert _bitwise(state_of(model), reference) == []
    if cls is ClipsValues:
        assert model.seen == (clip, "norm")  # called with the Trainer's settings


def test_configure_gradient_clipping_under_a_strategy_that_clips_itself_is_refused():
    """deepspeed and ddp_sequential step with ``before_optimizer_step(clip=False)``: the
    override would never run, so the first step stops, before the update, with the fix."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(state=SimpleNamespace(on_before_optimizer_step=None), module=ClipsValues())
    with pytest.raises(hookloop.ConfigurationError,
                       match=r"ClipsValues.configure_gradient_clipping is not called: the strategy clips the "
                             r"gradients itself. Remove the override and set Trainer\(gradient_clip_val=\.\.\., "):
        hookloop.before_optimizer_step(trainer, None, clip=False)
    trainer.module = TinyGPT()  # hookloop.Module's own: the Trainer's settings, nothing to refuse
    hookloop.before_optimizer_step(trainer, None, clip=False)
