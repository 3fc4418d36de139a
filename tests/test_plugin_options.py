"""Options construct plugins (issue 20): an option given by name (``plugin_options=``,
``--plugin-option``, ``HOOKLOOP_PLUGIN_OPTIONS``) goes to the plugin class's constructor, so
its ``__init__`` validation runs; the documented LocalSGD example runs from the command line;
a ddp subclass keeps its checkpoint state under its own name."""

from __future__ import annotations

import os
import re
import sys
import textwrap

import pytest
import torch

import hookloop
from conftest import REPO, install_fake_distribution, run_python
from hookloop.contract.registry import plugin_name
from hookloop_ddp import DDP

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


class PowerSGD(DDP):
    """ddp with PowerSGD compression (the third party's strategy of issue 20).

    rank: PowerSGD's matrix rank
    """

    hookloop_name = "powersgd"

    def __init__(self, rank: int = 2):
        super().__init__(comm_hook="powersgd", powersgd_rank=rank)


class PowerSGDKw(DDP):
    """PowerSGD again, passing every other ddp option through.

    rank: PowerSGD's matrix rank
    """

    hookloop_name = "powersgd_kw"

    def __init__(self, rank: int = 2, **ddp_options):
        super().__init__(comm_hook="powersgd", powersgd_rank=rank, **ddp_options)


class Window:
    """An extension whose option is checked by __init__ and kept under another name.

    size: the window, an integer >= 1
    """

    hookloop_name, hookloop_role = "window", "extension"

    def __init__(self, size: int = 3):
        if not isinstance(size, int) or size < 1:
            raise hookloop.ConfigurationError(f"window option size={size!r} must be an integer >= 1")
        self._size = size


# -- 1. an option outside the constructor is refused, never set behind __init__'s back ----


def test_an_option_that_is_no_constructor_argument_is_refused_not_set():
    # Before: comm_hook was set as an attribute afterwards, replacing PowerSGD with fp16.
    with pytest.raises(hookloop.ConfigurationError, match=r"plugin 'powersgd' has no option 'comm_hook' \(an option of its "
                                                          r"base class DDP that PowerSGD's constructor does not take\); its options: rank"):
        hookloop.Trainer(plugins=[PowerSGD], plugin_options={"powersgd": {"comm_hook": "fp16"}}, **QUIET)


def test_an_option_a_constructor_passes_on_twice_fails_in_the_constructor():
    # **ddp_options takes comm_hook, and DDP.__init__ then gets it twice: the constructor says so.
    with pytest.raises(TypeError, match="multiple values for keyword argument 'comm_hook'"):
        hookloop.Trainer(plugins=[PowerSGDKw], plugin_options={"powersgd_kw": {"comm_hook": "fp16"}}, **QUIET)
    trainer = hookloop.Trainer(plugins=[PowerSGDKw], plugin_options={"powersgd_kw": {"rank": 4, "timeout": 30}}, **QUIET)
    assert (trainer.strategy.comm_hook, trainer.strategy.powersgd_rank, trainer.strategy.timeout) == ("powersgd", 4, 30)


# -- 2. an option that is a constructor argument but no attribute works --------------------


def test_a_constructor_argument_that_is_no_attribute_is_an_option(site):
    # Before: "plugin 'window' has no option 'size' (did you mean 'size'?); its options: size".
    install_fake_distribution(site, "hookloop-window", {"window": "window_plugin:Window"},
                              {"window_plugin": "from test_plugin_options import Window\n"})
    trainer = hookloop.Trainer(plugins=["window"], plugin_options={"window": {"size": 5}}, **QUIET)
    assert trainer.plugins[0]._size == 5
    with pytest.raises(hookloop.ConfigurationError, match=r"size=0 must be an integer >= 1"):
        hookloop.Trainer(plugins=["window"], plugin_options={"window": {"size": 0}}, **QUIET)


def test_an_unknown_option_error_never_suggests_the_option_itself():
    with pytest.raises(hookloop.ConfigurationError) as info:
        hookloop.Trainer(plugins=[Window], plugin_options={"window": {"sizes": 5}}, **QUIET)
    assert str(info.value) == "plugin 'window' has no option 'sizes' (did you mean 'size'?); its options: size"


# -- objects given in code -----------------------------------------------------------------


def test_an_object_from_hookloop_plugin_is_constructed_again_with_the_options(site):
    # Before: options were set as attributes on the object ("has no option 'size' (did you
    # mean 'size'?)" for an argument kept under another name; no __init__ check).
    install_fake_distribution(site, "hookloop-window", {"window": "window_plugin:Window"},
                              {"window_plugin": "from test_plugin_options import Window\n"})
    made = hookloop.plugin("window", size=2)
    trainer = hookloop.Trainer(plugins=[made], plugin_options={"window": {"size": 5}}, **QUIET)
    assert trainer.plugins[0] is made and made._size == 5  # the same object, constructed again
    with pytest.raises(hookloop.ConfigurationError, match=r"size=0 must be an integer >= 1"):
        hookloop.Trainer(plugins=[hookloop.plugin("window")], plugin_options={"window": {"size": 0}}, **QUIET)
    # the arguments given in code are kept; the options are added
    ddp = hookloop.plugin("ddp", find_unused_parameters=True)
    hookloop.Trainer(plugins=[ddp], plugin_options={"ddp": {"timeout": 45}}, **QUIET)
    assert (ddp.find_unused_parameters, ddp.timeout, ddp.hookloop_name) == (True, 45, "ddp")


def test_an_object_built_in_code_cannot_take_options_and_says_how_to_give_them():
    window = Window(2)
    with pytest.raises(hookloop.ConfigurationError) as info:
        hookloop.Trainer(plugins=[window], plugin_options={"window": {"size": 0}}, **QUIET)
    message = str(info.value)
    assert "option window.size=0" in message and "built in code as Window(...)" in message
    assert "Pass size=... to Window(...) in code" in message and "hookloop.plugin('window', ...)" in message
    assert window._size == 2


def test_the_environment_variable_constructs_the_plugin_too(monkeypatch):
    monkeypatch.setenv("HOOKLOOP_PLUGIN_OPTIONS", "powersgd.comm_hook=fp16")
    with pytest.raises(hookloop.ConfigurationError, match="has no option 'comm_hook'"):
        hookloop.Trainer(plugins=[PowerSGD], **QUIET)


# -- 3. the documented LocalSGD example, from the command line, in two processes -----------


def documented_localsgd() -> str:
    """The code of docs/plugin-authors.md's "subclassing ddp" example, as written there."""
    text = (REPO / "docs" / "plugin-authors.md").read_text()
    section = text[text.index("## 3. Writing a strategy by subclassing ddp"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "class LocalSGD(DDP)" in code
    return code


TRAIN = textwrap.dedent('''
    import os, sys
    import torch
    from torch.utils.data import DataLoader
    sys.path.insert(0, {tests!r})
    import hookloop
    from conftest import TinyModule, tiny_data

    class Recorded(TinyModule):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            weights = torch.cat([p.detach().flatten() for p in self.parameters()])
            torch.save(weights, f"w_rank{{self.trainer.global_rank}}_step{{self.trainer.global_step}}.pt")

    trainer = hookloop.Trainer(max_steps=4, enable_progress_bar=False, enable_model_summary=False,
                               default_root_dir="run", enable_checkpointing=True)
    assert type(trainer.strategy).__name__ == "LocalSGD"
    trainer.fit(Recorded(momentum=0.0), DataLoader(tiny_data(64), batch_size=4))
''')


@pytest.mark.slow
def test_the_documented_localsgd_example_takes_its_options_from_the_command_line(site, tmp_path):
    install_fake_distribution(site, "hookloop-localsgd", {"localsgd": "localsgd_plugin:LocalSGD"},
                              {"localsgd_plugin": documented_localsgd()})
    (tmp_path / "train.py").write_text(TRAIN.format(tests=str(REPO / "tests")))
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    run_python([sys.executable, "-m", "hookloop", "run", "--devices", "2", "--plugins", "localsgd",
                "--plugin-option", "localsgd.start=0", "--plugin-option", "localsgd.period=2",
                "--plugin-option", "localsgd.localsgd_group_size=1", "train.py"], cwd=tmp_path, env=env, timeout=300)
    # Each rank steps on its own shard (a group of one rank all-reduces nothing); torch's
    # PeriodicModelAverager averages the ranks after optimizer step k when (k - 1 - start) %
    # period == 0: steps 1 and 3 for start=0, period=2. The defaults (start=100, period=4)
    # would all-reduce every gradient: the ranks equal after every step.
    for step in (1, 2, 3, 4):
        a, b = (torch.load(tmp_path / f"w_rank{r}_step{step}.pt") for r in (0, 1))
        averaged = (step - 1) % 2 == 0
        gap = float((a - b).abs().max())
        assert (gap == 0.0) if averaged else (gap > 1e-4), (step, gap)
    # 4. the subclass's state goes under its own name, as on_save_checkpoint's docstring says
    ckpt = hookloop.safe_load(tmp_path / "run" / "logs" / "version_0" / "checkpoints" / "last.ckpt")
    assert "ddp" not in ckpt["plugins"]
    # (torch's post-localSGD hook counts iterations only up to start: 0 here)
    assert ckpt["plugins"]["localsgd"]["comm_hook"] == {"hook": "post_localsgd", "iter": 0}


# -- 4. loading: the subclass's own key, and the old "ddp" key -----------------------------


def localsgd_state():
    """torch's own post-localSGD state (no process group needed to hold it)."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

    return PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0)


@pytest.mark.parametrize("key", ["localsgd", "ddp"])
def test_a_ddp_subclass_loads_its_own_key_and_the_old_ddp_key(site, key):
    install_fake_distribution(site, "hookloop-localsgd", {"localsgd": "localsgd_plugin:LocalSGD"},
                              {"localsgd_plugin": documented_localsgd()})
    plugin = hookloop.plugin("localsgd", start=0)
    assert plugin_name(plugin) == "localsgd"
    plugin.comm_hook_state = localsgd_state()
    plugin.on_load_checkpoint({"plugins": {key: {"comm_hook": {"hook": "post_localsgd", "iter": 7}}}})
    assert plugin.comm_hook_state.iter == 7


def test_ddp_and_ddp_spawn_still_resume_each_others_checkpoints():
    for saver, loader in (("ddp", "ddp_spawn"), ("ddp_spawn", "ddp")):
        save = hookloop.plugin(saver, comm_hook="post_localsgd")
        save.comm_hook_state = localsgd_state()
        save.comm_hook_state.iter = 5
        checkpoint = {"plugins": {}}
        save.on_save_checkpoint(checkpoint)
        load = hookloop.plugin(loader, comm_hook="post_localsgd")
        load.comm_hook_state = localsgd_state()
        load.on_load_checkpoint(checkpoint)
        assert load.comm_hook_state.iter == 5, (saver, loader, checkpoint)
