"""Issue 18: ``hookloop.LightningCLI`` against pytorch-lightning 2.6.6's ``LightningCLI``.

One script, ``tests/scripts/lightning_cli_script.py`` (a module and a data module with
typed ``__init__`` arguments, a ``parser.link_arguments``, an ``after_fit``), is run
under both frameworks with only its imports changed (``CLI_FRAMEWORK``), with the same
arguments and config files: in this process (``run=False``, the script loaded once per
framework) or as a command (its sub-commands, ``--print_config``, ``hookloop run``).
The ``trainer`` sections differ by design (docs/decisions.md); everything else is
compared with what Lightning parses and computes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, finish_job, start_hookloop_run

SCRIPT = REPO / "tests" / "scripts" / "lightning_cli_script.py"
SECTIONS = ("model", "data", "seed_everything", "optimizer", "lr_scheduler")
TOL = 2e-3


def _load(framework: str, monkeypatch):
    """The script as a module, its imports those of ``framework``."""
    monkeypatch.setenv("CLI_FRAMEWORK", framework)
    spec = importlib.util.spec_from_file_location(f"lightning_cli_script_{framework}", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(framework: str, monkeypatch, args, run: bool = False, extend=None, **kwargs):
    """``CLI(Net, Data, run=run, args=args)`` under ``framework`` (``extend(CLI)``: a
    subclass of the script's CLI to use); the CLI and its config sections."""
    mod = _load(framework, monkeypatch)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    if framework == "lightning":
        import warnings

        warnings.filterwarnings("ignore")
    cls = extend(mod.CLI) if extend else mod.CLI
    cli = cls(mod.Net, mod.Data, run=run, args=args,
              trainer_defaults={"accelerator": "cpu", "enable_progress_bar": False, "logger": False}, **kwargs)
    config = cli.config.get(str(cli.subcommand), cli.config)
    return cli, {k: _plain(config.get(k)) for k in SECTIONS}


def _plain(value):
    return value.as_dict() if hasattr(value, "as_dict") else value


def _script(framework: str, args: list, cwd: Path, env: dict | None = None, check: bool = True):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKLOOP_", "TORCHELASTIC_", "PL_"))}
    full.pop("LOCAL_RANK", None)
    full.update({"CLI_FRAMEWORK": framework, "PYTHONWARNINGS": "ignore", **(env or {})})
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, f"{framework} {args}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _line(stdout: str, tag: str) -> dict:
    (line,) = [l for l in stdout.splitlines() if l.startswith(tag + "=")]
    return json.loads(line[len(tag) + 1:])


def _close(a: dict, b: dict, tol: float = TOL) -> None:
    assert set(a) == set(b), (sorted(a), sorted(b))
    for key in a:
        assert abs(a[key] - b[key]) <= tol, f"{key}: lightning {a[key]}, hookloop {b[key]}"


@pytest.fixture
def configs(tmp_path):
    """Two config files: the second overrides part of the first (``--config`` twice)."""
    first = tmp_path / "first.yaml"
    first.write_text(yaml.safe_dump({"seed_everything": 11, "model": {"hidden": 6, "lr": 0.2},
                                     "data": {"batch_size": 16, "n": 48}}))
    second = tmp_path / "second.yaml"
    second.write_text(yaml.safe_dump({"model": {"momentum": 0.5}, "data": {"n_features": 3}}))
    return first, second


# -- parsing ------------------------------------------------------------------------------

def test_parsed_config_equals_lightnings_for_config_files_and_arguments(monkeypatch, configs):
    first, second = configs
    args = ["--config", str(first), "--config", str(second), "--model.lr", "0.05", "--data.batch_size", "8"]
    got = {fw: _build(fw, monkeypatch, args)[1] for fw in ("lightning", "hookloop")}
    assert got["hookloop"] == got["lightning"]
    # and they are what the files and the arguments say, the link included (n_in <- n_features)
    assert got["hookloop"]["model"] == {"n_in": 3, "hidden": 6, "lr": 0.05, "momentum": 0.5}
    assert got["hookloop"]["data"] == {"batch_size": 8, "n": 48, "n_features": 3}
    assert got["hookloop"]["seed_everything"] == 11


def test_args_dict_and_run_false_build_the_objects(monkeypatch):
    args = {"seed_everything": 4, "model": {"hidden": 5}, "data": {"n": 32},
            "trainer": {"max_epochs": 3}}
    got = {fw: _build(fw, monkeypatch, args) for fw in ("lightning", "hookloop")}
    assert got["hookloop"][1] == got["lightning"][1]
    cli = got["hookloop"][0]
    assert cli.subcommand is None
    assert type(cli.model).__name__ == "Net" and cli.model.net[0].out_features == 5
    assert cli.model.hparams["hidden"] == 5 and cli.datamodule.n == 32
    import hookloop

    assert isinstance(cli.trainer, hookloop.Trainer) and cli.trainer.config.max_epochs == 3
    # seeded before the classes were built, as Lightning: same initial weights
    light = got["lightning"][0].model
    for a, b in zip(light.parameters(), cli.model.parameters()):
        assert (a.detach() - b.detach()).abs().max() < 1e-7


def test_validate_test_predict_subcommands_call_hooks_and_give_lightnings_numbers(monkeypatch):
    def extend(base):
        class Recording(base):
            calls: list = []

            def before_instantiate_classes(self):
                self.calls.append("before_instantiate_classes")

            def after_instantiate_classes(self):
                self.calls.append("after_instantiate_classes")

            def before_validate(self):
                self.calls.append("before_validate")

            def after_validate(self):
                self.calls.append("after_validate")

            def before_test(self):
                self.calls.append("before_test")

            def after_test(self):
                self.calls.append("after_test")

            def predict(self, **kwargs):  # a CLI method of the sub-command's name replaces the Trainer's
                self.calls.append("predict")
                self.predictions = self.trainer.predict(**kwargs)

        Recording.calls = []
        return Recording

    got: dict = {}
    for sub in ("validate", "test", "predict"):
        for fw in ("lightning", "hookloop"):
            cli, sections = _build(fw, monkeypatch, [sub, "--seed_everything", "2", "--model.hidden", "5"], run=True,
                                   extend=extend, save_config_kwargs={"overwrite": True})
            if sub == "predict":
                value = torch_cat(cli.predictions)
            else:
                value = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
            got[sub, fw] = (value, cli.calls, sections)
        (light, light_calls, light_cfg), (hook, hook_calls, hook_cfg) = got[sub, "lightning"], got[sub, "hookloop"]
        assert hook_calls == light_calls and hook_cfg == light_cfg
        if sub == "predict":
            assert light_calls[-1] == "predict" and (light - hook).abs().max() < 1e-6
        else:
            assert light_calls[-2:] == [f"before_{sub}", f"after_{sub}"]
            _close(light, hook)


def torch_cat(batches):
    import torch

    return torch.cat([b.detach() for b in batches])


def test_unknown_model_argument_is_jsonargparses_error(monkeypatch, capsys):
    errors = {}
    for fw in ("lightning", "hookloop"):
        with pytest.raises(SystemExit) as info:
            _build(fw, monkeypatch, ["--model.x", "3"])
        assert info.value.code == 2
        errors[fw] = capsys.readouterr().err.strip().splitlines()[-1]
    assert errors["hookloop"] == errors["lightning"] == "error: unrecognized arguments: --model.x 3"


def test_trainer_defaults_naming_no_trainer_argument_is_a_clear_error(monkeypatch):
    import hookloop

    mod = _load("hookloop", monkeypatch)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    with pytest.raises(hookloop.ConfigurationError, match=r"trainer_defaults names \['detect_anomaly'\]"):
        mod.CLI(mod.Net, mod.Data, run=False, args=[], trainer_defaults={"detect_anomaly": True})


@pytest.mark.slow
def test_print_config_model_and_data_sections_equal_lightnings(tmp_path, configs):
    first, _ = configs
    args = ["fit", "--config", first, "--model.momentum", "0.25", "--optimizer", "SGD", "--optimizer.lr", "0.3",
            "--print_config"]
    printed = {fw: yaml.safe_load(_script(fw, args, tmp_path).stdout) for fw in ("lightning", "hookloop")}
    for key in (*SECTIONS, "ckpt_path"):
        assert printed["hookloop"][key] == printed["lightning"][key], key
    assert printed["hookloop"]["model"] == {"hidden": 6, "lr": 0.2, "momentum": 0.25}  # a link target is not printed
    # Trainer sections differ by design: each framework's own Trainer arguments.
    assert "plugins" in printed["hookloop"]["trainer"] and "enable_model_summary" in printed["lightning"]["trainer"]
    assert not list(tmp_path.glob("**/config.yaml")), "--print_config must run nothing"


@pytest.mark.slow
def test_subclass_mode_model_takes_a_class_path(tmp_path):
    args = ["--model", "WideNet", "--model.hidden", "12", "--model.scale", "2.0"]
    got = {fw: _line(_script(fw, args, tmp_path, env={"CLI_RUN": "0", "CLI_SUBCLASS": "1"}).stdout, "CONFIG")
           for fw in ("lightning", "hookloop")}
    assert got["hookloop"] == got["lightning"]
    assert got["hookloop"]["model"]["class_path"] == "__main__.WideNet"
    assert got["hookloop"]["model"]["init_args"]["hidden"] == 12
    # seed_everything_default=True without PL_GLOBAL_SEED: Lightning 2.6 seeds 0, not a random seed
    assert got["hookloop"]["seed_everything"] == 0


# -- running ------------------------------------------------------------------------------

@pytest.mark.slow
def test_fit_then_test_give_lightnings_numbers_and_save_the_config(tmp_path):
    args = ["fit", "--trainer.max_epochs", "3", "--seed_everything", "3", "--data.batch_size", "16", "--model.hidden", "5",
            "--optimizer", "Adam", "--optimizer.lr", "0.01", "--lr_scheduler", "StepLR",
            "--lr_scheduler.step_size", "2", "--lr_scheduler.gamma", "0.5"]
    out = {}
    for fw in ("lightning", "hookloop"):
        (tmp_path / fw).mkdir()
        proc = _script(fw, args, tmp_path / fw)
        out[fw] = (_line(proc.stdout, "RESULT"), _line(proc.stdout, "CONFIG"))
    (light, light_cfg), (hook, hook_cfg) = out["lightning"], out["hookloop"]
    assert hook_cfg == light_cfg
    _close(light["fit"], hook["fit"])
    _close(light["test"], hook["test"])
    _close(dict(enumerate(light["weights"])), dict(enumerate(hook["weights"])))
    # config.yaml in the run's log dir, as Lightning writes it there: same model/data/optimizer
    saved = {fw: yaml.safe_load((tmp_path / fw / out[fw][0]["log_dir"] / "config.yaml").read_text())
             for fw in ("lightning", "hookloop")}
    for key in SECTIONS:
        assert saved["hookloop"][key] == saved["lightning"][key], key
    assert saved["hookloop"]["trainer"]["max_epochs"] == 3

    # test --ckpt_path: the module is built from the checkpoint's hyperparameters (hidden=5,
    # not the default 8), as Lightning does, and tests the trained weights.
    tested = {}
    for fw in ("lightning", "hookloop"):
        (ckpt,) = (tmp_path / fw).glob("**/checkpoints/epoch=*.ckpt")
        tested[fw] = _line(_script(fw, ["test", "--ckpt_path", ckpt], tmp_path / fw).stdout, "TESTED")
        assert tested[fw]["hidden"] == 5
    _close(tested["lightning"]["metrics"], {k: v for k, v in tested["hookloop"]["metrics"].items() if k.startswith("test_")})
    _close(tested["lightning"]["metrics"], light["test"])


@pytest.mark.full  # two launched 2-process runs (~45 s)
def test_runs_under_hookloop_run_with_ddp_and_with_trainer_plugins(tmp_path):
    """2 processes x 8 samples train as Lightning's CLI with its own ddp on 2 processes
    (the training sampler shuffles, seeded by seed_everything, in both)."""
    common = ["--trainer.max_epochs", "2", "--seed_everything", "3", "--model.lr", "0.05"]
    (tmp_path / "lightning").mkdir()
    reference = _line(_script("lightning", ["fit", *common, "--data.batch_size", "8", "--trainer.strategy", "ddp",
                                            "--trainer.devices", "2", "--trainer.accelerator", "cpu"],
                              tmp_path / "lightning").stdout, "RESULT")
    assert reference["world_size"] == 2

    # hookloop run's options are the Trainer defaults of the script's CLI ...
    (tmp_path / "run").mkdir()
    env_before = dict(os.environ)
    os.environ["CLI_FRAMEWORK"] = "hookloop"
    try:
        job = start_hookloop_run(["--devices", "2", "--plugins", "ddp", SCRIPT, "fit", *common,
                                  "--data.batch_size", "8"], cwd=tmp_path / "run")
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    stdout, stderr = finish_job(job, timeout=240)
    result = _line(stdout, "RESULT")
    assert result["world_size"] == 2
    _close(dict(enumerate(reference["weights"])), dict(enumerate(result["weights"])))
    saved = yaml.safe_load((tmp_path / "run" / result["log_dir"] / "config.yaml").read_text())
    assert saved["trainer"]["devices"] == 2

    # ... and --trainer.plugins ddp --trainer.devices 2 launches the workers itself.
    (tmp_path / "plugins").mkdir()
    proc = _script("hookloop", ["fit", *common, "--data.batch_size", "8", "--trainer.plugins", "ddp",
                                "--trainer.devices", "2"], tmp_path / "plugins")
    result = _line(proc.stdout, "RESULT")
    assert result["world_size"] == 2
    _close(dict(enumerate(reference["weights"])), dict(enumerate(result["weights"])))


@pytest.mark.slow
def test_without_jsonargparse_the_error_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['jsonargparse'] = None\n"
            "import hookloop, hookloop.cli\n"
            "assert hookloop.tools.cli.main(['plugins']) == 0\n"  # the hookloop command still works
            "try:\n    hookloop.LightningCLI\nexcept ImportError as exc:\n    print('ERR=' + str(exc))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'hookloop[cli]'" in proc.stdout


def test_trainer_plugins_from_names_class_paths_and_trainer_defaults(monkeypatch, tmp_path):
    import hookloop

    config = tmp_path / "callbacks.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "hookloop.EarlyStopping", "init_args": {"monitor": "val_loss", "patience": 1}}]}}))
    mod = _load("hookloop", monkeypatch)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])

    class Marker:
        hookloop_name, hookloop_role = "marker", "observer"

        @hookloop.hookimpl
        def on_fit_start(self, trainer):
            pass

    marker = Marker()
    cli = mod.CLI(mod.Net, mod.Data, run=False, trainer_defaults={"callbacks": marker, "max_epochs": 4},
                  args=["--config", str(config), "--trainer.plugins", "csv,lr_monitor"])
    plugins = cli.trainer.plugins
    kinds = [type(p).__name__ for p in plugins]
    assert {"CSVLogger", "LearningRateMonitor", "EarlyStopping", "SaveConfigCallback"} <= set(kinds)
    assert marker in plugins and cli.trainer.config.max_epochs == 4
    (stopper,) = [p for p in plugins if isinstance(p, hookloop.EarlyStopping)]
    assert stopper.patience == 1
    # as Lightning: no config saved by a fast_dev_run
    cli = mod.CLI(mod.Net, mod.Data, run=False, args=["--trainer.fast_dev_run", "true"])
    assert "SaveConfigCallback" not in [type(p).__name__ for p in cli.trainer.plugins]
