"""Plugins by name: discovery without import, loading, roles, and the errors for bad input."""

import sys

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.contract import registry
from conftest import TinyModule, install_fake_distribution, tiny_data

COUNTER = '''
import hookloop
IMPORTED = True

class Counter:
    hookloop_role = "observer"

    def __init__(self, every=1):
        self.every = every
        self.batches = 0
        self.epochs = []

    @hookloop.hookimpl
    def on_train_batch_end(self, batch_idx):
        self.batches += 1

    @hookloop.hookimpl
    def on_train_epoch_end(self, epoch, metrics):
        self.epochs.append((epoch, round(metrics["train_loss"], 6)))
'''

STRATEGY = '''
import hookloop

class {cls}:
    hookloop_role = "strategy"
'''


@pytest.fixture
def counter_plugin(site):
    install_fake_distribution(site, "hookloop-counter", {"counter": "hl_counter:Counter"}, {"hl_counter": COUNTER})
    yield
    sys.modules.pop("hl_counter", None)


def fit(plugins, epochs=2, **kw):
    module = TinyModule()
    trainer = hookloop.Trainer(plugins=plugins, max_epochs=epochs, enable_checkpointing=False, **kw)
    trainer.fit(module, DataLoader(tiny_data(40), batch_size=8))
    return trainer


def test_listing_imports_nothing(counter_plugin):
    infos = hookloop.installed_plugins()
    assert infos["counter"].distribution == "hookloop-counter"
    assert infos["counter"].version == "0.1"
    assert "hl_counter" not in sys.modules  # installed, not imported


def test_enable_by_name_runs_its_hooks(counter_plugin):
    trainer = fit(["counter"])
    counter = trainer.plugins[0]
    assert counter.batches == 10
    assert [e for e, _ in counter.epochs] == [0, 1]
    assert counter.epochs[-1][1] == pytest.approx(trainer.callback_metrics["train_loss"], abs=1e-6)


def test_plugin_with_options_through_hookloop_plugin(counter_plugin):
    p = hookloop.plugin("counter", every=5)
    assert p.every == 5 and p.hookloop_name == "counter"
    assert fit([p]).plugins[0] is p


def test_enable_through_environment(counter_plugin, monkeypatch):
    monkeypatch.setenv("HOOKLOOP_PLUGINS", "counter")
    trainer = fit([])
    assert registry.plugin_name(trainer.plugins[0]) == "counter" and trainer.plugins[0].batches == 10


def test_autoload_and_block(counter_plugin, monkeypatch):
    monkeypatch.setenv("HOOKLOOP_AUTOLOAD_PLUGINS", "1")
    loaded = [registry.plugin_name(p) for p in fit([], epochs=1).plugins]
    assert "counter" in loaded
    # never a strategy, a mesh dimension (a layout the user sizes; cp refuses the CPU) or a
    # plugin that opted out (compile: a compile's cost; float8: a GPU's numerics)
    installed = set(hookloop.contract.registry.installed_plugins())
    for name in ("ddp", "fsdp", "tp", "pipeline", "cp", "compile", "float8", "early_stopping"):
        assert name not in loaded, (name, loaded)
    assert {"tp", "pipeline", "cp", "compile", "float8"} & installed, installed
    assert "counter" not in [registry.plugin_name(p) for p in fit(["no:counter"], epochs=1).plugins]


def test_plugin_objects_classes_and_modules_can_be_passed_directly():
    class Seen:
        hookloop_role = "observer"

        def __init__(self):
            self.started = 0

        @hookloop.hookimpl
        def on_fit_start(self, trainer):
            self.started += 1

    trainer = fit([Seen], epochs=1)
    assert trainer.plugins[0].started == 1
    import types

    mod = types.ModuleType("my_plugin_module")
    mod.calls = []
    mod.on_fit_end = hookloop.hookimpl(lambda trainer: mod.calls.append(trainer.global_step))
    fit([mod], epochs=1)
    assert mod.calls == [5]


def test_unknown_name_lists_installed_and_suggests(counter_plugin):
    with pytest.raises(hookloop.PluginNotFoundError) as info:
        fit(["countr"])
    msg = str(info.value)
    assert "'countr'" in msg and "Did you mean 'counter'" in msg and "Installed plugins: " in msg


def test_missing_dependency_names_the_pip_package(site):
    install_fake_distribution(
        site, "hookloop-needsdep", {"needsdep": "hl_needsdep:P"},
        {"hl_needsdep": "import some_backend_that_is_not_here\nclass P: pass\n"},
        requires=["hookloop", "some-backend-that-is-not-here>=1.0"],
    )
    with pytest.raises(hookloop.MissingDependencyError, match="pip install some-backend-that-is-not-here"):
        fit(["needsdep"])


def test_two_strategies_refused_at_start(site):
    install_fake_distribution(
        site, "hookloop-twostrats", {"alpha": "hl_strats:Alpha", "beta": "hl_strats:Beta"},
        {"hl_strats": STRATEGY.format(cls="Alpha") + STRATEGY.format(cls="Beta")},
    )
    with pytest.raises(hookloop.PluginConflictError, match="'alpha', 'beta' are all strategy plugins"):
        hookloop.Trainer(plugins=["alpha", "beta"])


def test_hookimpl_with_argument_the_spec_lacks(site):
    class Typo:
        @hookloop.hookimpl
        def on_train_batch_end(self, trainer, batch_index):  # the spec says batch_idx
            pass

    with pytest.raises(hookloop.PluginValidationError, match="Typo.*on_train_batch_end|on_train_batch_end.*Typo") as info:
        hookloop.Trainer(plugins=[Typo()])
    assert "batch_index" in str(info.value)


def test_hookimpl_for_a_hook_that_does_not_exist():
    class Misspelled:
        @hookloop.hookimpl
        def on_train_batch_ended(self, trainer):
            pass

    with pytest.raises(hookloop.PluginValidationError, match="on_train_batch_ended"):
        hookloop.Trainer(plugins=[Misspelled()])


def test_unknown_role_is_refused():
    class Odd:
        hookloop_role = "magic"

    with pytest.raises(hookloop.PluginValidationError, match="hookloop_role='magic'"):
        hookloop.Trainer(plugins=[Odd()])


def test_strategy_hooks_replace_defaults_through_the_contract():
    """A third-party strategy overrides backward/optimizer_step without any core special case."""

    class HalfStep:
        hookloop_role = "strategy"

        @hookloop.hookimpl
        def optimizer_step(self, optimizer):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad.mul_(0.5)
            optimizer.step()
            return True

    a, b = TinyModule(), TinyModule(lr=0.05)
    hookloop.Trainer(plugins=[HalfStep()], max_epochs=1, enable_checkpointing=False).fit(a, DataLoader(tiny_data(40), batch_size=8))
    hookloop.Trainer(max_epochs=1, enable_checkpointing=False).fit(b, DataLoader(tiny_data(40), batch_size=8))
    # SGD with momentum is linear in the gradient: halving the gradient == halving the lr.
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(va, vb, atol=1e-6), k


class Recorder:
    """An observer that records the events in order."""

    hookloop_role = "observer"

    def __init__(self):
        self.events = []

    @hookloop.hookimpl
    def setup(self, stage):
        self.events.append(("setup", stage))

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        self.events.append(("fit_start", trainer.global_step))

    @hookloop.hookimpl
    def on_train_epoch_start(self, epoch):
        self.events.append(("epoch_start", epoch))

    @hookloop.hookimpl
    def on_train_epoch_end(self, epoch):
        self.events.append(("epoch_end", epoch))

    @hookloop.hookimpl
    def on_validation_end(self, metrics):
        self.events.append(("validation_end", sorted(metrics)))

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        self.events.append(("fit_end", trainer.global_step))

    @hookloop.hookimpl
    def on_exception(self, exception):
        self.events.append(("exception", type(exception).__name__))

    @hookloop.hookimpl
    def teardown(self, stage):
        self.events.append(("teardown", stage))


def test_observer_events_in_order():
    rec = Recorder()
    trainer = hookloop.Trainer(plugins=[rec], max_epochs=2, enable_checkpointing=False)
    trainer.fit(TinyModule(), DataLoader(tiny_data(40), batch_size=8), DataLoader(tiny_data(16), batch_size=8))
    assert rec.events == [
        ("setup", "fit"), ("fit_start", 0),
        ("validation_end", ["val_acc", "val_loss"]),  # the sanity check (num_sanity_val_steps=2)
        ("epoch_start", 0), ("validation_end", ["val_acc", "val_loss"]), ("epoch_end", 0),
        ("epoch_start", 1), ("validation_end", ["val_acc", "val_loss"]), ("epoch_end", 1),
        ("fit_end", 10), ("teardown", "fit"),
    ]


def test_exception_reaches_observers_and_teardown_still_runs():
    class Boom(TinyModule):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise ValueError("boom")
            return super().training_step(batch, batch_idx)

    rec = Recorder()
    with pytest.raises(ValueError, match="boom"):
        hookloop.Trainer(plugins=[rec], max_epochs=1, enable_checkpointing=False).fit(
            Boom(), DataLoader(tiny_data(40), batch_size=8))
    assert rec.events[-2:] == [("exception", "ValueError"), ("teardown", "fit")]


def test_code_strategy_wins_over_environment_strategy(site, monkeypatch):
    install_fake_distribution(
        site, "hookloop-twostrats2", {"alpha2": "hl_strats2:Alpha", "beta2": "hl_strats2:Beta"},
        {"hl_strats2": STRATEGY.format(cls="Alpha") + STRATEGY.format(cls="Beta")},
    )
    monkeypatch.setenv("HOOKLOOP_PLUGINS", "beta2")
    trainer = hookloop.Trainer(plugins=["alpha2"])
    assert [registry.plugin_name(p) for p in trainer.plugins if registry.plugin_role(p) == "strategy"] == ["alpha2"]
