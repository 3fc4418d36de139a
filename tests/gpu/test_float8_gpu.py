"""hookloop-float8 on a CUDA GPU with float8 tensor cores (compute capability 8.9+).

Marked ``gpu`` and skipped without CUDA (tests/gpu/conftest.py); skipped too where torchao
is not installed or the GPU has no float8 tensor cores, with the reason. The plugin's
run (``Trainer(plugins=["float8"])`` on ``cuda``) against torchao's own
``convert_to_float8_training`` of the same layers in a hand-written loop on the same GPU.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from float8_models import MLP, data, reference  # noqa: E402

STEPS = 3


@pytest.mark.gpu
def test_float8_on_the_gpu_trains_like_torchaos_hand_written_loop(tmp_path):
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install torchao)")
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name(0)} has no float8 tensor cores (capability < 8.9)")
    from torchao.float8.float8_linear import Float8Linear

    module = MLP()
    seen = {}

    class Probe:
        hookloop_name, hookloop_role = "probe", "observer"

        @hookloop.hookimpl
        def on_train_start(self, trainer):
            seen.update({n: type(m) for n, m in trainer.module.named_children()})
            seen["device"] = str(trainer.root_device)

    hookloop.Trainer(plugins=["float8", Probe()], accelerator="gpu", devices=1, max_steps=STEPS, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     default_root_dir=tmp_path).fit(module, DataLoader(data(), batch_size=16))
    assert seen["device"] == "cuda:0"
    assert seen["fc1"] is Float8Linear and seen["fc2"] is Float8Linear and seen["head"] is torch.nn.Linear
    expected = reference(STEPS, "cuda")
    got = {k: v.detach().float().cpu() for k, v in module.state_dict().items()}
    assert max(float((got[k] - expected[k]).abs().max()) for k in expected) <= 1e-6
