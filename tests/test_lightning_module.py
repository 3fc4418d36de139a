"""The module as Lightning users write it: its attributes, hyperparameters, hooks,
several optimizers with manual optimization, and monitored LR schedulers."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import TinyModule, max_abs_diff, reference_loop, state_of, tiny_data


def fit(module, loader, val=None, ckpt_path=None, **kw):
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("num_sanity_val_steps", 0)
    trainer = hookloop.Trainer(**kw)
    trainer.fit(module, loader, val, ckpt_path=ckpt_path)
    return trainer


# -- attributes ---------------------------------------------------------------------------


def test_device_epoch_step_and_log_dict_inside_a_run():
    seen = []

    class Reads(TinyModule):
        def training_step(self, batch, batch_idx):
            seen.append((self.device, self.current_epoch, self.global_step))
            self.log_dict({"a": 1.0, "b": torch.tensor(2.0)})
            return super().training_step(batch, batch_idx)

    module = Reads()
    assert (module.device, module.current_epoch, module.global_step) == (torch.device("cpu"), 0, 0)
    trainer = fit(module, DataLoader(tiny_data(32), batch_size=8), max_epochs=2)
    assert seen == [(torch.device("cpu"), e, e * 4 + i) for e in range(2) for i in range(4)]
    assert (trainer.callback_metrics["a"], trainer.callback_metrics["b"]) == (1.0, 2.0)


def test_logging_on_step_and_on_epoch_reports_both_as_lightning_does():
    class Logs(TinyModule):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            self.log("x0", x[:, 0].mean(), on_step=True, on_epoch=True)
            return super().training_step(batch, batch_idx)

    data = tiny_data(32)
    trainer = fit(Logs(), DataLoader(data, batch_size=8), max_epochs=1)
    m = trainer.callback_metrics
    assert m["x0_epoch"] == pytest.approx(data.tensors[0][:, 0].mean().item(), abs=1e-6)
    assert m["x0_step"] == pytest.approx(data.tensors[0][24:, 0].mean().item(), abs=1e-6)
    assert m["x0"] == m["x0_epoch"]  # after the epoch, the plain name is the epoch value


# -- hyperparameters and load_from_checkpoint -----------------------------------------------


class Configured(hookloop.Module):
    def __init__(self, hidden: int = 16, lr: float = 0.1, layers: tuple = (8, 3), note: str = "x", loss=None):
        super().__init__()
        self.save_hyperparameters(ignore=["loss"])
        self.net = nn.Sequential(nn.Linear(layers[0], hidden), nn.ReLU(), nn.Linear(hidden, layers[1]))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_save_hyperparameters_and_load_from_checkpoint(tmp_path):
    module = Configured(hidden=32, lr=0.05, note="run-1", loss=nn.CrossEntropyLoss())
    assert dict(module.hparams) == {"hidden": 32, "lr": 0.05, "layers": (8, 3), "note": "run-1"}
    assert module.hparams.hidden == 32
    trainer = fit(module, DataLoader(tiny_data(32), batch_size=8), max_epochs=1, enable_checkpointing=True,
                  default_root_dir=str(tmp_path))
    path = tmp_path / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    raw = torch.load(path, weights_only=True)  # what a user would do: nothing else unpickled
    assert raw["hyper_parameters"] == {"hidden": 32, "lr": 0.05, "layers": (8, 3), "note": "run-1"}
    loaded = Configured.load_from_checkpoint(path)
    assert dict(loaded.hparams) == dict(module.hparams)
    assert max_abs_diff(state_of(loaded), state_of(module)) == 0.0
    overridden = Configured.load_from_checkpoint(path, lr=0.5)
    assert overridden.hparams.lr == 0.5 and overridden.hparams.hidden == 32
    with pytest.raises(hookloop.CheckpointError, match="different model"):
        Configured.load_from_checkpoint(path, hidden=8)
    assert trainer.global_step == 4


def test_hyperparameters_a_weights_only_load_cannot_hold_are_refused():
    with pytest.raises(hookloop.ConfigurationError, match="'loss'.*ignore=\\['loss'\\]"):
        class Keeps(Configured):
            def __init__(self, loss=None):
                hookloop.Module.__init__(self)
                self.save_hyperparameters()

        Keeps(loss=nn.CrossEntropyLoss())


def test_save_hyperparameters_by_name_and_from_a_dict():
    class Picks(hookloop.Module):
        def __init__(self, a=1, b=2, c=3):
            super().__init__()
            self.save_hyperparameters("a", "c")

    assert dict(Picks().hparams) == {"a": 1, "c": 3}

    class Given(hookloop.Module):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"lr": 1e-3, "schedule": [1, 2]})

    assert dict(Given().hparams) == {"lr": 1e-3, "schedule": [1, 2]}


# -- module hooks -------------------------------------------------------------------------


class Hooked(TinyModule):
    def __init__(self):
        super().__init__()
        self.calls = []

    def setup(self, stage):
        self.calls.append(("setup", stage))

    def on_fit_start(self):
        self.calls.append("on_fit_start")

    def on_train_start(self):
        self.calls.append("on_train_start")

    def on_train_epoch_start(self):
        self.calls.append(("on_train_epoch_start", self.current_epoch))

    def on_train_batch_start(self, batch, batch_idx):
        self.calls.append(("on_train_batch_start", batch_idx))

    def on_before_optimizer_step(self, optimizer):
        self.calls.append(("on_before_optimizer_step", self.global_step))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.calls.append(("on_train_batch_end", batch_idx, round(float(outputs), 6) > 0))

    def on_validation_epoch_start(self):
        self.calls.append("on_validation_epoch_start")

    def on_validation_epoch_end(self):
        self.calls.append("on_validation_epoch_end")

    def on_train_epoch_end(self):
        self.calls.append(("on_train_epoch_end", self.current_epoch))
        self.log("logged_at_epoch_end", 10.0 + self.current_epoch)

    def on_train_end(self):
        self.calls.append("on_train_end")

    def on_fit_end(self):
        self.calls.append("on_fit_end")

    def on_save_checkpoint(self, checkpoint):
        checkpoint["module_extra"] = {"epochs_seen": self.current_epoch}

    def on_load_checkpoint(self, checkpoint):
        self.calls.append(("on_load_checkpoint", checkpoint["module_extra"]["epochs_seen"]))

    def teardown(self, stage):
        self.calls.append(("teardown", stage))


class SeesMetrics:
    hookloop_role = "observer"

    def __init__(self):
        self.metrics = []

    @hookloop.hookimpl
    def on_train_epoch_end(self, metrics):
        self.metrics.append(metrics.get("logged_at_epoch_end"))


def test_module_hooks_are_called_in_lightnings_order(tmp_path):
    module, probe = Hooked(), SeesMetrics()
    fit(module, DataLoader(tiny_data(16), batch_size=8), DataLoader(tiny_data(8), batch_size=8), max_epochs=2,
        plugins=[probe], accumulate_grad_batches=2, enable_checkpointing=True, default_root_dir=str(tmp_path))
    epoch = lambda e: [  # noqa: E731
        ("on_train_epoch_start", e),
        ("on_train_batch_start", 0), ("on_train_batch_end", 0, True),
        ("on_train_batch_start", 1), ("on_before_optimizer_step", e), ("on_train_batch_end", 1, True),
        "on_validation_epoch_start", "on_validation_epoch_end",
        ("on_train_epoch_end", e),
    ]
    assert module.calls == [("setup", "fit"), "on_fit_start", "on_train_start", *epoch(0), *epoch(1),
                            "on_train_end", "on_fit_end", ("teardown", "fit")]
    # a value the module logs in on_train_epoch_end reaches the plugins' on_train_epoch_end
    assert probe.metrics == [10.0, 11.0]
    resumed = Hooked()
    fit(resumed, DataLoader(tiny_data(16), batch_size=8), max_epochs=3, ckpt_path=tmp_path / "logs" / "version_0" / "checkpoints" / "last.ckpt")
    # saved by the checkpoint callback at the end of the second epoch, where (as in Lightning)
    # current_epoch is still that epoch's index; the resumed run starts with the third
    assert ("on_load_checkpoint", 1) in resumed.calls
    assert ("on_train_epoch_start", 2) in resumed.calls and ("on_train_epoch_start", 1) not in resumed.calls


def test_a_module_without_hooks_adds_nothing_to_the_run():
    registered = []

    class Looks:
        hookloop_role = "observer"

        @hookloop.hookimpl
        def on_fit_start(self, trainer):
            registered.extend(name for name, _ in trainer.plugin_manager.list_name_plugin())
            registered.extend(f"{impl.plugin_name}:{name}" for name in ("on_train_batch_end", "on_train_batch_start",
                              "on_before_optimizer_step") for impl in getattr(trainer.hook, name).get_hookimpls())

    fit(TinyModule(), DataLoader(tiny_data(16), batch_size=8), max_epochs=1, plugins=[Looks()])
    assert not any(name.startswith("module:") or ":" in name for name in registered)


def test_on_train_batch_start_returning_minus_one_ends_the_epoch():
    class Stops(TinyModule):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 2 else None

    trainer = fit(Stops(), DataLoader(tiny_data(64), batch_size=8), max_epochs=2)
    assert trainer.global_step == 4 and trainer.current_epoch == 2


# -- several optimizers, manual optimization ----------------------------------------------


class TwoNets(hookloop.Module):
    """A tiny generator/discriminator pair stepped by hand, as Lightning's GAN example."""

    def __init__(self, toggle: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.toggle = toggle
        self.g = nn.Linear(4, 8)
        self.d = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
        fake = self.g(z)
        # discriminator
        if self.toggle:
            self.toggle_optimizer(opt_d)
        d_loss = F.softplus(-self.d(real)).mean() + F.softplus(self.d(fake.detach())).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        if self.toggle:
            self.untoggle_optimizer(opt_d)
            self.toggle_optimizer(opt_g)
        # generator
        g_loss = F.softplus(-self.d(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=0.5)
        opt_g.step()
        if self.toggle:
            self.untoggle_optimizer(opt_g)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.g.parameters(), lr=1e-2)
        opt_d = torch.optim.SGD(self.d.parameters(), lr=1e-2, momentum=0.9)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_d, 1, gamma=0.5)]


def gan_by_hand(module: TwoNets, loader, epochs: int) -> None:
    (opt_g, opt_d), _ = module.configure_optimizers()
    for _ in range(epochs):
        for batch_idx, (real, _) in enumerate(loader):
            z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
            fake = module.g(z)
            d_loss = F.softplus(-module.d(real)).mean() + F.softplus(module.d(fake.detach())).mean()
            opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            opt_d.step()
            for p in module.d.parameters():
                p.requires_grad_(False)
            g_loss = F.softplus(-module.d(fake)).mean()
            opt_g.zero_grad(set_to_none=True)
            g_loss.backward()
            torch.nn.utils.clip_grad_norm_(module.g.parameters(), 0.5)
            opt_g.step()
            for p in module.d.parameters():
                p.requires_grad_(True)


def test_two_optimizers_by_manual_optimization_match_the_hand_written_loop():
    data = DataLoader(tiny_data(48), batch_size=8)
    ours, reference = TwoNets(), TwoNets()
    trainer = fit(ours, data, max_epochs=2)
    gan_by_hand(reference, data, epochs=2)
    assert max_abs_diff(state_of(ours), state_of(reference)) < 1e-6
    assert trainer.global_step == 2 * 6 * 2  # every optimizer step counts, as in Lightning
    assert trainer.lr_scheduler.get_last_lr() == [1e-2]  # the loop steps no scheduler here
    assert set(trainer.callback_metrics) >= {"d_loss", "g_loss"}


class ManualTiny(TinyModule):
    """TinyModule stepping its optimizer by hand, clipping at ``clip``: the automatic
    loop with ``gradient_clip_val=clip`` is its reference."""

    def __init__(self, clip: float = 0.05, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False
        self.clip = clip

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=self.clip)
        opt.step()
        return loss


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed"])
def test_manual_optimization_goes_through_the_precision_plugin(precision):
    """manual_backward scales the loss and step() unscales, clips and steps through the
    GradScaler (16-mixed: the CPU scaler path) exactly as the automatic loop does."""

    def plugins():
        return [] if precision == "32" else [hookloop.plugin("amp", allow_cpu_fp16=True, init_scale=2.0**8)]

    loader = DataLoader(tiny_data(64), batch_size=8, shuffle=True)
    torch.manual_seed(1)
    automatic = TinyModule()
    t1 = fit(automatic, loader, max_epochs=2, plugins=plugins(), precision=precision, gradient_clip_val=0.05)
    torch.manual_seed(1)
    manual = ManualTiny()
    t2 = fit(manual, loader, max_epochs=2, plugins=plugins(), precision=precision)
    assert max_abs_diff(state_of(automatic), state_of(manual)) == 0.0
    assert t1.global_step == t2.global_step == 16
    if precision == "16-mixed":
        assert t2.plugins[0].scaler.get_scale() == t1.plugins[0].scaler.get_scale()


def test_several_optimizers_need_manual_optimization():
    class Two(TinyModule):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

    with pytest.raises(hookloop.ConfigurationError, match="automatic_optimization = False"):
        fit(Two(), DataLoader(tiny_data(16), batch_size=8), max_epochs=1)

    class OptimizerIdx(TinyModule):
        def training_step(self, batch, batch_idx, optimizer_idx):
            return super().training_step(batch, batch_idx)

    with pytest.raises(hookloop.ConfigurationError, match="optimizer_idx"):
        fit(OptimizerIdx(), DataLoader(tiny_data(16), batch_size=8), max_epochs=1)


def test_manual_optimization_calls_outside_manual_mode_are_errors():
    class Wrong(TinyModule):
        def training_step(self, batch, batch_idx):
            self.optimizers()

    with pytest.raises(hookloop.ConfigurationError, match="manual optimization"):
        fit(Wrong(), DataLoader(tiny_data(16), batch_size=8), max_epochs=1)


def test_a_strategy_that_clips_itself_refuses_clip_gradients():
    class ClipsItself:
        hookloop_role = "strategy"
        hookloop_owns = {"gradient_clipping"}

    class Clips(ManualTiny):
        pass

    with pytest.raises(hookloop.ConfigurationError, match="clips gradients itself"):
        fit(Clips(), DataLoader(tiny_data(16), batch_size=8), max_epochs=1, plugins=[ClipsItself()])


# -- schedulers -----------------------------------------------------------------------------


class Plateau(TinyModule):
    def __init__(self, monitor="val_loss", frequency=1, interval="epoch", strict=True):
        super().__init__(lr=4.0)  # large enough to overshoot: the validation loss stops improving
        self.config = {"monitor": monitor, "frequency": frequency, "interval": interval, "strict": strict}

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, **self.config}}


def plateau_by_hand(module, loader, val, epochs, frequency=1):
    opt = torch.optim.SGD(module.parameters(), lr=module.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    lrs = []
    for epoch in range(epochs):
        for x, y in loader:
            F.cross_entropy(module(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            x, y = val.dataset.tensors
            val_loss = F.cross_entropy(module(x), y).item()
        if (epoch + 1) % frequency == 0:
            plateau.step(val_loss)
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


class LRs:
    hookloop_role = "observer"

    def __init__(self):
        self.lrs = []

    @hookloop.hookimpl
    def on_train_epoch_start(self, trainer, epoch):
        if epoch:
            self.lrs.append(trainer.optimizer.param_groups[0]["lr"])

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("frequency", [1, 2])
def test_reduce_lr_on_plateau_steps_with_the_monitored_metric(frequency):
    loader = DataLoader(tiny_data(64), batch_size=16)
    val = DataLoader(tiny_data(64, seed=2), batch_size=64)
    lrs = LRs()
    ours = Plateau(frequency=frequency)
    reference = Plateau()
    reference.load_state_dict(ours.state_dict())
    fit(ours, loader, val, max_epochs=6, plugins=[lrs])
    expected = plateau_by_hand(reference, loader, val, epochs=6, frequency=frequency)
    assert lrs.lrs == expected
    assert min(expected) < 4.0  # the plateau was reached and the rate did drop
    assert max_abs_diff(state_of(ours), state_of(reference)) < 1e-6


def test_a_monitored_metric_never_logged_is_a_clear_error():
    # Lightning's wording, then what to do
    with pytest.raises(hookloop.ConfigurationError, match=r"conditioned on metric val_lost which is not "
                       r"available\. Available metrics are: \[.*'val_acc'.*\]\. Log it with self\.log\('val_lost'"):
        fit(Plateau(monitor="val_lost"), DataLoader(tiny_data(32), batch_size=16),
            DataLoader(tiny_data(16), batch_size=16), max_epochs=1)
    # strict=False skips the step and says so (Lightning's RuntimeWarning)
    with pytest.warns(RuntimeWarning, match="conditioned on metric val_lost which is not available but strict"):
        fit(Plateau(monitor="val_lost", strict=False), DataLoader(tiny_data(32), batch_size=16),
            DataLoader(tiny_data(16), batch_size=16), max_epochs=1)


def test_plateau_without_monitor_is_refused_and_unknown_config_keys_warned_about():
    """As Lightning (automatic optimization): a plateau without a monitor is refused; an
    unknown config key is warned about, naming the key it may stand for, and ignored."""
    class NoMonitor(TinyModule):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt)

    with pytest.raises(hookloop.ConfigurationError, match="'monitor'"):
        fit(NoMonitor(), DataLoader(tiny_data(16), batch_size=8), max_epochs=1)

    class Typo(TinyModule):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "intervall": "step"}}

    with pytest.warns(RuntimeWarning, match="'intervall' \\(did you mean 'interval'\\?\\)"):
        fit(Typo(), DataLoader(tiny_data(16), batch_size=8), max_epochs=1)


def test_step_interval_with_frequency():
    class Every3(TinyModule):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 3}}

    trainer = fit(Every3(), DataLoader(tiny_data(80), batch_size=8), max_epochs=1)  # 10 optimizer steps
    assert trainer.optimizer.param_groups[0]["lr"] == 0.5 ** 3  # stepped after steps 3, 6 and 9


def test_lightning_return_forms_of_configure_optimizers():
    class Lists(TinyModule):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), "interval": "epoch"}]

    data = tiny_data(64)
    torch.manual_seed(2)
    ours = Lists()
    trainer = fit(ours, DataLoader(data, batch_size=16, shuffle=True), max_epochs=2)
    torch.manual_seed(2)
    reference = TinyModule(scheduler=True)
    reference_loop(reference, DataLoader(data, batch_size=16, shuffle=True), epochs=2)
    assert max_abs_diff(state_of(ours), state_of(reference)) == 0.0
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
