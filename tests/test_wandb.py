"""hookloop-wandb: real runs in W&B's offline mode (no network), read back from the
offline run directory's transaction log (``wandb/offline-run-*/run-<id>.wandb``: W&B's
records, protobufs in LevelDB-log framing, parsed here with ``wandb.proto``).

References: the CSV logger's ``metrics.csv`` of the same run, and numbers worked out by
hand (tests/scripts/wandb_job.py logs ``mark`` = 100 * epoch + batch_idx per step).
"""

from __future__ import annotations

import csv
import json
import os
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

import hookloop
from conftest import REPO, run_python

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import wandb_job  # noqa: E402

pytest.importorskip("wandb")

SCRIPT = REPO / "tests" / "scripts" / "wandb_job.py"
# a launched run costs a minute on a loaded 2-core machine: the long tier (make test-full)
FULL = pytest.mark.full  # launched runs
STEPS = wandb_job.SAMPLES // wandb_job.BATCH  # optimizer steps per epoch in one process


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """W&B offline, silent, with every directory it writes under tmp_path."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_DIR": tmp_path / "wandb_default", "WANDB_CACHE_DIR": tmp_path / "wandb_cache",
                       "WANDB_DATA_DIR": tmp_path / "wandb_data", "WANDB_CONFIG_DIR": tmp_path / "wandb_config",
                       "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(key, str(value))


def records(path: Path) -> list:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log blocks of 32 KiB, each record a 7-byte header (crc, length, type) and a
    piece of a ``wandb_internal_pb2.Record`` (types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, buffer, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buffer += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buffer)
            out.append(record)
            buffer = b""
    return out


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


def finished_records(path: Path) -> list:
    """The records of a finished run's file. ``run.finish()`` returns before W&B's service
    process (shared by the runs of one process) has written all of them: wait until the
    run's ``exit`` record is there (a wait for a file, not a timing)."""
    deadline = time.monotonic() + 120
    while True:
        found = records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def offline_runs(root: Path) -> list[dict]:
    """Every offline run under ``root``, oldest first: its id, history rows (the logged
    keys with ``_step``), config (top-level keys, decoded) and artifacts' names."""
    runs = []
    for path in sorted(root.rglob("offline-run-*/run-*.wandb")):
        run = {"dir": path.parent, "id": None, "history": [], "config": {}, "artifacts": [], "metadata": [], "exit": None}
        for record in finished_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"].update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                run["config"].update({_key(i): json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                run["history"].append({_key(i): json.loads(i.value_json) for i in record.history.item
                                       if not _key(i).startswith("_") or _key(i) == "_step"})
            elif kind == "artifact":
                run["artifacts"].append((record.artifact.name, record.artifact.type, sorted(record.artifact.aliases)))
                run["metadata"].append(json.loads(record.artifact.metadata))
            elif kind == "exit":
                run["exit"] = record.exit.exit_code
        runs.append(run)
    return runs


def by_step(history: list[dict], name: str) -> dict[int, float]:
    out = {}
    for row in history:
        if name in row:
            assert row["_step"] not in out, f"{name} logged twice at step {row['_step']}"
            out[row["_step"]] = row[name]
    return out


def csv_by_step(log_dir: Path, name: str) -> dict[int, float]:
    with open(log_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def marks(epochs: int, first_step: int = 1) -> dict[int, float]:
    """``mark`` by step, by hand: step s (from 1) is batch (s - 1) % STEPS of epoch (s - 1) // STEPS."""
    return {s: float(100 * ((s - 1) // STEPS) + (s - 1) % STEPS) for s in range(first_step, epochs * STEPS + 1)}


@pytest.mark.slow
def test_offline_run_metrics_config_and_checkpoints(tmp_path):
    from hookloop_wandb import WandbLogger

    logger = WandbLogger(project="hl", name="first", tags=["a", "b"], log_model=True)
    trainer = wandb_job.fit(tmp_path, plugins=[logger], epochs=2)
    log_dir = Path(trainer.log_dir)
    (run,) = offline_runs(log_dir / "wandb")  # the run directory is W&B's dir by default
    assert run["id"] == logger.version and run["exit"] == 0
    assert json.loads((log_dir / "wandb-run.json").read_text()) == {"run_id": run["id"], "last_step": 2 * STEPS}
    history = run["history"]
    # every step's metrics, at the trainer's step, equal to what the CSV logger wrote and the hand count
    assert by_step(history, "mark") == marks(2) == csv_by_step(log_dir, "mark")
    loss = by_step(history, "train_loss")
    assert loss == pytest.approx(csv_by_step(log_dir, "train_loss"), rel=1e-6) and len(loss) == 2 * STEPS
    assert by_step(history, "val_const") == {STEPS: 3.5, 2 * STEPS: 3.5}
    assert by_step(history, "trainer/global_step") == {s: s for s in range(1, 2 * STEPS + 1)}
    # the config: the Trainer's settings and the module's save_hyperparameters()
    assert run["config"]["trainer"]["max_epochs"] == 2 and "wandb" in run["config"]["trainer"]["plugins"]
    assert run["config"]["module"] == {"lr": 0.05, "crash_at": None}
    # log_model=True: the last (here also the best) checkpoint, once, as a model artifact
    # log_model=True: the best and the last checkpoints (two files here), once each, as versions
    # of the run's model artifact; the best carries the alias "best"
    assert run["artifacts"] == [(f"model-{run['id']}", "model", ["best", "latest"]),
                                (f"model-{run['id']}", "model", ["latest"])]


@pytest.mark.slow
def test_ckpt_path_resume_logs_into_the_same_run_without_repeating_steps(tmp_path):
    first = wandb_job.fit(tmp_path, plugins=["wandb"], epochs=1)
    ckpt = Path(first.log_dir) / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["plugins"]["wandb"]["last_step"] == STEPS
    # log_model="all": every checkpoint file, each once, as it appears
    second = wandb_job.fit(tmp_path, plugins=[hookloop.plugin("wandb", log_model="all")], epochs=2, ckpt_path=str(ckpt))
    assert second.log_dir != first.log_dir
    one, two = offline_runs(tmp_path)
    assert one["id"] == two["id"]  # the same W&B run, resumed
    assert by_step(one["history"], "mark") == marks(1)
    assert by_step(two["history"], "mark") == marks(2, first_step=STEPS + 1)
    assert min(r["_step"] for r in two["history"]) > max(r["_step"] for r in one["history"])
    files = sorted(p.name for p in (Path(second.log_dir) / "checkpoints").glob("*.ckpt") if p.name != "last.prev.ckpt")
    assert sorted(a["path"] for a in two["metadata"]) == files and not one["metadata"]
    assert {a[0] for a in two["artifacts"]} == {f"model-{two['id']}"}


@FULL
def test_a_restarted_worker_continues_the_same_run(tmp_path):
    """``--max-restarts 1``: attempt 0 logs steps 1..6 and raises in step 7; the restarted
    worker resumes from the epoch-1 checkpoint (step 4) and logs only steps 7..8."""
    run_python([sys.executable, "-m", "hookloop", "run", "--plugins", "wandb", "--max-restarts", "1",
                str(SCRIPT), str(tmp_path), "--crash-at", str(STEPS + 2)], cwd=tmp_path)
    one, two = offline_runs(tmp_path)
    assert one["id"] == two["id"] and one["exit"] != 0 and two["exit"] == 0
    assert by_step(one["history"], "mark") == {s: v for s, v in marks(2).items() if s <= STEPS + 2}
    assert by_step(two["history"], "mark") == marks(2, first_step=STEPS + 3)
    log_dir = Path(json.loads((tmp_path / "rank0.json").read_text())["log_dir"])
    assert json.loads((log_dir / "wandb-run.json").read_text()) == {"run_id": one["id"], "last_step": 2 * STEPS}


@FULL
def test_two_process_ddp_writes_one_run(tmp_path):
    run_python([sys.executable, "-m", "hookloop", "run", "--plugins", "ddp,wandb", "--devices", "2",
                "--plugin-option", "wandb.project=ddp", str(SCRIPT), str(tmp_path)], cwd=tmp_path)
    (run,) = offline_runs(tmp_path)
    assert json.loads((tmp_path / "rank0.json").read_text())["world_size"] == 2
    half = STEPS // 2  # each rank's share of the 4 batches
    assert by_step(run["history"], "mark") == {s: float(100 * ((s - 1) // half) + (s - 1) % half)
                                               for s in range(1, 2 * half + 1)}
    assert run["config"]["trainer"]["devices"] == 2


def test_bad_options_are_refused():
    with pytest.raises(hookloop.ConfigurationError, match="log_model"):
        hookloop.plugin("wandb", log_model="some")
    with pytest.raises(hookloop.ConfigurationError, match="mode"):
        hookloop.plugin("wandb", mode="cloud")
    with pytest.raises(hookloop.ConfigurationError, match="contradicts"):
        hookloop.plugin("wandb", offline=True, mode="online")
