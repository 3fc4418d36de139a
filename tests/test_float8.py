"""hookloop-float8 on the CPU machines: the refusals, and (where torchao is installed) the
conversion itself.

float8 training is refused on the CPU (torch._scaled_mm runs there but upcasts: 3.9x
slower than float32, docs/decisions.md); it is tested on a GPU with float8 tensor cores
in tests/gpu/test_float8_gpu.py. torchao is not in the project's environment: the last
test here runs where it is (``pytest.importorskip``), and was run by hand with torchao
0.18.0 on this machine (docs/decisions.md).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from float8_models import MLP, data, reference  # noqa: E402

STEPS = 3


def test_float8_on_the_cpu_is_refused_at_setup_naming_why_and_where_it_runs(tmp_path):
    trainer = hookloop.Trainer(plugins=["float8"], max_steps=1, logger=False, enable_checkpointing=False,
                               enable_progress_bar=False, default_root_dir=tmp_path)
    module = MLP()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(hookloop.ConfigurationError) as info:
        trainer.fit(module, DataLoader(data(), batch_size=16))
    message = str(info.value)
    assert message.startswith("float8: float8 training runs on CUDA GPUs with float8 tensor cores (capability 8.9+")
    assert "this run's device is cpu" in message and "3.9x slower" in message and "docs/decisions.md" in message
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # nothing trained
    assert type(module.fc1) is torch.nn.Linear  # nothing converted


def test_without_torchao_the_plugin_names_pip_install_torchao():
    from hookloop_float8 import import_torchao

    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(hookloop.MissingDependencyError, match="needs torchao .*: pip install torchao"):
            import_torchao()
    else:
        assert hasattr(import_torchao(), "convert_to_float8_training")


def test_bad_options_are_refused_and_the_layers_chosen_are_float8_capable():
    from torch import nn

    from hookloop_float8 import Float8

    with pytest.raises(hookloop.ConfigurationError, match="recipe='fp8'"):
        Float8(recipe="fp8")
    with pytest.raises(hookloop.ConfigurationError, match="skip=3"):
        Float8(skip=3)
    plugin = Float8(skip="fc2")
    chosen = [n for n, m in MLP().named_modules() if plugin.chosen(n, m)]
    assert chosen == ["fc1"]  # fc2 skipped, head 32x3 (not multiples of 16)
    assert not plugin.chosen("x", nn.Conv1d(16, 16, 1))
    assert Float8.hookloop_mesh_dims == () and Float8.hookloop_requires == ">=2,<3"


def test_the_plugin_converts_like_torchao_and_trains_like_its_hand_written_loop(tmp_path):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from hookloop_float8 import Float8

    class CPUFloat8(Float8):  # the CPU refusal skipped: the conversion and training are the plugin's
        def setup(self, trainer):
            pass

    CPUFloat8.setup = hookloop.hookimpl(CPUFloat8.setup)
    plugin, module = CPUFloat8(), MLP()
    seen = {}

    class Probe:
        hookloop_name, hookloop_role = "probe", "observer"

        @hookloop.hookimpl
        def on_train_start(self, trainer):
            seen.update({n: type(m).__name__ for n, m in trainer.module.named_children()})

    hookloop.Trainer(plugins=[plugin, Probe()], max_steps=STEPS, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, default_root_dir=tmp_path).fit(module, DataLoader(data(), batch_size=16))
    assert seen == {"fc1": Float8Linear.__name__, "fc2": Float8Linear.__name__, "head": "Linear"}
    assert plugin.converted == ["fc1", "fc2"]
    expected = reference(STEPS, "cpu")
    got = {k: v.detach().float() for k, v in module.state_dict().items()}
    diff = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    print("float8 plugin vs hand-written torchao loop:", diff)
    assert diff <= 1e-6
