"""Bounded loss: the last two checkpoints are kept, each carries a SHA-256 checksum, and a
newest checkpoint that cannot be used falls back to the previous one.

* A truncated or bit-flipped ``last.ckpt`` under ``ckpt_path="last"``, and under the
  automatic resume of a restarted worker: a warning naming both files, and the resumed
  run trains from the previous checkpoint's step to weights bit-identical to a run that
  was never interrupted.
* The same damage under an explicit ``ckpt_path``: a ``CheckpointError`` naming the file
  and the checksums, worked out here with ``hashlib``.
* A process SIGKILLed inside the save, between the temporary file and its rename, and a
  save that hits the file size limit (``RLIMIT_FSIZE``: the disk filling up): the
  previous ``last.ckpt`` stays loadable and the restarted job resumes from it.

The references are runs that were never interrupted; the faults happen to real processes
(tests/scripts/integrity_job.py).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import hookloop
from conftest import REPO, state_of
from test_observers import BATCHES, Scripted, train_loader

JOB = REPO / "tests" / "scripts" / "integrity_job.py"


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_a_weight_bit(path: Path) -> None:
    """Flip one bit inside the stored bytes of ``net.0.weight``: a torch.load without the
    checksum reads the file without complaint, with one wrong weight."""
    data = bytearray(path.read_bytes())
    weight = torch.load(io.BytesIO(bytes(data)), weights_only=True)["state_dict"]["net.0.weight"]
    wanted = weight.numpy().tobytes()
    archive = zipfile.ZipFile(io.BytesIO(bytes(data)))
    (info,) = [i for i in archive.infolist() if "/data/" in i.filename and archive.read(i) == wanted]
    header = info.header_offset  # a local file header: 30 bytes, the name, the extra field, the data
    name_len = int.from_bytes(data[header + 26:header + 28], "little")
    extra_len = int.from_bytes(data[header + 28:header + 30], "little")
    start = header + 30 + name_len + extra_len
    data[start + len(wanted) // 2] ^= 0x04
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": truncate, "bit-flipped": flip_a_weight_bit}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- ckpt_path="last" and explicit paths, in this process ---------------------------------


def fit(root: Path, module, ckpt_path=None, **kw):
    kw.setdefault("max_epochs", 2)
    # a logger: the run directory, with its resume last.ckpt and last.prev.ckpt
    trainer = hookloop.Trainer(default_root_dir=str(root), logger=True, enable_progress_bar=False, **kw)
    trainer.fit(module, train_loader(), ckpt_path=ckpt_path)
    return trainer


def checkpoints_to_step_10(root: Path) -> Path:
    """2 epochs are 14 steps; stopping at 10 with a checkpoint every 4 steps leaves
    last.ckpt at step 10 (where it stopped) and last.prev.ckpt at step 8."""
    torch.manual_seed(0)
    trainer = fit(root, Scripted(), max_steps=10, max_epochs=None,
                  callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=4, every_n_epochs=0)])
    directory = Path(trainer.log_dir) / "checkpoints"
    assert hookloop.safe_load(directory / "last.ckpt")["loop"]["global_step"] == 10
    assert hookloop.safe_load(directory / "last.prev.ckpt")["loop"]["global_step"] == 8
    return directory


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_and_resumes_exactly(tmp_path, damage):
    torch.manual_seed(0)
    straight = Scripted()
    fit(tmp_path / "straight", straight)

    directory = checkpoints_to_step_10(tmp_path / "b")
    DAMAGE[damage](directory / "last.ckpt")
    torch.manual_seed(5)  # whatever the RNG does in between must not matter
    resumed = Scripted(seed=8)
    newest, previous = directory / "last.ckpt", directory / "last.prev.ckpt"
    with pytest.warns(UserWarning, match=rf"newest checkpoint '{re.escape(str(newest))}' cannot be loaded \(.*"
                                         rf"(corrupt|truncated).*\); resuming from the previous checkpoint "
                                         rf"'{re.escape(str(previous))}' instead"):
        trainer = fit(tmp_path / "b", resumed, ckpt_path="last")
    assert sorted(resumed.step_losses) == list(range(9, 2 * BATCHES + 1))  # from step 8 on, no step twice
    assert trainer.global_step == 2 * BATCHES
    assert equal(state_of(straight), state_of(resumed))


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_explicit_checkpoint_is_an_error_naming_it_and_the_checksums(tmp_path, damage):
    directory = checkpoints_to_step_10(tmp_path)
    path = directory / "last.ckpt"
    written = path.read_bytes()
    assert written[-80:-64] == b"hookloop-sha256:"
    assert written[-64:].decode() == hashlib.sha256(written[:-64]).hexdigest()  # the trailer, checked by hand
    DAMAGE[damage](path)
    damaged = path.read_bytes()
    if damage == "bit-flipped":
        expected = (rf"checkpoint '{re.escape(str(path))}' is corrupt: the SHA-256 of its bytes is "
                    rf"{hashlib.sha256(damaged[:-64]).hexdigest()}, the checksum written with it is "
                    rf"{hashlib.sha256(written[:-64]).hexdigest()}")
    else:
        expected = (rf"checkpoint '{re.escape(str(path))}' is truncated or corrupt: .* the expected checksum is "
                    rf"lost with its end \(actual SHA-256 of what is left: {hashlib.sha256(damaged).hexdigest()}\)")
    with pytest.raises(hookloop.CheckpointError, match=expected):
        fit(tmp_path / "again", Scripted(), ckpt_path=path)
    with pytest.raises(hookloop.CheckpointError, match=expected):
        hookloop.safe_load(path)
    # the previous checkpoint is whole, and loads
    assert hookloop.safe_load(directory / "last.prev.ckpt")["loop"]["global_step"] == 8


def test_both_checkpoints_damaged_is_an_error_naming_both(tmp_path):
    directory = checkpoints_to_step_10(tmp_path)
    truncate(directory / "last.ckpt")
    flip_a_weight_bit(directory / "last.prev.ckpt")
    with pytest.raises(hookloop.CheckpointError, match=r"neither checkpoint can be loaded: .*last\.ckpt.*truncated.*"
                                                       r"previous one: .*last\.prev\.ckpt.* is corrupt"):
        fit(tmp_path, Scripted(), ckpt_path="last")


# -- restarted workers: real processes, real faults ---------------------------------------


def job(root: Path, out: Path, expect_rc: int = 0, **env):
    """One attempt of tests/scripts/integrity_job.py; returns (returncode, stdout, stderr)."""
    import subprocess

    full = {k: v for k, v in os.environ.items()
            if not k.startswith("HOOKLOOP_") and not k.startswith("TORCHELASTIC_") and k != "LOCAL_RANK"}
    full.update({k: str(v) for k, v in env.items()})
    proc = subprocess.run([sys.executable, str(JOB), str(root), str(out)], cwd=root.parent, env=full,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect_rc, f"rc {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def straight_job(tmp_path_factory):
    """The weights of the job never interrupted (its own process, as the attempts run)."""
    root = tmp_path_factory.mktemp("straight")
    job(root / "run", root / "final.pt")
    return torch.load(root / "final.pt", weights_only=True)


RUN = {"HOOKLOOP_RUN_ID": "job-7"}  # every attempt of the job (named by its id) gets the same run directory
RESTART = {**RUN, "TORCHELASTIC_RESTART_COUNT": 1}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_restarted_worker_falls_back_from_a_damaged_newest_checkpoint(tmp_path, straight_job, damage):
    job(tmp_path / "run", tmp_path / "first.pt", MAX_STEPS=10, **RUN)
    directory = tmp_path / "run" / "logs" / "version_0" / "checkpoints"
    DAMAGE[damage](directory / "last.ckpt")
    proc = job(tmp_path / "run", tmp_path / "final.pt", **RESTART)
    assert f"newest checkpoint '{directory / 'last.ckpt'}' cannot be loaded" in proc.stderr
    assert f"resuming from the previous checkpoint '{directory / 'last.prev.ckpt'}' instead" in proc.stderr
    assert f"resumed from {directory / 'last.prev.ckpt'} at epoch 1, global step 8" in proc.stdout
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["steps"] == list(range(9, 2 * BATCHES + 1))
    assert equal(final["state_dict"], straight_job["state_dict"])


@pytest.mark.slow
def test_killed_between_write_and_rename_the_previous_checkpoint_is_used(tmp_path, straight_job):
    job(tmp_path / "run", tmp_path / "first.pt", expect_rc=-9, KILL_AT=8, **RUN)
    directory = tmp_path / "run" / "logs" / "version_0" / "checkpoints"
    # killed with the new last.ckpt written in full beside the old one, not yet renamed
    (left,) = directory.glob(".last.ckpt.*.tmp")
    assert hookloop.safe_load(left)["loop"]["global_step"] == 8
    assert hookloop.safe_load(directory / "last.ckpt")["loop"]["global_step"] == 7  # the epoch's end
    proc = job(tmp_path / "run", tmp_path / "final.pt", **RESTART)
    assert f"resumed from {directory / 'last.ckpt'} at epoch 0, global step 7" in proc.stdout
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["steps"] == list(range(8, 2 * BATCHES + 1))
    assert equal(final["state_dict"], straight_job["state_dict"])
    # The restart's first save removed the dead process's temporary file.
    assert not left.exists() and not list(directory.glob(".*.tmp"))


@pytest.mark.slow
def test_a_save_removes_the_temporary_files_of_dead_writers_on_this_host_only(tmp_path):
    import socket
    import subprocess

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, host = int(done.stdout), socket.gethostname()
    names = {
        "dead": f".last.ckpt.{host}-{dead}.k2x9_q.tmp",  # killed mid-write
        "dead_link": f".last.prev.ckpt.{host}-{dead}.tmp",  # killed while keeping the previous
        "alive": f".last.ckpt.{host}-{os.getppid()}.a8b7c6.tmp",  # a live writer (this test's parent)
        "other_host": f".last.ckpt.elsewhere-{dead}.p0o9i8.tmp",  # another machine's (shared file system)
        "other_file": f".epoch=1.ckpt.{host}-{dead}.zz.tmp",  # not this file's
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    hookloop.resume.checkpoint.atomic_save({"x": torch.ones(2)}, tmp_path / "last.ckpt")
    left = {key for key, name in names.items() if (tmp_path / name).exists()}
    assert left == {"alive", "other_host", "other_file"}
    assert hookloop.safe_load(tmp_path / "last.ckpt")["x"].tolist() == [1.0, 1.0]


@pytest.mark.slow
def test_a_save_past_the_file_size_limit_fails_clearly_and_the_previous_checkpoint_is_used(tmp_path, straight_job):
    proc = job(tmp_path / "run", tmp_path / "first.pt", expect_rc=1, FSIZE_AT=8, SAVE_TOP_K=0, **RUN)
    directory = tmp_path / "run" / "logs" / "version_0" / "checkpoints"
    assert (f"hookloop.contract.errors.CheckpointError: writing checkpoint '{directory / 'last.ckpt'}' failed (File too "
            f"large); last.ckpt is unchanged and no temporary file is left.") in proc.stderr
    assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt", "last.prev.ckpt"]  # no partial file
    assert hookloop.safe_load(directory / "last.ckpt")["loop"]["global_step"] == 7
    proc = job(tmp_path / "run", tmp_path / "final.pt", **RESTART)
    assert f"resumed from {directory / 'last.ckpt'} at epoch 0, global step 7" in proc.stdout
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["steps"] == list(range(8, 2 * BATCHES + 1))
    assert equal(final["state_dict"], straight_job["state_dict"])
