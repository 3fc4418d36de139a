"""``ddp_sharded`` and ``ddp_sharded_spawn``: fairscale's OSS + ShardedDataParallel.

Lightning 1.x's ``plugins="ddp_sharded"``: the user's optimizer is re-created as
``fairscale.optim.OSS`` around the same class and arguments, so each rank keeps the
optimizer state of its partition only, and the model is wrapped in
``ShardedDataParallel``, which reduces each gradient to the rank that owns its parameter
(rather than all-reducing it to every rank). After each step OSS broadcasts the updated
parameters from their owners. The module needs no change.

Both are built on hookloop-ddp's extension points, not copies of it: :class:`DDPSharded`
subclasses :class:`hookloop_ddp.DDP` and overrides ``configure_ddp`` (the wrapper) and
``wrap_model`` (OSS first: ShardedDataParallel needs it); :class:`DDPShardedSpawn` adds
:class:`hookloop_ddp.DDPSpawn`'s launcher to it the way ``ddp2`` adds DataParallel to DDP.
Everything else (torchrun or spawn, samplers, ``no_sync`` accumulation, collectives,
process groups) is ddp's.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

import hookloop
from hookloop_ddp import DDP, DDPSpawn

from ._backend import require_fairscale
from ._options import refuse_ddp_only

SHARDED_OPTIONS = ("reduce_buffer_size", "reduce_fp16", "broadcast_fp16", "auto_refresh_trainable")


class DDPSharded(DDP):
    """Sharded data parallel training: fairscale's OSS optimizer + ShardedDataParallel.

    Launched like ddp (``hookloop run --plugins ddp_sharded --devices N``, several nodes
    with ``--nodes``). Options (constructor arguments, or
    ``plugin_options={"ddp_sharded": {...}}``):

    ``reduce_buffer_size``
        elements of the buffers that batch small gradients into one reduce (fairscale's
        default, 2**23; 0: reduce each gradient on its own).
    ``reduce_fp16``
        reduce gradients in fp16 (fairscale turns it off while reduce buffers are used).
    ``broadcast_fp16``
        broadcast the updated parameter shards in fp16 after each step (lossy; for AMP).
    ``auto_refresh_trainable``
        notice parameters frozen or unfrozen between steps (fairscale's default: True).
    ``process_group_backend``, ``broadcast_buffers``, ``sampler_seed``, ``timeout``
        as ddp's (``broadcast_buffers``: rank 0's buffers before each forward; default
        True, as fairscale's).

    DistributedDataParallel's own options (``comm_hook``, ``find_unused_parameters``,
    ``static_graph``, ``bucket_cap_mb``...) do not apply and are refused when set.
    Gradient clipping is by the global norm across the shards (``OSS.clip_grad_norm``,
    through the ``clip_gradients`` hook); under ``precision="16-mixed"`` the loss scaler
    is fairscale's ``ShardedGradScaler`` (the ``configure_grad_scaler`` hook); checkpoints hold the consolidated optimizer state
    in the plain optimizer's format.
    """

    hookloop_name = "ddp_sharded"
    #: fairscale's OSS owns the optimizer alone (ddp's dp_replicate claim is not inherited)
    hookloop_composes = False
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    # Its save_checkpoint gathers the state and lets the default write it (atomic_save):
    # ModelCheckpoint(async_save=True) may write that in the background.
    hookloop_async_save = True
    # Norm clipping needs a norm across the shards: done in on_before_optimizer_step, so
    # self.clip_gradients (which would clip each rank's shard on its own) is refused.
    hookloop_owns = frozenset({"gradient_clipping"})

    _OPTIONS = DDP._OPTIONS + SHARDED_OPTIONS

    def __init__(
        self,
        reduce_buffer_size: int = 2**23,
        reduce_fp16: bool = False,
        broadcast_fp16: bool = False,
        auto_refresh_trainable: bool = True,
        process_group_backend: str | None = None,
        broadcast_buffers: bool | None = None,
        sampler_seed: int | None = None,
        timeout: float | None = None,
    ):
        require_fairscale(self.hookloop_name)
        self.reduce_buffer_size = reduce_buffer_size
        self.reduce_fp16 = reduce_fp16
        self.broadcast_fp16 = broadcast_fp16
        self.auto_refresh_trainable = auto_refresh_trainable
        super().__init__(process_group_backend=process_group_backend, broadcast_buffers=broadcast_buffers,
                         sampler_seed=sampler_seed, timeout=timeout)
        self._sharded: dict[int, Any] = {}  # id(the user's optimizer) -> its ShardedOptimizer
        self._failed = False
        self._told_scaler = False

    def _check_option(self, name: str, value: Any) -> None:
        if name == "reduce_buffer_size":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise hookloop.ConfigurationError(
                    f"{self.hookloop_name} option reduce_buffer_size={value!r} must be an integer >= 0 "
                    f"(elements; 0 reduces each gradient on its own)"
                )
            return
        if name in ("reduce_fp16", "broadcast_fp16", "auto_refresh_trainable"):
            if not isinstance(value, bool):
                raise hookloop.ConfigurationError(f"{self.hookloop_name} option {name}={value!r} must be True or False")
            return
        if refuse_ddp_only(self.hookloop_name, name, value,
                           "fairscale's ShardedDataParallel reduces each gradient to the rank that owns it",
                           SHARDED_OPTIONS + ("process_group_backend", "broadcast_buffers", "sampler_seed", "timeout")):
            return
        super()._check_option(name, value)

    # -- extension points (hookloop_ddp.DDP's) ------------------------------------------

    def configure_ddp(self, trainer, model: nn.Module) -> nn.Module:
        """``ShardedDataParallel`` around ``model`` with the run's OSS optimizers.

        It broadcasts rank 0's parameters and buffers when it wraps (every rank starts
        from the same weights) and, in the backward pass, reduces each gradient to the
        rank that owns its parameter. Without optimizers (``validate``, ``test``) there
        is nothing to shard: plain DistributedDataParallel, as ddp.
        """
        if not self._sharded:
            return super().configure_ddp(trainer, model)
        from fairscale.nn.data_parallel import ShardedDataParallel

        return ShardedDataParallel(
            model,
            list(self._sharded.values()),
            broadcast_buffers=True if self.broadcast_buffers is None else self.broadcast_buffers,
            sync_models_at_startup=True,
            reduce_buffer_size=self.reduce_buffer_size,
            auto_refresh_trainable=self.auto_refresh_trainable,
            reduce_fp16=self.reduce_fp16,
            # Every validation switches the model to eval mode and back, which
            # ShardedDataParallel reports as a change of trainable parameters.
            warn_on_trainable_params_changed=False,
        )

    # -- environment --------------------------------------------------------------------

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        """Refuse what sharding cannot do."""
        self._failed = False
        if not trainer.automatic_optimization:
            raise hookloop.ConfigurationError(
                f"{self.hookloop_name} does not support manual optimization "
                f"(self.automatic_optimization = False): ShardedDataParallel reduces each "
                f"gradient once per forward, so several manual_backward calls in one "
                f"training_step would leave gradients unreduced. Use ddp for manual "
                f"optimization, or return the loss from training_step"
            )

    @hookloop.hookimpl
    def configure_grad_scaler(self, trainer, device, options):
        """``precision="16-mixed"``: fairscale's shard-aware ``ShardedGradScaler`` (inf/nan
        found by any rank skips the step on every rank: each rank unscales and checks the
        gradients of its own partition only), with the precision plugin's settings."""
        from ._scaler import ShardedGradScaler

        settings = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, **options}
        scaler = ShardedGradScaler(device.type, **settings)
        if trainer.global_rank == 0 and not self._told_scaler:
            print(f"hookloop-fairscale: precision='16-mixed' under {self.hookloop_name}: the loss "
                  f"scaler is fairscale's ShardedGradScaler (inf/nan on any rank skips the step "
                  f"on every rank)", flush=True)
        self._told_scaler = True
        return scaler

    @hookloop.hookimpl
    def on_exception(self, trainer):
        """Remember the run failed: teardown then skips its collective."""
        self._failed = True

    @hookloop.hookimpl
    def teardown(self, trainer, stage):
        """Consolidate the optimizer state on rank 0 (when ``fit`` ended normally), then
        do ddp's teardown (the process group goes, ``trainer.model`` is unwrapped).

        After ``fit`` the ranks' partitions cannot be gathered any more (the group is
        gone), so rank 0 keeps the whole state, on the CPU: ``trainer.save_checkpoint(path)``
        after ``fit`` then writes a complete checkpoint, as in Lightning.
        """
        try:
            if stage == "fit" and not self._failed and self._sharded and dist.is_initialized():
                for optimizer in self._sharded.values():
                    optimizer.consolidate(0)
        finally:
            self._sharded = {}
            super().teardown(trainer)

    # -- model and optimizer ------------------------------------------------------------

    @hookloop.hookimpl
    def wrap_model(self, trainer, model, optimizers):
        """Re-create every optimizer as OSS, then wrap with :meth:`configure_ddp`."""
        model = model.to(trainer.root_device)
        self._check_sync_batchnorm(trainer, model)
        self._sharded = {}
        if optimizers:
            from ._oss import shard

            self._sharded = {id(o): shard(o, broadcast_fp16=self.broadcast_fp16) for o in optimizers}
            self._report_partition(trainer)
        return super().wrap_model(trainer, model)

    @hookloop.hookimpl
    def wrap_optimizer(self, trainer, optimizer):
        """The OSS made from ``optimizer``; its LR schedulers now drive the OSS groups."""
        sharded = self._sharded.get(id(optimizer))
        if sharded is None:
            return None
        for scheduler in hookloop.schedulers_of(trainer, optimizer):
            hookloop.repoint_lr_scheduler(scheduler, sharded)
        return sharded

    def _check_sync_batchnorm(self, trainer, model: nn.Module) -> None:
        names = [name.removeprefix("module.") for name, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
        if names and trainer.root_device.type != "cuda":
            raise hookloop.ConfigurationError(
                f"the module has SyncBatchNorm layers ({', '.join(names[:5])}"
                f"{', ...' if len(names) > 5 else ''}) and this run is on the {trainer.root_device.type}: "
                f"torch's SyncBatchNorm gathers batch statistics on CUDA only (it refuses CPU "
                f"input under ddp as well). Use nn.BatchNorm on the CPU (each process "
                f"normalises over its own batch), or train on GPUs, where {self.hookloop_name} "
                f"runs SyncBatchNorm (torch no longer ties it to DistributedDataParallel, the "
                f"cause of Lightning #5210)"
            )

    def _report_partition(self, trainer) -> None:
        """Rank 0 prints how far OSS's greedy partition lands from total / N."""
        if trainer.global_rank != 0:
            return
        for index, optimizer in enumerate(self._sharded.values()):
            numels = optimizer.partition_numels()
            total = sum(numels)
            even = total / len(numels) if numels else 0
            parts = ", ".join(f"rank {r} {n} ({n / even:.2f} x)" for r, n in enumerate(numels)) if even else "-"
            label = "" if len(self._sharded) == 1 else f" {index}"
            print(f"hookloop-fairscale: optimizer{label} state sharded by whole parameters over "
                  f"{len(numels)} ranks, elements per rank (x total/{len(numels)} = {even:g}): {parts}",
                  flush=True)

    # -- the step -----------------------------------------------------------------------

    @hookloop.hookimpl
    def zero_grad(self, model):
        """``ShardedDataParallel.zero_grad``: gradients inside its reduce buffers are views
        of them and are zeroed in place (set to ``None`` they would leave the buffers);
        the others are set to ``None``."""
        from fairscale.nn.data_parallel import ShardedDataParallel

        if not isinstance(model, ShardedDataParallel):
            return None
        model.zero_grad(set_to_none=True)
        return True

    @hookloop.hookimpl(wrapper=True)
    def backward(self, model):
        """Flush ShardedDataParallel's gradient reductions when the whole backward pass is
        over, not from inside it.

        ShardedDataParallel asks the autograd engine to flush its reduce buffers at the end
        of the backward pass, from the first gradient hook that fires. Under activation
        checkpointing (a reentrant recomputation, ``activation_checkpointing``) that hook
        fires inside the recomputation's own, nested backward, whose end comes first: the
        buffers would be reduced before the layers outside it had their gradients.
        """
        from fairscale.nn.data_parallel import ShardedDataParallel

        # WORKAROUND (fairscale 0.4.13 internals, pinned by this distribution): mark the
        # flush as scheduled so no hook schedules it, and run it after backward returns.
        flush = isinstance(model, ShardedDataParallel) and model.training and not model._should_accumulate_grads
        if flush:
            model._bucket_flush_callback_set = True
        result = yield
        if flush:
            model._flush_reduce_calls()
        return result

    @hookloop.hookimpl
    def clip_gradients(self, optimizer, clip_val, algorithm):
        """Clip by the norm of all the gradients across the shards (``OSS.clip_grad_norm``).

        Each rank holds the reduced gradients of its own parameters only, so the norm is
        a sum over ranks (one all-reduce) and the coefficient is what unsharded clipping
        computes. ``"value"`` clipping is per element: the default clamps every shard
        correctly, and so do optimizers that are not OSS's.
        """
        from ._oss import ShardedOptimizer

        if algorithm != "norm" or not isinstance(optimizer, ShardedOptimizer):
            return None
        optimizer.clip_grad_norm(clip_val)
        return True

    # -- checkpoints --------------------------------------------------------------------

    @hookloop.hookimpl(tryfirst=True)
    def save_checkpoint(self, trainer, checkpoint):
        """Consolidate each OSS's partitions on rank 0 and put the whole optimizer state in
        ``checkpoint["optimizer_states"]``, in the plain optimizer's format (it loads into
        a plain optimizer, under ddp, ddp_sharded, or another number of processes).

        Returns ``None``: the default then writes rank 0's file atomically and waits.
        """
        if not self._sharded or not dist.is_initialized():
            return None  # after fit: rank 0's optimizer holds the consolidated state already
        states = checkpoint.get("optimizer_states")
        for index, optimizer in enumerate(trainer.optimizers):
            if not any(optimizer is o for o in self._sharded.values()):
                continue
            optimizer.consolidate(0)
            if trainer.global_rank == 0 and states is not None:
                states[index] = optimizer.state_dict()
            optimizer.release_consolidated()
        return None


class DDPShardedSpawn(DDPSharded, DDPSpawn):
    """``ddp_sharded`` whose processes are started by ``fit`` (ddp_spawn's launcher).

    For notebooks and code a launcher cannot re-run; the caller's module holds rank 0's
    trained weights afterwards. Options:

    ``start_method``
        ddp_spawn's: ``"spawn"`` (default), ``"forkserver"`` or ``"fork"``.
    ``reduce_buffer_size``, ``reduce_fp16``, ``broadcast_fp16``, ``auto_refresh_trainable``
        as :class:`DDPSharded`'s (ShardedDataParallel's reduce buffers, fp16 reduction,
        fp16 broadcast of the updated shards, noticing frozen parameters).
    ``process_group_backend``, ``broadcast_buffers``, ``sampler_seed``, ``timeout``
        as ddp's.
    """

    hookloop_name = "ddp_sharded_spawn"
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    _OPTIONS = DDPSharded._OPTIONS + ("start_method",)

    def __init__(
        self,
        start_method: str = "spawn",
        reduce_buffer_size: int = 2**23,
        reduce_fp16: bool = False,
        broadcast_fp16: bool = False,
        auto_refresh_trainable: bool = True,
        process_group_backend: str | None = None,
        broadcast_buffers: bool | None = None,
        sampler_seed: int | None = None,
        timeout: float | None = None,
    ):
        super().__init__(reduce_buffer_size=reduce_buffer_size, reduce_fp16=reduce_fp16,
                         broadcast_fp16=broadcast_fp16, auto_refresh_trainable=auto_refresh_trainable,
                         process_group_backend=process_group_backend, broadcast_buffers=broadcast_buffers,
                         sampler_seed=sampler_seed, timeout=timeout)
        self.start_method = start_method  # DDPSpawn.__init__ (in the chain above) set its default
