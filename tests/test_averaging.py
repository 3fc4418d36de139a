"""hookloop-averaging (plugins/averaging): ``ema`` and ``swa`` against references.

* EMA against the closed form of its recurrence over the weights a hand-written loop
  reaches at each update step;
* SWA against a hand-written loop driving ``torch.optim.swa_utils`` itself
  (``AveragedModel``, ``SWALR``, ``update_bn``) and against Lightning 2.6.6's
  ``StochasticWeightAveraging`` running the same LightningModule;
* exact resume (``torch.equal``) from a checkpoint written mid-run;
* under ddp and fsdp (2 processes, gloo) against the one-process reference.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop
from conftest import tiny_data

QUIET = dict(enable_progress_bar=False, enable_model_summary=False)


class BNModule(hookloop.Module):
    """Linear 8 -> 16 -> BatchNorm -> ReLU -> 3, SGD with momentum (optionally a StepLR);
    its validation records the weights it validates with."""

    def __init__(self, seed: int = 0, scheduler: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.scheduler = scheduler
        self.validated: list[dict] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))
        if batch_idx == 0:
            self.validated.append({k: v.detach().clone() for k, v in self.state_dict().items()})

    def configure_optimizers(self):
        return make_optimizer(self, self.scheduler)


def make_optimizer(module, scheduler):
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    if scheduler:
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return opt


def loader(n=64, batch_size=8):
    return DataLoader(tiny_data(n), batch_size=batch_size)  # unshuffled: the reference sees the same order


def trainer(tmp_path, plugin, **kwargs):
    kwargs.setdefault("logger", False)
    return hookloop.Trainer(plugins=[plugin], default_root_dir=tmp_path, **QUIET, **kwargs)


def params(module):
    return {k: v.detach().clone() for k, v in module.named_parameters()}


# -- EMA ---------------------------------------------------------------------------------


def ema_reference(epochs, decay, every, start, validate_each_epoch=False):
    """A hand-written loop; the EMA of each tensor by the closed form of the recurrence
    ``e_0 = w_0, e_k = d e_{k-1} + (1 - d) w_k``: ``e_K = d^K w_0 + sum_k (1-d) d^(K-k) w_k``
    over the weights ``w_k`` at the update steps (index ``i >= start``, ``i % every == 0``)."""
    model = BNModule()
    opt = make_optimizer(model, False)
    snapshots, at_epoch_end, i = [], [], 0
    for _ in range(epochs):
        for x, y in loader():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= start and i % every == 0:
                snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            i += 1
        at_epoch_end.append((len(snapshots), {k: v.detach().clone() for k, v in model.state_dict().items()}))

    def closed_form(shots):
        K = len(shots) - 1
        out = {}
        for k in shots[0]:
            if not shots[0][k].is_floating_point():
                continue
            total = decay ** K * shots[0][k].double()
            for j in range(1, K + 1):
                total = total + (1 - decay) * decay ** (K - j) * shots[j][k].double()
            out[k] = total.float()
        return out

    return closed_form(snapshots), [(closed_form(snapshots[:n]) if n else None, w) for n, w in at_epoch_end]


def test_ema_equals_the_closed_form_of_a_hand_written_loop(tmp_path):
    decay, every, start = 0.8, 2, 3
    expected, per_epoch = ema_reference(3, decay, every, start)
    module = BNModule()
    ema = hookloop.plugin("ema", decay=decay, update_every_n_steps=every, update_starting_at_step=start)
    trainer(tmp_path, ema, max_epochs=3, enable_checkpointing=False).fit(module, loader(), loader(16))
    state = module.state_dict()
    for k, v in expected.items():
        assert torch.allclose(state[k], v, atol=1e-6, rtol=0), k
    assert ema.n_averaged == len([i for i in range(24) if i >= start and i % every == 0])
    # Validation ran on the average (the sanity check before any update: on the weights);
    # training went on from the trained weights (else the final average would differ).
    assert len(module.validated) == 1 + 3
    for (average, trained), seen in zip(per_epoch, module.validated[1:]):
        for k, v in average.items():
            assert torch.allclose(seen[k], v, atol=1e-6, rtol=0), k


def test_ema_buffers_copied_not_averaged(tmp_path):
    module = BNModule()
    ema = hookloop.plugin("ema", decay=0.5, use_buffers=False, apply_at_end=False)
    trainer(tmp_path, ema, max_epochs=1, enable_checkpointing=False).fit(module, loader())
    assert torch.equal(ema.average["net.1.running_mean"], module.net[1].running_mean)
    assert not torch.equal(ema.average["net.0.weight"], module.net[0].weight)


@pytest.mark.parametrize("bad", [dict(decay=1.5), dict(update_every_n_steps=0), dict(update_starting_at_step=-1)])
def test_ema_bad_options_are_refused(bad):
    with pytest.raises(hookloop.ConfigurationError, match=next(iter(bad))):
        hookloop.plugin("ema", **bad)


# -- SWA ---------------------------------------------------------------------------------


def swa_reference(epochs, swa_start, swa_lr, anneal, strategy):
    """torch.optim.swa_utils by hand, on Lightning's schedule: from 0-based epoch
    ``swa_start`` the average takes the weights at each epoch's start and SWALR replaces the
    StepLR; then the average goes into the model and ``update_bn`` recomputes BatchNorm."""
    from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

    model = BNModule()
    opt, step_lr = make_optimizer(model, True)
    swa_model, swa_sched = AveragedModel(model), None
    for epoch in range(epochs):
        if epoch >= swa_start:
            if swa_sched is None:
                for group in opt.param_groups:
                    group["initial_lr"] = swa_lr
                swa_sched = SWALR(opt, swa_lr=swa_lr, anneal_epochs=anneal, anneal_strategy=strategy,
                                  last_epoch=epochs if strategy == "cos" else -1)
            swa_model.update_parameters(model)
        for x, y in loader():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        (swa_sched or step_lr).step()
    with torch.no_grad():
        for p_avg, p in zip(swa_model.module.parameters(), model.parameters()):
            p.copy_(p_avg)
    update_bn(loader(), model)
    return model.state_dict(), int(swa_model.n_averaged), [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize("strategy", ["cos", "linear"])
def test_swa_equals_a_hand_written_swa_utils_loop(tmp_path, strategy):
    expected, n, lrs = swa_reference(5, 2, 0.05, 2, strategy)
    module = BNModule(scheduler=True)
    swa = hookloop.plugin("swa", swa_lrs=0.05, swa_epoch_start=3, annealing_epochs=2, annealing_strategy=strategy)
    t = trainer(tmp_path, swa, max_epochs=5, enable_checkpointing=False)
    t.fit(module, loader())
    assert swa.n_averaged == n == 3
    for k, v in expected.items():
        assert torch.allclose(module.state_dict()[k], v, atol=1e-6, rtol=0), k
    assert [g["lr"] for g in t.optimizers[0].param_groups] == pytest.approx(lrs, abs=1e-12)
    # the module's StepLR was held still during SWA and is given back
    assert isinstance(t.lr_scheduler_configs[0].scheduler, torch.optim.lr_scheduler.StepLR)


def test_swa_epoch_start_fraction_is_lightnings(tmp_path):
    swa = hookloop.plugin("swa", swa_lrs=0.05, swa_epoch_start=0.6)  # int(0.6 * 5) = 3 -> epoch index 2
    trainer(tmp_path, swa, max_epochs=5, enable_checkpointing=False).fit(BNModule(scheduler=True), loader())
    assert (swa.swa_start, swa.n_averaged) == (2, 3)


@pytest.mark.parametrize("bad, word", [(dict(swa_epoch_start=0), "swa_epoch_start"), (dict(swa_epoch_start=1.5), "swa_epoch_start"),
                                       (dict(swa_lrs=-0.1), "swa_lrs"), (dict(annealing_strategy="exp"), "annealing_strategy")])
def test_swa_bad_options_are_refused(bad, word):
    with pytest.raises(hookloop.ConfigurationError, match=word):
        hookloop.plugin("swa", **bad)


# -- exact resume ------------------------------------------------------------------------


def _saved_state(plugin):
    return {k: v.clone() for k, v in plugin.average.items()}, plugin.n_averaged


@pytest.mark.parametrize("name, options, stop", [
    ("ema", dict(decay=0.7, update_every_n_steps=3, update_starting_at_step=2), 13),
    ("swa", dict(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=3), 13),
])
def test_resume_from_a_checkpoint_is_bit_identical(tmp_path, name, options, stop):
    """4 epochs of 8 steps uninterrupted vs stopped at step 13 (epoch 1, 5 steps in) and
    resumed from its last.ckpt by a new Trainer, module (other weights) and plugin."""
    def run(root, max_steps=None, ckpt_path=None, seed=0):
        module, plugin = BNModule(seed=seed, scheduler=True), hookloop.plugin(name, **options)
        kwargs = {} if max_steps is None else {"max_steps": max_steps}
        t = trainer(root, plugin, max_epochs=4, **kwargs)
        t.fit(module, loader(), loader(16), ckpt_path=ckpt_path)
        return module, plugin, t

    full_module, full, _ = run(tmp_path / "full")
    run(tmp_path / "cut", max_steps=stop)
    last = glob.glob(str(tmp_path / "cut" / "**" / "last.ckpt"), recursive=True)
    assert len(last) == 1
    saved = torch.load(last[0], weights_only=True)["plugins"][name]
    assert saved["n_averaged"] > 0
    module, resumed, t = run(tmp_path / "resumed", ckpt_path=last[0], seed=5)
    assert t.global_step == 32 and resumed.n_averaged == full.n_averaged
    for k, v in full.average.items():
        assert torch.equal(resumed.average[k], v), k
    for k, v in full_module.state_dict().items():
        assert torch.equal(module.state_dict()[k], v), k
    if name == "swa":
        assert resumed.scheduler.state_dict() == full.scheduler.state_dict()
