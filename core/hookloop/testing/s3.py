"""A real S3-compatible server on 127.0.0.1 for tests: moto in server mode, in a process of
its own, reached by the real client (``s3fs``) through the AWS SDK's standard variables.

    with s3_server() as server:            # a fresh bucket, the variables set in os.environ
        Trainer(default_root_dir=server.url("run")).fit(...)

The endpoint reaches every client, in this process and in the workers it starts, the way a
user points any AWS SDK at a non-AWS store: ``AWS_ENDPOINT_URL`` (honoured by botocore,
hence by boto3, aiobotocore and s3fs) with ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
and ``AWS_DEFAULT_REGION``. Nothing is passed as ``storage_options``: a worker process,
``hookloop run`` and torchrun's children inherit the environment and find the same store.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class S3Server:
    """A running moto server: its endpoint, its bucket and the variables that reach it."""

    endpoint: str
    bucket: str
    process: subprocess.Popen
    env: dict[str, str] = field(default_factory=dict)

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts...>``."""
        return "/".join([f"s3://{self.bucket}", *(p.strip("/") for p in parts if p)])

    def filesystem(self):
        """A fresh ``s3fs.S3FileSystem`` on this server (not fsspec's cached instance)."""
        import s3fs

        return s3fs.S3FileSystem(client_kwargs={"endpoint_url": self.endpoint}, key=self.env["AWS_ACCESS_KEY_ID"],
                                 secret=self.env["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True)

    def keys(self, *parts: str) -> list[str]:
        """Every object key under ``url(*parts)``, relative to the bucket, sorted."""
        fs = self.filesystem()
        root = self.url(*parts).removeprefix("s3://")
        try:
            found = fs.find(root)
        except FileNotFoundError:
            return []
        return sorted(k.removeprefix(self.bucket + "/") for k in found)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the moto server exited with status {process.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the moto server did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def start_s3_server(bucket: str | None = None, timeout: float = 60.0) -> S3Server:
    """Start ``moto_server`` on a free port of 127.0.0.1 and create ``bucket`` (a fresh name
    when ``None``); stop it with :func:`stop_s3_server`."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1",
                                "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    server = S3Server(endpoint, bucket or f"hookloop-{uuid.uuid4().hex[:12]}", process, env)
    try:
        _wait_listening(port, process, timeout)
        server.filesystem().mkdir(server.bucket)
    except BaseException:
        stop_s3_server(server)
        raise
    return server


def stop_s3_server(server: S3Server) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@contextlib.contextmanager
def s3_server(bucket: str | None = None) -> Iterator[S3Server]:
    """A moto server with a bucket, and its variables set in ``os.environ`` for the block
    (restored after); fsspec's cached ``s3`` filesystems are dropped on entry and exit so
    no client keeps another endpoint."""
    server = start_s3_server(bucket)
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    clear_fsspec_cache()
    try:
        yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        clear_fsspec_cache()
        stop_s3_server(server)


def clear_fsspec_cache() -> None:
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
