"""The training loaders :class:`~hookloop.testing.ResumeConformance` can certify
(its ``loader`` attribute), built by the job (:mod:`hookloop.testing.resume`).

* ``"map"``: a ``DataLoader`` of a map-style dataset (hookloop's resumable batch sampler).
* ``"stateful"``: torchdata's ``StatefulDataLoader`` over a map-style dataset, built by hand.
* ``"stateful_trainer"``: the same ``DataLoader`` as ``"map"``, and
  ``Trainer(stateful_dataloader=True)`` builds the ``StatefulDataLoader`` from it.
* ``"hf_streaming"``: a Hugging Face ``datasets`` ``IterableDataset`` streamed from local
  parquet files (``load_dataset(..., streaming=True)``), split per rank with
  ``split_dataset_by_node``, in a ``StatefulDataLoader``.
* ``"litdata"``: LitData's ``StreamingDataset`` over a local "remote" directory written
  once by ``litdata.optimize``, in LitData's ``StreamingDataLoader``.
* ``"stateful_worker_rng"``: ``"stateful"`` with the augmentation drawn from the worker's
  global generator (``torch.randn`` in ``__getitem__``), which no library restores: the
  case that is *not* exact, kept to show the certificate catches it.

What the workers draw: a ``StatefulDataLoader`` restores each worker's dataset state (a
dataset with ``state_dict``/``load_state_dict``) and the loader's base seed, not the
worker's global random generators. So the stateful kinds draw their augmentation from a
generator the dataset holds and saves (:class:`StatefulAugmentedDataset`); the streaming
kinds, whose dataset objects belong to their library, draw it from a generator seeded by
the sample's index (the same noise every epoch): the narrower setting that resumes
exactly (docs/how-to/streaming-data.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hookloop.testing.reference import tiny_dataset

#: the loader kinds a certificate can run
LOADERS = ("map", "stateful", "stateful_trainer", "hf_streaming", "litdata", "stateful_worker_rng")
#: the streaming kinds' files: this many parquet files, or LitData chunks of this many items
SHARDS = 4


class StatefulAugmentedDataset(torch.utils.data.Dataset):
    """``tiny_dataset`` with Gaussian noise drawn, in the worker that reads the sample,
    from a generator the dataset holds; ``state_dict``/``load_state_dict`` save and
    restore it, so a ``StatefulDataLoader`` gives every worker its generator back."""

    def __init__(self, n: int, seed: int = 1, noise: float = 0.1, own_generator: bool = True):
        self.data, self.noise, self.own_generator = tiny_dataset(n, seed=seed), noise, own_generator
        self.generator: torch.Generator | None = None

    def __len__(self) -> int:
        return len(self.data)

    def _generator(self) -> torch.Generator:
        if self.generator is None:  # first use, in the worker: its seed (the loader's base seed + id)
            info = torch.utils.data.get_worker_info()
            self.generator = torch.Generator().manual_seed(info.seed if info is not None else 0)
        return self.generator

    def __getitem__(self, i):
        x, y, index = self.data[i]
        if self.noise:
            x = x + self.noise * torch.randn(x.shape, generator=self._generator() if self.own_generator else None)
        return x, y, index

    def state_dict(self) -> dict:
        return {"generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if state["generator"] is not None:
            self._generator().set_state(state["generator"])


def sample_noise(index: int, features: int, noise: float) -> torch.Tensor:
    """The streaming kinds' augmentation: drawn from a generator seeded by the sample."""
    if not noise:
        return torch.zeros(features)
    return noise * torch.randn(features, generator=torch.Generator().manual_seed(10_000 + int(index)))


class StreamCollate:
    """Collate of the streaming kinds: dict samples -> the job's ``(x, y, index)`` batch,
    ``x`` augmented (in the worker)."""

    def __init__(self, noise: float):
        self.noise = noise

    def __call__(self, samples: list) -> tuple:
        x = torch.stack([torch.as_tensor(s["x"], dtype=torch.float32) + sample_noise(s["index"], len(s["x"]), self.noise)
                         for s in samples])
        y = torch.tensor([int(s["y"]) for s in samples])
        index = torch.tensor([int(s["index"]) for s in samples])
        return x, y, index


def _rows(n: int, seed: int = 1) -> list[dict]:
    data = tiny_dataset(n, seed=seed)
    return [{"x": data.x[i].tolist(), "y": int(data.y[i]), "index": i} for i in range(n)]


def write_parquet(directory: Path, n: int) -> list[str]:
    """``n`` samples of ``tiny_dataset`` in :data:`SHARDS` parquet files (atomically)."""
    import datasets

    directory.mkdir(parents=True, exist_ok=True)
    rows = _rows(n)
    files = []
    for shard in range(SHARDS):
        path = directory / f"part{shard}.parquet"
        if not path.exists():
            tmp = directory / f".part{shard}.{os.getpid()}.parquet"
            datasets.Dataset.from_list(rows[shard::SHARDS]).to_parquet(str(tmp))
            os.replace(tmp, path)
        files.append(str(path))
    return files


def _litdata_item(row: dict) -> dict:
    return row


def write_litdata(directory: Path, n: int) -> str:
    """``n`` samples of ``tiny_dataset`` optimized by ``litdata.optimize`` into ``directory``
    (once: a finished directory is reused; written beside it, then renamed)."""
    import litdata

    if (directory / "index.json").exists():
        return str(directory)
    tmp = directory.with_name(f"{directory.name}.{os.getpid()}.tmp")
    litdata.optimize(fn=_litdata_item, inputs=_rows(n), output_dir=str(tmp), chunk_size=max(1, n // SHARDS // 2),
                     num_workers=1, mode="overwrite", verbose=False)
    try:
        os.replace(tmp, directory)
    except OSError:  # another rank renamed its copy first: the same bytes
        pass
    return str(directory)


def train_loader(kind: str, *, n: int, batch_size: int, rank: int, world_size: int, noise: float,
                 persistent_workers: bool, data_dir: Path) -> Any:
    """The training loader of kind ``kind`` (not ``"map"``, which the job builds itself)
    for global rank ``rank`` of ``world_size``."""
    options = dict(batch_size=batch_size, num_workers=2, persistent_workers=persistent_workers)
    if kind in ("stateful", "stateful_trainer", "stateful_worker_rng"):
        dataset = StatefulAugmentedDataset(n, noise=noise, own_generator=kind != "stateful_worker_rng")
        if kind == "stateful_trainer":
            return torch.utils.data.DataLoader(dataset, shuffle=True, **options)
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, shuffle=True, **options)
    if kind == "hf_streaming":
        import datasets
        from datasets.distributed import split_dataset_by_node
        from torchdata.stateful_dataloader import StatefulDataLoader

        files = write_parquet(data_dir / f"parquet.rank{rank}", n)
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        stream = split_dataset_by_node(stream, rank=rank, world_size=world_size)
        return StatefulDataLoader(stream, collate_fn=StreamCollate(noise), **options)
    if kind == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        remote = write_litdata(data_dir / f"litdata.rank{rank}", n)
        dataset = StreamingDataset(input_dir=remote, shuffle=True, seed=7, drop_last=True)
        return StreamingDataLoader(dataset, collate_fn=StreamCollate(noise), **options)
    raise ValueError(f"unknown loader kind {kind!r}: one of {', '.join(LOADERS)}")
