"""``hookloop.dispatch`` and the step it serves (issue 34, item 2).

* The core generates no code and reaches into pluggy's private API in one module only
  (``dispatch.py``, pinned to a tested pluggy range): an ``ast`` scan of every module.
* A plain caller (:func:`hookloop.dispatch.event`) calls what pluggy's own caller calls,
  in pluggy's order, with pluggy's results: the reference is pluggy's caller itself.
* The training step is a :class:`hookloop.engine.step.TrainStep` with named fields:
  ``accumulate`` is an attribute the loop sets, plain torch replaces only the hooks that
  ``PLAIN_TORCH_DEFAULTS`` names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hookloop
import pluggy
import pytest
import torch
from conftest import TinyModule, tiny_data
from hookloop import dispatch
from hookloop.engine.step import PLAIN_TORCH_DEFAULTS, TrainStep
from packaging.version import Version
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "hookloop"

#: pluggy's private names (modules ``pluggy._*`` aside) that a core module might reach for.
PLUGGY_PRIVATE = {"_inner_hookexec", "_hookexec", "_multicall", "_hookimpls", "_call_history",
                  "_nonwrappers", "_wrappers", "_name2plugin", "_plugin2hookcallers"}

#: The uses the scan allows, each ``(module path under core/hookloop, what) -> why``.
ALLOWED: dict[tuple[str, str], str] = {
    ("dispatch.py", "pluggy private"): "observing each implementation of a call pluggy "
    "dispatches has no public API; pinned to PLUGGY_TESTED (test below)",
    ("contract/pluginspec.py", "pluggy private"): "pluggy._decorators.varnames: a plugin's "
    "argument names read exactly as pluggy reads them, to report problems before pluggy does",
    ("lightning/callbacks.py", "exec"): "Lightning callbacks' events as hook implementations, "
    "compiled with each hook's parameter names (pluggy reads them from the code object); "
    "Lightning compatibility, not the engine",
}


def uses(path: Path) -> set[str]:
    """``"exec"`` (a call of ``exec``/``eval``/``compile``) and ``"pluggy private"`` (an
    import of a ``pluggy._*`` module or one of :data:`PLUGGY_PRIVATE`) found in ``path``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("exec", "eval", "compile"):
            found.add("exec")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pluggy._"):
            found.add("pluggy private")
        elif isinstance(node, ast.Import) and any(a.name.startswith("pluggy._")
                                                  for a in node.names):
            found.add("pluggy private")
        elif isinstance(node, ast.Attribute) and node.attr in PLUGGY_PRIVATE:
            found.add("pluggy private")
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr == "function" for t in node.targets):
            found.add("pluggy private")  # a HookImpl's function rewritten in place
    return found


@pytest.mark.check
def test_no_core_module_generates_code_or_uses_pluggys_private_api_but_the_named_ones():
    found = {(str(p.relative_to(CORE)), what)
             for p in sorted(CORE.rglob("*.py")) for what in uses(p)}
    unexplained = sorted(found - ALLOWED.keys())
    assert not unexplained, (
        f"{unexplained}: call the implementations as plain functions (hookloop.dispatch.event) "
        f"and observe them with hookloop.dispatch.observe_hook_calls; a use that cannot go "
        f"needs its reason in ALLOWED")
    assert sorted(ALLOWED.keys() - found) == [], "an allowed use went: drop it from ALLOWED"
    assert not {what for module, what in found if module.startswith("engine/")}


@pytest.mark.check
def test_the_scan_finds_what_it_looks_for(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from pluggy._callers import _multicall\nexec('1')\n"
                      "def f(pm, impl):\n    pm._inner_hookexec = None\n    impl.function = f\n")
    assert uses(source) == {"exec", "pluggy private"}
    source.write_text("import pluggy\ndef f(pm):\n    return pm.add_hookcall_monitoring\n")
    assert uses(source) == set()


@pytest.mark.check
def test_pluggy_is_a_version_the_dispatch_is_tested_with():
    low, high = dispatch.PLUGGY_TESTED
    installed = Version(pluggy.__version__)
    assert Version(low) <= installed < Version(high), (
        f"pluggy {installed} is installed, and hookloop.dispatch reads pluggy's private "
        f"PluginManager._inner_hookexec and pluggy._callers._multicall, tested with "
        f"pluggy>={low},<{high}: run tests/test_hook_observers.py, tests/test_ledger.py and "
        f"tests/test_dispatch.py on it, then widen PLUGGY_TESTED and pyproject.toml's pin")
    pin = re.search(r'"pluggy([^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert pin == f">={low},<{high}", (
        f"pyproject.toml pins pluggy{pin}, PLUGGY_TESTED says >={low},<{high}")
    assert dispatch.PLUGGY_DISPATCH is not None
    assert pluggy.PluginManager("x")._inner_hookexec is dispatch.PLUGGY_DISPATCH


# -- plain callers against pluggy's ----------------------------------------------------


def implementer(name: str, calls: list, result=None, **marks):
    """A plugin implementing a per-step event and a ``firstresult`` hook with a subset of
    their arguments, recording each call and returning ``result``."""

    @hookloop.hookimpl(**marks)
    def on_train_batch_end(self, batch_idx, outputs):
        calls.append((name, batch_idx, outputs))
        return result

    @hookloop.hookimpl(**marks)
    def zero_grad(self, optimizer):
        calls.append((name, "zero_grad", optimizer))
        return result

    return type(name, (), {"hookloop_name": name, "hookloop_role": "extension",
                           "on_train_batch_end": on_train_batch_end, "zero_grad": zero_grad})()


@pytest.mark.check
def test_a_plain_caller_calls_what_pluggys_caller_calls_in_its_order_with_its_results():
    calls: list = []
    plugins = [implementer("a", calls, "ra"), implementer("b", calls, None, tryfirst=True),
               implementer("c", calls, "rc", trylast=True), implementer("d", calls, "rd")]
    trainer = hookloop.Trainer(plugins=plugins, logger=False, enable_progress_bar=False,
                               enable_checkpointing=False)
    kwargs = {"trainer": trainer, "outputs": 1.5, "loss": None, "batch": "b", "batch_idx": 3}
    for name, args in (("on_train_batch_end", kwargs),
                       ("zero_grad", {"trainer": trainer, "optimizer": "opt", "model": None})):
        reference = getattr(trainer.hook, name)(**args)
        pluggys, calls[:] = list(calls), []
        caller = dispatch.event(trainer, name)
        assert caller is not getattr(trainer.hook, name)  # a plain caller, not pluggy's
        assert caller(**args) == reference
        assert calls == pluggys
        calls.clear()
    assert dispatch.event(trainer, "on_before_backward") is None  # nobody implements it


@pytest.mark.check
def test_a_wrapper_or_a_monitor_leaves_the_call_to_pluggy():
    class Wrapper:
        hookloop_role = "observer"

        @hookloop.hookimpl(wrapper=True)
        def on_train_batch_end(self):
            return (yield)

    trainer = hookloop.Trainer(plugins=[implementer("a", []), Wrapper()], logger=False,
                               enable_progress_bar=False, enable_checkpointing=False)
    assert dispatch.event(trainer, "on_train_batch_end") is trainer.hook.on_train_batch_end
    plain = hookloop.Trainer(plugins=[implementer("a", [])], logger=False,
                             enable_progress_bar=False, enable_checkpointing=False)
    undo = plain.plugin_manager.add_hookcall_monitoring(lambda *a: None, lambda *a: None)
    assert dispatch.event(plain, "on_train_batch_end") is plain.hook.on_train_batch_end
    undo()
    assert dispatch.event(plain, "on_train_batch_end") is not plain.hook.on_train_batch_end


# -- the step ---------------------------------------------------------------------------


def built_step(plugins=(), **options) -> TrainStep:
    steps: list[TrainStep] = []
    build = TrainStep.build

    def keep(trainer):
        steps.append(build(trainer))
        return steps[-1]

    trainer = hookloop.Trainer(plugins=list(plugins), max_steps=2, logger=False,
                               enable_progress_bar=False, enable_checkpointing=False,
                               num_sanity_val_steps=0, **options)
    TrainStep.build = keep  # type: ignore[method-assign]
    try:
        trainer.fit(TinyModule(), DataLoader(tiny_data(32), batch_size=8))
    finally:
        TrainStep.build = build  # type: ignore[method-assign]
    (step,) = steps
    return step


@pytest.mark.check
def test_plain_torch_replaces_only_the_named_defaults_and_a_plugin_gets_its_hook_called():
    assert set(PLAIN_TORCH_DEFAULTS) == {"backward", "optimizer_step", "zero_grad"}
    plain = built_step()
    assert plain.backward is torch.Tensor.backward
    assert plain.optimizer_step.__func__ is plain.optimizer.step.__func__
    assert plain.zero_grad.func.__func__ is type(plain.optimizer).zero_grad
    assert plain.on_before_backward is None and plain.accumulate == 1

    calls: list = []
    hooked = built_step([implementer("z", calls, True)])
    assert hooked.zero_grad is not plain.zero_grad and hooked.backward is torch.Tensor.backward
    assert sum(c[1] == "zero_grad" for c in calls) == 2  # the plugin's, at each of the 2 steps
    clipped = built_step(gradient_clip_val=1.0)
    assert clipped.optimizer_step.__name__ == "optimizer_step"  # the hook: it clips


class AccumulateFromSecondEpoch(hookloop.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        trainer.accumulate_grad_batches = 1 if trainer.current_epoch == 0 else 2


@pytest.mark.check
def test_accumulate_is_the_steps_attribute_read_again_at_each_epoch():
    trainer = hookloop.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,
                               enable_checkpointing=False, num_sanity_val_steps=0,
                               callbacks=[AccumulateFromSecondEpoch()])
    trainer.fit(TinyModule(), DataLoader(tiny_data(32), batch_size=8))
    # epoch 0: 4 batches, 4 optimizer steps; epoch 1: 4 batches in windows of 2, 2 steps
    assert trainer.global_step == 6
    assert not hasattr(TrainStep, "set_accumulate")


@pytest.mark.check
def test_every_module_hook_has_a_forwarder_that_passes_its_arguments_by_name():
    # the module's hooks are called through plain functions whose parameter names are the
    # hook's (pluggy passes arguments by name): one per argument list, none generated
    import inspect

    from hookloop.contract.hookspecs import MODULE_HOOKS
    from hookloop.engine.session import _forwarding_function

    class Loaders:  # an evaluation batch hook reads how many loaders its stage has
        val_dataloaders = test_dataloaders = predict_dataloaders = ["a", "b"]

    class OneLoader:
        val_dataloaders = test_dataloaders = predict_dataloaders = ["a"]

    for name, args in MODULE_HOOKS.items():
        seen = []
        forward = _forwarding_function(name, args, lambda *a: seen.append(a))
        if "dataloader_idx" in args:
            # dataloader_idx is passed only with several loaders, as Lightning passes it
            assert tuple(inspect.signature(forward).parameters) == ("self", "trainer", *args), name
            forward(None, Loaders(), *range(len(args)))
            forward(None, OneLoader(), *range(len(args)))
            assert seen == [tuple(range(len(args))), tuple(range(len(args) - 1))], name
            continue
        assert tuple(inspect.signature(forward).parameters) == ("self", *args), name
        forward(None, *range(len(args)))
        assert seen == [tuple(range(len(args)))], name
