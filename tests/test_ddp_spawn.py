"""ddp_spawn: ``fit`` starts the workers, and the caller's module gets the weights back."""

from __future__ import annotations

import sys
from pathlib import Path
import threading

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, TinyModule, max_abs_diff, run_python, tiny_data

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from ddp_reference import concatenated_batches_run  # noqa: E402


@pytest.mark.check
def test_hookloop_run_spawns_from_fit_and_returns_weights_and_metrics_to_the_caller(tmp_path):
    script = REPO / "tests" / "scripts" / "ddp_spawn_job.py"
    proc = run_python([sys.executable, "-m", "hookloop", "run", "--plugins", "ddp_spawn", "--devices", "2",
                       str(script), str(tmp_path)], cwd=tmp_path, timeout=300)
    assert proc.stdout.count("hookloop-test: script body ran") == 1  # the plain interpreter, once
    record = torch.load(tmp_path / "parent.pt", weights_only=False)
    # The caller's own module object holds what two processes trained.
    reference = concatenated_batches_run(tiny_data(96), epochs=2, batch=8)
    assert max_abs_diff(record["state"], reference) <= 1e-5
    assert (record["global_step"], record["current_epoch"]) == (12, 2)
    # Validation metrics of those weights on all 40 samples, computed here in one process.
    model = TinyModule()
    model.load_state_dict(record["state"])
    x, y = tiny_data(40, seed=2).tensors
    with torch.no_grad():
        logits = model(x)
    expected = {"val_loss": F.cross_entropy(logits, y).item(), "val_acc": (logits.argmax(-1) == y).float().mean().item()}
    for name, value in expected.items():
        assert record["callback_metrics"][name] == pytest.approx(value, abs=1e-5)  # from fit
        assert record["validate"][name] == pytest.approx(value, abs=1e-5)  # validate's return value
    # The run's directory, its logged metrics and its checkpoints reach the caller's
    # trainer: log_dir is the workers' version_0 (no empty version_1 claimed on reading it),
    # the checkpoint paths name the files the workers wrote there.
    assert record["versions"] == ["version_0"]
    assert record["log_dir"] == str(tmp_path / "logs" / "version_0")
    assert Path(record["best_model_path"]).is_file() and Path(record["last_model_path"]).is_file()
    assert Path(record["best_model_path"]).is_relative_to(record["log_dir"])
    assert Path(record["last_model_path"]).name == "last.ckpt"
    # monitor val_loss, mode min: the best of the two epochs, at most the last one's
    assert record["best_model_score"] <= expected["val_loss"] + 1e-5
    assert record["logged_metrics"]["val_loss"] == pytest.approx(expected["val_loss"], abs=1e-5)


class Observer:
    hookloop_name, hookloop_role = "observer-with-a-lock", "observer"

    def __init__(self):
        self.lock = threading.Lock()


def _spawn_fit(module, loader, plugins=("ddp_spawn",)):
    hookloop.Trainer(plugins=list(plugins), devices=2, max_epochs=1, enable_checkpointing=False).fit(module, loader)


def test_unpicklable_module_attribute_is_named_before_any_process_starts():
    module = TinyModule()
    module.net[0].scale = lambda t: 2 * t  # a lambda deep inside the model
    with pytest.raises(hookloop.ConfigurationError) as info:
        _spawn_fit(module, DataLoader(tiny_data(), batch_size=8))
    message = str(info.value)
    assert "trainer.module.net.0.scale (a lambda defined in test_ddp_spawn)" in message
    assert "pickle.dumps(obj)" in message and "'ddp' strategy" in message


def test_unpicklable_collate_fn_and_callback_are_named():
    loader = DataLoader(tiny_data(), batch_size=8, collate_fn=lambda items: torch.utils.data.default_collate(items))
    with pytest.raises(hookloop.ConfigurationError, match=r"trainer\.train_dataloader\.collate_fn \(a lambda"):
        _spawn_fit(TinyModule(), loader)

    def nested(items):
        return torch.utils.data.default_collate(items)

    with pytest.raises(hookloop.ConfigurationError, match=r"collate_fn \(the nested function 'nested'"):
        _spawn_fit(TinyModule(), DataLoader(tiny_data(), batch_size=8, collate_fn=nested))
    with pytest.raises(hookloop.ConfigurationError, match=r"plugin 'observer-with-a-lock'\.lock \(a _thread\.lock object\)"):
        _spawn_fit(TinyModule(), DataLoader(tiny_data(), batch_size=8), plugins=("ddp_spawn", Observer()))


@pytest.mark.slow
def test_classes_of_an_interactive_main_are_refused_with_advice(tmp_path):
    # `python -c` has a __main__ without a file, like a notebook: spawned processes
    # could not import the module class defined there.
    code = (
        "import sys, torch, hookloop\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "from conftest import TinyModule, tiny_data\n"
        "class NotebookModel(TinyModule):\n    pass\n"
        "try:\n"
        "    hookloop.Trainer(plugins=['ddp_spawn'], devices=2, max_epochs=1).fit(\n"
        "        NotebookModel(), torch.utils.data.DataLoader(tiny_data(), batch_size=8))\n"
        "except hookloop.ConfigurationError as exc:\n    print('ERROR:', exc)\n"
    )
    proc = run_python([sys.executable, "-c", code], cwd=tmp_path, timeout=300)
    assert "ERROR: ddp_spawn cannot send NotebookModel" in proc.stdout
    assert "start_method='fork'" in proc.stdout


def test_spawn_refuses_several_nodes():
    with pytest.raises(hookloop.ConfigurationError, match="ddp_spawn starts its processes on one machine"):
        hookloop.Trainer(plugins=["ddp_spawn"], devices=2, nodes=2, rdzv_endpoint="127.0.0.1:1").fit(
            TinyModule(), DataLoader(tiny_data(), batch_size=8))


def test_ddp_spawn_shares_the_ddp_implementation():
    from hookloop_ddp import DDP, DDPSpawn

    assert issubclass(DDPSpawn, DDP)
    plugin = hookloop.plugin("ddp_spawn", start_method="fork", comm_hook="fp16")
    assert (plugin.hookloop_role, plugin.start_method, plugin.comm_hook) == ("strategy", "fork", "fp16")
    with pytest.raises(hookloop.ConfigurationError, match="start_method='thread'"):
        DDPSpawn(start_method="thread")
