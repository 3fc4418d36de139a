"""``ModelCheckpoint(async_save=True)``: the step pauses for a CPU snapshot, the write
happens in a background thread (issue 19, item 5).

* (a) Every checkpoint written in the background holds exactly what a synchronous run
  writes at the same step, also while slow writes let training mutate the weights (in
  place: SGD with momentum) long after the save call returned.
* (b) At most one save is in flight: every serialised file's writes, from a really slow
  writer, are counted by thread; and the writes do overlap training (they are async).
* (c) A background write that fails (the file size limit, in a real process) raises a
  ``CheckpointError`` naming the file at the next save, or at the end of ``fit``.
* (d) A process SIGKILLed in the middle of a background write leaves the previous
  ``last.ckpt`` loadable, and the restarted job resumes from it to weights bit-identical
  to a run never interrupted.
* (e) A resume from an asynchronously saved ``last.ckpt`` is bit-identical to a resume
  from a synchronously saved one, and to the run never interrupted.

The references are synchronous runs and runs never interrupted.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import hookloop
import hookloop.resume.checkpoint as ckpt
from test_observers import Scripted, train_loader

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "scripts" / "async_save_job.py"


def fit(root: Path, async_save: bool, ckpt_path=None, max_steps: int = 10, **checkpoint):
    torch.manual_seed(0)
    checkpoint = {"every_n_train_steps": 2, "every_n_epochs": 0, **checkpoint}
    trainer = hookloop.Trainer(default_root_dir=str(root), logger=True, enable_progress_bar=False,
                               enable_model_summary=False, max_steps=max_steps,
                               callbacks=[hookloop.ModelCheckpoint(async_save=async_save, **checkpoint)])
    module = Scripted()
    trainer.fit(module, train_loader(), ckpt_path=ckpt_path)
    return trainer, module


def same(a, b, path="checkpoint") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
              and a.shape == b.shape and torch.equal(a, b))
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in same(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def checkpoints(trainer) -> dict[str, dict]:
    """Every checkpoint file of the run by name, loaded, with the run's root taken out of
    the paths the checkpoint observer's bookkeeping holds."""
    directory = Path(trainer.log_dir) / "checkpoints"
    root = str(Path(trainer.default_root_dir))
    found = {}
    for path in sorted(directory.glob("*.ckpt")):
        state = hookloop.safe_load(path)
        book = state["plugins"]["checkpoint"]
        book["dir"] = book["dir"].replace(root, "ROOT")
        book["best_model_path"] = book["best_model_path"].replace(root, "ROOT")
        book["last_model_path"] = book["last_model_path"].replace(root, "ROOT")
        book["latest"] = [p.replace(root, "ROOT") for p in book["latest"]]
        book["best_k_models"] = {p.replace(root, "ROOT"): v for p, v in book["best_k_models"].items()}
        book["kth_best_model_path"] = book["kth_best_model_path"].replace(root, "ROOT")
        state["callbacks"] = _rooted(state["callbacks"], root)  # Lightning's copy of the same bookkeeping
        state["plugins"] = _rooted(state["plugins"], root)  # the csv logger's file too
        found[path.name] = state
    return found


def _rooted(value, root: str):
    if isinstance(value, str):
        return value.replace(root, "ROOT")
    if isinstance(value, dict):
        return {_rooted(k, root): _rooted(v, root) for k, v in value.items()}
    return value


class SlowWrites:
    """A real slow writer: each serialised checkpoint file's writing stalls after its
    first write (the file object's ``write``, wrapped), and records which threads write at once and at which
    training steps each file's writes started and ended."""

    def __init__(self, monkeypatch, trainer_box: list, pause: float):
        self.active: dict[int, int] = {}  # thread -> files it is writing
        self.most = 0
        self.spans: dict[str, list[int]] = {}  # file (thread name) -> [first step, last step]
        self.lock = threading.Lock()
        real_write, real_trailer = ckpt._ChecksumWriter.write, ckpt._ChecksumWriter.write_trailer
        box = trainer_box

        def write(writer, data):
            me = threading.current_thread()
            first = not getattr(writer, "_counted", False)
            with self.lock:
                if first:
                    writer._counted = True
                    self.active[me.ident] = self.active.get(me.ident, 0) + 1
                    self.most = max(self.most, sum(self.active.values()))
                span = self.spans.setdefault(me.name, [box[0].global_step] * 2)
                span[1] = box[0].global_step
            written = real_write(writer, data)
            if first:  # once per file: the file is open, half-written, for `pause` seconds
                time.sleep(pause)
            return written

        def write_trailer(writer):
            real_trailer(writer)
            with self.lock:
                self.spans[threading.current_thread().name][1] = box[0].global_step
                self.active[threading.current_thread().ident] -= 1

        monkeypatch.setattr(ckpt._ChecksumWriter, "write", write)
        monkeypatch.setattr(ckpt._ChecksumWriter, "write_trailer", write_trailer)


def overlapped_training(spans: dict[str, list[int]]) -> bool:
    """Whether some file's writing ended after a later training step: measured from the
    step the save was asked at (``step=N`` in the file's name), not from the writer
    thread's first write, which a loaded machine may schedule only after the next step."""
    asked = {name: int(re.search(r"step=(\d+)", name).group(1)) for name in spans if re.search(r"step=(\d+)", name)}
    return any(spans[name][1] > step for name, step in asked.items())


class Box:
    """An observer that hands the running trainer to SlowWrites."""

    hookloop_role = "observer"

    def __init__(self, box):
        self.box = box

    @hookloop.hookimpl
    def setup(self, trainer):
        self.box[:] = [trainer]


# -- (a) exactly the state at the step it was taken ------------------------------------


def test_async_checkpoints_hold_exactly_what_synchronous_ones_do_while_training_mutates_weights(
        tmp_path, monkeypatch):
    sync_trainer, _ = fit(tmp_path / "sync", False, save_top_k=-1, max_steps=12)
    expected = checkpoints(sync_trainer)
    box: list = []
    slow = SlowWrites(monkeypatch, box, pause=0.2)
    torch.manual_seed(0)
    trainer = hookloop.Trainer(default_root_dir=str(tmp_path / "async"), logger=True, enable_progress_bar=False,
                               enable_model_summary=False, max_steps=12,
                               callbacks=[Box(box), hookloop.ModelCheckpoint(
                                   every_n_train_steps=2, every_n_epochs=0, save_top_k=-1, async_save=True)])
    trainer.fit(Scripted(), train_loader())
    written = checkpoints(trainer)
    # 6 top-k files (steps 2..12), last.ckpt and last.prev.ckpt
    assert sorted(written) == sorted(expected) and len(written) == 8
    for name in expected:
        assert same(written[name], expected[name], name) == []
    # The weights changed while files were written: some write ended after training moved
    # on from the step whose state it holds.
    assert overlapped_training(slow.spans), slow.spans


def test_cpu_snapshot_is_a_copy_that_keeps_shared_storages_shared():
    weight = torch.arange(6.0).reshape(2, 3)
    state = {"w": weight, "view": weight[1], "same": weight, "n": [1, (2, "x")], "sd": torch.nn.Linear(2, 2).state_dict()}
    copy = ckpt.cpu_snapshot(state)
    weight.add_(100.0)  # training goes on, in place
    assert copy["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and copy["view"].tolist() == [3.0, 4.0, 5.0]
    assert copy["same"] is copy["w"] and copy["view"].untyped_storage().data_ptr() == copy["w"].untyped_storage().data_ptr()
    assert copy["n"] == [1, (2, "x")] and copy["sd"]._metadata == state["sd"]._metadata
    assert copy["w"].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    # the next snapshot copies into the storages of one nothing reads any more
    used: list = []
    first = ckpt.cpu_snapshot(state, used=used)
    weight.mul_(2.0)
    second = ckpt.cpu_snapshot(state, reuse=used)
    assert not used and second["w"].untyped_storage().data_ptr() == first["w"].untyped_storage().data_ptr()
    assert second["view"].tolist() == [206.0, 208.0, 210.0] and torch.equal(second["sd"]["weight"], state["sd"]["weight"])


# -- (b) at most one in flight ------------------------------------------------------------


def test_at_most_one_save_is_in_flight_and_writes_overlap_training(tmp_path, monkeypatch):
    box: list = []
    slow = SlowWrites(monkeypatch, box, pause=0.1)
    torch.manual_seed(0)
    trainer = hookloop.Trainer(default_root_dir=str(tmp_path), logger=True, enable_progress_bar=False,
                               enable_model_summary=False, max_steps=12,
                               callbacks=[Box(box), hookloop.ModelCheckpoint(
                                   every_n_train_steps=1, every_n_epochs=0, save_top_k=3, async_save=True,
                                   monitor="step", mode="max")])  # the 3 newest (Lightning needs a monitor)
    module = Scripted()
    trainer.fit(module, train_loader())
    # one serialised file per step (last.ckpt is its copy), and epoch 0's end's last.ckpt
    assert len(slow.spans) == 13
    assert slow.most == 1
    assert overlapped_training(slow.spans), slow.spans
    directory = Path(trainer.log_dir) / "checkpoints"
    # top-3 by recency, the rest removed only after their successors were written
    assert sorted(p.name for p in directory.glob("*.ckpt")) == [
        "epoch=1-step=10.ckpt", "epoch=1-step=11.ckpt", "epoch=1-step=12.ckpt", "last.ckpt", "last.prev.ckpt"]
    last = hookloop.safe_load(directory / "last.ckpt")
    assert last["loop"]["global_step"] == 12
    assert same(last["state_dict"], module.state_dict()) == []
    assert trainer.checkpoint_callback.best_model_path == str(directory / "epoch=1-step=12.ckpt")


def test_async_save_is_an_option_of_the_builtin_observer(tmp_path):
    with pytest.raises(hookloop.ConfigurationError, match=r"checkpoint async_save='yes' must be True or False"):
        hookloop.ModelCheckpoint(async_save="yes")
    torch.manual_seed(0)
    trainer = hookloop.Trainer(default_root_dir=str(tmp_path), logger=True, enable_progress_bar=False,
                               enable_model_summary=False, max_steps=3,
                               plugin_options={"checkpoint": {"async_save": True}})
    trainer.fit(Scripted(), train_loader())
    assert trainer.checkpoint_callback.async_save is True and trainer.checkpoint_callback._async
    assert hookloop.safe_load(Path(trainer.log_dir) / "checkpoints" / "last.ckpt")["loop"]["global_step"] == 3


# -- real processes: a failing disk, a kill mid-write --------------------------------------


def job(root: Path, out: Path, expect_rc: int = 0, **env):
    import subprocess

    full = {k: v for k, v in os.environ.items()
            if not k.startswith("HOOKLOOP_") and not k.startswith("TORCHELASTIC_") and k != "LOCAL_RANK"}
    full.update({k: str(v) for k, v in env.items()})
    proc = subprocess.run([sys.executable, str(JOB), str(root), str(out)], cwd=root.parent, env=full,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect_rc, f"rc {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


RUN = {"HOOKLOOP_RUN_ID": "job-19"}  # every attempt of the job (named by its id) gets the same run directory
RESTART = {**RUN, "TORCHELASTIC_RESTART_COUNT": 1}


@pytest.fixture(scope="module")
def straight_job(tmp_path_factory):
    """The job never interrupted, saving synchronously (its own process, as the attempts)."""
    root = tmp_path_factory.mktemp("straight")
    job(root / "run", root / "final.pt", ASYNC=0)
    return torch.load(root / "final.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("fails_at, raised_at", [(6, 7), (10, 10)], ids=["next-save", "end-of-fit"])
def test_a_failed_background_write_is_raised_at_the_next_save_or_the_end_of_fit(tmp_path, fails_at, raised_at):
    proc = job(tmp_path / "run", tmp_path / "out.pt", expect_rc=1, FSIZE_AT=fails_at, **RUN)
    directory = tmp_path / "run" / "logs" / "version_0" / "checkpoints"
    path = directory / f"epoch={(fails_at - 1) // 7}-step={fails_at}.ckpt"
    assert (f"hookloop.contract.errors.CheckpointError: the background save of checkpoint '{path}' failed: writing "
            f"checkpoint '{path}' failed (File too large)") in proc.stderr, proc.stderr
    assert f"fit failed at global step {raised_at}" in proc.stdout  # 7: the epoch end saves last.ckpt
    # nothing half-written; the previous checkpoints are whole
    assert not path.exists() and not list(directory.glob(".*.tmp"))
    assert hookloop.safe_load(directory / "last.ckpt")["loop"]["global_step"] == fails_at - 2


@pytest.mark.slow
def test_killed_mid_background_write_the_previous_checkpoint_is_used(tmp_path, straight_job):
    import signal
    import subprocess

    root = tmp_path / "run"
    root.mkdir()
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("HOOKLOOP_") and not k.startswith("TORCHELASTIC_") and k != "LOCAL_RANK"}
    full.update({**RUN, "SLOW_AT": "6"})
    proc = subprocess.Popen([sys.executable, str(JOB), str(root), str(tmp_path / "first.pt")], cwd=tmp_path,
                            env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(1200):  # the step-6 file is being written in the background
            if (root / "writing").exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert (root / "writing").exists(), proc.communicate(timeout=10)[0]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -9
    directory = root / "logs" / "version_0" / "checkpoints"
    (partial,) = directory.glob(".epoch=0-step=6.ckpt.*.tmp")  # killed mid-write: half a file
    with pytest.raises(hookloop.CheckpointError):
        ckpt.verify_checksum(partial)
    assert not (directory / "epoch=0-step=6.ckpt").exists()
    assert hookloop.safe_load(directory / "last.ckpt")["loop"]["global_step"] == 4
    restarted = job(root, tmp_path / "final.pt", **RESTART)
    assert f"resumed from {directory / 'last.ckpt'} at epoch 0, global step 4" in restarted.stdout
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["steps"] == list(range(5, 11))
    assert same(final["state_dict"], straight_job["state_dict"]) == []
    assert same(final["optimizer"], straight_job["optimizer"]) == []


# -- (e) resume ----------------------------------------------------------------------------


def test_resume_from_an_async_last_ckpt_is_bit_identical_to_the_synchronous_case(tmp_path):
    straight, straight_module = fit(tmp_path / "straight", False, max_steps=14)
    finals = {}
    for async_save in (False, True):
        root = tmp_path / ("async" if async_save else "sync")
        first, _ = fit(root, async_save, max_steps=5)  # stops mid-epoch: last.ckpt at step 5
        last = Path(first.log_dir) / "checkpoints" / "last.ckpt"
        assert hookloop.safe_load(last)["loop"]["global_step"] == 5
        trainer, module = fit(root, async_save, ckpt_path=str(last), max_steps=14)
        finals[async_save] = (module.state_dict(), trainer.optimizers[0].state_dict())
    assert same(finals[True], finals[False]) == []
    assert same(finals[True], (straight_module.state_dict(), straight.optimizers[0].state_dict())) == []


# -- ddp, and fairscale's ddp_sharded: only the writing rank writes --------------------------


def _ddp_checkpoints(root: str, strategy: str) -> dict:
    """On each rank: a synchronous and an asynchronous fit saving every 2 steps; the
    files each rank serialised (by the writing thread's name)."""
    import hookloop.resume.checkpoint as ckpt_module

    written: list[str] = []
    real_write = ckpt_module._ChecksumWriter.write

    def write(writer, data):
        if not getattr(writer, "_named", False):
            writer._named = True
            written.append(threading.current_thread().name)
        return real_write(writer, data)

    ckpt_module._ChecksumWriter.write = write
    dirs = {}
    for async_save in (False, True):
        torch.manual_seed(0)
        trainer = hookloop.Trainer(
            default_root_dir=str(Path(root) / ("async" if async_save else "sync")), logger=True,
            enable_progress_bar=False, enable_model_summary=False, max_steps=6, plugins=[strategy],
            callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=2, every_n_epochs=0, save_top_k=-1,
                                                async_save=async_save)])
        trainer.fit(Scripted(), train_loader())
        dirs[async_save] = (trainer.log_dir, trainer.checkpoint_callback._async)
    return {"written": written, "dirs": dirs}


FULL = pytest.mark.full  # the long matrix


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("ddp_sharded", marks=FULL),
                                      pytest.param("fsdp", marks=FULL)])  # fsdp: state_dict_type="full"
def test_under_several_processes_only_the_writing_rank_writes_and_files_equal_synchronous_ones(tmp_path, strategy):
    from hookloop.testing import run_processes

    ranks = run_processes(_ddp_checkpoints, nprocs=2, args=(str(tmp_path), strategy), timeout=300)
    (sync_dir, sync_async), (async_dir, async_async) = ranks[0]["dirs"][False], ranks[0]["dirs"][True]
    assert (sync_async, async_async) == (False, True)
    # rank 0 serialised each file once, synchronously then in background threads (steps 2, 4
    # and 6, and epoch 0's end's last.ckpt after step 4: 4 batches a rank); rank 1 none
    assert ranks[1]["written"] == []
    names = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt", "epoch=1-step=6.ckpt"]
    assert ranks[0]["written"] == ["MainThread"] * 4 + [f"hookloop checkpoint writer ({n})" for n in names]

    class Run:  # what checkpoints() reads
        def __init__(self, log_dir, root):
            self.log_dir, self.default_root_dir = log_dir, root

    expected = checkpoints(Run(sync_dir, tmp_path / "sync"))
    written = checkpoints(Run(async_dir, tmp_path / "async"))
    assert sorted(written) == sorted(expected) and len(written) == 5  # 3 top-k, last, last.prev
    for name in expected:
        assert same(written[name], expected[name], name) == []


class OwnWriter:
    """A strategy-like plugin that writes checkpoints itself and declares nothing."""

    hookloop_role = "extension"
    hookloop_name = "own_writer"

    @hookloop.hookimpl(tryfirst=True)
    def save_checkpoint(self, trainer, checkpoint, path):
        ckpt.atomic_save(checkpoint, path)
        (Path(path).parent / "after-the-file.txt").write_text(str(Path(path).stat().st_size))
        return path


def test_a_plugin_that_writes_checkpoints_itself_and_does_not_declare_it_saves_synchronously(tmp_path):
    torch.manual_seed(0)
    trainer = hookloop.Trainer(default_root_dir=str(tmp_path), logger=True, enable_progress_bar=False,
                               enable_model_summary=False, max_steps=2, plugins=[OwnWriter()],
                               callbacks=[hookloop.ModelCheckpoint(async_save=True, every_n_train_steps=2)])
    with pytest.warns(UserWarning, match=r"checkpoint async_save=True: own_writer writes its checkpoints itself and "
                                         r"does not declare that they can be written in the background"):
        trainer.fit(Scripted(), train_loader())
    assert trainer.checkpoint_callback._async is False
    directory = Path(trainer.log_dir) / "checkpoints"
    # it found its file on disk right after atomic_save: the save was synchronous
    assert int((directory / "after-the-file.txt").read_text()) == (directory / "epoch=0-step=2.ckpt").stat().st_size


# -- fsdp's sharded directories: torch.distributed.checkpoint.async_save -------------------


def _fsdp_sharded(root: str) -> dict:
    """On each rank (fsdp, state_dict_type="sharded", 2 processes): the run never
    interrupted (8 steps); then, saving synchronously and asynchronously, a run stopped
    at step 4 (``last.ckpt``: a directory) resumed to step 8. DCP's writes are slowed
    (0.3 s each, in this process) so that training goes on while they are in flight; the
    steps at which each write started and ended, and the thread that made it, are kept."""
    import torch.distributed.checkpoint.filesystem as fs

    from hookloop.testing import weights

    spans, box = [], []
    real_write = fs.FileSystemWriter.write_data

    def write_data(writer, plan, planner):
        start = box[0].global_step if box else None
        time.sleep(0.3)
        result = real_write(writer, plan, planner)
        spans.append((threading.current_thread().name, start, box[0].global_step if box else None))
        return result

    fs.FileSystemWriter.write_data = write_data

    def fit(directory, max_steps, async_save=None, ckpt_path=None):
        torch.manual_seed(0)
        callbacks = [Box(box)]
        if async_save is not None:
            callbacks.append(hookloop.ModelCheckpoint(every_n_train_steps=2, every_n_epochs=0, save_top_k=-1,
                                                      async_save=async_save))
        trainer = hookloop.Trainer(
            default_root_dir=str(Path(root) / directory), logger=True, enable_progress_bar=False,
            enable_model_summary=False, max_steps=max_steps, callbacks=callbacks,
            enable_checkpointing=async_save is not None,
            plugins=[hookloop.plugin("fsdp", state_dict_type="sharded")])
        module = Scripted()
        trainer.fit(module, train_loader(), ckpt_path=ckpt_path)
        return trainer, weights(module)

    _, straight = fit("straight", 8)
    result = {"straight": straight}
    for async_save in (False, True):
        name = "async" if async_save else "sync"
        spans.clear()
        first, _ = fit(name, 4, async_save)
        result[f"{name}_spans"] = list(spans)
        result[f"{name}_async"] = first.checkpoint_callback._async
        last = Path(first.log_dir) / "checkpoints" / "last.ckpt"
        result[f"{name}_latest"] = (last / "latest").read_text().strip()
        _, result[name] = fit(name, 8, async_save, ckpt_path=str(last))
    fs.FileSystemWriter.write_data = real_write
    return result


@pytest.mark.slow
def test_fsdp_sharded_directories_are_written_by_dcp_in_the_background_and_resume_bit_identical(tmp_path):
    """fsdp's sharded checkpoint directories with ``async_save=True``: every rank's DCP
    writes run in a background thread while training goes on (steps advance during them),
    the tag is committed once they are on disk, and a resume from the asynchronously saved
    ``last.ckpt`` ends bit-identical to the synchronous case and to the run never
    interrupted. Before, async_save under sharded fsdp warned and saved synchronously."""
    pytest.importorskip("hookloop_fsdp")
    from hookloop.testing import run_processes

    ranks = run_processes(_fsdp_sharded, nprocs=2, args=(str(tmp_path),), timeout=400)
    for rank, result in enumerate(ranks):
        assert (result["sync_async"], result["async_async"]) == (False, True)
        assert result["sync_latest"] == result["async_latest"] == "step4.1"  # step 4, then the epoch's end
        # synchronous: every write on the training thread, at the step of its save
        assert result["sync_spans"] and all(t == "MainThread" and a == b for t, a, b in result["sync_spans"])
        # asynchronous: never on the training thread, and training stepped during some
        assert result["async_spans"] and all(t != "MainThread" for t, _, _ in result["async_spans"])
        assert any(b > a for _, a, b in result["async_spans"]), result["async_spans"]
        assert same(result["async"], result["sync"], f"rank {rank}") == []
        assert same(result["async"], result["straight"], f"rank {rank}") == []
