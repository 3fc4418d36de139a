"""Checkpoints, run directories and logs on object storage through fsspec (issue 37 item 2).

The storage layer (hookloop.resume.storage) against a real S3-compatible server (moto in
server mode on 127.0.0.1, the ``s3`` fixture) with the real client (s3fs), and against
fsspec's ``memory://``; a killed upload is a real SIGKILL of a real process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
import time

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import TinyModule, state_of, tiny_data
from hookloop.contract.errors import CheckpointError, ConfigurationError
from hookloop.resume import storage


@pytest.fixture(autouse=True)
def _staging(tmp_path, monkeypatch):
    """Each test's staging directories under its own tmp_path (not ~/.cache)."""
    monkeypatch.setenv(storage.STAGING_ENV, str(tmp_path / "staging"))


PAYLOAD_A = os.urandom(3 << 20)
PAYLOAD_B = os.urandom(2 << 20)


# -- URLs ------------------------------------------------------------------------------

def test_urls_and_local_paths_are_told_apart(tmp_path):
    assert storage.is_url("s3://bucket/run") and storage.is_url("memory://run") and storage.is_url("gs://b")
    assert not storage.is_url("runs/x") and not storage.is_url(tmp_path) and not storage.is_url("file:///tmp/x")
    assert storage.local_path("file:///tmp/x") == storage.local_path("/tmp/x")
    assert storage.local_path(tmp_path / "a") == tmp_path / "a"
    with pytest.raises(ConfigurationError, match="is a URL of a store"):
        storage.local_path("s3://bucket/run")


@pytest.mark.parametrize("url, package", [("gs://bucket/run", "gcsfs"), ("az://container/run", "adlfs"),
                                          ("abfs://container/run", "adlfs")])
def test_a_scheme_whose_implementation_is_missing_names_the_package(url, package):
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.fail(f"{package} is installed here: this test needs a scheme without its implementation")
    with pytest.raises(ConfigurationError, match=rf"needs the fsspec implementation of .*: pip install {package}$"):
        storage.filesystem(url)


def test_an_unknown_scheme_is_an_error_not_a_local_path():
    with pytest.raises(ConfigurationError, match="no fsspec implementation registers the scheme 'nosuch'"):
        storage.filesystem("nosuch://bucket/run")


# -- the commit protocol, on memory:// -----------------------------------------------------

def _memory_url(name: str) -> str:
    import uuid

    return f"memory://hookloop-tests/{uuid.uuid4().hex}/{name}"


def test_commit_file_then_resolve_and_download_on_memory(tmp_path):
    url = _memory_url("checkpoints/last.ckpt")
    assert storage.resolve(url) is None and storage.download(url, tmp_path / "x") is None
    (tmp_path / "a").write_bytes(PAYLOAD_A)
    first = storage.commit_file(tmp_path / "a", url, step=4)
    assert first.startswith(url + "/step4-") and first.endswith("/last.ckpt")
    assert storage.resolve(url) == first
    second = storage.commit_file(lambda f: f.write(PAYLOAD_B), url, step=8)
    assert storage.resolve(url) == second
    # the previous commit went once the marker moved; only latest and the new tag remain
    assert storage.listdir(url) == sorted(["latest", storage.name_of(storage.parent_of(second))])
    assert storage.download(url, tmp_path / "got.ckpt").read_bytes() == PAYLOAD_B


def test_a_tree_is_committed_by_several_writers_and_published_once(tmp_path):
    url = _memory_url("last.ckpt")
    tag_url = storage.begin(url, step=3)
    for rank in range(2):  # each writer uploads its own files under the one tag
        shard = tmp_path / f"rank{rank}"
        (shard / "step3").mkdir(parents=True)
        (shard / "step3" / f"shard_{rank}.distcp").write_bytes(bytes([rank]) * 100)
        storage.upload(shard, tag_url)
    assert storage.resolve(url) is None  # uploaded, not published: nothing to read yet
    storage.publish(tag_url)
    assert storage.resolve(url) == tag_url
    got = storage.download(url, tmp_path / "got")
    assert sorted(p.name for p in (got / "step3").iterdir()) == ["shard_0.distcp", "shard_1.distcp"]
    assert (got / "step3" / "shard_1.distcp").read_bytes() == b"\x01" * 100


def test_an_upload_without_marker_is_never_read_and_goes_at_the_next_commit(tmp_path):
    url = _memory_url("last.ckpt")
    (tmp_path / "a").write_bytes(PAYLOAD_A)
    committed = storage.commit_file(tmp_path / "a", url, step=1)
    orphan = storage.begin(url, step=2)
    storage.write_bytes(storage.join(orphan, "last.ckpt"), PAYLOAD_B[:1000])  # a save killed before its marker
    assert storage.resolve(url) == committed
    assert storage.download(url, tmp_path / "got").read_bytes() == PAYLOAD_A
    storage.commit_file(tmp_path / "a", url, step=3)
    assert storage.name_of(orphan) not in storage.listdir(url)


def test_a_marker_that_names_a_path_is_refused(tmp_path):
    url = _memory_url("last.ckpt")
    storage.write_bytes(storage.join(url, "latest"), b"../../other-run/last.ckpt\n")
    with pytest.raises(CheckpointError, match="which is not a tag hookloop writes"):
        storage.resolve(url)


def test_remove_takes_the_marker_first_and_everything_under_the_url(tmp_path):
    url = _memory_url("last.ckpt")
    storage.commit_file(lambda f: f.write(b"x"), url, step=1)
    storage.remove(url)
    assert storage.listdir(url) == [] and storage.resolve(url) is None


def test_exclusive_write_refuses_an_existing_object():
    url = _memory_url("claim")
    assert storage.write_bytes(url, b"a", exclusive=True)
    assert not storage.write_bytes(url, b"b", exclusive=True)
    assert storage.read_bytes(url) == b"a"


# -- retries -----------------------------------------------------------------------------

def test_transient_errors_are_told_from_permanent_ones():
    import aiohttp
    import botocore.exceptions

    assert storage.is_transient(botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert storage.is_transient(aiohttp.ServerDisconnectedError())
    assert storage.is_transient(ConnectionResetError())
    assert storage.is_transient(OSError(5, "An error occurred (SlowDown) when calling the PutObject operation"))
    assert not storage.is_transient(FileNotFoundError("s3://b/k"))
    assert not storage.is_transient(PermissionError("AccessDenied"))


def test_retrying_gives_up_after_the_bounded_tries_naming_the_url():
    calls = []

    def flaky():
        calls.append(time.monotonic())
        raise ConnectionResetError("Connection reset by peer")

    with pytest.raises(CheckpointError, match=r"cannot write 's3://b/k': ConnectionResetError: .* \(tried 3 times\)"):
        storage.retrying(flaky, "s3://b/k", "write", tries=3, backoff=0.05)
    assert len(calls) == 3 and calls[2] - calls[1] >= 0.09  # the wait doubles


# -- against a real S3 server (moto) with s3fs ---------------------------------------------

@pytest.mark.slow
def test_commit_resolve_download_prune_on_s3(s3, tmp_path):
    url = s3.url("run/checkpoints/last.ckpt")
    (tmp_path / "a").write_bytes(PAYLOAD_A)
    first = storage.commit_file(tmp_path / "a", url, step=1)
    assert s3.keys("run") == sorted(["run/checkpoints/last.ckpt/latest", first.removeprefix(f"s3://{s3.bucket}/")])
    second = storage.commit_file(lambda f: f.write(PAYLOAD_B), url, step=2)  # streamed (multipart)
    assert storage.resolve(url) == second
    assert s3.keys("run") == sorted(["run/checkpoints/last.ckpt/latest", second.removeprefix(f"s3://{s3.bucket}/")])
    assert storage.download(url, tmp_path / "got.ckpt").read_bytes() == PAYLOAD_B
    assert storage.write_bytes(s3.url("run/claim"), b"1", exclusive=True)
    assert not storage.write_bytes(s3.url("run/claim"), b"2", exclusive=True)


_KILLED_UPLOAD = textwrap.dedent("""
    import os, sys, time
    from hookloop.resume import storage
    url, mode, ready = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "streaming":   # killed inside a multipart upload: a part sent, never completed
        def write(f):
            for _ in range(9):
                f.write(os.urandom(6 << 20))  # s3fs sends a part per 50 MiB block
            open(ready, "w").close()
            time.sleep(600)
        storage.commit_file(write, url, step=2)
    else:                     # killed after the payload's upload, before the marker
        tag = storage.begin(url, step=2)
        storage.write_bytes(storage.join(tag, "last.ckpt"), os.urandom(1 << 20))
        open(ready, "w").close()
        time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["streaming", "before-marker"])
def test_a_kill_during_an_upload_leaves_the_previous_commit_bit_identical(s3, tmp_path, mode):
    url = s3.url("run/last.ckpt")
    (tmp_path / "a").write_bytes(PAYLOAD_A)
    committed = storage.commit_file(tmp_path / "a", url, step=1)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_UPLOAD, url, mode, str(ready)], env=os.environ.copy())
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, "the uploading process exited before the kill"
            assert time.monotonic() < deadline, "the upload did not start within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    uploads = s3.filesystem().list_multipart_uploads(s3.bucket)
    assert len(uploads) == (1 if mode == "streaming" else 0)  # killed with a part sent, the upload unfinished
    assert storage.resolve(url) == committed
    assert storage.download(url, tmp_path / "got").read_bytes() == PAYLOAD_A
    storage.commit_file(tmp_path / "a", url, step=3)  # the next commit cleans the killed upload
    assert len([k for k in s3.keys("run") if not k.endswith("/latest")]) == 1
    assert s3.filesystem().list_multipart_uploads(s3.bucket) == []  # and aborts its unfinished upload


def _forward_after(delay: float, port: int, target: int, stop: threading.Event) -> threading.Thread:
    """After ``delay`` seconds, listen on ``port`` and forward every connection to
    ``target`` (both on 127.0.0.1): before that, a connection is refused."""
    import socket

    def pipe(a, b):
        with a, b:
            while data := a.recv(1 << 16):
                b.sendall(data)

    def serve():
        time.sleep(delay)
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(0.2)
            while not stop.is_set():
                try:
                    client, _ = server.accept()
                except OSError:
                    continue
                upstream = socket.create_connection(("127.0.0.1", target))
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_an_unreachable_store_is_retried_then_reached(s3, monkeypatch):
    """The store becomes reachable while the save retries: real refused connections first."""
    from hookloop.testing.s3 import _free_port, clear_fsspec_cache

    port, stop = _free_port(), threading.Event()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries off: hookloop's are tested
    monkeypatch.setenv(storage.RETRIES_ENV, "8")
    monkeypatch.setenv(storage.BACKOFF_ENV, "0.25")
    clear_fsspec_cache()
    thread = _forward_after(1.5, port, int(s3.endpoint.rsplit(":", 1)[1]), stop)
    try:
        url = s3.url("run/last.ckpt")
        started = time.monotonic()
        payload = storage.commit_file(lambda f: f.write(b"x" * 100), url, step=1)
        assert time.monotonic() - started >= 1.0  # it did wait for the store
        assert storage.read_bytes(payload) == b"x" * 100
    finally:
        stop.set()
        thread.join()
        clear_fsspec_cache()


@pytest.mark.slow
def test_a_store_that_stays_unreachable_is_an_error_naming_the_url(monkeypatch):
    from hookloop.testing.s3 import _free_port, clear_fsspec_cache

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv(storage.RETRIES_ENV, "3")
    monkeypatch.setenv(storage.BACKOFF_ENV, "0.05")
    clear_fsspec_cache()
    try:
        with pytest.raises(CheckpointError, match=r"cannot upload to 's3://nowhere/run/last.ckpt/step1-[0-9a-f]{12}/"
                                                  r"last.ckpt': .*\(tried 3 times\)"):
            storage.commit_file(lambda f: f.write(b"x"), "s3://nowhere/run/last.ckpt", step=1)
    finally:
        clear_fsspec_cache()


# -- the Trainer on a store ---------------------------------------------------------------

def _fit(root, epochs: int, ckpt_path=None, callbacks=None, **kw) -> tuple[hookloop.Trainer, TinyModule]:
    module = TinyModule()
    trainer = hookloop.Trainer(default_root_dir=root, max_epochs=epochs, enable_progress_bar=False, log_every_n_steps=1,
                               enable_model_summary=False, callbacks=callbacks, **kw)
    trainer.fit(module, DataLoader(tiny_data(), batch_size=16), ckpt_path=ckpt_path)
    return trainer, module


def _optimizer_state(trainer) -> dict:
    return trainer.optimizers[0].state_dict()["state"]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _same(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k


def test_a_memory_url_root_is_a_store_not_a_local_directory(tmp_path):
    """Before: Trainer(default_root_dir="memory://run") trained into ./memory:/run."""
    url = _memory_url("run")
    _fit(url, 1)
    assert not (tmp_path / "memory:").exists(), "the URL was taken for a local path"
    names = storage.listdir(storage.join(url, "logs", "version_0"))
    assert {".hookloop-run", "checkpoints", "metrics.csv", "hparams.yaml"} <= set(names)
    last = storage.join(url, "logs", "version_0", "checkpoints", "last.ckpt")
    assert storage.resolve(last).endswith("/last.ckpt") and storage.name_of(storage.parent_of(storage.resolve(last))).startswith("step6-")
    assert b"train_loss" in storage.read_bytes(storage.join(url, "logs", "version_0", "metrics.csv"))


def test_a_file_url_root_is_the_local_directory(tmp_path):
    _fit(f"file://{tmp_path / 'run'}", 1)
    assert (tmp_path / "run" / "logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "file:").exists()


def test_ckpt_path_last_on_a_store_resumes_on_a_machine_without_the_staging_copy(tmp_path, monkeypatch):
    """Train 2 epochs, lose the local staging directory (another machine), resume to 3 from
    the store's last.ckpt: the weights and optimizer state equal an uninterrupted run's."""
    url = _memory_url("run")
    _fit(url, 2)
    monkeypatch.setenv(storage.STAGING_ENV, str(tmp_path / "other-machine"))
    resumed, module = _fit(url, 3, ckpt_path="last")
    # it resumed from the store's copy (a fresh start would end at the same weights)
    assert str(resumed.state.loaded_ckpt_path).startswith(str(tmp_path / "other-machine"))
    straight, reference = _fit(str(tmp_path / "straight"), 3)
    assert resumed.global_step == straight.global_step == 18
    _same(state_of(module), state_of(reference))
    _same(_optimizer_state(resumed), _optimizer_state(straight))
    # the run directory on the store is claimed anew, as locally: version_1
    assert storage.listdir(storage.join(url, "logs")) == ["version_0", "version_1"]
    # and a URL as ckpt_path
    again, module2 = _fit(_memory_url("other"), 3, ckpt_path=storage.join(url, "logs", "version_0", "checkpoints", "last.ckpt"))
    assert again.global_step == 18
    _same(state_of(module2), state_of(reference))


def test_a_ckpt_path_url_with_nothing_committed_is_an_error():
    with pytest.raises(CheckpointError, match=r"checkpoint memory://.*/nothing.ckpt does not exist: nothing is committed"):
        _fit(_memory_url("run"), 1, ckpt_path=_memory_url("nothing.ckpt"))


def test_two_runs_with_staging_on_two_machines_claim_two_versions_on_the_store(tmp_path, monkeypatch):
    """Issue 2's protection on a store: the claim is an exclusive create there, so a second
    machine (its own staging directory) never writes into the first run's version."""
    url = _memory_url("run")
    from hookloop.resume import rundir

    claimed = []
    for machine in ("a", "b"):
        monkeypatch.setenv(storage.STAGING_ENV, str(tmp_path / machine))
        claimed.append(rundir.claim(storage.local_root(url), "job", 0, reuse=False).name)
    assert claimed == ["version_0", "version_1"]
    # a later attempt of the job takes the directory its marker names
    assert rundir.claim(storage.local_root(url), "job", 0, reuse=True).name == "version_1"


def test_top_k_pruning_and_dirpath_on_a_store(tmp_path):
    url = _memory_url("ck")
    callback = hookloop.ModelCheckpoint(dirpath=url, save_top_k=1, monitor="train_loss", save_last=True)
    trainer, _ = _fit(str(tmp_path / "root"), 3, callbacks=[callback])
    on_store = storage.listdir(url)
    best = os.path.basename(callback.best_model_path)
    assert on_store == sorted([best, "last.ckpt"]), on_store  # the pushed-out ones went from the store too
    assert storage.download(storage.join(url, best), tmp_path / "best.ckpt").read_bytes() == \
        open(callback.best_model_path, "rb").read()


def test_a_dirpath_or_save_dir_url_without_its_implementation_is_refused():
    with pytest.raises(ConfigurationError, match="pip install gcsfs"):
        hookloop.ModelCheckpoint(dirpath="gs://bucket/ck")
    with pytest.raises(ConfigurationError, match="pip install gcsfs"):
        hookloop.Trainer(default_root_dir="gs://bucket/run")
    with pytest.raises(ConfigurationError, match="pip install gcsfs"):
        hookloop.CSVLogger(save_dir="gs://bucket/logs")


def test_save_checkpoint_to_a_url_commits_it(tmp_path):
    trainer, module = _fit(str(tmp_path / "root"), 1)
    url = _memory_url("model.ckpt")
    trainer.save_checkpoint(url)
    got = storage.download(url, tmp_path / "got.ckpt")
    loaded = hookloop.resume.checkpoint.safe_load(got)
    _same(loaded["state_dict"], state_of(module))


@pytest.mark.slow
def test_fit_on_s3_async_save_resume_bit_identical(s3, tmp_path, monkeypatch):
    """The real store and client: async_save=True writes in the background and commits to
    S3; a resume from the store on another machine equals an uninterrupted run."""
    url = s3.url("run")
    callback = hookloop.ModelCheckpoint(async_save=True, every_n_train_steps=2)
    _fit(url, 2, callbacks=[callback])
    keys = s3.keys("run")
    assert "run/logs/version_0/checkpoints/last.ckpt/latest" in keys and "run/logs/version_0/metrics.csv" in keys
    assert [k for k in keys if k.startswith("run/logs/version_0/checkpoints/last.ckpt/step12-")]
    monkeypatch.setenv(storage.STAGING_ENV, str(tmp_path / "other-machine"))
    resumed, module = _fit(url, 3, ckpt_path="last", callbacks=[hookloop.ModelCheckpoint(async_save=True)])
    assert str(resumed.state.loaded_ckpt_path).startswith(str(tmp_path / "other-machine"))  # from the store
    straight, reference = _fit(str(tmp_path / "straight"), 3)
    _same(state_of(module), state_of(reference))
    _same(_optimizer_state(resumed), _optimizer_state(straight))


# -- hookloop run --max-restarts with a root on S3, a rank killed mid-upload ----------------

def _run_resume_job(out, root: str, kills: list, restarts: int, env: dict, plugin: str = "ddp",
                    options: dict | None = None, async_save: bool = False) -> subprocess.Popen:
    import json

    from hookloop.testing.conformance import ResumeConformance

    class OnS3(ResumeConformance):
        epochs = 2

    OnS3.plugin, OnS3.options = plugin, options or {}
    spec = OnS3._spec(out, kills)
    spec.write_text(json.dumps({**json.loads(spec.read_text()), "root": root, "async_save": async_save}))
    command = OnS3._command(out, spec, restarts)
    command[command.index("run") + 1:command.index("run") + 1] = ["--default-root-dir", root]  # the failure logs' root
    return subprocess.Popen(command, cwd=out, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _same_tree(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where



def test_csv_and_tensorboard_loggers_with_a_save_dir_on_a_store(tmp_path):
    """Both loggers write in the staging directory; their files reach the store whole."""
    from hookloop_tensorboard import TensorBoardLogger

    url = _memory_url("logs")
    loggers = [hookloop.CSVLogger(save_dir=url, name="csv"), TensorBoardLogger(save_dir=url, name="tb")]
    _fit(str(tmp_path / "root"), 2, logger=loggers)
    csv = storage.read_bytes(storage.join(url, "csv", "version_0", "metrics.csv"))
    assert csv == (Path(loggers[0].log_dir) / "metrics.csv").read_bytes() and b"train_loss" in csv
    events = storage.listdir(storage.join(url, "tb", "version_0"))
    local = sorted(p.name for p in Path(loggers[1].log_dir).iterdir() if p.name.startswith("events."))
    assert local and set(local) <= set(events)
    for name in local:
        assert storage.read_bytes(storage.join(url, "tb", "version_0", name)) == (Path(loggers[1].log_dir) / name).read_bytes()


def test_a_sharded_checkpoint_on_a_store_resumes_on_a_machine_without_the_staging_copy(tmp_path, monkeypatch):
    """fsdp's sharded directory (DCP) is committed to the store as a tree (its own latest
    and tag); another machine resumes from it like an uninterrupted run (issue 37, item 2)."""
    url = _memory_url("run")
    sharded = dict(plugins=["fsdp"], devices=1, plugin_options={"fsdp": {"state_dict_type": "sharded"}})
    _fit(url, 2, **sharded)
    payload = storage.resolve(storage.join(url, "logs", "version_0", "checkpoints", "last.ckpt"))
    assert storage.name_of(payload).startswith("step12-") and "latest" in storage.listdir(payload)
    monkeypatch.setenv(storage.STAGING_ENV, str(tmp_path / "other-machine"))
    resumed, module = _fit(url, 3, ckpt_path="last", **sharded)
    # it resumed from the store's copy, downloaded into this machine's (empty) staging directory
    assert str(resumed.state.loaded_ckpt_path).startswith(str(tmp_path / "other-machine"))
    assert (resumed.state.loaded_ckpt_path / "latest").is_file()
    straight, reference = _fit(str(tmp_path / "straight"), 3, **sharded)
    assert resumed.global_step == straight.global_step == 18
    from hookloop.testing.reference import local_tensor  # fsdp's parameters are DTensors

    _same({k: local_tensor(v) for k, v in state_of(module).items()},
          {k: local_tensor(v) for k, v in state_of(reference).items()})


# -- hookloop run --max-restarts with a root on S3, rank 0 killed mid-upload ----------------
# ddp's single file, and sharded checkpoints (a strategy's directory, every rank's shards)

KILLED_UPLOADS = {
    # case: (plugin, options, ModelCheckpoint(async_save=...), tier)
    "ddp": ("ddp", {}, False, pytest.mark.slow),
    "fsdp": ("fsdp", {"state_dict_type": "sharded"}, False, pytest.mark.full),  # in process in every tier
    "fsdp-async": ("fsdp", {"state_dict_type": "sharded"}, True, pytest.mark.full),
    "deepspeed_stage_2": ("deepspeed_stage_2", {}, False, pytest.mark.full),
}


@pytest.mark.parametrize("case", [pytest.param(name, marks=case[-1]) for name, case in KILLED_UPLOADS.items()])
def test_hookloop_run_restarts_from_the_remote_last_after_a_kill_mid_upload(s3, tmp_path, case):
    """2 ranks under ``hookloop run --max-restarts 1``, the root on S3: rank 0 is SIGKILLed
    half-way through the upload of step 6's checkpoint (half of ddp's file in an unfinished
    multipart upload; half of a sharded directory's files); the restarted attempt resumes
    from the committed one (step 4), and every rank's final weights, optimizer states and
    schedulers equal an uninterrupted run's, bit for bit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    env[storage.STAGING_ENV] = str(tmp_path / "staging")
    kill = {"kind": "upload", "rank": 0, "at": 6}
    jobs, logs = {}, {}
    for name, kills in (("straight", []), ("killed", [kill])):
        (tmp_path / name).mkdir()
        plugin, options, async_save, _ = KILLED_UPLOADS[case]
        jobs[name] = _run_resume_job(tmp_path / name, s3.url(name), kills, 1, env, plugin, options, async_save)
    for name, proc in jobs.items():
        try:
            logs[name] = proc.communicate(timeout=900)[0]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, f"{name} job failed:\n{logs.get(name, '')[-6000:]}"
    assert (tmp_path / "killed" / "killed.attempt0.json").exists(), logs["killed"][-4000:]
    # the restart found the committed step 4 on the store, not the half-uploaded step 6
    assert re.search(r"restart 1 of this run .*: resumed from \S+ at epoch \d+, global step 4\b", logs["killed"]), \
        logs["killed"][-4000:]
    for rank in range(2):
        straight = torch.load(tmp_path / "straight" / f"final.rank{rank}.pt", weights_only=False)
        killed = torch.load(tmp_path / "killed" / f"final.rank{rank}.pt", weights_only=False)
        assert (killed["attempt"], straight["attempt"]) == (1, 0)
        _same_tree({k: v for k, v in killed.items() if k != "attempt"},
               {k: v for k, v in straight.items() if k != "attempt"}, f"rank {rank}")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(":")]
    last = s3.url("killed", "logs", "version_0", "checkpoints", "last.ckpt")
    payload = storage.resolve(last)
    if plugin == "ddp":  # one file, committed at step 8; the killed multipart upload was aborted
        assert storage.name_of(storage.parent_of(payload)).startswith("step8-"), payload
        assert s3.filesystem().list_multipart_uploads(s3.bucket) == []
        return
    # a sharded one: last.ckpt is a tree (the strategy's latest and its tag's shards), committed at step 8
    assert storage.name_of(payload).startswith("step8-"), payload
    names = storage.listdir(payload)
    assert "latest" in names and len(names) == 2, names
    shards = [k for k in s3.keys("killed", "logs", "version_0", "checkpoints") if "/last.ckpt/" in k]
    pattern = r"__\d+_0\.distcp$" if case.startswith("fsdp") else r"zero_pp_rank_\d+_mp_rank_00_optim_states\.pt$"
    assert len([k for k in shards if re.search(pattern, k)]) >= 2, shards  # every rank's shard
    # the store's committed checkpoints are the uninterrupted run's, each its marker and one tag;
    # the killed upload (epoch=1-step=6.ckpt, which the restart saved as -v1 beside its local copy
    # and pruned) is a tag without a marker: never read
    directories = {name: storage.join(s3.url(name), "logs", "version_0", "checkpoints") for name in jobs}
    committed = {}
    for name, directory in directories.items():
        committed[name] = {c: storage.listdir(storage.join(directory, c)) for c in storage.listdir(directory)}
        committed[name] = {c: tags for c, tags in committed[name].items() if "latest" in tags}
        assert all(len(tags) == 2 for tags in committed[name].values()), committed[name]
    assert committed["killed"].keys() == committed["straight"].keys()
    assert storage.resolve(storage.join(directories["killed"], "epoch=1-step=6.ckpt")) is None
