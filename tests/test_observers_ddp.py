"""The built-in observers under ``hookloop run --plugins ddp --devices 2`` (gloo, CPU):
one progress bar, one CSV, one run directory, and rank 0's decisions on every rank.

One run of tests/scripts/observers_battery.py; the values each rank logs, and so every
expected number below, are in that script.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest




pytestmark = pytest.mark.check  # every test reads the shared ddp job (tests/jobs.py)


@pytest.fixture(scope="module")
def battery(jobs):
    run = jobs.run("ddp")  # tests/jobs.py: observers_battery.py in the shared ddp job
    return run.ranks("observers_battery"), run.stdout("observers_battery"), run.dir("observers_battery")


def test_every_rank_uses_the_same_run_directory(battery):
    ranks, _, out = battery
    assert ranks[0]["log_dir"] == ranks[1]["log_dir"] == str(out / "root" / "logs" / "version_0")
    assert [p.name for p in (out / "root" / "logs").iterdir()] == ["version_0"]


def test_rank_zero_decides_early_stopping_and_every_rank_stops_at_the_same_step(battery):
    ranks, stdout, _ = battery
    for record in ranks:
        # rank 0's val_loss 5, 3, 4: no improvement at epoch 2, patience 0
        assert record["epochs_trained"] == [0, 1, 2]
        assert record["global_step"] == 3 * 4 and record["stopped_epoch"] == 2
    assert stdout.count("hookloop: early stopping at epoch 2") == 1


def test_rank_zero_values_choose_the_top_k_files_on_every_rank(battery):
    ranks, _, _ = battery
    expected = ["epoch=1-val_loss=3.0.ckpt", "epoch=2-val_loss=4.0.ckpt", "last.ckpt", "last.prev.ckpt"]
    for record in ranks:
        assert record["files"] == expected
        assert Path(record["best_model_path"]).name == "epoch=1-val_loss=3.0.ckpt"
        assert sorted(record["best_k_models"].values()) == [3.0, 4.0]


def test_one_progress_line_per_epoch_from_rank_zero_only(battery):
    _, stdout, _ = battery
    lines = [line for line in stdout.splitlines() if line.startswith("Epoch ")]
    assert [line.split(":")[0] for line in lines] == ["Epoch 1/5", "Epoch 2/5", "Epoch 3/5"]
    assert all("4 batches in" in line for line in lines)


def test_rank_zero_writes_the_csv_with_every_event_once(battery):
    ranks, _, out = battery
    with open(Path(ranks[0]["log_dir"]) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [(int(r["step"]), int(r["epoch"])) for r in rows if r["train_loss"]]
    assert steps == [(2, 0), (4, 0), (6, 1), (8, 1), (10, 2), (12, 2)]
    validation = [(int(r["step"]), float(r["val_loss"]), float(r["shared"])) for r in rows if r["val_loss"]]
    assert validation == [(4, 5.0, 1.5), (8, 3.0, 1.5), (12, 4.0, 1.5)]  # rank 0's val_loss; shared: mean of 1, 2
    assert len(rows) == 9
    assert float(rows[-1]["val_loss"]) == ranks[0]["callback_metrics"]["val_loss"]
    assert list((out / "root").glob("**/metrics.csv")) == [Path(ranks[0]["log_dir"]) / "metrics.csv"]
