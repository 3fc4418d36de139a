"""The runnable examples of examples/, run as a user would, on 1 and 2 processes."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import REPO, run_python

HOOKLOOP = [sys.executable, "-m", "hookloop"]
EXAMPLES = REPO / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_a_lightning_module_runs_with_only_its_imports_changed(tmp_path, devices):
    out = run_python([sys.executable, str(EXAMPLES / "lightning_port.py"), "--devices", str(devices),
                      "--max-epochs", "8"], cwd=tmp_path, timeout=300)
    (line,) = re.findall(r"lightning_port: .*", out.stdout)
    values = dict(re.findall(r"(val_acc|test_acc|lr|world) ([\d.]+)", line))
    assert int(values["world"]) == devices
    assert float(values["val_acc"]) >= 0.93 and float(values["test_acc"]) >= 0.92
    assert "297 predictions" in line  # every test sample once, also gathered from 2 ranks
    assert (tmp_path / "lightning_port_logs" / "final.ckpt").is_file()


@pytest.mark.slow
def test_the_gan_example_trains_under_ddp(tmp_path):
    out = run_python(HOOKLOOP + ["run", "--plugins", "ddp", "--devices", "2", "--max-epochs", "4",
                                 str(EXAMPLES / "gan.py")], cwd=tmp_path, timeout=300)
    (line,) = re.findall(r"d_loss .*optimizer steps\)", out.stdout)
    gap = float(re.search(r"pixel mean gap ([\d.]+)", line).group(1))
    steps = int(re.search(r"\((\d+) optimizer steps", line).group(1))
    assert steps == 4 * (1797 // (64 * 2)) * 2  # 4 epochs x 14 batches per rank x 2 optimizers
    # an untrained generator's pixels average about 0.5 against the digits' 0.30
    assert gap < 0.1
