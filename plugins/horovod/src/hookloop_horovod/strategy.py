"""The ``horovod`` strategy: workers started by ``horovodrun``, gradients averaged by Horovod.

Each worker trains the unwrapped model on its share of the data. Horovod's
``DistributedOptimizer`` all-reduces every gradient as soon as backward produces it
(once per ``accumulate_grad_batches`` micro-batches) and averages it before the step.
Rank 0's parameters, buffers and optimizer settings are broadcast at the start, so every
rank starts from the same state. The learning rate is multiplied by the number of
workers, as Horovod (and Lightning's Horovod strategy) does to compensate for the larger
global batch; ``scale_lr=False`` turns that off.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

import hookloop

from .backend import build_status, import_horovod
from .launcher import HOSTS_ENV, Horovodrun

COMPRESSIONS = ("none", "fp16")


class Horovod(hookloop.DistributedSampling):
    """Data-parallel training with Horovod over Gloo (CPU) or its GPU operations.

    Options (``Trainer(plugin_options={"horovod": {...}})`` or ``hookloop.plugin("horovod",
    ...)``):

    ``scale_lr`` (``True``)
        multiply every parameter group's learning rate, and the schedulers' base rates, by
        the number of workers. ``False`` keeps the rate of ``configure_optimizers``.
    ``compression`` (``"none"``)
        ``"fp16"`` sends gradients as float16 (half the traffic, float16 rounding).
    ``hosts`` (``None``)
        horovodrun's ``-H``, e.g. ``"host1:4,host2:4"``, to start workers on several
        machines; a host without ``:N`` runs ``devices`` workers. Default: ``devices``
        workers on ``localhost`` (or ``$HOOKLOOP_HOROVOD_HOSTS``).
    ``launcher_args`` (``None``)
        extra horovodrun arguments, a list or a string, e.g.
        ``"--network-interface eth0 --start-timeout 120"``.
    ``gradient_predivide_factor`` (``1.0``)
        Horovod's split of the averaging before and after the sum (fp16 overflow control).
    ``sampler_seed`` (``None``)
        seed of the distributed samplers (the same on every rank); ``None``: the seed
        ``hookloop.seed_everything`` set, as ddp's.

    The samplers are :class:`hookloop.DistributedSampling`'s (shared with every strategy);
    the collectives are Horovod's own.
    """

    hookloop_name = "horovod"
    #: owns the model/optimizer lifecycle (hvd.init, its optimizer) alone: no mesh plugin beside it
    hookloop_composes = False
    hookloop_role = "strategy"
    #: variables that change the run, said in its first lines (docs/environment.md)
    hookloop_environment = {HOSTS_ENV: "the hosts horovodrun starts the workers on"}
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    # `hookloop plugins` shows "not built: ..." until Horovod's PyTorch extension is built.
    hookloop_build_status = staticmethod(build_status)

    def __init__(
        self,
        scale_lr: bool = True,
        compression: str = "none",
        hosts: str | None = None,
        launcher_args: list[str] | str | None = None,
        gradient_predivide_factor: float = 1.0,
        sampler_seed: int | None = None,
    ):
        self.scale_lr = scale_lr
        self.compression = compression
        self.hosts = hosts
        self.launcher_args = launcher_args
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sampler_seed = sampler_seed
        self.check_options()
        self._hvd: Any = None
        self._optimizers: list = []  # this run's DistributedOptimizers
        self._names = itertools.count()

    def check_options(self) -> None:
        """Raise ``ConfigurationError`` for an option that cannot work.

        Called again at launch and in each worker, because ``plugin_options`` are set on
        the plugin after it is created.
        """
        if not isinstance(self.scale_lr, bool):
            raise hookloop.ConfigurationError(f"horovod scale_lr={self.scale_lr!r} must be True or False")
        if self.compression not in COMPRESSIONS:
            raise hookloop.ConfigurationError(
                f"horovod compression={self.compression!r} must be one of {', '.join(map(repr, COMPRESSIONS))}"
            )
        if self.hosts is not None and not isinstance(self.hosts, str):
            raise hookloop.ConfigurationError(
                f"horovod hosts={self.hosts!r} must be a string like 'host1:4,host2:4'"
            )
        if self.launcher_args is not None and not isinstance(self.launcher_args, (str, list, tuple)):
            raise hookloop.ConfigurationError(
                f"horovod launcher_args={self.launcher_args!r} must be a list of strings or a string"
            )
        factor = self.gradient_predivide_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise hookloop.ConfigurationError(
                f"horovod gradient_predivide_factor={factor!r} must be a positive number"
            )
        hookloop.check_sampler_seed("horovod", self.sampler_seed)

    # -- launching: the horovodrun launcher (launcher.py) --------------------------------

    @property
    def hookloop_launcher(self) -> Horovodrun:
        """``horovodrun`` with this strategy's ``hosts`` and ``launcher_args``, unless the
        run names another launcher."""
        return Horovodrun(hosts=self.hosts, launcher_args=self.launcher_args, check=self.check_options)

    # -- environment --------------------------------------------------------------------

    @hookloop.hookimpl
    def setup_environment(self, trainer):
        """``hvd.init()``; ranks from Horovod; this rank's device (CPU, or its local GPU).

        First the generators are seeded again from ``seed_everything``'s seed
        (:func:`hookloop.reset_seed`), as ddp and deepspeed do when they start their
        process group, so what a run draws from here on is the same under every strategy.
        """
        self.check_options()
        hookloop.reset_seed()
        hvd = import_horovod()
        hvd.init()
        self._hvd = hvd
        size = hvd.size()
        asked = trainer.config.num_processes() * trainer.config.nodes
        hosts_given = self.hosts is not None or bool(os.environ.get(HOSTS_ENV))
        # With hosts, their slots decide the count; with devices=1, horovodrun's -np does.
        if asked > 1 and size != asked and not hosts_given:
            raise hookloop.ConfigurationError(
                f"devices={trainer.config.devices!r} x nodes={trainer.config.nodes} asks for "
                f"{asked} processes, but Horovod started {size}: make horovodrun's -np match, "
                f"or leave devices at 1 and let horovodrun decide"
            )
        if "OMP_NUM_THREADS" not in os.environ:
            # torchrun sets OMP_NUM_THREADS=1 for its workers and horovodrun sets nothing:
            # N workers with all cores each (plus Horovod's background thread) oversubscribe
            # the machine. Share the cores instead; OMP_NUM_THREADS overrides.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
        device = hookloop.local_rank_device(trainer, hvd.local_rank())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        trainer.world_size, trainer.global_rank = size, hvd.rank()
        trainer.local_rank, trainer.node_rank = hvd.local_rank(), hvd.cross_rank()
        trainer.root_device = device
        return True

    @hookloop.hookimpl
    def teardown(self):
        """Retire this run's ``DistributedOptimizer``; Horovod itself stays initialised.

        Horovod shuts itself down at exit, and ``hvd.init()`` after ``hvd.shutdown()`` is
        not reliable, so a script that calls ``fit`` and then ``validate`` keeps one
        Horovod session. The optimizer's gradient hooks stay on the parameters (Horovod
        gives no way to remove them): they are told never to all-reduce again, so a
        second ``fit`` of the same module is not disturbed by the first one's optimizer.
        """
        optimizers, self._optimizers = self._optimizers, []
        for optimizer in optimizers:
            for p in getattr(optimizer, "_allreduce_delay", {}):
                optimizer._allreduce_delay[p] = float("inf")
        # No barrier here: teardown also runs after an exception on one rank, and a
        # barrier the other ranks never reach would hang the job instead of ending it.

    # -- model, optimizer and data ------------------------------------------------------

    @hookloop.hookimpl
    def wrap_model(self, trainer, model):
        """Move ``model`` to this rank's device and give it rank 0's parameters and buffers.

        The model is not wrapped: Horovod works on the optimizer, so the loop calls the
        user's ``training_step`` directly.
        """
        model = model.to(trainer.root_device)
        self._hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model

    @hookloop.hookimpl
    def wrap_optimizer(self, trainer, model, optimizer):
        """Scale the learning rate, broadcast rank 0's optimizer state, and return
        ``hvd.DistributedOptimizer`` (averaging, ``backward_passes_per_step`` =
        ``accumulate_grad_batches``, optional fp16 compression). Called once per
        optimizer (several under manual optimization)."""
        hvd = self._hvd
        schedulers = hookloop.schedulers_of(trainer, optimizer)
        if self.scale_lr:
            scale_learning_rate(optimizer, schedulers, trainer.world_size)
        broadcast_optimizer_state(hvd, optimizer)
        names = {id(p): n for n, p in model.named_parameters()}
        # Horovod names each gradient's all-reduce; every optimizer parameter needs one.
        named = [
            (names.get(id(p), f"hookloop.unnamed.{g}.{i}"), p)
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        ]
        compression = hvd.Compression.fp16 if self.compression == "fp16" else hvd.Compression.none
        distributed = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=named,
            compression=compression,
            backward_passes_per_step=trainer.accumulate_grad_batches,
            op=hvd.Average,
            gradient_predivide_factor=float(self.gradient_predivide_factor),
        )
        for scheduler in schedulers:
            hookloop.repoint_lr_scheduler(scheduler, distributed)
        self._optimizers.append(distributed)
        return distributed

    # -- the step -----------------------------------------------------------------------

    @hookloop.hookimpl(wrapper=True)
    def optimizer_step(self, optimizer):
        """Average the gradients first, then let the step run without a second all-reduce.

        A wrapper around whoever steps (the default: clip, step; hookloop-amp: unscale,
        clip, step through the GradScaler, update), so that all of them see the averaged
        gradients: clipping the local ones would clip each rank differently, and a
        GradScaler that checked local gradients for inf/nan could skip the step on one
        rank and take it on another. This is Horovod's documented
        ``synchronize()`` / ``skip_synchronize()`` pattern.
        """
        if not any(optimizer is o for o in self._optimizers):
            return (yield)
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            return (yield)

    @hookloop.hookimpl
    def zero_grad(self, optimizer):
        """``optimizer.zero_grad()``: Horovod's takes no ``set_to_none`` (it sets to None)."""
        if not any(optimizer is o for o in self._optimizers):
            return None
        optimizer.zero_grad()
        return True

    # -- collectives --------------------------------------------------------------------

    @hookloop.hookimpl
    def reduce(self, tensor, op):
        """``hvd.allreduce`` with Average, Sum, Max or Min."""
        hvd = self._hvd
        if hvd is None:
            return None
        ops = {"mean": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}
        if op == "mean" and not tensor.is_floating_point():
            tensor = tensor.float()
        # Named by call order (the same on every rank) rather than left to Horovod's
        # own naming, so a collective never waits for a differently named one.
        return hvd.allreduce(tensor, op=ops[op], name=self._name("reduce"))

    @hookloop.hookimpl
    def barrier(self):
        """``hvd.barrier()``."""
        if self._hvd is None:
            return None
        self._hvd.barrier()
        return True

    @hookloop.hookimpl
    def broadcast(self, obj, src):
        """``hvd.broadcast_object`` from global rank ``src``.

        Named explicitly: Horovod names it after ``type(obj)``, which differs between
        ranks when only ``src`` holds the object, and the ranks would wait forever.
        """
        if self._hvd is None:
            return None
        return self._hvd.broadcast_object(obj, root_rank=src, name=self._name("broadcast"))

    def _name(self, kind: str) -> str:
        return f"hookloop.{kind}.{next(self._names)}"

    # -- checkpoints --------------------------------------------------------------------

    @hookloop.hookimpl
    def on_save_checkpoint(self, trainer, checkpoint):
        """Record the world size the learning rate was scaled for."""
        checkpoint["plugins"]["horovod"] = {"world_size": trainer.world_size, "scale_lr": self.scale_lr}

    @hookloop.hookimpl
    def on_load_checkpoint(self, trainer, checkpoint):
        """Rescale the restored learning rate when resuming on a different number of workers.

        The optimizer state in the checkpoint holds the rate scaled for the saving run's
        world size; with ``scale_lr`` on both sides it is moved to this run's.
        """
        saved = checkpoint.get("plugins", {}).get("horovod")
        if not saved or not (self.scale_lr and saved.get("scale_lr")):
            return
        old, new = int(saved["world_size"]), trainer.world_size
        if old != new:
            for optimizer in trainer.optimizers:
                scale_learning_rate(optimizer, hookloop.schedulers_of(trainer, optimizer), new / old)


# ---------------------------------------------------------------------------------------
# Optimizer surgery
# ---------------------------------------------------------------------------------------


# Param-group keys that hold an absolute learning rate: the rate itself; ``initial_lr``,
# where every PyTorch scheduler starts (OneCycleLR's ``max_lr / div_factor``); OneCycleLR's
# peak ``max_lr`` and floor ``min_lr``; SWALR's target ``swa_lr``.
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "swa_lr")
# Scheduler attributes that hold absolute learning rates, one per param group: the base
# rates (CyclicLR's lower bound), CyclicLR's upper bound, ReduceLROnPlateau's floors, and
# what ``get_last_lr()`` reports until the next step.
_SCHEDULER_LR_LISTS = ("base_lrs", "max_lrs", "min_lrs", "_last_lr")
# ...and single rates: the cosine schedules' floor, ReduceLROnPlateau's floor for groups
# added later (``None`` when it was given per group).
_SCHEDULER_LR_VALUES = ("eta_min", "default_min_lr")


def scale_learning_rate(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> None:
    """Multiply every learning rate the optimizer and the scheduler(s) keep by ``factor``.

    ``scheduler``: ``None``, a scheduler, or a list of the schedulers driving ``optimizer``.

    Afterwards the schedule is the one the user would have written for ``factor`` times
    the rate: scaling only ``lr`` would be undone at the first step of any scheduler that
    computes from its own copies. What PyTorch 2.13's schedulers keep, and the decision:

    - every scheduler: param-group ``initial_lr`` and ``base_lrs`` (absolute: scaled);
      ``get_last_lr()``'s list (scaled, so it reports the rate the next step uses).
    - ``OneCycleLR``: param-group ``initial_lr``, ``max_lr``, ``min_lr`` (absolute: scaled);
      ``div_factor``, ``final_div_factor``, ``pct_start`` are ratios (not scaled).
    - ``CyclicLR``: ``base_lrs`` and ``max_lrs``, the cycle's bounds (scaled); ``gamma``
      and ``scale_fn`` shape the amplitude relative to them (not scaled).
    - ``CosineAnnealingLR``, ``CosineAnnealingWarmRestarts``: ``eta_min``, the floor
      (absolute: scaled).
    - ``ReduceLROnPlateau``: ``min_lrs`` and ``default_min_lr``, the floors (scaled);
      ``factor`` is a ratio and ``eps`` a tolerance on rate changes, as the user wrote
      it for any rate (not scaled).
    - ``SWALR``: param-group ``swa_lr`` (absolute: scaled).
    - ``LambdaLR``, ``MultiplicativeLR``, ``StepLR``, ``MultiStepLR``, ``ExponentialLR``,
      ``LinearLR``, ``ConstantLR``, ``PolynomialLR``: factors of ``base_lrs`` or of the
      current rate (only ``base_lrs`` scaled).
    - ``SequentialLR``, ``ChainedScheduler``: their child schedulers, scaled in turn
      (recursively, each once).

    Another scheduler is scaled through the same attribute and key names; rates it keeps
    under other names are not seen. ``factor`` is the new world size over the old one
    when a checkpoint is resumed on another number of workers, so scaling twice composes.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
        raise ValueError(f"learning-rate scale factor={factor!r} must be a positive finite number")
    if factor == 1:
        return
    for group in optimizer.param_groups:
        for key in _GROUP_LR_KEYS:
            if key in group:
                group[key] = group[key] * factor
    seen: set[int] = set()
    for one in scheduler if isinstance(scheduler, (list, tuple)) else [scheduler]:
        _scale_scheduler(one, factor, seen)


def _scale_scheduler(scheduler: Any, factor: float, seen: set[int]) -> None:
    # ``seen``: a scheduler listed twice, or shared by two containers, is scaled once.
    if scheduler is None or id(scheduler) in seen:
        return
    seen.add(id(scheduler))
    for name in _SCHEDULER_LR_LISTS:
        values = getattr(scheduler, name, None)
        if values is not None:
            setattr(scheduler, name, [value * factor for value in values])
    for name in _SCHEDULER_LR_VALUES:
        value = getattr(scheduler, name, None)
        if value is not None:
            setattr(scheduler, name, value * factor)
    for child in getattr(scheduler, "_schedulers", None) or ():
        _scale_scheduler(child, factor, seen)


def broadcast_optimizer_state(hvd: Any, optimizer: torch.optim.Optimizer) -> None:
    """Give every rank rank 0's optimizer settings and state.

    ``hvd.broadcast_optimizer_state`` first creates missing state by stepping with zero
    gradients, which moves the weights under weight decay and counts a step in Adam's
    bias correction. A fresh optimizer has no state to share, so only its settings (lr,
    momentum...) are broadcast then, and the run stays step-for-step what a single
    process would compute.
    """
    if optimizer.state:
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    settings = hvd.broadcast_object(settings, root_rank=0, name="hookloop.optimizer_settings")
    for group, values in zip(optimizer.param_groups, settings):
        group.update(values)


__all__ = ["Horovod", "COMPRESSIONS", "scale_learning_rate", "broadcast_optimizer_state"]
