"""Where the training loader stands, so that a mid-epoch resume yields exactly the batches
the uninterrupted run yields (docs/decisions.md, "Loader state").

Three kinds of training loader:

* a loader with ``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader``
  contract): its state is saved per rank and loaded at a mid-epoch resume; nothing is
  skipped.
* a ``DataLoader`` of a map-style dataset (the common case): fit iterates a shallow copy
  whose batch sampler is a :class:`ResumableBatchSampler`. A resume skips the done
  batches as lists of indices, so no skipped sample is read or collated; the sampler's
  draw is replayed from the generator state it started from (saved per rank), so the
  permutation is the uninterrupted run's with or without ``persistent_workers``; and with
  ``num_workers > 0`` each batch reseeds the worker that reads it (torch, ``random``,
  NumPy) from the epoch's draw and the batch's position, so what ``__getitem__`` draws
  does not depend on which worker reads the batch or on what that worker read before.
* anything else (an ``IterableDataset`` without state, a loader class with its own
  ``__iter__``): the done batches are read again and discarded, with a warning on global
  rank 0 (exact only when reading again gives the same batches).
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import itertools
import random
import sys
import warnings
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from hookloop.resume import checkpoint as ckpt

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def is_stateful(loader: Any) -> bool:
    """Whether ``loader`` keeps its own position (``state_dict``/``load_state_dict``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class _SeededBatch(list):
    """One batch's indices, with the seed the worker that reads them reseeds from."""

    def __init__(self, indices: Any, seed: int):
        super().__init__(indices)
        self.seed = seed


def _reseed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


class _SeedingGetitems:
    """The dataset's ``__getitems__`` inside a worker: reseed from the batch, then read it
    as the worker would have (the dataset's own ``__getitems__``, else one ``[i]`` each)."""

    def __init__(self, dataset: Any, own: Any):
        self.dataset, self.own = dataset, own

    def __call__(self, indices: Any) -> list:
        seed = getattr(indices, "seed", None)
        if seed is not None:
            _reseed(seed)
        if self.own is not None:
            return self.own(indices)
        dataset = self.dataset
        return [dataset[i] for i in indices]


class _WorkerInit:
    """``worker_init_fn`` of the loader fit iterates: the user's, then per-batch seeding."""

    def __init__(self, user: Any):
        self.user = user

    def __call__(self, worker_id: int) -> None:
        if self.user is not None:
            self.user(worker_id)
        info = torch.utils.data.get_worker_info()
        dataset = info.dataset
        own = getattr(dataset, "__getitems__", None) or None
        try:
            dataset.__getitems__ = _SeedingGetitems(dataset, own)
        except (AttributeError, TypeError):  # a dataset with __slots__: no per-batch seeds
            pass


class ResumableBatchSampler(Sampler):
    """The loader's own batch sampler, skippable by index and with per-batch worker seeds.

    Iterating it iterates the wrapped batch sampler lazily, so every generator draws what
    it draws without it and in the same order (after the loader's base seed). It remembers
    the RNG state from which this epoch's batches were drawn (:attr:`drawn_from`, saved in
    mid-epoch checkpoints); :meth:`resume_at` makes the next iteration replay the draw from
    such a state and start at a given batch.
    """

    def __init__(self, batch_sampler: Any, workers: int, generator: torch.Generator | None):
        self.batch_sampler = batch_sampler
        self.workers = workers
        self.generator = generator
        self.drawn_from: dict | None = None
        self.first_after_resume = False  # see iterate()
        self._skip, self._resume_from, self._generator_after = 0, None, None

    # what code that reads a batch sampler expects of one
    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def batch_size(self) -> Any:
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        return bool(getattr(self.batch_sampler, "drop_last", False))

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def resume_at(self, batch: int, drawn_from: dict | None, generator: torch.Tensor | None = None) -> None:
        """The next iteration starts at ``batch``, its order drawn from ``drawn_from``;
        the loader's own ``generator`` is left in state ``generator`` (as at the checkpoint)."""
        self._skip, self._resume_from, self._generator_after = batch, drawn_from, generator

    def _state(self) -> dict:
        state = ckpt.rng_state()
        if self.generator is not None:
            state["loader_generator"] = self.generator.get_state()
        return state

    def _set(self, state: dict) -> None:
        ckpt.set_rng_state(state)
        if self.generator is not None and "loader_generator" in state:
            self.generator.set_state(state["loader_generator"])

    def __iter__(self) -> Iterator[list]:
        # _epoch runs at the first batch, after the loader drew its base seed; then the
        # batches pass through chain (C): no Python call per batch without workers.
        return itertools.chain.from_iterable(self._epoch())

    def _epoch(self) -> Iterator[Iterator[list]]:
        skip, drawn_from = self._skip, self._resume_from
        self._skip, self._resume_from = 0, None  # _generator_after is read below
        if drawn_from is None:
            drawn_from = self._state()
            batches = iter(self.batch_sampler)
        else:
            now = self._state()
            self._set(drawn_from)
            try:
                # lazily, as the uninterrupted run: a sampler may draw again later in the
                # epoch (RandomSampler with a generator, at its end), from where it stood
                batches = iter(self.batch_sampler)
                for _ in range(skip):
                    next(batches)
            finally:
                self._set(now)
                if self.generator is not None and self._generator_after is not None:
                    self.generator.set_state(self._generator_after)
        self.drawn_from = drawn_from
        if not self.workers:
            yield batches
            return
        digest = hashlib.blake2b(digest_size=8)
        digest.update(drawn_from["torch"].numpy().tobytes())
        if "loader_generator" in drawn_from:
            digest.update(drawn_from["loader_generator"].numpy().tobytes())
        yield _seeded(batches, skip, int.from_bytes(digest.digest(), "little"))


def _seeded(batches: Iterator[list], start: int, epoch_seed: int) -> Iterator[_SeededBatch]:
    for position, indices in enumerate(batches, start):
        yield _SeededBatch(indices, (epoch_seed + (position + 1) * _GOLDEN) & _MASK63)


def resumable_loader(loader: Any) -> Any:
    """The loader ``fit`` iterates: for a plain ``DataLoader`` of a map-style dataset, a
    shallow copy with a :class:`ResumableBatchSampler` (the user's loader is untouched);
    any other loader as it is."""
    if (not isinstance(loader, DataLoader) or is_stateful(loader) or isinstance(loader.dataset, IterableDataset)
            or loader.batch_sampler is None or type(loader).__iter__ is not DataLoader.__iter__
            or type(loader)._get_iterator is not DataLoader._get_iterator):
        return loader
    if isinstance(loader.batch_sampler, ResumableBatchSampler):
        return loader
    copied = copy.copy(loader)
    object.__setattr__(copied, "_iterator", None)
    wrapped = ResumableBatchSampler(loader.batch_sampler, loader.num_workers, loader.generator)
    object.__setattr__(copied, "batch_sampler", wrapped)  # DataLoader refuses it after __init__
    if loader.num_workers:
        copied.worker_init_fn = _WorkerInit(loader.worker_init_fn)
    return copied


def release(trainer) -> None:
    """End the workers of the loader copies ``fit`` iterated (the trainer keeps the training
    one, for a checkpoint saved after ``fit``, but not its persistent workers)."""
    loaders = [trainer.state.fit_train_loader, *(trainer.state.fit_val_loaders or [])]
    trainer.state.fit_val_loaders = None
    for loader in loaders:
        if loader is None or not (isinstance(getattr(loader, "batch_sampler", None), ResumableBatchSampler)
                                  or getattr(loader, "_hookloop_built", False)):
            continue
        iterator = loader._iterator
        object.__setattr__(loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def resumed(loader: Any) -> None:
    """``fit`` restored a checkpoint: the first iteration of ``loader`` in this process
    may continue workers the uninterrupted run still had (see :func:`iterate`)."""
    if not (getattr(loader, "num_workers", 0) and getattr(loader, "persistent_workers", False)):
        return
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, ResumableBatchSampler):
        batch_sampler.first_after_resume = True
    elif is_stateful(loader) and isinstance(loader, DataLoader):
        # a StatefulDataLoader restores its workers' base seed from its state; what its
        # first iter() here draws from the global generator, the uninterrupted run's
        # persistent workers never drew
        loader._hookloop_first_after_resume = True


def iterate(loader: Any, epoch: int) -> Any:
    """``iter(loader)`` for training epoch ``epoch``. With persistent workers the
    uninterrupted run drew the loader's base seed (from the global generator) once, when
    epoch 0 started its workers; later epochs reuse them and draw none. A resumed process
    starting its workers at a later epoch therefore draws its base seed from a scratch
    generator, so the epoch's shuffle and everything after it (dropout) come from where
    the uninterrupted run's did. What the workers draw does not depend on the base seed:
    each batch reseeds the worker that reads it."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if getattr(loader, "_hookloop_first_after_resume", False):
        loader._hookloop_first_after_resume = False
    elif not getattr(batch_sampler, "first_after_resume", False):
        return started(loader, iter(loader))
    else:
        batch_sampler.first_after_resume = False
    if epoch == 0 or loader._iterator is not None:
        return started(loader, iter(loader))
    return _iter_with_scratch_base_seed(loader)


def iterate_validation(loader: Any) -> Any:
    """``iter(loader)`` for a validation inside ``fit``. A loader that :func:`resumable_loader`
    prepared for validation (``fit``'s, with workers) draws its base seed from a scratch
    generator, so each batch's worker seed is the RNG state at the validation's start (the
    same after a resume: training left it there) and the batch's position, whether its
    persistent workers are new or reused."""
    if isinstance(getattr(loader, "batch_sampler", None), ResumableBatchSampler) and loader.num_workers:
        return _iter_with_scratch_base_seed(loader)
    return iter(loader)


def started(loader: Any, iterator: Any) -> Any:
    """``iterator`` (``iter(loader)``), its base seed drawn as at this call. A loader whose
    ``__iter__`` is a generator function (LitData's ``StreamingDataLoader``) runs none of
    it at ``iter()``: the ``DataLoader`` iterator inside, which draws the workers' base
    seed from the global generator (or the loader's), starts at the first ``next()``, after
    ``fit`` has put the checkpoint's RNG state back (a resume) or given the loader its own
    generator back (a scratch base seed). That draw then shifted dropout and everything
    after it. So the first ``_get_iterator`` of this iteration draws from the RNG state and
    the generator of this call, and leaves the global generator where it found it when a
    resume moved it meanwhile (the uninterrupted run's draw is in the checkpoint's state)."""
    if (not isinstance(loader, DataLoader) or not inspect.isgenerator(iterator)
            or inspect.getgeneratorstate(iterator) != inspect.GEN_CREATED):
        return iterator
    if loader.persistent_workers and loader.num_workers and loader._iterator is not None:
        return iterator  # its workers are reused: no new iterator, no draw
    at_iter, generator = torch.get_rng_state(), loader.generator  # the base seed's: torch's CPU one

    def _get_iterator() -> Any:
        loader.__dict__.pop("_get_iterator", None)
        now, own = torch.get_rng_state(), loader.generator
        torch.set_rng_state(at_iter)
        object.__setattr__(loader, "generator", generator)
        try:
            return type(loader)._get_iterator(loader)
        finally:
            object.__setattr__(loader, "generator", own)
            if not torch.equal(now, at_iter):
                torch.set_rng_state(now)

    object.__setattr__(loader, "_get_iterator", _get_iterator)
    return iterator


def _iter_with_scratch_base_seed(loader: Any) -> Any:
    own = loader.generator
    object.__setattr__(loader, "generator", torch.Generator())
    try:
        return started(loader, iter(loader))
    finally:
        object.__setattr__(loader, "generator", own)


def _finished(state: Any) -> bool:
    """Whether a loader state (torchdata's ``StatefulDataLoader``) was taken after its
    iterator was exhausted: its next ``iter()`` starts a new epoch."""
    return isinstance(state, dict) and bool(state.get("_iterator_finished", False))


def loader_state(trainer, loader: Any) -> dict | None:
    """This rank's loader state for a mid-epoch checkpoint (``None``: nothing to save)."""
    if not trainer.batch_idx or loader is None:
        return None
    if is_stateful(loader):
        pending = trainer.state.loader_state_pending
        return {"state_dict": pending if pending is not None else loader.state_dict()}
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, ResumableBatchSampler) and batch_sampler.drawn_from is not None:
        state = {"drawn_from": batch_sampler.drawn_from}
        if batch_sampler.generator is not None:  # a loader's own generator: where it is now
            state["generator"] = batch_sampler.generator.get_state()
        return state
    return None


def start_epoch(trainer, loader: Any, skip: int, iterating: bool = True) -> bool:
    """Prepare ``loader`` for this epoch's iteration, resuming at batch ``skip``; whether
    the done batches still have to be read and discarded (the fallback). ``iterating=False``:
    the epoch had no batch left; only a stateful loader's state is loaded (the next epoch
    continues from it)."""
    trainer.state.loader_state_pending = None
    state = trainer.state.loader_resume_state
    trainer.state.loader_resume_state = None
    if not skip:
        return False
    if is_stateful(loader) and state is not None and "state_dict" in state:
        loader.load_state_dict(state["state_dict"])
        if not iterating and not _finished(state["state_dict"]) and not _next_iter_starts_next_epoch(loader):
            # The state is at its epoch's end, its iterator not yet exhausted (all batches
            # yielded, no StopIteration yet): the next iter() yields the (empty) rest of
            # that epoch (torchdata's StatefulDataLoader), so read it here, and the next
            # epoch starts where the uninterrupted run's did. Its base seed comes from a
            # scratch generator: the state restores the workers' own. A state whose
            # iterator is exhausted (``_iterator_finished``) is not read here: torchdata's
            # next iter() of it starts the next epoch (a fresh pass of the sampler, the
            # workers' restored datasets), as the uninterrupted run's next iter() does;
            # reading it here would read a whole extra epoch (the workers' generators and a
            # stateful sampler advanced by one epoch: not exact). Nor is a LitData loader's:
            # its next iter() starts the next epoch itself.
            for _ in (_iter_with_scratch_base_seed(loader) if isinstance(loader, DataLoader) else loader):
                pass
        return False
    if not iterating:
        return False
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, ResumableBatchSampler):
        # without a saved draw (older checkpoints): the epoch's start, exact for loaders
        # that drew no base seed before it (persistent_workers=False)
        drawn_from = state.get("drawn_from") if state else None
        batch_sampler.resume_at(skip, drawn_from if drawn_from is not None else trainer.state.epoch_rng,
                                state.get("generator") if state else None)
        return False
    if trainer.global_rank == 0:  # once: only the resumed epoch starts with a skip
        kind = "an IterableDataset" if isinstance(getattr(loader, "dataset", None), IterableDataset) else "a loader"
        warnings.warn(
            f"resuming mid-epoch (batch {skip}) with {kind} that has no state_dict()/load_state_dict(): hookloop "
            f"reads the {skip} done batches again and discards them, which is exact only if reading the loader "
            f"again yields the same batches (a stream, a dataset that draws its own randomness or shards by worker "
            f"cannot resume exactly). Give the loader state_dict()/load_state_dict() (torchdata's "
            f"StatefulDataLoader) to resume exactly", stacklevel=2)
    return True


def _next_iter_starts_next_epoch(loader: Any) -> bool:
    """Whether ``loader``, given a state taken after its epoch's last batch, starts the next
    epoch at its next ``iter()`` (LitData's ``StreamingDataLoader``: reading an "empty rest"
    there would read, and lose, the whole next epoch) rather than yield that epoch's empty
    rest first (torchdata's ``StatefulDataLoader``)."""
    return type(loader).__module__.split(".")[0] == "litdata"


def stateful_loader(loader: Any) -> Any:
    """``Trainer(stateful_dataloader=True)``: the training ``DataLoader`` rebuilt as
    torchdata's ``StatefulDataLoader`` (Accelerate's ``use_stateful_dataloader``), every
    setting kept; a loader that keeps its own state is returned as it is. A plain
    ``RandomSampler`` (``shuffle=True`` on one process) becomes the ``StatefulDataLoader``'s
    own, whose generator state is saved; a sampler hookloop gave the loader
    (``DistributedSampler``, seeded and set per epoch) is kept."""
    if loader is None or is_stateful(loader):
        return loader
    from hookloop.contract.errors import ConfigurationError
    from hookloop.helpers import rebuild_dataloader

    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as error:
        raise ConfigurationError(
            f"Trainer(stateful_dataloader=True) builds torchdata's StatefulDataLoader, and torchdata cannot be "
            f"imported ({error}): pip install torchdata, or pass stateful_dataloader=False") from None
    if not isinstance(loader, DataLoader):
        raise ConfigurationError(
            f"Trainer(stateful_dataloader=True) rebuilds a torch DataLoader, got a {type(loader).__name__}: pass a "
            f"DataLoader, or build the StatefulDataLoader yourself and pass stateful_dataloader=False")
    sampler = loader.sampler
    if isinstance(loader.dataset, IterableDataset):
        built = rebuild_dataloader(loader, None, cls=StatefulDataLoader)
    elif (type(sampler) is torch.utils.data.RandomSampler and not sampler.replacement
            and sampler._num_samples is None and sampler.generator in (None, loader.generator)):
        built = rebuild_dataloader(loader, None, cls=StatefulDataLoader, shuffle=True)  # loader.generator kept
    elif type(sampler) is torch.utils.data.SequentialSampler:
        built = rebuild_dataloader(loader, None, cls=StatefulDataLoader, shuffle=False)
    else:
        built = rebuild_dataloader(loader, sampler, cls=StatefulDataLoader)
    built._hookloop_built = True  # its persistent workers end with fit (release)
    return built


def check_rank_split(trainer, loader: Any) -> None:
    """Under several data-parallel processes, a training ``IterableDataset`` is not split by
    hookloop (no sampler can index it): each rank must read its own share, or every rank
    trains on the same samples. Hugging Face ``datasets`` and LitData datasets say which
    rank they read for: a split that is missing or is another rank's is an error, raised
    on every rank (the ranks compare their findings, once, at start). Any other
    ``IterableDataset`` may split itself (``get_worker_info`` and the rank in its
    ``__iter__``), which hookloop cannot see: a warning on global rank 0, once
    (docs/how-to/streaming-data.md)."""
    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, IterableDataset):
        return
    from hookloop.distributed.strategy import data_parallel_rank

    replicas, rank = data_parallel_rank(trainer)
    if replicas == 1:
        return
    problem, known = _split_problem(dataset, rank, replicas)
    if known:
        import torch.distributed as dist

        problems = [problem]
        if dist.is_available() and dist.is_initialized():
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
        found = next((p for p in problems if p is not None), None)
        if found is not None:
            from hookloop.contract.errors import ConfigurationError

            raise ConfigurationError(found)
        return
    if trainer.global_rank == 0:
        warnings.warn(
            f"the training loader's {type(dataset).__name__} is an IterableDataset and runs on {replicas} "
            f"data-parallel processes: hookloop cannot split it by rank (no sampler can index it), so unless its "
            f"__iter__ reads only this rank's share, every rank trains on the same samples. Split it by rank: "
            f"datasets.distributed.split_dataset_by_node for Hugging Face datasets (LitData's StreamingDataset "
            f"splits itself), or (replicas, rank) = hookloop.data_parallel_rank(trainer) with "
            f"torch.utils.data.get_worker_info() in __iter__ (docs/how-to/streaming-data.md)", stacklevel=2)


def _split_problem(dataset: Any, rank: int, replicas: int) -> tuple[str | None, bool]:
    """(what is wrong with ``dataset``'s rank split, or None; whether its library says)."""
    name = type(dataset).__name__
    library = type(dataset).__module__.split(".")[0]
    if library == "datasets" and hasattr(dataset, "_distributed"):
        split = dataset._distributed
        if split is None:
            return (f"the training loader's datasets.{name} is not split by rank: each of the {replicas} "
                    f"data-parallel processes would read the same samples. Split it with "
                    f"datasets.distributed.split_dataset_by_node(dataset, rank=rank, world_size={replicas}), "
                    f"(replicas, rank) = hookloop.data_parallel_rank(trainer)"), True
        if (split.rank, split.world_size) != (rank, replicas):
            return (f"the training loader's datasets.{name} on data-parallel rank {rank} of {replicas} is split for "
                    f"rank {split.rank} of {split.world_size}: split it with split_dataset_by_node(dataset, "
                    f"rank=rank, world_size={replicas}), (replicas, rank) = hookloop.data_parallel_rank(trainer)"), True
        return None, True
    env = getattr(dataset, "distributed_env", None)
    if library == "litdata" and env is not None:
        if (env.global_rank, env.world_size) != (rank, replicas):
            return (f"the training loader's litdata.{name} on data-parallel rank {rank} of {replicas} reads for rank "
                    f"{env.global_rank} of {env.world_size}: LitData reads the rank when the dataset is built (from "
                    f"torch.distributed, else the WORLD_SIZE and GLOBAL_RANK variables), so build it once the "
                    f"processes are up: in train_dataloader() or a DataModule's setup()"), True
        return None, True
    return None, False
