"""hookloop-deepspeed without processes: options, bad input, the DeepSpeed config it builds.

Nothing here starts DeepSpeed; the training runs are in test_deepspeed.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from torch.utils.data import DataLoader

import hookloop
import hookloop.tools.cli
from conftest import TinyModule, tiny_data
from hookloop_deepspeed import DeepSpeedStrategy
from hookloop_deepspeed.cli import main as deepspeed_cli
from hookloop_deepspeed.config import CONFIG_ENV, DEFAULT_OPTIONS, build_config, load_custom_config


def build(precision="32", accumulate=1, clip=None, algorithm="norm", micro=32, world=2, custom=None, **options):
    return build_config(
        {**DEFAULT_OPTIONS, **options}, custom, precision=precision, accumulate=accumulate, clip_val=clip,
        clip_algorithm=algorithm, micro_batch_size=micro, world_size=world,
    )


# ---------------------------------------------------------------------------------------
# Bad input: each a clear error naming the fix
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [4, -1, "2", True, 2.0])
def test_stage_outside_0_to_3_is_refused(stage):
    with pytest.raises(hookloop.ConfigurationError, match=r"stage=.* is not a ZeRO stage: use 0"):
        DeepSpeedStrategy(stage=stage)


def test_stage_from_plugin_options_is_checked_before_training(tmp_path):
    # Plugin options construct the plugin, so the class's own check runs in Trainer().
    with pytest.raises(hookloop.ConfigurationError, match="stage=7 is not a ZeRO stage"):
        hookloop.Trainer(plugins=["deepspeed"], plugin_options={"deepspeed": {"stage": 7}})


def test_offload_with_stage_0_is_refused():
    with pytest.raises(hookloop.ConfigurationError, match="offload_optimizer=True needs ZeRO stage 1, 2 or 3"):
        DeepSpeedStrategy(stage=0, offload_optimizer=True)
    with pytest.raises(hookloop.ConfigurationError, match="offload_parameters=True needs ZeRO stage 3"):
        DeepSpeedStrategy(stage=2, offload_parameters=True)


def test_nvme_without_a_path_is_refused_before_any_worker_starts(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    code = hookloop.tools.cli.main(["run", "--plugins", "deepspeed_stage_3_offload_nvme", "--devices", "2", str(script)])
    err = capsys.readouterr().err
    assert code == 2
    assert "needs nvme_path" in err and "plugin_options" in err
    with pytest.raises(hookloop.ConfigurationError, match="offload_optimizer_device=nvme and offload_params_device=nvme needs nvme_path"):
        DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True, offload_optimizer_device="nvme",
                          offload_params_device="nvme").check()
    # The path given through plugin_options is enough.
    hookloop.Trainer(plugins=["deepspeed_stage_3_offload_nvme"],
                     plugin_options={"deepspeed_stage_3_offload_nvme": {"nvme_path": str(tmp_path)}}).strategy.check()


def test_nvme_device_without_offload_is_refused():
    with pytest.raises(hookloop.ConfigurationError, match="has no effect without offload_optimizer=True"):
        DeepSpeedStrategy(stage=3, offload_optimizer_device="nvme", nvme_path="/tmp")


def test_deepspeed_together_with_ddp_is_refused():
    with pytest.raises(hookloop.PluginConflictError, match="'deepspeed', 'ddp' are all strategy plugins"):
        hookloop.Trainer(plugins=["deepspeed", "ddp"])


def test_config_file_that_is_not_json_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "ds_config.json"
    bad.write_text("{zero_optimization: {stage: 2}}")
    with pytest.raises(hookloop.ConfigurationError, match=r"ds_config.json' is not JSON \(.* line 1"):
        DeepSpeedStrategy(config=str(bad))
    monkeypatch.setenv(CONFIG_ENV, str(bad))
    with pytest.raises(hookloop.ConfigurationError, match=rf"{CONFIG_ENV}=.*ds_config.json is not JSON"):
        DeepSpeedStrategy()
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(hookloop.ConfigurationError, match="holds a JSON list, not an object"):
        DeepSpeedStrategy(config=tmp_path / "list.json")
    with pytest.raises(hookloop.ConfigurationError, match="no such file"):
        DeepSpeedStrategy(config=tmp_path / "missing.json")


def test_clipping_by_value_is_refused():
    with pytest.raises(hookloop.ConfigurationError, match="clips the gradient norm only"):
        build(clip=1.0, algorithm="value")


def test_custom_config_that_contradicts_the_trainer_is_refused():
    with pytest.raises(hookloop.ConfigurationError, match="train_micro_batch_size_per_gpu=16, but the training loader's batch_size is 32"):
        build(custom={"train_micro_batch_size_per_gpu": 16})
    with pytest.raises(hookloop.ConfigurationError, match="train_batch_size=100"):
        build(custom={"train_batch_size": 100})
    with pytest.raises(hookloop.ConfigurationError, match="asks for bf16, but the DeepSpeed config enables fp16"):
        build(precision="bf16-mixed", custom={"fp16": {"enabled": True}})


def test_collate_of_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    assert deepspeed_cli(["collate", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    assert "no 'latest' file" in capsys.readouterr().err
    assert deepspeed_cli(["collate", str(tmp_path / "nope"), str(tmp_path / "out.pt")]) == 2
    assert not (tmp_path / "out.pt").exists()


# ---------------------------------------------------------------------------------------
# The DeepSpeed config built from the options and the trainer
# ---------------------------------------------------------------------------------------


def test_options_become_the_zero_section():
    config, notes = build(stage=3, offload_optimizer=True, offload_parameters=True, reduce_bucket_size=1000,
                          overlap_comm=False, accumulate=4, micro=8)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 1000 and zero["overlap_comm"] is False
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert config["train_micro_batch_size_per_gpu"] == 8 and config["gradient_accumulation_steps"] == 4
    assert notes == []


def test_gradient_clipping_is_mapped_and_deepspeeds_own_default_is_off():
    assert build(clip=0.5)[0]["gradient_clipping"] == 0.5
    # DeepSpeed 0.19 clips at norm 1.0 unless told otherwise; hookloop clips only on request.
    assert build()[0]["gradient_clipping"] == 0.0


@pytest.mark.parametrize("precision, section", [("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("bf16-true", "bf16"), ("16-true", "fp16")])
def test_precision_is_mapped_never_dropped(precision, section):
    config, _ = build(precision=precision)
    assert config[section]["enabled"] is True
    other = {"bf16": "fp16", "fp16": "bf16"}[section]
    assert other not in config
    if section == "fp16":
        assert config["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert "bf16" not in build(precision="32")[0] and "fp16" not in build(precision="32")[0]


def test_precision_reaches_the_strategy_through_the_trainer():
    # No precision plugin named: the strategy owns precision, so amp is not auto-enabled.
    trainer = hookloop.Trainer(plugins=["deepspeed"], precision="bf16-mixed")
    assert [hookloop.contract.registry.plugin_name(p) for p in trainer.plugins
            if hookloop.contract.registry.plugin_role(p) != "observer"] == ["deepspeed"]
    assert trainer.strategy_owns("precision")
    # Named together, amp steps aside (checked in a real run in test_deepspeed.py).
    trainer = hookloop.Trainer(plugins=["deepspeed", "amp"], precision="16-mixed")
    assert trainer.precision == "16-mixed"


def test_custom_config_wins_over_the_options_and_says_what_it_overrode(tmp_path, monkeypatch):
    custom = {"zero_optimization": {"stage": 1}, "gradient_clipping": 2.0}
    config, notes = build(stage=3, offload_optimizer=True, custom=custom)
    assert config["zero_optimization"] == {"stage": 1}
    assert config["gradient_clipping"] == 2.0  # the config's own, as no gradient_clip_val was given
    assert config["train_micro_batch_size_per_gpu"] == 32  # filled in from the loader
    assert notes == ["the custom DeepSpeed config overrides the options stage=3, offload_optimizer=True"]
    # The environment variable names a file; an explicit config argument wins over it.
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert load_custom_config(None) == ({"zero_optimization": {"stage": 2}}, f"${CONFIG_ENV} ({path})")
    assert load_custom_config({"zero_optimization": {"stage": 0}})[0] == {"zero_optimization": {"stage": 0}}


@pytest.mark.slow  # proves deepspeed is not imported: a fresh interpreter, where nothing imported it before
def test_presets_and_roles_without_importing_deepspeed():
    code = """
import sys, hookloop
names = ["deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
         "deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme"]
for name in names:
    p = hookloop.plugin(name)
    print(name, p.hookloop_name, p.hookloop_role, sorted(p.hookloop_owns), p.stage, p.offload_optimizer,
          p.offload_parameters, p.offload_optimizer_device)
print("deepspeed imported:", "deepspeed" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.splitlines()
    assert lines[-1] == "deepspeed imported: False"
    rows = {line.split()[0]: line.split()[1:] for line in lines[:-1]}
    assert rows["deepspeed"] == ["deepspeed", "strategy", "['gradient_clipping',", "'precision']", "2", "False", "False", "cpu"]
    assert rows["deepspeed_stage_1"][4] == "1"
    assert rows["deepspeed_stage_2_offload"][4:7] == ["2", "True", "False"]
    assert rows["deepspeed_stage_3"][4:7] == ["3", "False", "False"]
    assert rows["deepspeed_stage_3_offload"][4:7] == ["3", "True", "True"]
    assert rows["deepspeed_stage_3_offload_nvme"][4:] == ["3", "True", "True", "nvme"]
    assert all(row[0] == name for name, row in rows.items())
