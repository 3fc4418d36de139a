"""Shared pieces for strategies built on ``torch.distributed`` (and samplers for any).

Public helpers for plugin authors; a strategy inherits what it needs instead of
writing its own copy:

* :class:`DistributedSampling`: the ``configure_sampler`` hook: each rank its share of
  the data, shuffled with the seed of ``hookloop.seed_everything`` (or the strategy's
  ``sampler_seed`` option). For any multi-process strategy (ddp, deepspeed, horovod).
* :class:`TorchCollectives`: the ``reduce``, ``barrier`` and ``broadcast`` hooks over
  ``torch.distributed`` (half-precision values reduced in float32: gloo reduces
  neither; an integer mean in float64).
* :class:`TorchDistributed`: both, plus process-group ownership: :meth:`start_process_group`
  (``hookloop.reset_seed()``, then a group unless one exists) and
  :meth:`release_owned_process_group` (only the group this plugin made).

Strategies whose collectives are not ``torch.distributed``'s (Horovod) take
:class:`DistributedSampling` only.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, IterableDataset, Sampler, SequentialSampler

from hookloop.contract.errors import ConfigurationError
from hookloop.distributed.collectives import init_process_group, release_process_group, torch_reduce_op
from hookloop.helpers import GLOBAL_SEED_ENV, distributed_sampler, global_seed, reset_seed
from hookloop.contract.hookspecs import hookimpl

__all__ = ["DistributedSampling", "RankZeroOrder", "TorchCollectives", "TorchDistributed", "check_sampler_seed",
           "data_parallel_rank"]

#: The device-mesh dimensions over which the data is split; every other dimension (tp,
#: cp, pp, a third party's) sees the same batches as its neighbours on that dimension.
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")


def data_parallel_rank(trainer) -> tuple[int, int]:
    """``(replicas, rank)`` of this process among the data-parallel replicas: what the
    distributed samplers split the data by.

    Without a device mesh (``trainer.device_mesh`` absent or ``None``) every process is
    a replica: ``(trainer.world_size, trainer.global_rank)``. With one, only its
    :data:`DATA_PARALLEL_DIMS` split the data: the processes of a tensor-parallel (or
    context/pipeline-parallel) group all get the same batches. ``(1, 0)`` when the mesh
    has no data-parallel dimension (a tp-only run)."""
    mesh = getattr(trainer, "device_mesh", None)
    if mesh is None or not getattr(mesh, "mesh_dim_names", None):
        return trainer.world_size, trainer.global_rank
    names = mesh.mesh_dim_names
    coordinate = mesh.get_coordinate()
    replicas, rank = 1, 0
    for i, name in enumerate(names):
        if name in DATA_PARALLEL_DIMS:
            size = mesh.size(i)
            replicas, rank = replicas * size, rank * size + coordinate[i]
    return replicas, rank


def check_sampler_seed(owner: str, value: Any) -> None:
    """Raise ``ConfigurationError`` unless ``value`` is a ``sampler_seed`` option: an
    integer, or ``None`` for the seed of ``hookloop.seed_everything``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigurationError(
            f"{owner} option sampler_seed={value!r}: must be an integer, or None for the seed of "
            f"hookloop.seed_everything")


class DistributedSampling:
    """``configure_sampler``: each data-parallel replica gets its share of each loader
    (:func:`hookloop.distributed_sampler`; the replicas are the processes, or those of the
    device mesh's data-parallel dimensions: :func:`data_parallel_rank`), with the samplers
    seeded by ``self.sampler_seed`` when the strategy has that option and it is set,
    else by the seed ``hookloop.seed_everything`` recorded (0 when none was), the same
    on every rank, as Lightning's samplers are.

    A world of one, ``use_distributed_sampler=False``, iterable datasets and loaders
    that already shard are left alone. With one data-parallel replica (tp, cp or the
    pipeline alone) every process gets the user's loader as it is: in order, or with its
    own sampler drawn by global rank 0 (:class:`RankZeroOrder`), the one-process order.
    """

    #: seed of the distributed samplers; ``None``: ``seed_everything``'s
    sampler_seed: int | None = None

    @hookimpl
    def configure_sampler(self, trainer, dataloader, training):
        """This rank's share of ``dataloader`` (see :class:`DistributedSampling`)."""
        if trainer.world_size == 1 or not trainer.config.use_distributed_sampler:
            return None
        replicas, rank = data_parallel_rank(trainer)
        if replicas == 1:  # one replica (tp, cp, pp alone): the user's loader, as in one process
            if isinstance(dataloader.sampler, (SequentialSampler, DistributedSampler, RankZeroOrder)) \
                    or isinstance(dataloader.dataset, IterableDataset):
                return None  # in order, the user's own split, or nothing to index
            # the user's own sampler and order, drawn by global rank 0 and sent to the others
            return RankZeroOrder(dataloader.sampler)
        if training:
            _check_seed_agrees(trainer, self.sampler_seed)
        return distributed_sampler(dataloader, replicas, rank, training, seed=self.sampler_seed)


def _check_seed_agrees(trainer: Any, chosen: int | None) -> None:
    """The training samplers' seed is the same on every rank, or the run stops naming it.

    Each rank shuffles with its own ``DistributedSampler``; ranks seeded differently draw
    different permutations, so some samples are trained on twice an epoch and others
    never: a silently different function. The seed comes from the strategy's
    ``sampler_seed`` or from ``seed_everything`` (``PL_GLOBAL_SEED``), which a launcher
    must hand every worker (docs/environment.md); a worker started without it uses 0.
    One all-reduce of two numbers per training loader and run (none per step); the
    seeds are gathered only to name them when they differ."""
    seed = chosen if chosen is not None else global_seed()
    key = seed % 2**61  # an int64 on every backend
    spread = trainer.reduce(torch.tensor([key, -key], dtype=torch.int64), "max")
    if int(spread[0]) != -int(spread[1]):
        seeds = trainer.all_gather_object(seed)
        by_seed: dict[Any, list[int]] = {}
        for rank, value in enumerate(seeds):
            by_seed.setdefault(value, []).append(rank)
        found = "; ".join(f"seed {value} on rank(s) {ranks}" for value, ranks in by_seed.items())
        raise ConfigurationError(
            f"the ranks would shuffle the training data with different seeds ({found}), so each "
            f"epoch would train some samples twice and others never. The seed is "
            f"seed_everything's ({GLOBAL_SEED_ENV} in each worker's environment): call "
            f"hookloop.seed_everything(N) in the script every worker runs (before the Trainer), "
            f"or have the launcher pass {GLOBAL_SEED_ENV} to every worker, or give the strategy "
            f"sampler_seed=N")


class RankZeroOrder(Sampler):
    """The user's sampler, unchanged, for processes that all load the same batches (one
    data-parallel replica: a tp, cp or pipeline group): at each epoch global rank 0 draws
    the epoch's indices from it, exactly as one process would (a ``RandomSampler`` seeds
    itself from torch's global generator), and broadcasts them, so every process of the
    group sees rank 0's order (one collective per epoch, none per step). Without a
    process group it is the user's sampler."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return iter(self.sampler)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        indices = torch.tensor(list(self.sampler) if dist.get_rank() == 0 else [], dtype=torch.int64)
        size = torch.tensor([indices.numel()], dtype=torch.int64, device=device)
        dist.broadcast(size, src=0)
        if dist.get_rank() != 0:
            indices = torch.empty(int(size), dtype=torch.int64)
        moved = indices.to(device) if device is not None else indices
        dist.broadcast(moved, src=0)
        return iter(moved.cpu().tolist())


class TorchCollectives:
    """``reduce``, ``barrier`` and ``broadcast`` over ``torch.distributed``'s default group.

    Each defers (returns the value unchanged, or ``None``) in a world of one or when no
    process group is initialised, so the single-process default answers.
    """

    @hookimpl
    def reduce(self, trainer, tensor, op):
        """All-reduce ``tensor`` with ``op`` on ``trainer.root_device``; ``"mean"`` is a sum
        divided by the world size (in float64 for an integer tensor). Half-precision values
        are reduced in float32 and come back in their own dtype."""
        if trainer.world_size == 1 or not dist.is_initialized():
            return tensor
        original = tensor.device
        value = tensor.detach().to(trainer.root_device).clone()
        low = value.dtype in (torch.bfloat16, torch.float16)
        if low:
            value = value.float()
        elif op == "mean" and not value.is_floating_point():
            value = value.double()
        dist.all_reduce(value, op=torch_reduce_op(op))
        if op == "mean":
            value /= trainer.world_size
        return (value.to(tensor.dtype) if low else value).to(original)

    @hookimpl
    def barrier(self, trainer):
        """``torch.distributed.barrier()`` across all ranks (on this rank's GPU under nccl)."""
        if trainer.world_size > 1 and dist.is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[trainer.root_device.index])
            else:
                dist.barrier()
        return True

    @hookimpl
    def broadcast(self, trainer, obj, src):
        """Every rank gets global rank ``src``'s ``obj`` (``broadcast_object_list``).

        ``trainer.broadcast`` hands the object in a one-element list, so a broadcast
        ``None`` comes back as ``[None]``, never mistaken for "not handled".
        """
        if trainer.world_size == 1 or not dist.is_initialized():
            return None  # the default returns obj as it is
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]


class TorchDistributed(DistributedSampling, TorchCollectives):
    """:class:`DistributedSampling` and :class:`TorchCollectives`, and the process group.

    Call :meth:`start_process_group` from ``setup_environment`` and
    :meth:`release_owned_process_group` from ``teardown``: a group the user (or a
    launcher of theirs) made is theirs, and is left alone.
    """

    _owns_process_group: bool = False

    def start_process_group(self, backend: str, rank: int, world_size: int, timeout: float | None = None,
                            init: Callable[[], None] | None = None, **kwargs: Any) -> bool:
        """Seed the generators again from ``seed_everything``'s seed
        (:func:`hookloop.reset_seed`, as Lightning's strategies do when they set up their
        process group), then initialise the default process group unless one exists:
        ``init()`` when given (a strategy's own rendezvous), else
        :func:`hookloop.init_process_group` with these arguments. Returns whether this
        plugin made the group (and so destroys it in :meth:`release_owned_process_group`)."""
        reset_seed()
        if dist.is_initialized():
            self._owns_process_group = False
        else:
            if init is not None:
                init()
            else:
                init_process_group(backend, rank, world_size, timeout=timeout, **kwargs)
            self._owns_process_group = True
        return self._owns_process_group

    def release_owned_process_group(self, destroy: Any = None) -> None:
        """Destroy the process group :meth:`start_process_group` made (nothing for one the
        user made); ``destroy``: a backend's own destroy function
        (see :func:`hookloop.release_process_group`)."""
        owned, self._owns_process_group = self._owns_process_group, False
        if owned:
            release_process_group(destroy)
