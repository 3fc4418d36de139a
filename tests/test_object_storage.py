"""Checkpoints, run directories and logs on object storage through fsspec (issue 37 item 2).

The storage layer (hookloop.resume.storage) against a real S3-compatible server (moto in
server mode on 127.0.0.1, the ``s3`` fixture) with the real client (s3fs), and against
fsspec's ``memory://``; a killed upload is a real SIGKILL of a real process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hookloop.contract.errors import CheckpointError, ConfigurationError
from hookloop.resume import storage

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
    assert s3.keys("run") == sorted([f"run/checkpoints/last.ckpt/latest", first.removeprefix(f"s3://{s3.bucket}/")])
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
