"""Reading ``torch.distributed.checkpoint`` (DCP) directories without running their code.

DCP's ``FileSystemReader`` unpickles a directory's ``.metadata`` with plain
``pickle.load``, and its planner reads each non-tensor entry with
``torch.load(weights_only=False)``: either can run code planted in a shared checkpoint.
:class:`SafeFileSystemReader` unpickles the metadata with an allow-list of DCP's own
metadata classes (Python's "restricting globals" unpickler; torch's weights-only
unpickler does not read the pickle protocol 4 that DCP writes), and the callers here
load inside :func:`hookloop.weights_only_loads`, which makes the entries' ``torch.load``
weights-only. Tensor entries DCP already reads with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

import hookloop

# What the .metadata of torch 2.13's DCP references: the metadata's own dataclasses (plain
# fields), torch.Size, the memory-format enum, the layout looked up by name, and the path
# the checkpoint was saved to. torch dtypes (torch.float32, ...) are accepted besides.
_METADATA_GLOBALS = frozenset({
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size",
    "torch.serialization._get_layout",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
})


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals above (and torch dtypes); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {full} is not part of DCP's metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds no persistent references")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled through an allow-list: a
    metadata file holding any other object raises :class:`hookloop.CheckpointError`
    naming it, before anything in it runs."""

    #: The refusal of a metadata file: DCP turns read_metadata's exception into the text of
    #: another one (and tries the per-rank metadata), so the callers below raise this.
    refusal: hookloop.CheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The directory's metadata, unpickled without running code; see the class."""
        if self.refusal is not None:  # no falling back to another metadata file
            raise self.refusal
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except pickle.UnpicklingError as exc:
                what = str(exc).removeprefix("GLOBAL ").removesuffix(" is not part of DCP's metadata")
                self.refusal = hookloop.unsafe_checkpoint_error(self.path, what, [str(path)])
                raise self.refusal from exc
        if not isinstance(metadata, Metadata):
            raise hookloop.CheckpointError(
                f"{str(path)!r} is not DCP metadata (it holds a {type(metadata).__name__}): the directory "
                f"is not a torch.distributed.checkpoint checkpoint")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load(state_dict: dict, directory, source) -> None:
    """``torch.distributed.checkpoint.load`` of ``directory`` into ``state_dict``
    (in place), refusing pickled objects: :class:`SafeFileSystemReader` for the
    metadata, :func:`hookloop.weights_only_loads` (naming ``source``) for the entries."""
    import torch.distributed.checkpoint as dcp

    reader = SafeFileSystemReader(str(directory))
    with hookloop.weights_only_loads(source), _raising_refusal(reader):
        dcp.load(state_dict, storage_reader=reader)


def to_torch_save(directory, output, source) -> None:
    """``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, written atomically and refusing pickled
    objects as :func:`load` does: the same private loader and planner it uses (torch
    2.13), with :class:`SafeFileSystemReader` for its ``FileSystemReader``."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    reader = SafeFileSystemReader(str(directory))
    with hookloop.weights_only_loads(source), _raising_refusal(reader):
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    hookloop.atomic_save(state, output)  # a temporary file, fsync, rename; with a checksum


@contextlib.contextmanager
def _raising_refusal(reader: SafeFileSystemReader) -> Iterator[None]:
    """Whatever DCP raised, a refused metadata file is the error."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if reader.refusal is not None:
            raise reader.refusal from exc
        raise
