"""Bad settings and inputs refused early, with the fix named (issue 32, helper A's items).

* every float setting of the Trainer is checked for NaN and infinity, naming the setting
  and its valid range (``gradient_clip_val=nan`` used to train every weight into NaN);
* ``devices=2.5`` says to give a whole number; a device list on the CPU is refused (device
  indices name GPUs), after ``accelerator="auto"`` is resolved;
* ``ckpt_path=3`` names what ``ckpt_path`` accepts; ``process_group_timeout=inf`` is refused
  at ``Trainer(...)`` and ``hookloop run``, not in a worker;
* ``hookloop run trian.py`` refuses a script that does not exist before any process starts,
  with a did-you-mean;
* a ``pytorch_lightning.LightningModule`` (import not changed) is refused at ``fit``,
  ``validate``, ``test`` and ``predict`` with the import to change.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
import hookloop.tools.cli
from conftest import TinyModule, tiny_data

NAN, INF = float("nan"), float("inf")


def quiet(**kwargs) -> hookloop.Trainer:
    kwargs.setdefault("max_epochs", 1)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_model_summary", False)
    return hookloop.Trainer(**kwargs)


def command(*args: str) -> tuple[int, str]:
    """``hookloop ARGS`` in this process: (exit status, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = hookloop.tools.cli.main(list(args))
    return code, err.getvalue()


# ---------------------------------------------------------------------------------------
# Item 1: every float setting is finite and in its range
# ---------------------------------------------------------------------------------------

#: Every argument of Trainer that takes a float, the values refused, and a phrase of its
#: valid range that the message must hold. (The integer settings refuse any float: their
#: messages say "integer".)
FLOAT_SETTINGS = {
    "gradient_clip_val": (NAN, INF, -INF, "a finite number > 0"),
    "limit_train_batches": (NAN, INF, -INF, "a float in [0.0, 1.0]"),
    "limit_val_batches": (NAN, INF, -INF, "a float in [0.0, 1.0]"),
    "limit_test_batches": (NAN, INF, -INF, "a float in [0.0, 1.0]"),
    "limit_predict_batches": (NAN, INF, -INF, "a float in [0.0, 1.0]"),
    "overfit_batches": (NAN, INF, -INF, "a float in [0.0, 1.0]"),
    "val_check_interval": (NAN, INF, -INF, "a float in (0.0, 1.0]"),
    "process_group_timeout": (NAN, INF, -INF, 1e300, "at most 1e+09"),
}
FLOAT_CASES = [(name, value, spec[-1]) for name, spec in FLOAT_SETTINGS.items() for value in spec[:-1]]


def test_the_table_names_every_float_argument_of_the_trainer():
    import inspect

    floats = {name for name, p in inspect.signature(hookloop.Trainer).parameters.items()
              if "float" in str(p.annotation)}
    assert floats == set(FLOAT_SETTINGS)


@pytest.mark.parametrize("name, value, valid", FLOAT_CASES, ids=[f"{n}={v}" for n, v, _ in FLOAT_CASES])
def test_a_float_setting_that_is_nan_or_infinite_is_refused_with_its_range(name, value, valid):
    with pytest.raises(hookloop.ConfigurationError) as caught:
        hookloop.Trainer(**{name: value})
    message = str(caught.value)
    assert message.startswith(f"{name}={value!r} ") and valid in message, message


def test_gradient_clip_val_nan_no_longer_trains_the_weights_into_nan():
    # Before: accepted; one epoch left every weight NaN. Now refused at Trainer(...).
    with pytest.raises(hookloop.ConfigurationError, match=r"^gradient_clip_val=nan must be a finite number > 0"):
        quiet(gradient_clip_val=NAN)
    # a finite clip still trains to finite weights
    module = TinyModule()
    quiet(gradient_clip_val=1e30).fit(module, DataLoader(tiny_data(16), batch_size=8))
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize("value", [NAN, INF, -INF, -1.0])
def test_clip_gradients_in_the_module_refuses_a_value_that_is_not_finite(value):
    """``self.clip_gradients(opt, gradient_clip_val=nan)`` clipped every weight into NaN; a
    negative or infinite value is refused too (0 does not clip, as in Lightning)."""

    class ClipsItself(TinyModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=value)
            opt.step()
            opt.zero_grad()

    module = ClipsItself()
    with pytest.raises(hookloop.ConfigurationError, match=rf"^self.clip_gradients\(gradient_clip_val={value!r}\): "
                                                          r"gradient_clip_val must be a finite number \(> 0 clips"):
        quiet().fit(module, DataLoader(tiny_data(16), batch_size=8))


@pytest.mark.parametrize("max_time", [{"hours": NAN}, {"hours": INF}, {"days": 1e10}, "99999999999:00:00:00"])
def test_a_max_time_that_is_not_a_finite_duration_is_refused_with_the_setting_named(max_time):
    # Before: a bare ValueError/OverflowError from datetime.timedelta.
    with pytest.raises(hookloop.ConfigurationError, match=r"^Trainer\(max_time=.*\) is not a valid duration"):
        hookloop.Trainer(max_time=max_time)


def test_the_ddp_timeout_option_is_checked_as_process_group_timeout():
    pytest.importorskip("hookloop_ddp")
    with pytest.raises(hookloop.ConfigurationError, match=r"timeout=inf must be .*at most 1e\+09"):
        hookloop.Trainer(plugins=[hookloop.plugin("ddp", timeout=INF)])


@pytest.mark.parametrize("value", [NAN, INF])
def test_the_ddp_bucket_size_must_be_finite(value):
    pytest.importorskip("hookloop_ddp")
    with pytest.raises(hookloop.ConfigurationError, match=r"^ddp option bucket_cap_mb=(nan|inf): must be a finite number"):
        hookloop.plugin("ddp", bucket_cap_mb=value)


@pytest.mark.parametrize("value", ["inf", "nan", "1e300"])
def test_hookloop_run_refuses_a_process_group_timeout_that_is_not_finite_before_starting(tmp_path, value):
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    code, err = command("run", "--process-group-timeout", value, str(tmp_path / "train.py"))
    assert code == 2
    assert err.startswith(f"hookloop: error: process_group_timeout={float(value)!r} must be a number of seconds > 0 "
                          f"and at most 1e+09"), err


def test_the_largest_process_group_timeout_is_accepted_by_torch():
    import torch.distributed as dist

    from hookloop.engine.settings import MAX_PROCESS_GROUP_TIMEOUT

    hookloop.Trainer(process_group_timeout=MAX_PROCESS_GROUP_TIMEOUT)
    hookloop.init_process_group("gloo", 0, 1, timeout=MAX_PROCESS_GROUP_TIMEOUT)
    try:
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        assert tensor.item() == 1
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# Items 2 and 3: devices
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("devices, hint", [(2.5, "devices=2 or devices=3"), (2.0, "devices=2"), ("2.5", "devices=2 or devices=3"),
                                           (NAN, "e.g. devices=2")])
def test_devices_that_is_not_a_whole_number_says_to_give_one(devices, hint):
    with pytest.raises(hookloop.ConfigurationError) as caught:
        hookloop.Trainer(devices=devices)
    message = str(caught.value)
    assert message.startswith(f"devices={devices!r} is not a whole number") and hint in message, message


def test_hookloop_run_devices_not_a_whole_number_is_refused_before_starting(tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    code, err = command("run", "--devices", "2.5", str(tmp_path / "train.py"))
    assert code == 2 and err.startswith("hookloop: error: devices='2.5' is not a whole number"), err


CPU_LIST = ("device indices name GPUs, and this run is on the CPU")


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("auto", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="accelerator='auto' is the CPU only without CUDA"))])
@pytest.mark.parametrize("devices", [[0, 3], "0,3"])
def test_a_device_list_on_the_cpu_is_refused_before_processes_start(accelerator, devices):
    trainer = quiet(devices=devices, accelerator=accelerator, plugins=["ddp"])
    with pytest.raises(hookloop.ConfigurationError) as caught:
        trainer.fit(TinyModule(), DataLoader(tiny_data(16), batch_size=8))
    message = str(caught.value)
    assert message.startswith(f"devices={devices!r}: {CPU_LIST}"), message
    assert "devices=2" in message, message


def test_hookloop_run_refuses_a_device_list_on_the_cpu(tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    code, err = command("run", "--plugins", "ddp", "--accelerator", "cpu", "--devices", "0,3", str(tmp_path / "train.py"))
    assert code == 2 and err.startswith(f"hookloop: error: devices=[0, 3]: {CPU_LIST}"), err


def test_a_device_list_is_left_to_the_gpus_plugin_that_chooses_gpus(monkeypatch):
    """With a devices plugin that chose GPUs (a machine that has them), the list is its:
    the check reads the accelerator the plugin resolved."""
    pytest.importorskip("hookloop_gpus")
    from hookloop_gpus import SELECTED_ENV, GpuInfo, Machine

    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", SELECTED_ENV):
        monkeypatch.setenv(key, "")  # records the value to restore (publish sets them), then removes it
        monkeypatch.delenv(key)
    machine = Machine([GpuInfo(index=i) for i in range(4)], "nvml")
    trainer = quiet(devices=[0, 3], plugins=["ddp", hookloop.plugin("gpus", machine=lambda: machine)])
    trainer._check_devices()  # chooses GPUs 0 and 3: two processes, no error
    assert trainer.device_ids == [0, 3] and trainer.config.accelerator == "cuda"


def test_ddp_still_counts_the_processes_of_a_gpu_list():
    """On GPUs a list reaches ddp, which refuses more processes than the list names (the
    check a CPU run no longer reaches: tests/test_ddp.py's battery runs on the CPU)."""
    pytest.importorskip("hookloop_ddp")
    from hookloop_ddp.environment import ClusterEnvironment
    from hookloop_ddp.strategy import _check_process_count

    cluster = ClusterEnvironment(world_size=2, global_rank=0, local_rank=0, local_world_size=2, node_rank=0,
                                 master_addr="127.0.0.1", master_port=29500, source="torchrun")
    _check_process_count([0, 3], cluster)
    with pytest.raises(hookloop.ConfigurationError, match=r"devices=\[0\] names 1 device\(s\) per node, but torchrun started 2"):
        _check_process_count([0], cluster)


# ---------------------------------------------------------------------------------------
# Item 4: ckpt_path
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["fit", "validate", "test", "predict"])
def test_a_ckpt_path_of_the_wrong_type_names_what_it_accepts(entry):
    class Evaluated(TinyModule):
        def test_step(self, batch, batch_idx):
            return self.validation_step(batch, batch_idx)

    trainer, module, loader = quiet(), Evaluated(), DataLoader(tiny_data(16), batch_size=8)
    with pytest.raises(hookloop.ConfigurationError) as caught:
        getattr(trainer, entry)(module, loader, ckpt_path=3)
    assert str(caught.value).startswith(
        f"{entry}(ckpt_path=3): ckpt_path must be the path of a checkpoint (a str or os.PathLike), 'last', "
        f"'best' or None, got int"), str(caught.value)


# ---------------------------------------------------------------------------------------
# Item 6: hookloop run with a script that does not exist
# ---------------------------------------------------------------------------------------


def test_hookloop_run_refuses_a_script_that_does_not_exist_with_a_did_you_mean(tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    code, err = command("run", "--plugins", "ddp", "--devices", "2", "trian.py")
    assert code == 2
    assert err == (f"hookloop: error: the script 'trian.py' does not exist (in {tmp_path}); did you mean "
                   f"'train.py'? Give the path of the training script: hookloop run [OPTIONS] SCRIPT [ARGS]\n"), err


def test_hookloop_run_refuses_a_missing_script_in_another_folder_and_a_folder(tmp_path):
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "mnist.py").write_text("raise SystemExit('must not run')\n")
    code, err = command("run", "examples/mnsit.py")
    assert code == 2 and "did you mean 'examples/mnist.py'?" in err, err
    code, err = command("run", "nothing_like_it.py")
    assert code == 2 and "did you mean" not in err and "does not exist" in err, err
    code, err = command("tune", "lr", "trian.py")
    assert code == 2 and "the script 'trian.py' does not exist" in err, err
    code, err = command("run", "examples")
    assert code == 2 and err.startswith("hookloop: error: the script 'examples' is a folder"), err


# ---------------------------------------------------------------------------------------
# Item 7: a Lightning module whose import was not changed
# ---------------------------------------------------------------------------------------


def lightning_module():
    pl = pytest.importorskip("pytorch_lightning")

    class Ported(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

        test_step = predict_step = validation_step

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Ported()


@pytest.mark.parametrize("entry", ["fit", "validate", "test", "predict"])
def test_a_lightning_module_whose_import_was_not_changed_is_refused_with_the_import_to_change(entry):
    module = lightning_module()
    with pytest.raises(hookloop.ConfigurationError) as caught:
        getattr(quiet(), entry)(module, DataLoader(tiny_data(16), batch_size=8))
    message = str(caught.value)
    assert message.startswith("Ported subclasses pytorch_lightning.LightningModule (Lightning's own: the import was "
                              "not changed)"), message
    assert "from hookloop import Module" in message, message



def test_a_lightning_pytorch_module_is_named_with_its_own_import():
    """``lightning.pytorch`` (the unified package; not installed here): found by the
    class's module name, as hookloop never imports Lightning."""
    base = type("LightningModule", (torch.nn.Module,), {"__module__": "lightning.pytorch.core.module"})

    class Ported(base):
        def training_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return None

    with pytest.raises(hookloop.ConfigurationError) as caught:
        quiet().fit(Ported(), DataLoader(tiny_data(16), batch_size=8))
    message = str(caught.value)
    assert message.startswith("Ported subclasses lightning.pytorch.LightningModule (Lightning's own: the import was "
                              "not changed)") and "change `from lightning.pytorch import LightningModule`" in message, message
