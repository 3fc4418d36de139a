"""Sharded checkpoints (a strategy's checkpoint *directory*: fsdp's DCP shards, DeepSpeed's
ZeRO shards, any third-party strategy with ``hookloop_checkpoint_format = "directory"``) on
object storage, with the same commit protocol as single files (:mod:`hookloop.resume.storage`).

The strategy writes and commits its directory in the run's local staging directory exactly
as on a local disk (every rank its shards, a barrier, rank 0 replaces the local ``latest``):
no strategy knows about stores. Then the directory's committed state (its ``latest`` and the
tag it names) goes to the store as one tree payload::

    s3://b/run/.../last.ckpt/latest                 the committed tag, written last
    s3://b/run/.../last.ckpt/<tag>/latest           the strategy's own marker
    s3://b/run/.../last.ckpt/<tag>/step42/...       its shards (every rank's)

Rank 0 chooses the tag; every machine's local rank 0 uploads the files its disk holds
(on a disk every machine shares, the later machines find them uploaded and skip them);
a barrier; rank 0 writes the store's ``latest``, then removes the previous tag. A process
killed during the uploads leaves the store's ``latest`` on the previous checkpoint.
Resuming downloads the committed tree into the staging directory, where the strategy's
own loader reads it (:func:`hookloop.resume.storage.fetch`).

docs/decisions.md, "Checkpoints on object storage", says why the strategies do not write
to the store themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hookloop.resume import storage
from hookloop.resume.checkpoint import tag_entry

#: The strategy's own marker file in its checkpoint directory (TaggedCheckpointDir's).
LATEST = "latest"


def commit_directory(trainer: Any, path: str | os.PathLike, step: int) -> str | None:
    """Commit the staged checkpoint directory ``path`` to its store (call on every rank,
    after the strategy's ``save_checkpoint`` returned). Returns the committed tag's URL, or
    ``None`` when ``path`` is not staged (a local run: nothing to do, no collective)."""
    url = storage.remote_of(path)
    if url is None:
        return None
    tag_url = trainer.broadcast(storage.begin(url, step) if trainer.is_global_zero else None, 0)
    _upload_and_publish(Path(path), tag_url, trainer.is_global_zero, trainer.local_rank == 0,
                        lambda name: trainer.barrier(f"checkpoint_store_{name}"))
    return tag_url


def commit_directory_later(trainer: Any, path: str | os.PathLike, step: int) -> Callable[[], None] | None:
    """:func:`commit_directory` for an asynchronous save: the tag is chosen and the process
    group made now (on the training thread, on every rank); the returned job uploads and
    commits in the background writer, after this rank's shard writes (its barriers run on
    a gloo group of their own, never beside training's collectives). ``None``: not staged."""
    url = storage.remote_of(path)
    if url is None:
        return None
    from hookloop.distributed.collectives import cpu_process_group

    tag_url = trainer.broadcast(storage.begin(url, step) if trainer.is_global_zero else None, 0)
    group = cpu_process_group("checkpoint.store") if trainer.world_size > 1 else None

    def barrier(_name: str) -> None:
        if group is not None:
            import torch.distributed as torch_dist

            torch_dist.barrier(group=group)

    rank_zero, uploads = trainer.is_global_zero, trainer.local_rank == 0
    return lambda: _upload_and_publish(Path(path), tag_url, rank_zero, uploads, barrier)


def _upload_and_publish(path: Path, tag_url: str, rank_zero: bool, uploads: bool,
                        barrier: Callable[[str], None]) -> None:
    barrier("written")  # every rank's shards are on its disk, and rank 0 committed them there
    if uploads:
        upload_committed(path, tag_url)
    barrier("uploaded")  # every machine's files are on the store
    if rank_zero:
        storage.publish(tag_url)  # the store's latest: the commit point
    barrier("published")


def upload_committed(path: Path, tag_url: str) -> list[str]:
    """Upload the committed state of the local checkpoint directory ``path`` (its
    ``latest`` and the tag it names) under ``tag_url``, skipping the files already there
    with the same size (another machine's upload of a shared disk). Returns the keys
    written. A directory whose ``latest`` is missing uploads nothing: this machine holds
    none of the checkpoint (its shards are on the machines that wrote them)."""
    marker = path / LATEST
    if not marker.is_file():
        return []
    tag = marker.read_text().strip()
    entry = tag_entry(path, tag)  # refuses a marker that leads out of the directory
    fs, root = storage.filesystem(tag_url)
    present = _sizes(fs, root)
    written = []
    files = [marker] + sorted(p for p in entry.rglob("*") if p.is_file())
    for file in files:
        rel = file.relative_to(path).as_posix()
        if present.get(rel) == file.stat().st_size:
            continue
        key = storage.join(root, rel)
        storage.retrying(lambda f=file, k=key: fs.put_file(str(f), k), storage.join(tag_url, rel), "upload to")
        written.append(rel)
    fs.invalidate_cache(root)
    return written


def _sizes(fs: Any, root: str) -> dict[str, int]:
    fs.invalidate_cache(root)
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    base = root.rstrip("/") + "/"
    return {key[len(base):]: int(info.get("size") or 0) for key, info in found.items() if key.startswith(base)}


def copy_committed(source: str | os.PathLike, target: str | os.PathLike, step: int) -> str | None:
    """Commit, as the staged checkpoint ``target`` (``last.ckpt``), the store's committed
    copy of the staged checkpoint ``source``: copied on the store (no upload), under a
    new tag of ``target``, then published. Rank 0 only. ``None`` when either is not staged
    or ``source`` has nothing committed."""
    source_url, target_url = storage.remote_of(source), storage.remote_of(target)
    if source_url is None or target_url is None:
        return None
    payload = storage.resolve(source_url)
    if payload is None:
        return None
    tag_url = storage.begin(target_url, step)
    fs, src = storage.filesystem(payload)
    _, dst = storage.filesystem(tag_url)
    for key in storage.retrying(lambda: fs.find(src), payload, "list"):
        rel = key[len(src.rstrip("/")) + 1:]
        storage.retrying(lambda k=key, r=rel: fs.copy(k, storage.join(dst, r)), storage.join(tag_url, rel), "copy to")
    fs.invalidate_cache(dst)
    storage.publish(tag_url)
    return tag_url
