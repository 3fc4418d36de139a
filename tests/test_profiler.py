"""hookloop-profiler: real runs (one process, and two ddp processes over gloo) of a tiny
model, the traces read back as JSON and the phase counts checked against closed forms.

tests/scripts/wandb_job.py is the run: 16 samples in batches of 4 (4 optimizer steps per
epoch in one process, 2 per rank in two), a validation per epoch; the two-process one is
tests/scripts/profiler_ddp.py in the shared ddp job (tests/jobs.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import hookloop
from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import wandb_job  # noqa: E402

STEPS = wandb_job.SAMPLES // wandb_job.BATCH


def trace_events(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def profiler_steps(events: list[dict]) -> set[str]:
    return {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}


def test_torch_mode_traces_exactly_the_active_steps_with_the_hooks_named(tmp_path, capsys):
    plugin = hookloop.plugin("profiler", wait=1, warmup=1, active=3)
    trainer = wandb_job.fit(tmp_path, plugins=[plugin], epochs=2, logger=False)
    out = Path(trainer.log_dir) / "profiler"
    (trace,) = sorted((out / "rank0").iterdir())  # one cycle (repeat=1)
    events = trace_events(trace)
    # wait 1 + warmup 1, then 3 recorded steps: batches 2, 3, 4 (profiler steps count from 0)
    assert profiler_steps(events) == {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}
    names = {e.get("name") for e in events}
    # the hook calls (pluggy's monitoring) and each plugin's implementation: profiler step 4 is
    # the first epoch's end (its checkpoint, written by the core's default save_checkpoint)
    assert {"hookloop/on_train_batch_end", "hookloop/on_before_backward",
            "hookloop/checkpoint.on_train_epoch_end", "hookloop/checkpoint.on_save_checkpoint",
            "hookloop/hookloop.defaults.save_checkpoint"} <= names
    assert sum(e.get("name") == "hookloop/on_train_batch_end" for e in events) == 3
    table = (out / "hooks.rank0.txt").read_text()
    assert "hookloop/checkpoint.on_save_checkpoint" in table
    # the per-step events go through pluggy only while profiling: undone at teardown
    assert trainer.plugin_manager._inner_hookexec.__name__ == "_multicall"
    assert "time per hook" in capsys.readouterr().out


def test_simple_mode_counts_the_phases_and_stays_within_fit(tmp_path):
    plugin = hookloop.plugin("profiler", mode="simple")
    epochs = 3
    start = time.perf_counter()
    trainer = wandb_job.fit(tmp_path, plugins=[plugin], epochs=epochs, logger=False)
    wall = time.perf_counter() - start
    report = json.loads((Path(trainer.log_dir) / "profiler" / "simple.rank0.json").read_text())
    calls = {phase: row["calls"] for phase, row in report["phases"].items()}
    batches = epochs * STEPS
    assert {k: calls[k] for k in ("fetch", "training_step", "backward", "optimizer_step")} == \
        dict.fromkeys(("fetch", "training_step", "backward", "optimizer_step"), batches)
    assert calls["validation"] == epochs and calls["sanity_check"] == 1
    total = sum(row["total"] for row in report["phases"].values())
    assert total <= report["fit"] <= wall
    assert all(row["total"] >= 0 for row in report["phases"].values())


@pytest.mark.check  # reads the shared ddp job
def test_two_process_ddp_writes_a_trace_per_rank(jobs):
    # tests/scripts/profiler_ddp.py in the shared ddp job (tests/jobs.py): wandb_job.py's run,
    # 2 epochs, with the profiler's wait=0, warmup=1, active=2
    out = jobs.run("ddp").dir("profiler_ddp")
    log_dir = Path(json.loads((out / "rank0.json").read_text())["log_dir"])
    for rank in (0, 1):
        (trace,) = sorted((log_dir / "profiler" / f"rank{rank}").iterdir())
        events = trace_events(trace)
        assert profiler_steps(events) == {"ProfilerStep#1", "ProfilerStep#2"}
        names = {e.get("name") for e in events}
        assert {"hookloop/on_train_batch_end", "hookloop/on_before_backward"} <= names
        assert (log_dir / "profiler" / f"hooks.rank{rank}.txt").is_file()


def test_bad_options_are_refused():
    with pytest.raises(hookloop.ConfigurationError, match="mode"):
        hookloop.plugin("profiler", mode="fancy")
    with pytest.raises(hookloop.ConfigurationError, match="active"):
        hookloop.plugin("profiler", active=0)
