"""The ``pipeline`` strategy: pipeline parallelism on the ``pp`` dimension of the mesh.

Built on :class:`hookloop_ddp.DDP` (launching, the process group, the collectives), as
hookloop-tp is. The module is split into ``pp x virtual_stages`` stages
(:mod:`hookloop_pipeline.split`); rank ``r`` of the ``pp`` group runs its stages with a
``torch.distributed.pipelining`` schedule, which runs the forward and the backward of
every micro-batch together with the loss.

How the step runs (no new hook): ``wrap_model`` sets the module's ``training_step`` on
the instance to the pipeline's step, so the loop calls it wherever it would call the
user's (directly, or inside a data-parallel wrapper's forward); it returns the loss (the
mean over the micro-batches, computed on the last stage and broadcast over the ``pp``
group, so every rank logs the same value), and the ``backward`` hook does nothing: the
schedule ran it. ``wrap_model`` returns ``None``, so the data-parallel plugin still wraps
the step module (torchtitan's order: pipeline split first). Under ddp the reducer stays
idle (its forward returns after the backward ran) and this plugin averages the stages'
gradients over ddp's group before each optimizer step.

Every rank keeps the whole module; only its stages' parameters get gradients and
optimizer state. Before an evaluation, a checkpoint and at teardown each stage's
parameters are broadcast from their rank to the ``pp`` group, so validation runs the
user's ``validation_step`` unchanged on every rank, a checkpoint is one whole-model file
(resumable under any ``pp``, or by one process) and the module is whole after ``fit``.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookloop
from hookloop import ConfigurationError
from hookloop.distributed.mesh import mesh_dims
from hookloop_ddp import DDP

from .split import stage_modules

#: schedule name -> (torch class name, several stages per rank, stage placement)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False, "loop"),
    "1f1b": ("Schedule1F1B", False, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", True, "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", True, "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", True, "v"),
}
_ALIASES = {k.replace("_", ""): k for k in SCHEDULES}

_DDP_OPTIONS_KEPT = ("process_group_backend", "sampler_seed", "timeout")


def schedule_name(value: Any) -> str:
    """The canonical name of a schedule (``"1F1B"``, ``"Interleaved1F1B"``,
    ``"ScheduleGPipe"`` and ``"interleaved-1f1b"`` are accepted), or a clear error with
    the close matches."""
    if not isinstance(value, str):
        raise ConfigurationError(f"pipeline option schedule={value!r} must be a schedule name: "
                                 f"{', '.join(SCHEDULES)}")
    key = value.strip().lower().replace("-", "_")
    if key.startswith("schedule"):
        key = key[len("schedule"):].lstrip("_")
    if key in SCHEDULES:
        return key
    if key.replace("_", "") in _ALIASES:
        return _ALIASES[key.replace("_", "")]
    close = difflib.get_close_matches(key, list(SCHEDULES), n=3, cutoff=0.5)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ConfigurationError(f"pipeline option schedule={value!r} is no schedule{hint}: one of "
                             f"{', '.join(SCHEDULES)}")


class Pipeline(DDP):
    """Pipeline parallelism: the module's stages spread over the ``pp`` processes, run by
    one of ``torch.distributed.pipelining``'s schedules.

    The stages (see :func:`hookloop_pipeline.stage_modules`): the module's
    ``configure_pipeline(self, num_stages)`` hook, its ``pipeline_stages`` attribute, or
    an automatic split of its top-level ``nn.Sequential``/``nn.ModuleList`` of blocks.
    The loss: the module's ``pipeline_loss(output, target)`` method, else its
    ``loss_fn`` attribute; a batch is ``(input, target)``. ``training_step`` is not called
    (the schedule runs the stages); ``validation_step``, ``test_step`` and
    ``predict_step`` are, on the whole module.

    Options (constructor arguments, ``plugin_options={"pipeline": {...}}`` or
    ``--plugin-option pipeline.NAME=VALUE``):

    ``schedule``
        ``"gpipe"``, ``"1f1b"`` (default), ``"interleaved_1f1b"``, ``"looped_bfs"``,
        ``"interleaved_zero_bubble"``, ``"zbv_zero_bubble"`` (torch's class names work too).
    ``microbatches``
        micro-batches per batch (default ``2 x pp``); it must divide the batch size.
    ``virtual_stages``
        stages per rank (default 1; 2 for the multi-stage schedules, which require >= 2;
        ``zbv_zero_bubble`` exactly 2).
    ``split_points``
        the automatic split's cut points: the first block of every stage but the first
        (indices, or names such as ``"blocks.2"``); default: equal runs of blocks.
    ``process_group_backend``, ``sampler_seed``, ``timeout``
        as for ddp.
    """

    hookloop_name = "pipeline"
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    hookloop_mesh_dims = ("pp",)

    _PP_OPTIONS = ("schedule", "microbatches", "virtual_stages", "split_points")
    _OPTIONS = _DDP_OPTIONS_KEPT + _PP_OPTIONS

    def __init__(self, schedule: str = "1f1b", microbatches: int | None = None, virtual_stages: int | None = None,
                 split_points: list | None = None, process_group_backend: str | None = None,
                 sampler_seed: int | None = None, timeout: float | None = None):
        super().__init__(process_group_backend=process_group_backend, sampler_seed=sampler_seed, timeout=timeout)
        self.schedule = schedule
        self.microbatches = microbatches
        self.virtual_stages = virtual_stages
        self.split_points = split_points
        self._check_schedule_and_stages()
        self._reset()

    def _reset(self) -> None:
        self.trainer = None
        self.pp = 1
        self.pp_rank = 0
        self.pp_group = None
        self.pp_ranks: list[int] = [0]
        self.stages: list[nn.Module] = []       # every stage of the pipeline, in order
        self.own: list[int] = []                # the indices of this rank's stages
        self._schedules: dict[int, Any] = {}
        self._module = None
        self._dp_group = None
        self._version = self._synced = 0
        self._failed = False

    # -- options --------------------------------------------------------------------------

    def _check_option(self, name: str, value: Any) -> None:
        if name == "schedule":
            schedule_name(value)
        elif name in ("microbatches", "virtual_stages"):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigurationError(f"pipeline option {name}={value!r} must be None or an integer >= 1")
        elif name == "split_points":
            if value is not None and (not isinstance(value, (list, tuple))
                                      or not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value)):
                raise ConfigurationError(
                    f"pipeline option split_points={value!r} must be None or a list of block indices or "
                    f"block names (e.g. [2] or ['blocks.2'])")
        elif name == "sampler_seed":
            hookloop.check_sampler_seed("pipeline", value)
        else:
            super()._check_option(name, value)

    def _check_schedule_and_stages(self) -> None:
        """The schedule and ``virtual_stages`` together (at construction, and again at
        setup for options changed since: one at a time they may pass through a mismatch)."""
        schedule = schedule_name(self.schedule)
        virtual = self.virtual_stages
        _, multi, style = SCHEDULES[schedule]
        if multi and virtual is not None and virtual < 2:
            raise ConfigurationError(
                f"pipeline schedule {schedule!r} interleaves several stages per rank, and "
                f"virtual_stages={virtual}: give virtual_stages >= 2 (or leave it out: 2), or use "
                f"schedule='1f1b' or 'gpipe' for one stage per rank")
        if style == "v" and virtual not in (None, 2):
            raise ConfigurationError(
                f"pipeline schedule {schedule!r} places exactly 2 stages per rank (a V), and "
                f"virtual_stages={virtual}: leave it out or give 2")
        if not multi and virtual not in (None, 1):
            raise ConfigurationError(
                f"pipeline schedule {schedule!r} runs one stage per rank, and virtual_stages={virtual}: "
                f"use an interleaved schedule (interleaved_1f1b, looped_bfs, interleaved_zero_bubble) "
                f"for several")

    @property
    def n_virtual(self) -> int:
        _, multi, _ = SCHEDULES[schedule_name(self.schedule)]
        return self.virtual_stages or (2 if multi else 1)

    # -- environment ----------------------------------------------------------------------

    @hookloop.hookimpl(tryfirst=True)
    def setup(self, trainer, stage):
        """Refuse what the pipeline cannot run, then take the ``pp`` group: the core's
        ``trainer.device_mesh["pp"]``, or all processes (a pipeline-only run)."""
        self._check_schedule_and_stages()
        self._reset()
        self.trainer = trainer
        for p in trainer.plugins:
            dims = set(mesh_dims(p) or ())
            if p is not self and dims & {"cp"}:
                name = getattr(p, "hookloop_name", None) or type(p).__name__
                raise ConfigurationError(
                    f"the pipeline plugin does not compose with {name!r} (mesh "
                    f"dimension(s) {', '.join(sorted(dims))}) yet: it composes with ddp, fsdp and tp "
                    f"(--mesh pp=P,dp_replicate=R, pp=P,dp_shard=S or pp=P,tp=T). See "
                    f"plugins/pipeline/README.md")
        super().setup(trainer)
        mesh = getattr(trainer, "device_mesh", None)
        if mesh is not None and "pp" in (mesh.mesh_dim_names or ()):
            pp_mesh = mesh["pp"]
            self.pp, self.pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
            self.pp_group = pp_mesh.get_group() if self.pp > 1 else None
            self.pp_ranks = dist.get_process_group_ranks(self.pp_group) if self.pp > 1 else [trainer.global_rank]
        elif dist.is_initialized() and trainer.world_size > 1:
            self.pp, self.pp_rank = trainer.world_size, trainer.global_rank
            self.pp_group = dist.group.WORLD
            self.pp_ranks = list(range(trainer.world_size))
        else:
            self.pp_ranks = [trainer.global_rank]
        # pp = 1 (one process, or pp=1 on the mesh): no pipeline, nothing refused for it
        if self.pp > 1 and not trainer.automatic_optimization:
            raise ConfigurationError(
                "the pipeline plugin does not support manual optimization: its schedule runs the "
                "backward pass itself. Return the loss from training_step (automatic optimization)")
        if self.pp > 1 and trainer.precision == "16-mixed":
            raise ConfigurationError(
                "precision='16-mixed' is not supported by the pipeline plugin: the schedule runs the "
                "backward pass, where a loss scaler cannot scale it. Use 'bf16-mixed' or 32")

    @hookloop.hookimpl
    def on_exception(self, trainer):
        """A failed run gathers nothing at teardown: the other ranks may not be there."""
        self._failed = True

    @hookloop.hookimpl(trylast=True)
    def teardown(self, trainer):
        """The module whole on every rank again (each stage broadcast from its rank), the
        user's ``training_step`` back, then ddp's teardown (the process group, which this
        plugin made: its ``setup_environment`` is called first, as its ``wrap_model``).
        ``trylast``: after the other mesh plugins' teardowns, which may need the group
        (tp gathers its DTensors)."""
        try:
            if self._module is not None and not self._failed and dist.is_initialized():
                self._sync_stages()
        finally:
            if self._module is not None:
                self._module.__dict__.pop("training_step", None)
            trainer.__dict__.pop("pipeline_stages", None)
            self._reset()
            super().teardown(trainer)

    # -- the split ------------------------------------------------------------------------

    def stage_rank(self, index: int) -> int:
        """The ``pp`` rank that runs stage ``index``: ``index % pp`` (loop), or the V of
        ``zbv_zero_bubble`` (rank ``r`` runs ``r`` and ``2 pp - 1 - r``)."""
        if SCHEDULES[schedule_name(self.schedule)][2] == "v":
            return index if index < self.pp else 2 * self.pp - 1 - index
        return index % self.pp

    def own_parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages, as they are now (a later transform, such
        as a tensor-parallel one, may replace them)."""
        return [p for s in self.own for p in self.stages[s].parameters()]

    @hookloop.hookimpl
    def wrap_model(self, trainer, model):
        """Split the module into ``pp x virtual_stages`` stages and route ``training_step``
        through the schedule; every rank starts from global rank 0's weights. Returns
        ``None``: the data-parallel plugin (or the default) then wraps the step module."""
        module = model.module
        model.to(trainer.root_device)
        n_stages = self.pp * self.n_virtual
        self.stages = stage_modules(module, n_stages, self.split_points)
        self._loss = _loss_function(module)
        if self.pp > 1:
            with torch.no_grad():
                for t in (*module.parameters(), *module.buffers()):
                    dist.broadcast(t.data, src=0)
        self.own = [s for s in range(n_stages) if self.stage_rank(s) == self.pp_rank]
        m = self.microbatches or 2 * self.pp
        size = getattr(trainer.train_dataloader, "batch_size", None)
        if isinstance(size, int) and size % m:
            raise _microbatch_error(m, size)
        if self.pp == 1:
            return None  # one stage: no pipeline, the user's training_step as it is
        self._module = module
        module.training_step = self._training_step  # on the instance: removed at teardown
        # This rank's stage modules, for a data-parallel plugin that shards per stage
        # (fsdp's wrap_model, which runs next, calls fully_shard on each: torchtitan's way).
        trainer.pipeline_stages = [self.stages[s] for s in self.own]
        return None

    @hookloop.hookimpl
    def wrap_optimizer(self, model):
        """Under a data-parallel wrapper (ddp), keep its reducer idle: the backward runs
        inside the wrapped forward; this plugin averages the gradients over the wrapper's
        group before each optimizer step."""
        if self._module is not None and isinstance(model, nn.parallel.DistributedDataParallel):
            model.require_backward_grad_sync = False
            self._dp_group = model.process_group
        return None

    @hookloop.hookimpl
    def configure_sampler(self, trainer, dataloader, training):
        """The data-parallel share (``hookloop.data_parallel_rank``): every stage of a
        pipeline sees the same batches."""
        return hookloop.DistributedSampling.configure_sampler(self, trainer, dataloader, training)

    # -- the step -------------------------------------------------------------------------

    def _schedule(self, batch_size: int):
        schedule = self._schedules.get(batch_size)
        if schedule is not None:
            return schedule
        from torch.distributed import pipelining
        from torch.distributed.pipelining import schedules as torch_schedules

        m = self.microbatches or 2 * self.pp
        if batch_size % m:
            raise _microbatch_error(m, batch_size)
        name = schedule_name(self.schedule)
        cls_name, multi, _ = SCHEDULES[name]
        device = self.trainer.root_device
        stages = [pipelining.PipelineStage(self.stages[s], s, len(self.stages), device, group=self.pp_group)
                  for s in self.own]
        cls = getattr(torch_schedules, cls_name)
        # scale_grads=False: the loss function divides by the micro-batch count itself, so
        # gradients accumulated over a window are not divided again at each step.
        try:
            schedule = cls(stages if multi else stages[0], m, loss_fn=self._microbatch_loss, scale_grads=False)
        except (ValueError, AssertionError, RuntimeError) as error:
            raise ConfigurationError(
                f"torch.distributed.pipelining's {cls_name} refused pp={self.pp}, virtual_stages="
                f"{self.n_virtual}, microbatches={m}: {error}") from error
        self._m = m
        self._schedules[batch_size] = schedule
        return schedule

    def _microbatch_loss(self, output, target):
        return self._loss(output, target) / (self._m * self.trainer.accumulate_grad_batches)

    def _training_step(self, batch, batch_idx=None):
        """The step the loop calls for ``training_step``: one run of the schedule (forward
        and backward of every micro-batch); the batch's loss, the same on every rank."""
        x, target = _input_and_target(batch)
        schedule = self._schedule(x.shape[0])
        first, last = 0 in self.own, len(self.stages) - 1 in self.own
        losses: list = []
        kwargs = {"target": target, "losses": losses} if last else {}
        schedule.step(*((x,) if first else ()), **kwargs)
        if losses:
            loss = torch.stack([l.detach().float() for l in losses]).sum() * self.trainer.accumulate_grad_batches
        else:
            loss = torch.zeros((), device=self.trainer.root_device)
        if self.pp > 1:
            owner = self.pp_ranks[self.stage_rank(len(self.stages) - 1)]
            dist.broadcast(loss, src=owner, group=self.pp_group)
        return loss

    @hookloop.hookimpl
    def backward(self):
        """Nothing: the schedule ran the backward pass inside the step."""
        return True if self._module is not None else None

    @hookloop.hookimpl
    def optimizer_step(self, trainer, optimizer):
        """Average this rank's stage gradients over the data-parallel group (under ddp),
        then step (the other stages' parameters have no gradient: the optimizer skips them).
        ``None`` without a pipeline (pp = 1): the default steps, and clips."""
        if self._module is None:
            return None
        if self._dp_group is not None:
            size = dist.get_world_size(self._dp_group)
            for p in self.own_parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self._dp_group)
                    p.grad.div_(size)
        hookloop.before_optimizer_step(trainer, optimizer)  # clips through clip_gradients below
        optimizer.step()
        self._version += 1
        return True

    @hookloop.hookimpl
    def clip_gradients(self, trainer, optimizer, clip_val, algorithm):
        """Clip over the whole model: ``"norm"`` by the 2-norm of every stage's gradients
        (each rank's share summed over the ``pp`` group), ``"value"`` element-wise, as
        ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on one process would."""
        if self._module is None:
            return None
        own = {id(p) for p in self.own_parameters()}
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if id(p) in own and p.grad is not None]
        if algorithm == "value":
            for g in grads:
                g.clamp_(-clip_val, clip_val)
            return True
        squares = torch.zeros((), dtype=torch.float64, device=self.trainer.root_device)
        for g in grads:
            norm = torch.linalg.vector_norm(g.detach(), 2.0)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a tp-sharded gradient
            squares += norm.double() ** 2
        dist.all_reduce(squares, group=self.pp_group)
        # torch's coefficient from the total norm (a float32 tensor, clamped): no host read
        coefficient = hookloop.helpers.clip_coefficient(squares.sqrt().float(), clip_val)
        with torch.no_grad():
            for g in grads:
                (g.to_local() if hasattr(g, "to_local") else g).mul_(coefficient)  # a tp shard: its local part
        return True

    # -- the whole module on every rank ---------------------------------------------------

    def _sync_stages(self) -> None:
        """Broadcast each stage's parameters and buffers from its rank to the ``pp`` group
        (a collective; nothing when they did not change since the last time)."""
        if self.pp == 1 or self._synced == self._version and self._version:
            return
        with torch.no_grad():
            for index, stage in enumerate(self.stages):
                src = self.pp_ranks[self.stage_rank(index)]
                for t in (*stage.parameters(), *stage.buffers()):
                    local = _pp_local(t)  # a DTensor: this rank's tp shard (gathered over fsdp's dims)
                    dist.broadcast(local, src=src, group=self.pp_group)  # the owner's: sent, not written back
        self._synced = self._version

    @hookloop.hookimpl
    def on_validation_start(self, trainer):
        """Evaluation runs the user's step on the whole module: bring it up to date."""
        if self._module is not None:
            self._sync_stages()

    on_test_start = on_validation_start
    on_predict_start = on_validation_start

    # -- checkpoints ----------------------------------------------------------------------

    def _fsdp_stages(self) -> bool:
        """Whether fsdp shards this rank's stages (pp x fsdp): the same on every rank."""
        return any(_data_parallel_dims(p) for p in self.own_parameters())

    @hookloop.hookimpl(tryfirst=True)
    def save_checkpoint(self, trainer, checkpoint, path):
        """One whole-model checkpoint: every stage's parameters brought to every rank, and
        the optimizer state of each parameter taken from the rank that trains it (under
        fsdp gathered over the stage's data-parallel group first). Returns ``None``: the
        default (or tp's DCP writer) writes; under pp x fsdp this plugin writes the file
        itself (global rank 0, atomically) and returns ``path``, so that fsdp's writer,
        which knows one stage only, does not."""
        if self._module is None or self.pp == 1 or not dist.is_initialized():
            return None
        sharded = self._fsdp_stages()
        self._sync_stages()
        current = trainer.module.state_dict()
        checkpoint["state_dict"] = {k: current[k].detach().cpu().clone() if isinstance(current[k], torch.Tensor)
                                    else current[k] for k in checkpoint["state_dict"]}
        own = {id(p) for p in self.own_parameters()}
        mine = []
        for optimizer in trainer.optimizers:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            state = optimizer.state_dict()["state"]
            mine.append({i: {k: (_pp_local(v).cpu() if hasattr(v, "to_local") and sharded else v)
                             for k, v in s.items()} for i, s in state.items() if id(params[i]) in own})
        gathered: list = [None] * self.pp
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        for index, saved in enumerate(checkpoint.get("optimizer_states") or []):
            union: dict = {}
            for part in gathered:
                if index < len(part):
                    union.update(part[index])
            saved["state"] = dict(sorted(union.items()))
        if not sharded:
            return None
        if trainer.global_rank == 0:
            hookloop.atomic_save(checkpoint, path)
        trainer.barrier("pipeline_save_checkpoint")
        return path

    @hookloop.hookimpl(tryfirst=True)
    def load_model_state(self, trainer, checkpoint):
        """Under pp x fsdp: the whole-model checkpoint into every rank's module, each
        fsdp-sharded parameter (and its optimizer state) as this rank's slice of the full
        tensor (no collective: every rank reads the whole file); the other stages'
        parameters whole. ``None`` otherwise (the default, or tp's/fsdp's loader)."""
        if self._module is None or not self._fsdp_stages():
            return None
        from torch.distributed.tensor import distribute_tensor

        if "state_dict" not in checkpoint:
            raise hookloop.CheckpointError("checkpoint has no 'state_dict': it was not written by hookloop")
        optimizer_states, scheduler_states = hookloop.optimizer_and_scheduler_states(checkpoint)
        state = checkpoint["state_dict"]
        hookloop.check_state_dict(trainer.module, state)

        def like(t, value):
            value = value.to(device=t.device, dtype=t.dtype)
            if hasattr(t, "to_local"):
                return distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None)
            return value

        with torch.no_grad():
            for name, t in (*trainer.module.named_parameters(), *trainer.module.named_buffers()):
                value = like(t, state[name])
                (t.to_local() if hasattr(t, "to_local") else t).copy_(
                    value.to_local() if hasattr(value, "to_local") else value)
        if len(optimizer_states) != len(trainer.optimizers):
            raise hookloop.CheckpointError(
                f"the checkpoint holds {len(optimizer_states)} optimizer state(s), and this run has "
                f"{len(trainer.optimizers)} optimizer(s)")
        own = {id(p) for p in self.own_parameters()}
        for optimizer, saved in zip(trainer.optimizers, optimizer_states):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            mine = {i: {k: (like(params[i], v) if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(params[i].shape)
                            and k != "step" else v) for k, v in s.items()}
                    for i, s in (saved.get("state") or {}).items() if id(params[int(i)]) in own}
            optimizer.load_state_dict({"state": mine, "param_groups": saved["param_groups"]})
        hookloop.load_scheduler_states(trainer, scheduler_states)
        return True


PipelineParallel = Pipeline


def _microbatch_error(m: int, batch_size: int) -> ConfigurationError:
    return ConfigurationError(
        f"the pipeline cuts each batch into microbatches={m} equal micro-batches, and a batch has "
        f"{batch_size} samples: give a batch size that is a multiple of {m} (and drop_last=True "
        f"for a last, smaller batch), or another microbatches")


def _data_parallel_dims(t: Any) -> list[int]:
    """The mesh dimensions of a DTensor that are data-parallel (fsdp's ``dp_shard`` /
    ``dp_replicate``): a stage sharded by fsdp on this rank."""
    names = getattr(getattr(t, "device_mesh", None), "mesh_dim_names", None) or ()
    return [i for i, n in enumerate(names) if n in ("dp_shard", "dp_replicate")]


def _pp_local(t: torch.Tensor) -> torch.Tensor:
    """What stage ``t`` looks like to the other ``pp`` ranks: a plain tensor's data; a
    DTensor's local shard (tp's), gathered first over fsdp's dimensions (a collective of
    the stage's data-parallel group) when this rank shards the stage with fsdp."""
    if not hasattr(t, "to_local"):
        return t.data
    dims = _data_parallel_dims(t)
    if dims:
        from torch.distributed.tensor import Replicate

        placements = [Replicate() if i in dims else pl for i, pl in enumerate(t.placements)]
        return t.detach().redistribute(t.device_mesh, placements).to_local()
    return t.to_local()


def _loss_function(module: nn.Module):
    loss = getattr(module, "pipeline_loss", None)
    if not callable(loss):
        loss = getattr(module, "loss_fn", None)
    if not callable(loss):
        raise ConfigurationError(
            f"the pipeline plugin computes the loss on the last stage, per micro-batch, and "
            f"{type(module).__name__} has neither a pipeline_loss(self, output, target) method nor a "
            f"loss_fn attribute: add one (e.g. self.loss_fn = nn.CrossEntropyLoss())")
    return loss


def _input_and_target(batch: Any) -> tuple[torch.Tensor, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        return batch[0], batch[1]
    raise ConfigurationError(
        f"the pipeline plugin feeds a batch's input to the first stage and its target to the "
        f"loss on the last: a batch must be (input, target), a pair of tensors; got "
        f"{type(batch).__name__}{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}")
