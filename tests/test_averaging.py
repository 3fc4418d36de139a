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
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop
from conftest import REPO, run_python, tiny_data

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from mesh_models import Classifies  # noqa: E402

# the long matrix (make test-full): the other annealing strategy, EMA's resume, fsdp, Lightning
FULL = pytest.mark.full  # the long matrix

QUIET = dict(enable_progress_bar=False, enable_model_summary=False)


class BNModule(Classifies, hookloop.Module):
    """Linear 8 -> 16 -> BatchNorm -> ReLU -> 3, SGD with momentum (optionally a StepLR);
    its validation records the weights it validates with."""

    def __init__(self, seed: int = 0, scheduler: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.scheduler = scheduler
        self.validated: list[dict] = []

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


@pytest.mark.parametrize("strategy", ["cos", pytest.param("linear", marks=FULL)])
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
    pytest.param("ema", dict(decay=0.7, update_every_n_steps=3, update_starting_at_step=2), 13, marks=FULL),
    ("swa", dict(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=3), 13),
])
def test_resume_from_a_checkpoint_is_bit_identical(tmp_path, name, options, stop):
    """4 epochs of 8 steps uninterrupted vs stopped at step 13 (epoch 1, 5 steps in) and
    resumed from its last.ckpt by a new Trainer, module (other weights) and plugin."""
    def run(root, max_steps=None, ckpt_path=None, seed=0):
        module, plugin = BNModule(seed=seed, scheduler=True), hookloop.plugin(name, **options)
        kwargs = {} if max_steps is None else {"max_steps": max_steps}
        t = trainer(root, plugin, max_epochs=4, logger=True, **kwargs)  # the run directory's resume last.ckpt
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


# -- ddp and fsdp: the averages of one process's reference on the same full batches ------


def _tiny():
    from conftest import TinyModule  # Linear 8 -> 16 -> ReLU -> 3, no BatchNorm: batch statistics would split

    return TinyModule()


def dp_reference(name, epochs=3, world=2, batch_size=4, n=64):
    """One process, a hand-written loop over the full batches a ``world``-rank run trains on
    together (each rank's DistributedSampler(shuffle=True, seed=0) with set_epoch, the
    ranks' j-th batches joined): the EMA (decay 0.8, recurrence) or SWA (from epoch index
    1, SWALR 0.05 over 2 epochs, torch's AveragedModel) of its weights."""
    from torch.optim.swa_utils import SWALR, AveragedModel
    from torch.utils.data import DistributedSampler

    model = _tiny()
    opt = model.configure_optimizers()
    data = tiny_data(n)
    samplers = [DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0) for r in range(world)]
    steps = len(samplers[0]) // batch_size
    ema, swa, sched = None, AveragedModel(model), None
    for epoch in range(epochs):
        if name == "swa" and epoch >= 1:
            if sched is None:
                for group in opt.param_groups:
                    group["initial_lr"] = 0.05
                sched = SWALR(opt, swa_lr=0.05, anneal_epochs=2, last_epoch=epochs)
            swa.update_parameters(model)
        orders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for i in range(steps):
            block = [j for order in orders for j in order[i * batch_size:(i + 1) * batch_size]]
            x, y = data[torch.tensor(block)]
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            w = params(model)
            ema = w if ema is None else {k: 0.8 * ema[k] + 0.2 * w[k] for k in w}
        if sched is not None:
            sched.step()
    return ema if name == "ema" else dict(swa.module.named_parameters())


def dp_rank(strategy: str, root: str) -> dict:
    """One rank: ema then swa under ``strategy``; the model's weights after each fit."""
    import warnings

    out = {}
    for name, options in (("ema", dict(decay=0.8)), ("swa", dict(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=2))):
        module, plugin = _tiny(), hookloop.plugin(name, **options)
        t = hookloop.Trainer(plugins=[strategy, plugin], max_epochs=3, default_root_dir=os.path.join(root, name),
                             logger=False, enable_checkpointing=False, **QUIET)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(module, DataLoader(tiny_data(64), batch_size=4))
        out[name] = (params(module), plugin._sharded)
        # SWALR starts mid-training; torch's "lr_scheduler.step() before optimizer.step()" is wrong
        out[name + "_warned"] = [str(w.message)[:60] for w in caught if "optimizer.step()" in str(w.message)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=FULL)])
def test_averages_under_data_parallel_equal_one_process_reference(hookloop_processes, tmp_path, strategy):
    results = hookloop_processes(dp_rank, nprocs=2, args=(strategy, str(tmp_path)), timeout=300)
    for name in ("ema", "swa"):
        expected = dp_reference(name)
        for rank, result in enumerate(results):
            weights, sharded = result[name]
            assert result[name + "_warned"] == [], (name, rank)
            # fsdp: each rank averaged its own shards of the DTensor parameters
            assert sharded == (strategy == "fsdp")
            for k, v in expected.items():
                assert torch.allclose(weights[k], v.detach(), atol=1e-6, rtol=0), (name, rank, k)


# -- Lightning 2.6.6's StochasticWeightAveraging as the oracle ------------------------------

LIGHTNING_SCRIPT = """
import sys, torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader
sys.path.insert(0, {tests!r})
sys.path.insert(0, {tests!r} + "/scripts")
from conftest import tiny_data
from mesh_models import Classifies
import pytorch_lightning as pl
from pytorch_lightning.callbacks import StochasticWeightAveraging


class BNModule(Classifies, pl.LightningModule):
    def __init__(self, bn):
        super().__init__()
        torch.manual_seed(0)
        norm = [nn.BatchNorm1d(16)] if bn else []
        self.net = nn.Sequential(nn.Linear(8, 16), *norm, nn.ReLU(), nn.Linear(16, 3))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


for bn in (False, True):
    module = BNModule(bn)
    trainer = pl.Trainer(max_epochs=5, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=3, annealing_epochs=2)])
    trainer.fit(module, DataLoader(tiny_data(64), batch_size=8))
    torch.save(module.state_dict(), f"lightning_bn{{int(bn)}}.pt")
"""


@FULL
def test_swa_equals_lightnings_stochastic_weight_averaging(tmp_path):
    """The same module under pytorch_lightning 2.6.6 with its StochasticWeightAveraging and
    under hookloop with ``swa``: without BatchNorm every final weight; with BatchNorm the
    statistics that Lightning's extra epoch recomputes on the average (its weights are
    not compared there: during that epoch Lightning's weights move off the average, here
    by up to 0.03; the hand-written swa_utils loop above agrees with ours)."""
    (tmp_path / "light.py").write_text(LIGHTNING_SCRIPT.format(tests=str(REPO / "tests")))
    run_python([sys.executable, "light.py"], cwd=tmp_path, env={"PYTHONWARNINGS": "ignore"})
    for bn in (False, True):
        expected = torch.load(tmp_path / f"lightning_bn{int(bn)}.pt", weights_only=True)
        module = BNModule(scheduler=True)
        if not bn:
            torch.manual_seed(0)
            module.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        swa = hookloop.plugin("swa", swa_lrs=0.05, swa_epoch_start=3, annealing_epochs=2)
        trainer(tmp_path / str(bn), swa, max_epochs=5, enable_checkpointing=False).fit(module, loader())
        compared = [k for k in expected if not bn or "running" in k or "tracked" in k]
        assert len(compared) == (4 if not bn else 3)
        for k in compared:
            assert torch.allclose(module.state_dict()[k].to(expected[k].dtype), expected[k], atol=1e-6, rtol=0), (bn, k)


def bn_rank(root: str) -> dict:
    module, swa = BNModule(), hookloop.plugin("swa", swa_lrs=0.05, swa_epoch_start=1)
    t = hookloop.Trainer(plugins=["ddp", swa], max_epochs=2, default_root_dir=root, logger=False,
                         enable_checkpointing=False, **QUIET)
    t.fit(module, DataLoader(tiny_data(64), batch_size=4))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@FULL
def test_swa_batchnorm_statistics_under_ddp_are_the_whole_loader_s(hookloop_processes, tmp_path):
    """``update_bn`` passes over the train loader given to ``fit`` (unsharded) on every rank:
    the ranks end with the statistics of ``update_bn`` in one process over all the data."""
    from torch.optim.swa_utils import update_bn

    results = hookloop_processes(bn_rank, nprocs=2, args=(str(tmp_path),), timeout=300)
    model = BNModule()
    model.load_state_dict(results[0])
    update_bn(DataLoader(tiny_data(64), batch_size=4), model)
    for k in ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"):
        assert torch.equal(results[0][k], results[1][k]), k
        assert torch.allclose(results[0][k], model.state_dict()[k], atol=1e-6, rtol=0), k


# -- the kit's extension suite ------------------------------------------------------------

from hookloop.testing import ExtensionConformance  # noqa: E402


class _AveragingConformance(ExtensionConformance):
    """Trains beside the default observers, keeps its checkpoint state under its own name,
    resumes exactly (the average and the weights). Its ddp check (one more 2-process
    launch; ddp is tested above) runs under make test-full."""

    @FULL
    def test_under_ddp_the_ranks_agree_and_a_resume_ends_as_an_uninterrupted_run(self, ddp):
        super().test_under_ddp_the_ranks_agree_and_a_resume_ends_as_an_uninterrupted_run(ddp)


class TestEMAConformance(_AveragingConformance):
    plugin = "ema"
    options = {"decay": 0.9, "update_starting_at_step": 3}


class TestSWAConformance(_AveragingConformance):
    plugin = "swa"
    options = {"swa_lrs": 0.05, "swa_epoch_start": 1}


def fsdp_resume_rank(root: str) -> dict:
    """One rank: ema under fsdp, 3 epochs (8 steps each) uninterrupted, and stopped at step 13
    then resumed from its checkpoint directory by a new Trainer, module and plugin."""
    def run(sub, max_steps=None, ckpt_path=None, seed=0):
        from conftest import TinyModule

        module, plugin = TinyModule(seed=seed), hookloop.plugin("ema", decay=0.7, update_every_n_steps=2)
        kwargs = {} if max_steps is None else {"max_steps": max_steps}
        # a logger: its run directory holds the resume last.ckpt the cut run leaves (a run
        # without one writes Lightning's files only: decisions.md "A run without a logger")
        t = hookloop.Trainer(plugins=["fsdp", plugin], max_epochs=3, default_root_dir=os.path.join(root, sub),
                             logger=True, **QUIET, **kwargs)
        t.fit(module, DataLoader(tiny_data(64), batch_size=4), ckpt_path=ckpt_path)
        return {k: v.clone() for k, v in plugin.average.items()}, plugin.n_averaged, params(module), plugin._sharded

    full = run("full")
    run("cut", max_steps=13)
    last = glob.glob(os.path.join(root, "cut", "**", "last.ckpt"), recursive=True)
    resumed = run("resumed", ckpt_path=last[0], seed=5)
    return full, resumed


@FULL
def test_fsdp_sharded_average_resumes_bit_identical(hookloop_processes, tmp_path):
    results = hookloop_processes(fsdp_resume_rank, nprocs=2, args=(str(tmp_path),), timeout=400)
    for rank, (full, resumed) in enumerate(results):
        assert full[3] and resumed[3]  # the average is of local shards, saved per rank
        assert full[1] == resumed[1] == 12
        for k in full[0]:
            assert torch.equal(full[0][k], resumed[0][k]), (rank, k)
        for k in full[2]:
            assert torch.equal(full[2][k], resumed[2][k]), (rank, k)
    assert not torch.equal(results[0][0][0]["net.0.weight"], results[1][0][0]["net.0.weight"])  # shards differ


def test_swa_sets_up_swalr_before_the_modules_epoch_start_as_lightning(tmp_path):
    """Lightning's test_swa_multiple_lrs: a callback's on_train_epoch_start runs before the
    module's, so the module sees SWALR's ``initial_lr``/``swa_lr`` in the param groups. The
    same module under pytorch-lightning 2.6.6 and hookloop (the swa plugin was called after
    the module's hook: KeyError 'initial_lr')."""
    import pytorch_lightning as pl
    from hookloop_averaging import SWA

    def run(trainer_class, base, callback, **extra):
        seen = []

        class TwoGroups(base):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                return self.b(self.a(batch[0])).pow(2).mean()

            def configure_optimizers(self):
                return torch.optim.SGD([{"params": self.a.parameters(), "lr": 0.1},
                                        {"params": self.b.parameters(), "lr": 0.2}])

            def on_train_epoch_start(self):
                groups = self.trainer.optimizers[0].param_groups
                seen.append([(g["lr"], g.get("initial_lr"), g.get("swa_lr")) for g in groups])

        trainer = trainer_class(default_root_dir=tmp_path, max_epochs=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **extra)
        trainer.fit(TwoGroups(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
        return seen

    lightning = run(pl.Trainer, pl.LightningModule, pl.callbacks.StochasticWeightAveraging(swa_lrs=[0.3, 0.4]),
                    accelerator="cpu", devices=1)
    ours = run(hookloop.Trainer, hookloop.Module, SWA(swa_lrs=[0.3, 0.4]))
    assert lightning == [[(0.1, 0.3, 0.3), (0.2, 0.4, 0.4)]]
    assert ours == lightning
