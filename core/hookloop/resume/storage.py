"""Checkpoints, run directories and logs on object storage, through fsspec.

A path with a scheme (``s3://bucket/run``, ``gs://``, ``az://``, ``memory://``...) is a
*URL*: it names a place in a store that fsspec reaches, never a local directory. A plain
path and a ``file://`` URL are local paths (:func:`local_path`). fsspec is imported only
when a URL is used: a user without URLs does not need it.

The commit protocol (docs/decisions.md, "Checkpoints on object storage"). An object store
cannot rename, so a checkpoint at the URL ``DIR/NAME`` (``s3://b/run/checkpoints/last.ckpt``)
is a *directory* of tags there, as DeepSpeed's and :class:`~hookloop.resume.checkpoint.
TaggedCheckpointDir`'s are::

    DIR/NAME/latest            the committed tag's name (one line), written last
    DIR/NAME/<tag>/NAME        the payload of the single-file form (commit_file)
    DIR/NAME/<tag>/...         the payload of the tree form (begin, upload, publish)

A save uploads its payload under a new tag (:func:`new_tag`: the step and a random suffix,
never reused), then writes ``latest`` (a small object: a PUT is atomic, a reader sees the
old marker or the new one), then deletes every other tag. A reader follows ``latest`` only
(:func:`resolve`): a tag without the marker (an upload that was killed) is never read, and
the next commit deletes it; the previous commit stays until the marker names the new one.

Every call to the store is retried on a transient error (a lost connection, a timeout, a
5xx answer, throttling) :data:`RETRIES_ENV` times with exponential backoff; the last error
is raised as a :class:`~hookloop.contract.errors.CheckpointError` naming the URL.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from hookloop.contract.errors import CheckpointError, ConfigurationError

#: The marker of a checkpoint directory on a store: the committed tag's name.
LATEST = "latest"
#: How many times a call to the store is tried on a transient error (default 6).
RETRIES_ENV = "HOOKLOOP_STORAGE_RETRIES"
#: The first wait between two tries, in seconds (doubled each time; default 0.5).
BACKOFF_ENV = "HOOKLOOP_STORAGE_BACKOFF"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_TAG = re.compile(r"^(?:step(\d+)-)?[0-9a-f]{12}$")
_T = TypeVar("_T")


# --------------------------------------------------------------------------- URLs

def scheme_of(path: str | os.PathLike) -> str | None:
    """The scheme of ``path`` (``"s3"`` for ``s3://b/k``), or ``None`` for a plain path."""
    if not isinstance(path, str):
        return None
    m = _SCHEME.match(path)
    return m.group(1).lower() if m else None


def is_url(path: Any) -> bool:
    """Whether ``path`` names a place in a store that fsspec reaches (a string with a scheme
    other than ``file``), rather than a local path."""
    return scheme_of(path) not in (None, "file", "local")


def local_path(path: str | os.PathLike) -> Path:
    """``path`` as a local :class:`~pathlib.Path`: a plain path as it is, ``file:///x`` as
    ``/x``. A URL of a store is refused (``ConfigurationError``): it is never a local path."""
    if is_url(path):
        raise ConfigurationError(f"{path!r} is a URL of a store, not a local path")
    if isinstance(path, str) and scheme_of(path) in ("file", "local"):
        return Path(_SCHEME.sub("", path, count=1) or "/")
    return Path(path)


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended, ``/``-separated (a URL has no ``os.sep``)."""
    return posixpath.join(url.rstrip("/"), *(p.strip("/") for p in parts if p))


def name_of(url: str) -> str:
    """The last part of ``url`` (``last.ckpt`` of ``s3://b/run/last.ckpt``)."""
    return posixpath.basename(url.rstrip("/"))


def parent_of(url: str) -> str:
    """``url`` without its last part."""
    return posixpath.dirname(url.rstrip("/"))


def filesystem(url: str, **storage_options: Any) -> tuple[Any, str]:
    """The fsspec filesystem that serves ``url`` and the path of ``url`` in it.

    A scheme whose implementation is not installed, or that no fsspec implementation
    registers, is a ``ConfigurationError`` naming the package to install (fsspec's own
    ``known_implementations`` say which: ``s3://`` needs ``s3fs``, ``gs://`` ``gcsfs``,
    ``az://`` and ``abfs://`` ``adlfs``...). Options the filesystem takes (an endpoint, a
    profile) come from ``storage_options``, else from fsspec's configuration and the
    environment (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``...: docs/how-to/object-storage.md).
    """
    scheme = scheme_of(url) or "file"
    try:
        import fsspec
        from fsspec.registry import known_implementations, registry
    except ImportError as exc:
        raise ConfigurationError(
            f"{url!r} is a URL, and hookloop reaches stores through fsspec, which is not installed: "
            f"pip install fsspec (and the package of the {scheme}:// store, e.g. s3fs for s3://)") from exc
    if scheme not in registry and scheme not in known_implementations:
        raise ConfigurationError(
            f"{url!r}: no fsspec implementation registers the scheme {scheme!r}; hookloop takes a local path or "
            f"the URL of a store fsspec knows (s3://, gs://, az://, memory://, file://...): install the package "
            f"that provides {scheme}:// or fix the URL")
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ConfigurationError(f"{url!r} needs {_package_of(scheme, str(exc))}") from exc
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    return fs, path


def _package_of(scheme: str, why: str) -> str:
    """The advice for a scheme whose implementation does not import: the package, from
    the dotted class name fsspec registers (``s3fs.S3FileSystem`` -> ``pip install s3fs``),
    and fsspec's own text (``Install s3fs to access S3``)."""
    from fsspec.registry import known_implementations

    known = known_implementations.get(scheme, {})
    module = str(known.get("class", "")).split(".")[0]
    package = {"gcsfs": "gcsfs", "adlfs": "adlfs", "s3fs": "s3fs"}.get(module, module.replace("_", "-"))
    text = known.get("err") or why
    return (f"the fsspec implementation of {scheme}://, which is not installed ({text}): pip install {package}"
            if package else f"the fsspec implementation of {scheme}://, which does not import ({why})")


# --------------------------------------------------------------------------- retries

_TRANSIENT_NAMES = ("EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
                    "ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "ClientOSError",
                    "IncompleteReadError", "ResponseStreamingError")
_TRANSIENT_TEXT = ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttl",
                   "TooManyRequests", "503", "500 ", "502", "504", "Connection reset", "Broken pipe")
_TRANSIENT_ERRNO = {errno.EIO, errno.EAGAIN, errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE,
                    errno.ECONNABORTED, errno.EBUSY}


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth another try: a lost or refused connection, a timeout, a 5xx
    answer or throttling. A missing key, a refused permission or a failed precondition
    is not."""
    if isinstance(exc, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
                        NotADirectoryError, ValueError, TypeError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & set(_TRANSIENT_NAMES):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNO:
        return True
    text = str(exc)
    if any(t in text for t in _TRANSIENT_TEXT):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def retrying(call: Callable[[], _T], url: str, what: str, tries: int | None = None,
             backoff: float | None = None) -> _T:
    """``call()``, tried again after a transient error (:func:`is_transient`) up to
    ``tries`` times in all (:data:`RETRIES_ENV`), waiting ``backoff`` seconds, then twice as
    long each time (:data:`BACKOFF_ENV`). The last error, or the first that is not
    transient, is raised as a ``CheckpointError`` that names ``what`` and ``url`` (a
    ``FileNotFoundError`` is raised as it is: callers ask about missing keys)."""
    tries = tries if tries is not None else max(1, int(os.environ.get(RETRIES_ENV, "6")))
    wait = backoff if backoff is not None else float(os.environ.get(BACKOFF_ENV, "0.5"))
    for attempt in range(1, tries + 1):
        try:
            return call()
        except FileNotFoundError:
            raise
        except Exception as exc:
            if attempt < tries and is_transient(exc):
                time.sleep(wait * 2 ** (attempt - 1))
                continue
            tried = f" (tried {attempt} times)" if attempt > 1 else ""
            raise CheckpointError(f"cannot {what} {url!r}: {type(exc).__name__}: {exc}{tried}") from exc
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------- plain objects

def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return retrying(lambda: fs.exists(path), url, "look up")


def read_bytes(url: str) -> bytes | None:
    """The object at ``url``, or ``None`` when there is none."""
    fs, path = filesystem(url)
    try:
        return retrying(lambda: fs.cat_file(path), url, "read")
    except (FileNotFoundError, IsADirectoryError):
        return None


def write_bytes(url: str, data: bytes, exclusive: bool = False) -> bool:
    """Put ``data`` at ``url`` (one PUT: readers see the old object or the new one). With
    ``exclusive``, only if no object is there yet (S3's ``If-None-Match: *``, fsspec's
    ``mode="create"``; an implementation without it is asked first, which two writers
    racing can both pass): returns ``False`` when one is."""
    fs, path = filesystem(url)

    def put() -> None:
        if not exclusive:
            fs.pipe_file(path, data)
            return
        try:
            fs.pipe_file(path, data, mode="create")
        except TypeError:  # an implementation without exclusive writes: look, then write
            if fs.exists(path):
                raise FileExistsError(path) from None
            fs.pipe_file(path, data)
    try:
        retrying(put, url, "write")
    except CheckpointError as exc:
        if exclusive and isinstance(exc.__cause__, FileExistsError):
            return False
        raise
    fs.invalidate_cache(fs._parent(path))
    return True


def listdir(url: str) -> list[str]:
    """The names directly under ``url`` (objects and prefixes), or ``[]``."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    try:
        entries = retrying(lambda: fs.ls(path, detail=False), url, "list")
    except FileNotFoundError:
        return []
    base = path.rstrip("/")
    return sorted({posixpath.basename(e.rstrip("/")) for e in entries if e.rstrip("/") != base})


def remove(url: str) -> None:
    """Remove ``url`` and everything under it (nothing when there is nothing). For a
    checkpoint directory, its ``latest`` goes first: a reader never follows it into a
    half-deleted tag."""
    fs, path = filesystem(url)
    marker = join(path, LATEST)
    for target in (marker, path):
        try:
            retrying(lambda t=target: fs.rm(t, recursive=True), url, "remove")
        except FileNotFoundError:
            pass
    fs.invalidate_cache(path)


def upload(local: str | os.PathLike, url: str) -> None:
    """Copy the local file or directory ``local`` to ``url`` (a plain upload, no protocol:
    for logs; checkpoints go through :func:`commit_file`/:func:`commit_tree`)."""
    fs, path = filesystem(url)
    local = Path(local)
    if local.is_dir():
        for file in sorted(p for p in local.rglob("*") if p.is_file()):
            rel = file.relative_to(local).as_posix()
            target = join(path, rel)
            retrying(lambda f=file, t=target: fs.put_file(str(f), t), join(url, rel), "upload to")
    else:
        retrying(lambda: fs.put_file(str(local), path), url, "upload to")
    fs.invalidate_cache(path)


# --------------------------------------------------------------------------- the commit protocol

def new_tag(step: int | None = None) -> str:
    """A tag no save has had: ``step<step>-<12 hex digits>`` (the step for a reader's eye;
    the random part makes two saves at one step, or a restart's, distinct)."""
    suffix = uuid.uuid4().hex[:12]
    return f"step{int(step)}-{suffix}" if step is not None else suffix


def committed_tag(url: str) -> str | None:
    """The tag the checkpoint directory ``url``'s ``latest`` names, or ``None`` (nothing
    committed yet). A marker that does not name a tag of this protocol (a path, anything
    but ``step<N>-<hex>``) is refused: a resume never follows it out of the directory."""
    data = read_bytes(join(url, LATEST))
    if data is None:
        return None
    tag = data.decode("utf-8", "replace").strip()
    if not _TAG.match(tag):
        raise CheckpointError(
            f"checkpoint {url!r}: its '{LATEST}' names {tag!r}, which is not a tag hookloop writes "
            f"(step<N>-<12 hex digits>): the checkpoint was altered or written by other code. Pass the checkpoint "
            f"you mean as ckpt_path, or remove {join(url, LATEST)!r} to start over")
    return tag


def begin(url: str, step: int | None = None) -> str:
    """Start a save into the checkpoint directory ``url``: returns the new tag's URL
    (``url/<tag>``), under which the payload goes (every writer of a tree puts its own
    files there); :func:`publish` commits it. Nothing is read until then."""
    return join(url, new_tag(step))


def publish(tag_url: str) -> None:
    """Commit the payload uploaded under ``tag_url`` (from :func:`begin`): write its
    directory's ``latest`` (the commit point), then delete every other tag there (the
    previous commit, and uploads a kill left without a marker). Call it once, after every
    writer's upload finished (a barrier, for a tree written by several ranks)."""
    url, tag = parent_of(tag_url), name_of(tag_url)
    if not _TAG.match(tag):
        raise ValueError(f"{tag_url!r} is not a tag URL from begin()")
    if not listdir(tag_url):
        raise CheckpointError(f"cannot commit {tag_url!r}: nothing was uploaded under it")
    write_bytes(join(url, LATEST), (tag + "\n").encode())
    prune(url)


def prune(url: str) -> list[str]:
    """Delete every tag of the checkpoint directory ``url`` but the committed one (and
    anything else under it but ``latest``): the previous commit and killed uploads.
    Returns the names removed. Without a committed tag, nothing is removed."""
    keep = committed_tag(url)
    if keep is None:
        return []
    removed = [n for n in listdir(url) if n not in (keep, LATEST)]
    fs, path = filesystem(url)
    for name in removed:
        try:
            retrying(lambda n=name: fs.rm(join(path, n), recursive=True), join(url, name), "remove")
        except FileNotFoundError:
            pass
    _abort_uploads(fs, path, keep)
    fs.invalidate_cache(path)
    return removed


def _abort_uploads(fs: Any, path: str, keep: str) -> None:
    """Abort the unfinished multipart uploads under the checkpoint directory ``path`` (an
    S3 store keeps, and bills, the parts of an upload its writer was killed in until they
    are aborted); other stores have none."""
    if not hasattr(fs, "list_multipart_uploads") or not hasattr(fs, "abort_mpu"):
        return
    bucket, _, prefix = path.partition("/")
    for upload in retrying(lambda: fs.list_multipart_uploads(bucket), path, "list the uploads of"):
        key = upload.get("Key", "")
        if key.startswith(prefix.rstrip("/") + "/") and not key.startswith(join(prefix, keep) + "/"):
            try:
                retrying(lambda u=upload: fs.abort_mpu(bucket, u["Key"], u["UploadId"]), path, "abort an upload to")
            except (FileNotFoundError, CheckpointError):
                pass  # finished or aborted meanwhile: nothing left to bill


def commit_file(source: str | os.PathLike | Callable[[IO[bytes]], Any], url: str, step: int | None = None) -> str:
    """Commit one file as the checkpoint ``url``: ``source`` is a local file, or a function
    that writes the payload into the binary file object it is given (streamed to the
    store, a multipart upload that is not an object until it completes). The payload goes
    to ``url/<tag>/<name of url>``, then :func:`publish`. Returns the payload's URL."""
    tag_url = begin(url, step)
    payload = join(tag_url, name_of(url))
    fs, path = filesystem(payload)
    if callable(source):
        def stream() -> None:
            with fs.open(path, "wb") as f:
                source(f)
        retrying(stream, payload, "upload to")
    else:
        retrying(lambda: fs.put_file(str(source), path), payload, "upload to")
    fs.invalidate_cache(fs._parent(path))
    publish(tag_url)
    return payload


def commit_tree(source: str | os.PathLike, url: str, step: int | None = None) -> str:
    """Commit the local directory ``source`` (every file under it) as the checkpoint
    ``url``: uploaded under ``url/<tag>/``, then :func:`publish`. Returns the tag's URL.
    Several writers use :func:`begin`, their own uploads, then one :func:`publish`."""
    tag_url = begin(url, step)
    upload(source, tag_url)
    publish(tag_url)
    return tag_url


def resolve(url: str) -> str | None:
    """The committed payload of the checkpoint directory ``url``: the file's URL for the
    single-file form (``url/<tag>/<name>``), the tag's URL for a tree; ``None`` when
    nothing is committed there. Uploads without a marker are never returned."""
    tag = committed_tag(url)
    if tag is None:
        return None
    tag_url = join(url, tag)
    names = listdir(tag_url)
    if not names:
        raise CheckpointError(
            f"checkpoint {url!r}: its '{LATEST}' names the tag {tag!r}, which holds nothing (removed by hand or by "
            f"other code). Resume from an earlier checkpoint")
    fs, path = filesystem(join(tag_url, name_of(url)))
    if names == [name_of(url)] and retrying(lambda: fs.isfile(path), url, "look up"):
        return join(tag_url, name_of(url))
    return tag_url


def download(url: str, local: str | os.PathLike) -> Path | None:
    """Copy the committed payload of the checkpoint directory ``url`` (:func:`resolve`) to
    the local path ``local`` (a file, or a directory for a tree), written beside it and
    renamed into place; ``None`` when nothing is committed there. Returns ``local``."""
    payload = resolve(url)
    if payload is None:
        return None
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    fs, path = filesystem(payload)
    tmp = Path(tempfile.mkdtemp(prefix=f".{local.name}.download-", dir=local.parent))
    try:
        if name_of(payload) == name_of(url):  # the single-file form (a tag never has the checkpoint's name)
            retrying(lambda: fs.get_file(path, str(tmp / "payload")), payload, "download")
            os.replace(tmp / "payload", local)
        else:
            for key in retrying(lambda: fs.find(path), payload, "list"):
                rel = posixpath.relpath(key, path)
                target = tmp / "tree" / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                retrying(lambda k=key, t=target: fs.get_file(k, str(t)), join(payload, rel), "download")
            if local.exists():
                shutil.rmtree(local)
            os.replace(tmp / "tree", local)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return local


# --------------------------------------------------------------------------- local staging

#: Where hookloop keeps the local copies of the run directories whose root is a URL.
STAGING_ENV = "HOOKLOOP_STAGING_DIR"
#: what :func:`push_logs` uploaded: local file -> (size, mtime_ns)
_PUSHED: dict[Path, tuple[int, int]] = {}


def staging_root() -> Path:
    """The folder of the local staging directories: :data:`STAGING_ENV`, else
    ``~/.cache/hookloop/staging``."""
    return Path(os.environ.get(STAGING_ENV) or Path.home() / ".cache" / "hookloop" / "staging").expanduser().absolute()


def local_root(path: str | os.PathLike) -> Path:
    """The local directory hookloop works in for ``path``: a local path (``file://`` too)
    as it is; for the URL of a store, its staging directory, ``<staging root>/<scheme>/<the
    URL's path>``: the same in every process of the job on this machine, and
    :func:`remote_of` maps it back to the URL (no registry: a worker process that only
    inherited the environment finds the same). Hookloop writes there with every local
    protection, then commits checkpoints to the store (:func:`sync_file`) and uploads logs
    (:func:`push_logs`). A scheme without an installed implementation is refused here."""
    if not is_url(path):
        return local_path(path)
    url = str(path).rstrip("/")
    filesystem(url)  # the scheme is served: an error naming the package otherwise
    scheme, rest = url.split("://", 1)
    parts = [p for p in rest.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ConfigurationError(f"{url!r}: give a URL with a path (a bucket at least), without '.' or '..' in it")
    return staging_root().joinpath(scheme.lower(), *parts)


def remote_of(path: str | os.PathLike) -> str | None:
    """The URL a local path under the staging root stands for (:func:`local_root`), or
    ``None`` for any other path (the user's own)."""
    if isinstance(path, str) and is_url(path):
        return path.rstrip("/")
    local, root = Path(os.path.abspath(path)), staging_root()
    if root not in local.parents:
        return None
    scheme, *parts = local.relative_to(root).parts
    return f"{scheme}://{'/'.join(parts)}" if parts else None


def sync_file(local: str | os.PathLike, step: int | None = None) -> str | None:
    """Commit the checkpoint file ``local`` to the store when it is staged (:func:`commit_file`:
    a new tag, ``step`` in its name, then its ``latest``); returns the committed payload's
    URL, ``None`` for a path that is not staged."""
    url = remote_of(local)
    if url is None:
        return None
    return commit_file(local, url, step=step)


def unsync(local: str | os.PathLike) -> None:
    """Remove the store's copy of the staged checkpoint ``local`` (top-k pruning)."""
    url = remote_of(local)
    if url is not None:
        remove(url)


def committed_remote(local: str | os.PathLike) -> str | None:
    """The committed payload (:func:`resolve`) of the staged checkpoint ``local``, or
    ``None`` (not staged, or nothing committed)."""
    url = remote_of(local)
    return None if url is None else resolve(url)


def fetch(local: str | os.PathLike) -> bool:
    """Replace the staged checkpoint ``local`` with the store's committed copy (the store is
    the truth: another machine may have written it). Returns whether one was downloaded
    (``False`` for a path that is not staged, or nothing committed there)."""
    url = remote_of(local)
    return url is not None and download(url, local) is not None


def exists_remote(local: str | os.PathLike) -> bool:
    """Whether the store holds a committed checkpoint for the staged path ``local``."""
    url = remote_of(local)
    return url is not None and exists(join(url, LATEST))


def committed_at(url: str) -> float | None:
    """When the checkpoint directory ``url`` was last committed (its ``latest``'s time on
    the store, seconds since the epoch), or ``None`` (nothing committed)."""
    fs, path = filesystem(url)
    marker = join(path, LATEST)
    try:
        info = retrying(lambda: fs.info(marker), url, "look up")
    except FileNotFoundError:
        return None
    stamp = info.get("LastModified") or info.get("mtime") or info.get("created")
    if hasattr(stamp, "timestamp"):
        return float(stamp.timestamp())
    return float(stamp) if stamp is not None else 0.0


def push_logs(directories: list[str | os.PathLike]) -> list[str]:
    """Upload the files of the staged ``directories`` (a run's, its loggers') that changed
    since the last push, except checkpoints (committed by their own protocol), temporary
    files and the run markers: the logs (``metrics.csv``, ``hparams.yaml``, event files)
    reach the store at each checkpoint and at the end of a run, whole (an object store
    cannot append). Returns the URLs written."""
    written = []
    for directory in {Path(os.path.abspath(d)) for d in directories if d is not None}:
        if remote_of(directory) is None or not directory.is_dir():
            continue
        for file in sorted(directory.rglob("*")):
            rel = file.relative_to(directory).parts
            if (not file.is_file() or any(p.endswith(".ckpt") or p.startswith(".") for p in rel)
                    or "checkpoints" in rel[:-1]):
                continue
            stat = file.stat()
            key = (stat.st_size, stat.st_mtime_ns)
            if _PUSHED.get(file) == key:
                continue
            url = remote_of(file)
            assert url is not None
            upload(file, url)
            _PUSHED[file] = key
            written.append(url)
    return written
