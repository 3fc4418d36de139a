"""hookloop-tensorboard and hookloop-mlflow: real runs, read back with each library's
own reader (TensorBoard's EventAccumulator, MLflow's MlflowClient).

The module (tests/scripts/loggers_run.py) logs numbers worked out here by hand: the
batch index, the process count (summed across ranks), the epoch number, a constant in
validation, and the training loss, which a hand-written SGD loop reproduces.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import hookloop
from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import loggers_run  # noqa: E402
from loggers_run import BATCH, EPOCHS, SAMPLES, TEST_CONST, VAL_CONST  # noqa: E402

STEPS = SAMPLES // BATCH  # optimizer steps per epoch in one process


def reference_losses() -> list[float]:
    """The training loss of every step, by a hand-written loop over the same data."""
    (x, y), _ = (t.dataset.tensors for t in loggers_run.loaders())
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    losses = []
    for _ in range(EPOCHS):
        for i in range(0, SAMPLES, BATCH):
            loss = F.mse_loss(net(x[i:i + BATCH]), y[i:i + BATCH])
            losses.append(loss.item())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return losses


def expected_rows(steps_per_epoch: int, processes: int) -> dict[str, dict[int, float]]:
    """What the module logs, by metric and step (steps count from 1: the row of a step
    is written after its optimizer step)."""
    last = [steps_per_epoch * (e + 1) for e in range(EPOCHS)]
    steps = range(1, steps_per_epoch * EPOCHS + 1)
    return {
        "batch_idx": {s: float((s - 1) % steps_per_epoch) for s in steps},
        "procs": {s: float(processes) for s in steps},
        "epoch_number": {s: float(e) for e, s in enumerate(last)},
        "val_const": {s: VAL_CONST for s in last},
    }


# ---------------------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------------------


def read_events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    events = EventAccumulator(str(log_dir))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    hparams = {tag.split("/")[-1]: HParamsPluginData.FromString(content)
               for tag, content in events.PluginTagToContent("hparams").items()}
    return scalars, hparams


def hparam_values(hparams) -> dict:
    start = hparams["session_start_info"].session_start_info.hparams
    return {k: v.number_value if v.WhichOneof("kind") == "number_value" else v.string_value for k, v in start.items()}


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensorboard")
    trainer = loggers_run.fit(root, ["tensorboard"])
    trainer.fit_train_loss = trainer.callback_metrics["train_loss"]  # test() starts with no metrics
    trainer.test(dataloaders=loggers_run.loaders()[1], verbose=False)  # into the same directory
    return trainer, read_events(trainer.log_dir)


def test_tensorboard_scalars_are_the_logged_values(tensorboard_run):
    trainer, (scalars, _) = tensorboard_run
    assert len(list(trainer.log_dir.glob("events.out.tfevents.*"))) == 2  # fit's, test's
    expected = expected_rows(STEPS, processes=1)
    for tag, values in expected.items():
        assert scalars[tag] == pytest.approx(values), tag
    assert scalars["test_const"] == {STEPS * EPOCHS: TEST_CONST}
    losses = reference_losses()
    assert scalars["train_loss"] == pytest.approx({s + 1: v for s, v in enumerate(losses)}, rel=1e-5)
    assert scalars["train_loss"][STEPS * EPOCHS] == pytest.approx(trainer.fit_train_loss)
    assert set(scalars) == {*expected, "train_loss", "test_const"}


def test_tensorboard_hparams_flattened_with_the_metrics(tensorboard_run):
    trainer, (_, hparams) = tensorboard_run
    values = hparam_values(hparams)
    assert values["trainer/max_epochs"] == EPOCHS
    assert values["trainer/log_every_n_steps"] == 1
    assert values["module/lr"] == pytest.approx(0.05)
    assert values["module/fail_at_epoch"] == "None"
    assert values["trainer/plugins"] == str(["tensorboard", "model_summary", "csv", "checkpoint"])
    metrics = {m.name.tag for m in hparams["experiment"].experiment.metric_infos}
    assert metrics == {"train_loss", "batch_idx", "procs", "epoch_number", "val_const"}
    assert {info.name for info in hparams["experiment"].experiment.hparam_infos} == set(values)
    from tensorboard.plugins.hparams.api_pb2 import STATUS_SUCCESS

    assert hparams["session_end_info"].session_end_info.status == STATUS_SUCCESS


def test_tensorboard_failed_fit_is_closed_and_marked_failed(tmp_path):
    from tensorboard.plugins.hparams.api_pb2 import STATUS_FAILURE

    logger = hookloop.plugin("tensorboard")
    with pytest.raises(RuntimeError, match="planned failure"):
        loggers_run.fit(tmp_path, [logger], fail_at_epoch=1)
    assert logger.writer is None  # closed at teardown
    (log_dir,) = (tmp_path / "logs").iterdir()
    scalars, hparams = read_events(log_dir)
    # epoch 0 completed: its rows are all there
    for tag, values in expected_rows(STEPS, processes=1).items():
        assert scalars[tag] == pytest.approx({s: v for s, v in values.items() if s <= STEPS}), tag
    assert hparams["session_end_info"].session_end_info.status == STATUS_FAILURE
    assert hparam_values(hparams)["module/fail_at_epoch"] == 1


# ---------------------------------------------------------------------------------------
# MLflow
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_root(tmp_path_factory):
    """One root (so one SQLite database, whose creation is the slow part) for every run."""
    return tmp_path_factory.mktemp("mlflow")


def mlflow_client(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{root / 'mlflow.db'}")


def history(client, run_id: str, name: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}


def test_mlflow_run_params_metrics_checkpoints(mlflow_root):
    logger = hookloop.plugin("mlflow")
    trainer = loggers_run.fit(mlflow_root, [logger])
    client = mlflow_client(mlflow_root)  # the default store: <default_root_dir>/mlflow.db
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "lightning_logs"  # Lightning's default
    params = run.data.params
    assert params["module/lr"] == "0.05" and params["trainer/max_epochs"] == str(EPOCHS)
    assert params["trainer/log_every_n_steps"] == "1" and params["module/fail_at_epoch"] == "None"
    assert run.data.tags["hookloop.log_dir"] == str(trainer.log_dir)
    for name, values in expected_rows(STEPS, processes=1).items():
        assert history(client, logger.run_id, name) == pytest.approx(values), name
    losses = reference_losses()
    assert history(client, logger.run_id, "train_loss") == pytest.approx(
        {s + 1: v for s, v in enumerate(losses)}, rel=1e-5)
    # best and last checkpoints, as saved by the checkpoint observer, byte for byte
    callback = trainer.checkpoint_callback
    assert Path(callback.last_model_path).is_file() and Path(callback.best_model_path).is_file()
    logged = {Path(a.path).name for a in client.list_artifacts(logger.run_id, "checkpoints")}
    assert logged == {"last.ckpt", Path(callback.best_model_path).name}
    stored = Path(run.info.artifact_uri.removeprefix("file://")) / "checkpoints" / "last.ckpt"
    assert stored.read_bytes() == Path(callback.last_model_path).read_bytes()
    assert stored.is_relative_to(mlflow_root / "mlartifacts")


def test_mlflow_failed_run_is_failed_with_the_options(mlflow_root):
    uri = f"sqlite:///{mlflow_root / 'mlflow.db'}"
    logger = hookloop.plugin("mlflow", tracking_uri=uri, experiment_name="failing", run_name="boom")
    with pytest.raises(RuntimeError, match="planned failure"):
        loggers_run.fit(mlflow_root / "elsewhere", [logger], fail_at_epoch=1)
    client = mlflow_client(mlflow_root)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FAILED"
    assert run.info.run_name == "boom"
    assert client.get_experiment(run.info.experiment_id).name == "failing"
    # what was logged before the failure is there (epoch 0), and no checkpoint (fit never ended)
    expected = expected_rows(STEPS, processes=1)["batch_idx"]
    assert history(client, logger.run_id, "batch_idx") == {s: v for s, v in expected.items() if s <= STEPS}
    assert client.list_artifacts(logger.run_id) == []
    assert not (mlflow_root / "elsewhere" / "mlflow.db").exists()


def test_mlflow_environment_uri_log_checkpoints_off_and_test_after_fit(mlflow_root, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{mlflow_root / 'mlflow.db'}")
    logger = hookloop.plugin("mlflow", log_checkpoints=False)
    trainer = loggers_run.fit(mlflow_root / "env", [logger])
    fit_run = logger.run_id
    trainer.test(dataloaders=loggers_run.loaders()[1], verbose=False)
    assert logger.run_id == fit_run  # test after fit: the same run
    assert Path(trainer.checkpoint_callback.last_model_path).is_file()
    client = mlflow_client(mlflow_root)
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    assert history(client, logger.run_id, "test_const") == {STEPS * EPOCHS: TEST_CONST}
    assert history(client, logger.run_id, "val_const") == expected_rows(STEPS, processes=1)["val_const"]
    assert client.list_artifacts(logger.run_id) == []
    assert not (mlflow_root / "env" / "mlflow.db").exists()


def test_mlflow_unusable_tracking_uri_fails_before_training(tmp_path):
    class Steps:
        hookloop_name, hookloop_role, count = "steps", "observer", 0

        @hookloop.hookimpl
        def on_train_batch_end(self):
            self.count += 1

    steps = Steps()
    logger = hookloop.plugin("mlflow", tracking_uri="nosuchscheme://tracking")
    with pytest.raises(hookloop.ConfigurationError, match="nosuchscheme://tracking.*MLFLOW_TRACKING_URI"):
        loggers_run.fit(tmp_path, [logger, steps])
    assert steps.count == 0


@pytest.mark.parametrize("options, message", [
    ({"experiment_name": ""}, "experiment_name must be a non-empty name"),
    ({"log_checkpoints": "no"}, "log_checkpoints='no' must be true or false"),
])
def test_mlflow_bad_options_are_refused_when_created(options, message):
    with pytest.raises(hookloop.ConfigurationError, match=message):
        hookloop.Trainer(plugins=[hookloop.plugin("mlflow", **options)])


@pytest.mark.check  # reads the shared ddp job
def test_two_process_ddp_only_rank_zero_writes(jobs):
    """Both loggers in one 2-process run: tests/scripts/loggers_run.py in the shared ddp
    job (tests/jobs.py), the plugins, ``experiment_name=ddp`` and ``MLFLOW_TRACKING_URI``
    (``mlflow.db`` in its folder) set by the script."""
    tmp_path = jobs.run("ddp").dir("loggers_run")  # the run's root and working directory
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["world_size"] == 2
    steps = SAMPLES // (2 * BATCH)
    expected = expected_rows(steps, processes=2)
    # TensorBoard: one event file in the whole root, so rank 1 wrote none anywhere
    (event_file,) = tmp_path.rglob("events.out.tfevents.*")
    assert event_file.parent == Path(rank0["log_dir"])
    scalars, hparams = read_events(event_file.parent)
    for tag, values in expected.items():
        assert scalars[tag] == pytest.approx(values), tag
    assert scalars["train_loss"][steps * EPOCHS] == pytest.approx(rank0["callback_metrics"]["train_loss"])
    values = hparam_values(hparams)
    assert values["trainer/devices"] == 2 and "ddp" in values["trainer/plugins"]
    # MLflow: one run in the experiment, so rank 1 started none
    client = mlflow_client(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("ddp").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["trainer/devices"] == "2"
    for name, values in expected.items():
        assert history(client, run.info.run_id, name) == pytest.approx(values), name
    assert {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "checkpoints")} >= {"last.ckpt"}


# ---------------------------------------------------------------------------------------
# Both
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def missing_errors(tmp_path_factory):
    """The errors of enabling each plugin where its library cannot be imported
    (``sys.modules[name] = None`` is how Python marks a module that must not be imported;
    the plugins look for their library with ``importlib.util.find_spec``, which answers
    None for such a name whether or not it was imported before): in this process, blocking
    one more library at a time, and everything put back after."""

    def enable(plugin):
        try:
            hookloop.Trainer(plugins=[plugin])
        except hookloop.MissingDependencyError as exc:
            return str(exc)

    found = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("missing"))
        patch.setenv("MLFLOW_TRACKING_URI", "")  # the default store
        patch.setitem(sys.modules, "tensorboard", None)
        found["tensorboard"] = enable("tensorboard")
        patch.setitem(sys.modules, "sqlalchemy", None)
        found["sqlalchemy"] = enable("mlflow")
        patch.setitem(sys.modules, "mlflow", None)
        found["mlflow"] = enable("mlflow")
    return found


@pytest.mark.parametrize("blocked, install", [
    ("tensorboard", "pip install tensorboard"),
    ("mlflow", "pip install mlflow"),
    ("sqlalchemy", "pip install sqlalchemy alembic"),  # the default SQLite store's
])
def test_missing_library_is_a_clear_error_when_enabled(missing_errors, blocked, install):
    """Raised at ``Trainer(...)``, before any process or training starts."""
    message = missing_errors[blocked]
    assert message is not None and install in message and "not installed" in message, message


def test_hookloop_check_reports_both_plugins_ok(capsys):
    from hookloop.tools import cli

    assert cli.main(["check", "tensorboard", "mlflow"]) == 0  # `hookloop check tensorboard mlflow`, in-process
    assert capsys.readouterr().out.split() == ["tensorboard:", "ok", "mlflow:", "ok"]
