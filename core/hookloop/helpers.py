"""Public helpers for plugin authors: what more than one plugin needs lives here.

Everything in this module is part of the documented API (``hookloop.<name>``); plugins
call these instead of copying them.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import random
import weakref
import warnings
from typing import Any, Iterator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

# The distributed helpers moved to hookloop.dist (env_int to hookloop.utilities); they stay
# importable from here, where plugins found them first.
from hookloop.distributed.collectives import (  # noqa: F401
    DEFAULT_TIMEOUTS,
    REDUCE_OPS,
    cpu_process_group,
    default_process_group_timeout,
    init_process_group,
    release_process_group,
    torch_reduce_op,
)
from hookloop.engine.settings import MAX_PROCESS_GROUP_TIMEOUT, check_timeout_seconds  # noqa: F401 (strategies' timeout option)
from hookloop.contract.errors import ConfigurationError
from hookloop.contract.pluginspec import plugin_name
from hookloop.distributed.ranks import env_int  # noqa: F401

# ---------------------------------------------------------------------------------------
# Devices and batches
# ---------------------------------------------------------------------------------------


def apply_to_tensors(obj: Any, fn) -> Any:
    """``fn(tensor)`` for every tensor in a (nested) batch of tuples, namedtuples, lists
    and dicts; returns the same structure with the results. Other leaves are kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(apply_to_tensors(o, fn) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(apply_to_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, apply_to_tensors(v, fn)) for k, v in obj.items())
    return obj


def move_to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch of tuples, lists and dicts to ``device``."""
    return apply_to_tensors(obj, lambda t: t.to(device, non_blocking=True))


def batch_size_of(batch: Any) -> int:
    """Length of the first tensor found in ``batch`` (1 if there is none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, (list, tuple)):
        for item in batch:
            return batch_size_of(item)
    if isinstance(batch, dict):
        for item in batch.values():
            return batch_size_of(item)
    return 1


def gather_per_rank(trainer: Any, obj: Any) -> list:
    """Every rank's ``obj`` (state this rank holds on its own: RNG, loader position), its
    tensors moved to the CPU, as a list in global-rank order, for a checkpoint that one
    rank writes. A collective: call it on every rank (inside ``checkpoint_dict``)."""
    return trainer.all_gather_object(apply_to_tensors(obj, lambda t: t.detach().cpu()))


def own_entry(per_rank: Any, trainer: Any) -> Any:
    """This global rank's entry of a list :func:`gather_per_rank` made; ``None`` when there
    is none, or when the checkpoint was written by another number of processes."""
    if not isinstance(per_rank, (list, tuple)) or len(per_rank) != trainer.world_size:
        return None
    return per_rank[trainer.global_rank]


#: where :func:`seed_everything` records its seed, for the processes it starts and for
#: :func:`distributed_sampler` (Lightning's name: a seed set by Lightning's own
#: ``seed_everything`` counts too)
GLOBAL_SEED_ENV = "PL_GLOBAL_SEED"


def seed_everything(seed: int | None = None, verbose: bool = True) -> int:
    """Seed Python's, NumPy's (if installed) and torch's generators, and record ``seed`` in
    the environment (``PL_GLOBAL_SEED``, as Lightning does) for the distributed samplers
    (:func:`distributed_sampler`) of this process and of the processes it starts.

    Without a seed, as Lightning's: the one ``PL_GLOBAL_SEED`` holds, else 0 (warned,
    unless ``verbose=False``). Returns the seed set."""
    if seed is None:
        recorded = os.environ.get(GLOBAL_SEED_ENV)
        if recorded is None:
            seed = 0
            if verbose:
                warnings.warn(f"No seed found, seed set to {seed}", stacklevel=2)
        else:
            try:
                seed = int(recorded)
            except ValueError:
                raise ValueError(f"Invalid seed specified via {GLOBAL_SEED_ENV}: {recorded!r} (an integer, "
                                 f"or unset it and pass seed_everything(seed))") from None
    seed = int(seed)
    os.environ[GLOBAL_SEED_ENV] = str(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    return seed


def reset_seed() -> None:
    """Seed the generators again with the seed :func:`seed_everything` recorded
    (``PL_GLOBAL_SEED``); nothing when none was. Strategies that start a process group call
    it in ``setup_environment``, as Lightning's DDP, FSDP and DeepSpeed strategies do when
    they set up their process group, so what a run draws after that point (a dataset made
    in ``train_dataloader()``, dropout) is Lightning's."""
    seed = os.environ.get(GLOBAL_SEED_ENV)
    if seed is not None:
        seed_everything(int(seed))


def local_rank_device(trainer: Any, local_rank: int) -> torch.device:
    """The device of the process with ``local_rank`` on its machine, for ``setup_environment``.

    The CPU unless the run is on CUDA (``accelerator`` "cuda"/"gpu", or "auto" on a
    machine with CUDA). On CUDA: ``cuda:<local_rank>`` when a devices plugin chose the
    GPUs (it publishes them as ``CUDA_VISIBLE_DEVICES``, numbered from 0), else the
    ``local_rank``-th entry of a ``devices=[...]`` list, else ``cuda:<local_rank>``.
    Raises ``ConfigurationError`` when that GPU does not exist.
    """
    accelerator = trainer.config.accelerator
    cuda = torch.cuda.is_available()
    if accelerator in ("cuda", "gpu") and not cuda:
        raise ConfigurationError(
            f"accelerator={accelerator!r} but this machine has no CUDA GPU (torch "
            f"{torch.__version__}): run on CPU with accelerator='cpu'"
        )
    if not (accelerator in ("cuda", "gpu") or (accelerator == "auto" and cuda)):
        return torch.device("cpu")
    devices = trainer.config.devices
    if getattr(trainer, "device_ids", None):
        index = local_rank
    elif isinstance(devices, (list, tuple)):
        index = devices[local_rank]
    else:
        index = local_rank
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigurationError(
            f"local rank {local_rank} needs cuda:{index} but this machine has {count} "
            f"GPU(s): start at most {count} processes per machine"
        )
    return torch.device("cuda", index)


# ---------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def clip_gradients(trainer: Any, optimizer: torch.optim.Optimizer, value: float | None = None,
                   algorithm: str | None = None) -> None:
    """Clip the gradients of ``optimizer``'s parameters as the trainer is configured.

    ``gradient_clip_algorithm="norm"`` clips the total 2-norm to ``gradient_clip_val``;
    ``"value"`` clamps each element (``value``/``algorithm`` given: those instead).
    Does nothing when the value is None or 0. The clipping itself is the
    ``clip_gradients`` hook's (a sharded strategy computes the norm over all shards);
    its default is :func:`clip_parameters`. Precision plugins unscale gradients first.
    """
    if algorithm is None:
        if value is None:
            value = trainer.gradient_clip_val
        if not value:
            return  # the per-step path without clipping: no config read, no hook call
        algorithm = trainer.config.gradient_clip_algorithm
    elif not value:
        return
    trainer.hook.clip_gradients(trainer=trainer, optimizer=optimizer, clip_val=value, algorithm=algorithm)


def clip_order(optimizer: torch.optim.Optimizer, module: torch.nn.Module | None = None) -> list[torch.Tensor]:
    """``optimizer``'s parameters in ``module``'s order (``module.parameters()``, each once),
    then any the module does not hold, in the optimizer's order.

    A hand-written loop clips ``clip_grad_norm_(model.parameters(), max_norm)``: torch
    stacks the per-tensor norms in that order, and the total's rounding depends on it. An
    optimizer with two groups (nanoGPT's decay / no decay) holds the same tensors in
    another order, so clipping over its groups is a rounding away from the user's loop.
    Without ``module``: the optimizer's order. The order is cached per optimizer and
    worked out again when the tensors it holds change."""
    held = optimizer_parameters(optimizer)
    if module is None:
        return held
    key = tuple(map(id, held))
    cached = _CLIP_ORDER.get(optimizer)
    if cached is not None and cached[0] == key and cached[1] == id(module):
        return cached[2]
    ids = set(key)
    ordered = [p for p in module.parameters() if id(p) in ids]
    placed = {id(p) for p in ordered}
    ordered += [p for p in held if id(p) not in placed]
    try:  # the module's id, not the module: it refers to the trainer, which holds the optimizer
        _CLIP_ORDER[optimizer] = (key, id(module), ordered)
    except TypeError:  # an optimizer-like object without weak references: no cache
        pass
    return ordered


_CLIP_ORDER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def clip_parameters(optimizer: torch.optim.Optimizer, clip_val: float, algorithm: str,
                    module: torch.nn.Module | None = None) -> None:
    """``torch.nn.utils.clip_grad_norm_(params, clip_val)`` (``algorithm="norm"``) or
    ``clip_grad_value_(params, clip_val)`` (``"value"``), with torch's defaults, over
    ``optimizer``'s parameters in ``module``'s order (:func:`clip_order`): the default
    ``clip_gradients`` hook, bit for bit what a hand-written loop's
    ``clip_grad_norm_(model.parameters(), clip_val)`` computes."""
    params = clip_order(optimizer, module)
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, clip_val)
    elif _grad_meshes(params) > 1:
        clip_norm_across_meshes(params, clip_val)
    else:
        torch.nn.utils.clip_grad_norm_(params, clip_val)


def _grad_meshes(params: list) -> int:
    """How many device meshes the gradients of ``params`` live on (plain tensors: one)."""
    meshes: list = []
    for p in params:
        mesh = getattr(p.grad, "device_mesh", None) if p.grad is not None else None
        if not any(mesh is m for m in meshes):
            meshes.append(mesh)
    return len(meshes)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)``: the coefficient torch's
    ``clip_grad_norm_`` multiplies the gradients by (``_clip_grads_with_norm_``), as a
    tensor of ``total_norm``'s dtype (float32 gradients: a float32 division, not Python's
    float64). A strategy that computes the total norm itself scales by this, so that its
    coefficient is the one unsharded clipping computes from the same norm."""
    return torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)


def clip_norm_across_meshes(params: list, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``clip_grad_norm_`` for gradients that are DTensors on several device meshes (fsdp x
    tp: a split layer's on ``(dp_shard, tp)``, a replicated one's on ``dp_shard``), where
    torch's own stacks the per-tensor norms and DTensor refuses operands of two meshes.
    The norm of each mesh's group is computed (DTensor reduces it over that mesh), the
    groups' norms are combined, and every gradient is scaled by torch's coefficient
    (:func:`clip_coefficient`, a tensor: no host read). Returns the total norm."""
    groups: list[tuple[Any, list]] = []
    for p in params:
        if p.grad is None:
            continue
        mesh = getattr(p.grad, "device_mesh", None)
        for key, grads in groups:
            if key is mesh:
                grads.append(p.grad)
                break
        else:
            groups.append((mesh, [p.grad]))
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for _, grads in groups:
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coefficient = clip_coefficient(total, max_norm)
    with torch.no_grad():
        for _, grads in groups:
            # The local shards, scaled in place: the coefficient is the same on every rank.
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            torch._foreach_mul_(local, coefficient.to(local[0].device))
    return total


def repoint_lr_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Make ``scheduler`` drive ``optimizer``, a replacement of the one it was built on.

    Strategies that replace or wrap the user's optimizer (Horovod's
    ``DistributedOptimizer``, DeepSpeed's offload optimizer) call this so the schedule
    keeps changing the learning rate that is actually used. PyTorch's schedulers also
    mark ``optimizer.step`` to warn when they step first; the mark is carried over.
    """
    if scheduler is None:
        return
    scheduler.optimizer = optimizer
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    @functools.wraps(step)
    def counted_step(*args, **kwargs):
        optimizer._opt_called = True  # what PyTorch's own mark records
        return step(*args, **kwargs)

    counted_step._wrapped_by_lr_sched = True
    optimizer.step = counted_step


# ---------------------------------------------------------------------------------------
# Samplers and loaders
# ---------------------------------------------------------------------------------------


_MISSING = object()


class DistributedSamplerWrapper(Sampler):
    """Give each rank its share of the indices that a user's own sampler draws.

    The user's sampler (``WeightedRandomSampler``, a custom one) is iterated once per
    epoch on every rank with the same seed (``seed + epoch``), and rank ``r`` takes
    positions ``r, r + world, r + 2*world, ...``, padded by wrapping around so every rank
    gets the same count, as ``DistributedSampler`` does. The user's sampler is never
    replaced: its weighting and its order survive.
    """

    def __init__(self, sampler: Sampler, num_replicas: int, rank: int, seed: int = 0):
        self.sampler = sampler
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.num_samples = math.ceil(len(sampler) / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = self._draw(self.seed + self.epoch)
        if len(indices) < self.total_size:
            indices += (indices * math.ceil(self.total_size / max(len(indices), 1)))[
                : self.total_size - len(indices)
            ]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def _draw(self, seed: int) -> list[int]:
        """One epoch of the user's sampler drawn with ``seed``, the same on every rank.

        Nobody else's random stream moves: reseeding the user's generator, or calling
        ``torch.manual_seed`` (which also reseeds every CUDA generator), would change
        what the rest of the user's program draws.
        """
        sampler = self.sampler
        generator = getattr(sampler, "generator", _MISSING)
        if generator is None or isinstance(generator, torch.Generator):
            device = generator.device if generator is not None else "cpu"
            sampler.generator = torch.Generator(device=device).manual_seed(seed)
            try:
                return list(sampler)
            finally:
                sampler.generator = generator
        # A sampler that draws from torch's global CPU generator: seed only that one,
        # on a fork whose state is put back afterwards.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return list(sampler)


def global_seed() -> int:
    """The seed :func:`seed_everything` recorded (``PL_GLOBAL_SEED``); 0 when none was."""
    value = os.environ.get(GLOBAL_SEED_ENV, "").strip()
    if not value:
        return 0
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(
            f"{GLOBAL_SEED_ENV}={value!r} in the environment is not an integer: it is the seed of the "
            f"distributed samplers; set it with hookloop.seed_everything(<int>) or unset it"
        ) from None


class OrderedSampler(SequentialSampler):
    """A ``SequentialSampler`` whose order sharding keeps: ``overfit_batches`` replaces a
    training loader's sampler by one, and its ``DistributedSampler`` does not shuffle
    (Lightning: ``shuffle and not overfit_batches``)."""


def distributed_sampler(
    dataloader: DataLoader, num_replicas: int, rank: int, training: bool, seed: int | None = None
) -> Sampler | None:
    """The sampler that gives rank ``rank`` of ``num_replicas`` its share of a loader.

    * loaders of an ``IterableDataset``: ``None`` (the dataset shards itself; hookloop
      cannot index it).
    * the default samplers: a ``DistributedSampler``. As in Lightning, a training loader
      is always shuffled (seeded, ``set_epoch`` each epoch), even an unshuffled one, except
      under ``overfit_batches`` (its :class:`OrderedSampler`). Validation, test and
      predict loaders are never shuffled (Lightning shuffles those that shuffle; their
      means do not depend on the order).
    * a user's own sampler: wrapped in :class:`DistributedSamplerWrapper`.

    ``seed`` (the same on every rank) defaults to the one :func:`seed_everything` set
    (:func:`global_seed`, 0 when none was), as Lightning's samplers do; a strategy passes
    its own only when its user chose one. Strategies return this from ``configure_sampler``.
    """
    if isinstance(dataloader.dataset, IterableDataset):
        return None
    sampler = dataloader.sampler
    if isinstance(sampler, (DistributedSampler, DistributedSamplerWrapper)):
        return None
    if seed is None:
        seed = global_seed()
    if isinstance(sampler, (RandomSampler, SequentialSampler)):
        return DistributedSampler(
            dataloader.dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=training and not isinstance(sampler, OrderedSampler),
            seed=seed,
            drop_last=False,
        )
    return DistributedSamplerWrapper(sampler, num_replicas, rank, seed=seed)


def rebuild_dataloader(dataloader: DataLoader, sampler: Sampler | None, *, cls: type | None = None,
                       shuffle: bool | None = None) -> DataLoader:
    """A copy of ``dataloader`` that draws from ``sampler``, every other setting kept.

    The copy is built with the loader's own class (a ``DataLoader`` subclass keeps its
    behaviour; ``cls`` another one, e.g. torchdata's ``StatefulDataLoader``) from every
    argument of that class's ``__init__`` that the loader holds under the same attribute
    name, so arguments that a newer torch adds are kept too. Only ``sampler``,
    ``batch_sampler`` and ``shuffle`` are replaced (``sampler=None, shuffle=True``: the
    class's own shuffling sampler). Raises
    ``ConfigurationError`` when a required argument of a subclass is not stored as an
    attribute of that name, and ``TypeError`` for a custom ``batch_sampler``.
    """
    batch_sampler = dataloader.batch_sampler
    # a loader class's own batch sampler (torchdata's stateful one) was built from batch_size
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler and dataloader.batch_size is None:
        raise TypeError(
            f"the loader uses a custom batch_sampler ({type(batch_sampler).__name__}), "
            f"which hookloop cannot shard: give each rank its share inside it and pass "
            f"use_distributed_sampler=False"
        )
    cls = cls or type(dataloader)
    replaced = {"sampler": sampler, "batch_sampler": None, "shuffle": shuffle}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for param in _init_parameters(cls):
        if param.name in replaced:
            kwargs[param.name] = replaced[param.name]
            continue
        if hasattr(dataloader, param.name):
            value = getattr(dataloader, param.name)
        elif param.default is inspect.Parameter.empty:
            raise _unrebuildable(
                cls,
                f"its required argument {param.name!r} is not stored as self.{param.name}",
                f"store it as self.{param.name} in __init__",
            )
        else:
            continue  # not stored: the default it was built with, as far as we can tell
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[param.name] = value
    if "sampler" not in kwargs:
        raise _unrebuildable(
            cls,
            "its __init__ takes no sampler argument",
            "accept sampler (or **kwargs passed on to DataLoader) in __init__",
        )
    return cls(*args, **kwargs)


def _init_parameters(cls: type) -> list[inspect.Parameter]:
    """The named parameters that ``cls(...)`` accepts, in order, without ``self``.

    A subclass that takes ``**kwargs`` passes them up: the parameters of the classes
    above it are added, up to ``DataLoader``'s own.
    """
    params: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        signature = inspect.signature(klass.__init__)
        for param in list(signature.parameters.values())[1:]:
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name in params:
                continue
            # Parameters of a base class are reached through **kwargs: by keyword only.
            if klass is not cls and param.kind is param.POSITIONAL_ONLY:
                continue
            params[param.name] = param
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        if klass is DataLoader or not takes_kwargs:
            break
    return list(params.values())


def _unrebuildable(cls: type, problem: str, fix: str) -> Exception:
    return ConfigurationError(
        f"hookloop cannot rebuild the {cls.__name__} loader with this rank's sampler: "
        f"{problem}. Fix: {fix}, or pass use_distributed_sampler=False and give each rank "
        f"its share yourself"
    )


def run_hparams(trainer, flat: bool = False) -> dict:
    """What the loggers record as a run's hyperparameters: ``{"trainer": {...}, "module":
    {...}}``, the Trainer's settings (plugins by name) and the module's
    ``save_hyperparameters()``, as plain values (numbers, strings, lists, dicts; anything
    else by its ``repr``) that YAML, JSON, TensorBoard and MLflow all take. ``flat=True``
    joins nested keys with ``/`` (``{"trainer/max_epochs": 2, "module/lr": 0.1}``), the
    form of TensorBoard's and MLflow's parameters."""
    import dataclasses

    # Not dataclasses.asdict: it deep-copies, and plugin objects need not be copyable.
    settings = {f.name: getattr(trainer.config, f.name) for f in dataclasses.fields(trainer.config)
                if f.name != "plugins"}
    settings["plugins"] = [plugin_name(p) for p in trainer.plugins]
    hparams = dict(getattr(trainer.module, "hparams", None) or {})
    tree = {"trainer": _plain(settings), "module": _plain(hparams)}
    return _flatten(tree) if flat else tree


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _plain(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)
