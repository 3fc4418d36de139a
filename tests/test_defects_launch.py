"""Defects of launching and of ddp_sharded's optimizer re-creation (issue 17, section 2).

* 11: ``hookloop run --devices 2 train.py``, the script naming its strategy in code, was
  refused ("no strategy plugin is named"). It now starts the script as ``python
  train.py`` does, and the script's ``fit`` re-launches through its strategy's launcher.
* 12: ddp_sharded re-created the optimizer with ``**optimizer.defaults``, which torch's
  own ``AdamW`` refuses (its defaults hold ``decoupled_weight_decay``).
"""

from __future__ import annotations

import sys

import torch

from conftest import REPO, finish_job, max_abs_diff, start_hookloop_run

SCRIPTS = REPO / "tests" / "scripts"


# -- 11: the strategy named in code, --devices on the command line ---------------------------


def _records(out):
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_run_devices_2_with_the_strategy_named_in_code_trains_on_two_processes(tmp_path):
    script = SCRIPTS / "launch_code_strategy.py"
    code, cli = tmp_path / "code", tmp_path / "cli"
    code.mkdir(), cli.mkdir()
    finish_job(start_hookloop_run(["--devices", 2, script, code, "code"], code), timeout=300)
    finish_job(start_hookloop_run(["--plugins", "ddp", "--devices", 2, script, cli, "cli"], cli), timeout=300)
    from_code, from_cli = _records(code), _records(cli)
    for rank, (a, b) in enumerate(zip(from_code, from_cli)):
        assert (a["world_size"], a["global_rank"], a["strategy"]) == (2, rank, "ddp")
        assert (b["world_size"], b["global_rank"], b["strategy"]) == (2, rank, "ddp")
        assert a["global_step"] == b["global_step"] == 8  # 64 samples, 8 a batch, 2 ranks, 2 epochs
        assert max_abs_diff(a["state"], b["state"]) == 0.0
    assert max_abs_diff(from_code[0]["state"], from_code[1]["state"]) == 0.0
    assert not (code / "rank2.pt").exists() and not (cli / "rank2.pt").exists()


def test_run_devices_2_with_no_strategy_anywhere_says_how_to_name_one(tmp_path):
    (tmp_path / "x.py").write_text(
        "import sys; sys.path.insert(0, %r)\n"
        "import hookloop\n"
        "from torch.utils.data import DataLoader\n"
        "from conftest import TinyModule, tiny_data\n"
        "hookloop.Trainer(logger=False).fit(TinyModule(), DataLoader(tiny_data(16), batch_size=8))\n"
        "print('trained alone')\n" % str(REPO / "tests"))
    stdout, stderr = finish_job(start_hookloop_run(["--devices", 2, "x.py"], tmp_path), timeout=120, succeed=False)
    assert "trained alone" not in stdout
    assert "asks for 2 processes, but no strategy plugin is enabled" in stderr
    assert "plugins=['ddp'] or --plugins ddp" in stderr

