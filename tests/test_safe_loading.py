"""Checkpoints never run code (issue 12 item 7).

Every checkpoint format hookloop reads gets a pickle planted in it whose unpickling runs
a command (``os.system("touch MARKER")``); each test first shows the plant is live (the
loader hookloop replaced, or plain ``torch.load(weights_only=False)`` / ``pickle.load``,
creates a control marker), then that resuming, validating or collating that checkpoint
raises a ``CheckpointError`` naming the checkpoint and the refused object, and that the
marker was never created. The formats: hookloop's own file (also what fairscale's
ddp_sharded writes, its optimizer state consolidated), DeepSpeed directories (resume of
ZeRO 0/2, validate of ZeRO 3, ``hookloop deepspeed collate``) and FSDP's DCP directories
(resume, ``hookloop fsdp collate``). Unplanted checkpoints still load, with the weights
the run saved: the safe-globals lists are not too narrow.

Runs of a strategy happen in a world of one, in tests/scripts/safe_loading_worker.py
(one process per batch of runs).
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, run_python
from hookloop.testing import TinyClassifier, tiny_dataset

WORKER = REPO / "tests" / "scripts" / "safe_loading_worker.py"
LAST = Path("logs/version_0/checkpoints/last.ckpt")


class Planted:
    """Unpickling it runs ``touch MARKER``: the code a shared checkpoint could carry."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def assert_refused(message: str, checkpoint: Path, marker: Path) -> None:
    assert not marker.exists(), "the planted code ran"
    assert f"checkpoint {str(checkpoint)!r} contains objects that are not plain tensors and containers" in message, message
    assert "posix.system" in message and "no option to load it anyway" in message and "weights_only=False" in message, message


def plant_in_file(path: Path, marker: Path, where=lambda d: d) -> None:
    """Add a Planted object to the torch.save file ``path`` (to the dict ``where`` picks);
    first show that an unsafe load of it runs the code."""
    data = torch.load(path, map_location="cpu", weights_only=False)  # our own, trusted file
    control = marker.with_name(marker.name + ".control")
    where(data)["planted"] = Planted(control)
    torch.save(data, path)
    torch.load(path, weights_only=False)
    assert control.exists(), "the plant is not live: an unsafe load did not run it"
    where(data)["planted"] = Planted(marker)
    torch.save(data, path)


def run_worker(tmp_path: Path, runs: list[dict]) -> list[dict]:
    spec = tmp_path / f"runs{len(list(tmp_path.glob('runs*.json')))}.json"
    spec.write_text(json.dumps(runs))
    run_python([sys.executable, str(WORKER), str(spec)], cwd=tmp_path, timeout=240)
    return [torch.load(r["out"], weights_only=True) for r in runs]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# -- hookloop's own file ------------------------------------------------------------------


def test_a_hookloop_checkpoint_file_with_a_planted_pickle_is_refused(tmp_path):
    module = TinyClassifier()
    hookloop.Trainer(max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False).fit(
        module, DataLoader(tiny_dataset(), batch_size=16))
    evil, marker = tmp_path / "shared.ckpt", tmp_path / "ran"
    shutil.copy(tmp_path / LAST, evil)
    plant_in_file(evil, marker, lambda d: d["loop"])

    with pytest.raises(hookloop.CheckpointError) as refused:
        hookloop.Trainer(max_epochs=2, default_root_dir=tmp_path / "resume", enable_progress_bar=False).fit(
            TinyClassifier(), DataLoader(tiny_dataset(), batch_size=16), ckpt_path=evil)
    assert_refused(str(refused.value), evil, marker)
    with pytest.raises(hookloop.CheckpointError) as refused:
        hookloop.safe_load(evil)
    assert_refused(str(refused.value), evil, marker)


# -- fairscale's ddp_sharded: the consolidated optimizer state, in hookloop's file --------


@pytest.mark.slow
def test_a_ddp_sharded_checkpoint_with_a_planted_optimizer_state_is_refused(tmp_path):
    clean, evil = tmp_path / "clean" / LAST, tmp_path / "shared.ckpt"
    marker = tmp_path / "ran"
    (written,) = run_worker(tmp_path, [{"plugins": ["ddp_sharded"], "root": str(tmp_path / "clean"),
                                        "out": str(tmp_path / "written.pt")}])
    state = torch.load(clean, weights_only=True)
    assert state["optimizer_states"][0]["state"], "no consolidated Adam state to plant in"
    shutil.copy(clean, evil)
    plant_in_file(evil, marker, lambda d: d["optimizer_states"][0]["state"][0])

    resumed, refused = run_worker(tmp_path, [
        {"plugins": ["ddp_sharded"], "root": str(tmp_path / "r1"), "ckpt_path": str(clean), "out": str(tmp_path / "r1.pt")},
        {"plugins": ["ddp_sharded"], "root": str(tmp_path / "r2"), "ckpt_path": str(evil), "out": str(tmp_path / "r2.pt")},
    ])
    assert max_diff(resumed["weights"], written["weights"]) == 0.0  # the clean one loads, as saved
    assert not marker.exists(), "the planted code ran"
    assert refused.get("error") == "CheckpointError", refused
    assert_refused(refused["message"], evil, marker)


# -- DeepSpeed directories ----------------------------------------------------------------


def _ds(stage: int) -> dict:
    return {"plugins": ["deepspeed"], "plugin_options": {"deepspeed": {"stage": stage}}}


@pytest.fixture(scope="module")
def deepspeed_checkpoints(tmp_path_factory):
    """ZeRO 0, 2 and 3 checkpoint directories of a 4-step run, and the weights it saved."""
    out = tmp_path_factory.mktemp("deepspeed")
    written = run_worker(out, [{**_ds(s), "root": str(out / f"stage{s}"), "out": str(out / f"w{s}.pt")} for s in (0, 2, 3)])
    return out, dict(zip((0, 2, 3), written))


def _planted_copy(source: Path, target: Path, shard_glob: str, marker: Path) -> Path:
    shutil.copytree(source, target)
    (shard,) = (target / (target / "latest").read_text().strip()).glob(shard_glob)
    plant_in_file(shard, marker)
    return shard


@pytest.mark.slow
def test_deepspeed_resume_and_validate_refuse_a_planted_shard(deepspeed_checkpoints, tmp_path):
    out, written = deepspeed_checkpoints
    evil = {s: tmp_path / f"shared{s}" for s in (0, 2, 3)}
    shards = {
        0: _planted_copy(out / "stage0" / LAST, evil[0], "mp_rank_00_model_states.pt", tmp_path / "ran0"),
        2: _planted_copy(out / "stage2" / LAST, evil[2], "*optim_states.pt", tmp_path / "ran2"),
        3: _planted_copy(out / "stage3" / LAST, evil[3], "*model_states.pt", tmp_path / "ran3"),
    }
    results = run_worker(tmp_path, [
        # The clean checkpoints load (every DeepSpeed class they hold is accepted) ...
        {**_ds(2), "root": str(tmp_path / "c2"), "ckpt_path": str(out / "stage2" / LAST), "out": str(tmp_path / "c2.pt")},
        {**_ds(3), "root": str(tmp_path / "c3"), "ckpt_path": str(out / "stage3" / LAST), "validate": True,
         "out": str(tmp_path / "c3.pt")},
        # ... and the planted ones are refused: the engine's loader, and ZeRO-3's validate
        # (zero_to_fp32's loader, then the model states file).
        {**_ds(0), "root": str(tmp_path / "e0"), "ckpt_path": str(evil[0]), "out": str(tmp_path / "e0.pt")},
        {**_ds(2), "root": str(tmp_path / "e2"), "ckpt_path": str(evil[2]), "out": str(tmp_path / "e2.pt")},
        {**_ds(3), "root": str(tmp_path / "e3"), "ckpt_path": str(evil[3]), "validate": True, "out": str(tmp_path / "e3.pt")},
    ])
    clean2, clean3, *refused = results
    assert max_diff(clean2["weights"], written[2]["weights"]) == 0.0 and clean2["global_step"] == 4
    assert "error" not in clean3, clean3
    for stage, result in zip((0, 2, 3), refused):
        assert not (tmp_path / f"ran{stage}").exists(), f"ZeRO {stage}: the planted code ran"
        assert result.get("error") == "CheckpointError", result
        assert_refused(result["message"], evil[stage], tmp_path / f"ran{stage}")
        assert str(shards[stage]) in result["message"]  # the file that holds it


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_hookloop_deepspeed_collate_refuses_a_planted_shard(deepspeed_checkpoints, tmp_path, stage):
    out, written = deepspeed_checkpoints
    clean = tmp_path / "clean.pt"
    run_python([sys.executable, "-m", "hookloop", "deepspeed", "collate", str(out / f"stage{stage}" / LAST), str(clean)],
               cwd=tmp_path)
    assert max_diff(torch.load(clean, weights_only=True), written[stage]["weights"]) == 0.0

    evil, marker = tmp_path / "shared", tmp_path / "ran"
    # ZeRO 0: the one model states file; ZeRO 2: zero_to_fp32 reads the optimizer shards.
    shard = _planted_copy(out / f"stage{stage}" / LAST, evil, "mp_rank_00_model_states.pt" if stage == 0 else
                          "*optim_states.pt", marker)
    proc = _hookloop_fails("deepspeed", "collate", evil, tmp_path / "out.pt", cwd=tmp_path)
    assert_refused(proc.stderr, evil, marker)
    assert str(shard) in proc.stderr and not (tmp_path / "out.pt").exists()


def _hookloop_fails(*args, cwd: Path):
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "hookloop", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    return proc


# -- FSDP's DCP directories ---------------------------------------------------------------


FSDP = {"plugins": ["fsdp"], "plugin_options": {"fsdp": {"state_dict_type": "sharded"}}}


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    (written,) = run_worker(out, [{**FSDP, "root": str(out / "run"), "out": str(out / "written.pt")}])
    return out / "run" / LAST, written


def _tag(checkpoint: Path) -> Path:
    return checkpoint / (checkpoint / "latest").read_text().strip()


def plant_in_metadata(directory: Path, marker: Path) -> None:
    """A Planted object inside the DCP ``.metadata`` pickle (which DCP reads with plain
    ``pickle.load``): first show that DCP's own reader runs it."""
    from torch.distributed.checkpoint import FileSystemReader

    path = directory / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own, trusted file
    control = marker.with_name(marker.name + ".control")
    metadata.planner_data["planted"] = Planted(control)
    path.write_bytes(pickle.dumps(metadata))
    FileSystemReader(str(directory)).read_metadata()
    assert control.exists(), "the plant is not live: DCP's reader did not run it"
    metadata.planner_data["planted"] = Planted(marker)
    path.write_bytes(pickle.dumps(metadata))


def plant_in_entry(directory: Path, marker: Path, where) -> None:
    """Rewrite the DCP directory with a Planted object as a non-tensor entry (DCP writes
    it with torch.save and reads it with torch.load(weights_only=False)): first show that
    torch's own converter runs it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = directory.parent / "whole.pt"
    dcp_to_torch_save(directory, whole)
    state = torch.load(whole, weights_only=True)
    control = marker.with_name(marker.name + ".control")
    for target in (control, marker):
        where(state, Planted(target))
        shutil.rmtree(directory)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(directory), no_dist=True)
        if target is control:
            dcp_to_torch_save(directory, whole)
            assert control.exists(), "the plant is not live: torch's converter did not run it"


@pytest.mark.slow
def test_fsdp_resume_refuses_planted_dcp_metadata_and_entries(fsdp_checkpoint, tmp_path):
    clean, written = fsdp_checkpoint
    in_metadata, in_entry = tmp_path / "shared_meta", tmp_path / "shared_entry"
    shutil.copytree(clean, in_metadata)
    plant_in_metadata(_tag(in_metadata) / "model", tmp_path / "ran_meta")
    shutil.copytree(clean, in_entry)
    # An entry the optimizer's state dict asks for: Adam's learning rate.
    plant_in_entry(_tag(in_entry) / "optimizer", tmp_path / "ran_entry",
                   lambda s, p: s["optimizer_0"]["param_groups"][0].__setitem__("lr", p))

    resumed, *refused = run_worker(tmp_path, [
        {**FSDP, "root": str(tmp_path / "c"), "ckpt_path": str(clean), "out": str(tmp_path / "c.pt")},
        {**FSDP, "root": str(tmp_path / "m"), "ckpt_path": str(in_metadata), "out": str(tmp_path / "m.pt")},
        {**FSDP, "root": str(tmp_path / "e"), "ckpt_path": str(in_entry), "out": str(tmp_path / "e.pt")},
    ])
    assert max_diff(resumed["weights"], written["weights"]) == 0.0
    assert not (tmp_path / "ran_meta").exists() and not (tmp_path / "ran_entry").exists(), "the planted code ran"
    assert refused[0].get("error") == "CheckpointError", refused[0]
    assert_refused(refused[0]["message"], _tag(in_metadata) / "model", tmp_path / "ran_meta")
    assert str(_tag(in_metadata) / "model" / ".metadata") in refused[0]["message"]
    assert refused[1].get("error") == "CheckpointError", refused[1]
    assert_refused(refused[1]["message"], _tag(in_entry), tmp_path / "ran_entry")


@pytest.mark.slow
def test_hookloop_fsdp_collate_refuses_planted_dcp_metadata_and_entries(fsdp_checkpoint, tmp_path):
    clean, written = fsdp_checkpoint
    run_python([sys.executable, "-m", "hookloop", "fsdp", "collate", str(clean), str(tmp_path / "clean.pt")], cwd=tmp_path)
    assert max_diff(torch.load(tmp_path / "clean.pt", weights_only=True), written["weights"]) == 0.0

    in_metadata, in_entry = tmp_path / "shared_meta", tmp_path / "shared_entry"
    shutil.copytree(clean, in_metadata)
    plant_in_metadata(_tag(in_metadata) / "model", tmp_path / "ran_meta")
    shutil.copytree(clean, in_entry)
    plant_in_entry(_tag(in_entry) / "model", tmp_path / "ran_entry", lambda s, p: s.__setitem__("planted", p))

    proc = _hookloop_fails("fsdp", "collate", in_metadata, tmp_path / "m.pt", cwd=tmp_path)
    assert_refused(proc.stderr, _tag(in_metadata) / "model", tmp_path / "ran_meta")
    proc = _hookloop_fails("fsdp", "collate", in_entry, tmp_path / "e.pt", cwd=tmp_path)
    assert_refused(proc.stderr, _tag(in_entry), tmp_path / "ran_entry")
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "e.pt").exists()
