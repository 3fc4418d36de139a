"""``ddp_sequential``: pipeline stages on separate processes, data parallel across pipelines.

Lightning 1.x's ``DDPSequentialPlugin(balance=[...])`` without RPC, on
``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``). The ranks form
``replicas`` pipelines of ``stages`` processes (``devices = stages x replicas``; rank
``r`` is stage ``r % stages`` of pipeline ``r // stages``). Each rank keeps the layers of
its stage only (the other layers' parameters are released for the run); the ranks of a
pipeline see the same batches, each pipeline its own share of the data, and after the
backward pass each stage's gradients are averaged over the pipelines.

How a step runs without changing the module: every rank calls the user's step; when it
calls ``self.sequential_module(x)``, the first stage feeds ``x`` into the pipeline, the
others take their input from the stage before. GPipe runs every micro-batch forward,
then every backward; on the last stage, once the last micro-batch's output exists, the
user's ``training_step`` runs once on the whole batch with the whole output, and the
gradient of its loss with respect to that output is what each micro-batch's backward
starts from: the step is the whole-batch step, exactly. The output (not the gradients) is
then broadcast from the last stage, so every rank's step computes the same loss and logs
the same metrics (``sync_dist`` included).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookloop
from hookloop_ddp import DDP

from ._options import refuse_ddp_only
from .balance import check_balance, check_balance_option, choose_balance, sequential_of, stage_ranges

SEQUENTIAL_OPTIONS = ("balance", "stages", "chunks")


class DDPSequential(DDP):
    """Pipeline parallelism on processes, with data parallelism across pipelines.

    Launched like ddp: ``hookloop run --plugins ddp_sequential --devices N`` with
    ``N = stages x replicas`` (several nodes with ``--nodes``). Options (constructor
    arguments, or ``plugin_options={"ddp_sequential": {...}}``):

    ``balance``
        layers of ``sequential_module`` per stage, e.g. ``[2, 3]`` (the number of stages
        is its length); ``None``: ``stages`` stages, chosen as ``pipe`` chooses (by time
        with fairscale's ``balance_by_time`` when the module has an
        ``example_input_array``, else by parameter count), by rank 0, and printed.
    ``stages``
        the number of stages when ``balance`` is ``None`` (default: every process, one
        pipeline).
    ``chunks``
        micro-batches per batch (default 8, as Lightning's sequential plugin): a batch is
        cut into the largest number of equal micro-batches not above it.
    ``process_group_backend``, ``sampler_seed``, ``timeout``
        as ddp's.

    The module's trainable parameters must all be in ``sequential_module``; the
    schedule is GPipe; ``precision="bf16-mixed"`` composes, ``"16-mixed"`` (a loss
    scaler around a backward that the pipeline runs) is refused, as are manual
    optimization and ``predict``.
    """

    hookloop_name = "ddp_sequential"
    #: its own stages x replicas process groups, not the run's mesh (ddp's claim not inherited)
    hookloop_composes = False
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    # Its save_checkpoint gathers the state and lets the default write it (atomic_save):
    # ModelCheckpoint(async_save=True) may write that in the background.
    hookloop_async_save = True
    # Norm clipping is over the whole model, whose gradients are spread over the stages.
    hookloop_owns = frozenset({"gradient_clipping"})

    _OPTIONS = DDP._OPTIONS + SEQUENTIAL_OPTIONS

    def __init__(self, balance: list[int] | None = None, stages: int | None = None, chunks: int = 8,
                 process_group_backend: str | None = None, sampler_seed: int | None = None, timeout: float | None = None):
        self.balance = balance
        self.stages = stages
        self.chunks = chunks
        super().__init__(process_group_backend=process_group_backend, sampler_seed=sampler_seed, timeout=timeout)
        self._reset()

    def _reset(self) -> None:
        self.layout: tuple[int, int, int, int] | None = None  # stages, replicas, stage, replica
        self._pipeline_group = self._data_group = None
        self._pipeline_ranks: list[int] = []
        self._balance: list[int] = []
        self._sequential: nn.Sequential | None = None
        self._submodule: nn.Sequential | None = None
        self._own_parameters: list[nn.Parameter] = []
        self._released: list[tuple[nn.Parameter, torch.Size]] = []
        self._schedules: dict[int, Any] = {}
        self._trained_batch_sizes: set[int] = set()
        self._step: _Step | None = None
        self._accumulate = 1
        self._failed = False

    def _check_option(self, name: str, value: Any) -> None:
        if name == "balance":
            check_balance_option(self.hookloop_name, value)
            return
        if name == "stages":
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise hookloop.ConfigurationError(f"ddp_sequential option stages={value!r} must be None or an integer >= 1")
            return
        if name == "chunks":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise hookloop.ConfigurationError(f"ddp_sequential option chunks={value!r} must be an integer >= 1")
            return
        if name == "broadcast_buffers" and value is not None:
            raise hookloop.ConfigurationError(
                "ddp_sequential option broadcast_buffers: each stage keeps its own layers' buffers; "
                "there is no DistributedDataParallel to broadcast them")
        if refuse_ddp_only(self.hookloop_name, name, value, "the pipeline sends activations between "
                           "stages and averages each stage's gradients across pipelines itself",
                           SEQUENTIAL_OPTIONS + ("process_group_backend", "sampler_seed", "timeout")):
            return
        super()._check_option(name, value)

    # -- environment --------------------------------------------------------------------

    @hookloop.hookimpl(tryfirst=True)
    def setup(self, trainer, stage):
        """Refuse what a pipeline cannot run (``tryfirst``: before the precision plugin
        judges the precision), and make the pipeline and data groups."""
        self._failed = False
        if not trainer.automatic_optimization:
            raise hookloop.ConfigurationError(
                "ddp_sequential does not support manual optimization: the pipeline schedule runs "
                "the backward pass itself. Return the loss from training_step")
        if stage == "predict":
            raise hookloop.ConfigurationError(
                "ddp_sequential does not predict: every rank of a pipeline computes the same "
                "batches, which hookloop's gathering of predictions (one share per rank) does not "
                "expect. Predict with pipe, or with one process")
        if trainer.config.global_batch_size is not None:
            # the stages of a pipeline share batches, which hookloop.data_parallel_rank (no
            # mesh here) does not know: the derived accumulation would count every process
            raise hookloop.ConfigurationError(
                f"global_batch_size={trainer.config.global_batch_size} is not supported by ddp_sequential: "
                f"the stages of a pipeline share their batches, so the data-parallel size is not the number of "
                f"processes. Give accumulate_grad_batches = global batch / (batch_size x pipelines), or use the "
                f"pipeline plugin (its pp mesh dimension is counted)")
        if trainer.precision == "16-mixed":
            raise hookloop.ConfigurationError(
                "precision='16-mixed' is not supported by ddp_sequential: the pipeline runs the "
                "backward pass inside its schedule, where a loss scaler cannot scale it. Use "
                "precision='bf16-mixed' (no scaler needed) or 32")
        self._accumulate = trainer.accumulate_grad_batches
        world, rank = trainer.world_size, trainer.global_rank
        stages = len(self.balance) if self.balance is not None else (self.stages or world)
        if world % stages:
            raise hookloop.ConfigurationError(
                f"ddp_sequential has {stages} pipeline stages and {world} processes: devices must be "
                f"stages x replicas (a multiple of {stages}), e.g. --devices {stages} or "
                f"--devices {2 * stages}")
        replicas = world // stages
        self.layout = (stages, replicas, rank % stages, rank // stages)
        self._pipeline_ranks = [(rank // stages) * stages + s for s in range(stages)]
        # Every rank makes every group, in the same order (torch.distributed requires it).
        for replica in range(replicas):
            group = dist.new_group([replica * stages + s for s in range(stages)]) if stages > 1 else None
            if replica == rank // stages:
                self._pipeline_group = group
        for s in range(stages):
            group = dist.new_group([replica * stages + s for replica in range(replicas)]) if replicas > 1 else None
            if s == rank % stages:
                self._data_group = group

    @property
    def is_first(self) -> bool:
        return self.layout is not None and self.layout[2] == 0

    @property
    def is_last(self) -> bool:
        return self.layout is not None and self.layout[2] == self.layout[0] - 1

    @hookloop.hookimpl
    def on_exception(self, trainer):
        """Remember the run failed: teardown then skips its collectives."""
        self._failed = True

    @hookloop.hookimpl
    def teardown(self, trainer, stage):
        """Give every rank the whole trained model back (each stage broadcasts its layers to
        its pipeline), restore ``sequential_module``'s forward, then ddp's teardown."""
        try:
            if self._released and not self._failed and dist.is_initialized():
                self._restore_released_parameters()
        finally:
            if self._sequential is not None:
                self._sequential.__dict__.pop("forward", None)
            self._reset()
            super().teardown(trainer)

    def _restore_released_parameters(self) -> None:
        stages = self.layout[0]
        released = {id(p): shape for p, shape in self._released}
        for stage, layers in enumerate(stage_ranges(self._balance)):
            source = self._pipeline_ranks[stage]
            for index in layers:
                for p in self._sequential[index].parameters():
                    if id(p) in released:
                        p.data = torch.empty(released[id(p)], dtype=p.dtype, device=p.device)
                    if stages > 1:
                        dist.broadcast(p.data, src=source, group=self._pipeline_group)
        self._released = []

    # -- model and data -----------------------------------------------------------------

    @hookloop.hookimpl
    def wrap_model(self, trainer, model):
        """Keep this rank's stage of ``sequential_module`` and route its forward through the
        pipeline; every rank starts from rank 0's weights."""
        module = model.module
        sequential = sequential_of(module, self.hookloop_name)
        outside = [name for name, p in module.named_parameters()
                   if p.requires_grad and not name.startswith("sequential_module.")]
        if outside:
            raise hookloop.ConfigurationError(
                f"ddp_sequential trains the layers of sequential_module, stage by stage; "
                f"{type(module).__name__} also has trainable parameters outside it "
                f"({', '.join(outside[:5])}{', ...' if len(outside) > 5 else ''}), which no stage "
                f"would train: move those layers into sequential_module")
        model.to(trainer.root_device)
        with torch.no_grad():  # rank 0's weights on every rank, as DDP does
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        stages, replicas, stage, replica = self.layout
        balance = self.balance
        if balance is None:
            chosen = choose_balance(self.hookloop_name, module, sequential, stages, trainer.root_device) \
                if trainer.global_rank == 0 else None
            balance, how = trainer.broadcast(chosen, src=0)  # timing differs between processes
            trainer.print(f"hookloop-fairscale: ddp_sequential balance {balance} ({stages} stages x "
                          f"{replicas} replicas), chosen {how}; set balance=[...] to choose it yourself",
                          flush=True)
        self._balance = check_balance(self.hookloop_name, list(balance), sequential)
        mine = stage_ranges(self._balance)[stage]
        self._sequential = sequential
        self._submodule = nn.Sequential(*[sequential[i] for i in mine])  # the same layer objects
        self._own_parameters = list(self._submodule.parameters())
        own = {id(p) for p in self._own_parameters}
        self._released = []
        for index, layer in enumerate(sequential):
            if index in mine:
                continue
            for p in layer.parameters():
                if id(p) not in own:
                    self._released.append((p, p.shape))
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._schedules, self._trained_batch_sizes = {}, set()
        sequential.forward = _ThroughPipeline(self)  # an instance attribute, removed at teardown
        runner = _PipelineRunner(model, self)
        self._wrapped = (model, runner)
        return runner

    @hookloop.hookimpl
    def configure_sampler(self, trainer, dataloader, training):
        """Each pipeline its share of the data, the same batches for every stage of it."""
        if not trainer.config.use_distributed_sampler or self.layout is None:
            return None
        _, replicas, _, replica = self.layout
        if replicas == 1 and type(dataloader.sampler) is torch.utils.data.SequentialSampler:
            # One pipeline trains as one process: an unshuffled loader stays in order (a
            # shuffled one is sharded below, so that every stage draws the same order).
            return None
        return hookloop.distributed_sampler(dataloader, replicas, replica, training, seed=self.sampler_seed)

    # -- the step -----------------------------------------------------------------------

    @hookloop.hookimpl
    def backward(self):
        """Nothing: the pipeline schedule ran the backward pass inside the step (with one
        stage there is no pipeline, and the default ``loss.backward()`` runs)."""
        return True if self.layout is not None and self.layout[0] > 1 else None

    @hookloop.hookimpl
    def optimizer_step(self, trainer, optimizer):
        """Average this stage's gradients over the pipelines, clip over the whole model,
        step (the optimizer skips the other stages' parameters: they have no gradient)."""
        self._average_gradients()
        hookloop.before_optimizer_step(trainer, optimizer, clip=False)
        self._clip(trainer)
        optimizer.step()
        return True

    def _average_gradients(self) -> None:
        replicas = self.layout[1]
        if replicas == 1:
            return
        for p in self._own_parameters:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self._data_group)
                p.grad.div_(replicas)

    def _clip(self, trainer) -> None:
        value = trainer.gradient_clip_val
        if not value:
            return
        grads = [p.grad for p in self._own_parameters if p.grad is not None]
        with torch.no_grad():
            if trainer.config.gradient_clip_algorithm == "value":
                for g in grads:
                    g.clamp_(-value, value)
                return
            squares = torch.zeros((), dtype=torch.float64, device=trainer.root_device)
            for g in grads:
                squares += torch.linalg.vector_norm(g.double()) ** 2
            if self.layout[0] > 1:
                dist.all_reduce(squares, group=self._pipeline_group)
            coefficient = hookloop.helpers.clip_coefficient(squares.sqrt().float(), value)  # torch's
            for g in grads:
                g.mul_(coefficient)  # a float32 coefficient, as torch multiplies low-precision grads

    def schedule(self, batch_size: int, train: bool):
        """The GPipe schedule (and its stage) for ``train``/evaluation steps on batches of
        ``batch_size``. Stages learn their input shapes from a first run, once per batch
        size, and again at every switch between training and evaluation on one schedule:
        so each (batch size, mode) gets its own, initialised once."""
        key = (batch_size, train)
        schedule = self._schedules.get(key)
        if schedule is None:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            chunks = max(n for n in range(1, min(self.chunks, batch_size) + 1) if batch_size % n == 0)
            stages, _, stage, _ = self.layout
            pipeline_stage = PipelineStage(self._submodule, stage, stages, self._device(), group=self._pipeline_group)
            # scale_grads=False: the loss the last stage starts each micro-batch's backward
            # from is already the whole batch's (see _Step.micro_batch_loss).
            schedule = ScheduleGPipe(pipeline_stage, chunks, loss_fn=self._micro_batch_loss if train else None,
                                     scale_grads=False)
            self._schedules[key] = schedule
        return schedule

    def _device(self) -> torch.device:
        return next(iter(self._own_parameters), torch.empty(0)).device

    def _micro_batch_loss(self, output, index):
        return self._step.micro_batch_loss(output, index)

    # -- checkpoints --------------------------------------------------------------------

    def _owner_of(self, key: str) -> int | None:
        """The stage whose layer holds state-dict key ``key`` (``None``: outside the layers)."""
        if not key.startswith("sequential_module."):
            return None
        name = key[len("sequential_module."):].split(".", 1)[0]
        names = [n for n, _ in self._sequential.named_children()]
        if name not in names:
            return None
        index = names.index(name)
        for stage, layers in enumerate(stage_ranges(self._balance)):
            if index in layers:
                return stage
        return None

    def _owned(self, key: str) -> bool:
        owner = self._owner_of(key)
        return owner is None or owner == self.layout[2]

    @hookloop.hookimpl(tryfirst=True)
    def save_checkpoint(self, trainer, checkpoint):
        """Gather the stages' state dicts (and optimizer states) of the first pipeline on
        rank 0: one hookloop checkpoint, with the original ``sequential_module`` keys.
        Returns ``None``: the default writes rank 0's file."""
        if self.layout is None or not self._released or not dist.is_initialized():
            return None
        stage, replica = self.layout[2], self.layout[3]
        mine: dict = {"state_dict": {}, "optimizer_states": []}
        if replica == 0:
            mine["state_dict"] = {k: v.detach().cpu() for k, v in trainer.module.state_dict().items()
                                  if self._owner_of(k) == stage}
            mine["optimizer_states"] = [o.state_dict()["state"] for o in trainer.optimizers]
        gathered = trainer.all_gather_object(mine)
        if trainer.global_rank == 0:
            merged = dict(checkpoint["state_dict"])
            for part in gathered:
                merged.update(part["state_dict"])
            checkpoint["state_dict"] = {k: merged[k] for k in checkpoint["state_dict"]}
            for index, state in enumerate(checkpoint.get("optimizer_states") or []):
                union: dict = {}
                for part in gathered:
                    if index < len(part["optimizer_states"]):
                        union.update(part["optimizer_states"][index])
                state["state"] = dict(sorted(union.items()))
        return None

    @hookloop.hookimpl
    def load_model_state(self, trainer, checkpoint):
        """Load this stage's layers (and what lies outside them) from a whole-model
        checkpoint, with the optimizer state of this stage's parameters only."""
        if self.layout is None or not self._released:
            return None
        if "state_dict" not in checkpoint:
            raise hookloop.CheckpointError("checkpoint has no 'state_dict': it was not written by hookloop")
        saved = checkpoint["state_dict"]
        own = trainer.module.state_dict()
        shapes = {id(p): shape for p, shape in self._released}
        full_shapes = {k: shapes.get(id(t), t.shape) for k, t in _state_tensors(trainer.module).items()}
        missing = sorted(set(own) - set(saved))
        unexpected = sorted(set(saved) - set(own))
        wrong = [k for k in own if k in saved and isinstance(saved[k], torch.Tensor) and k in full_shapes
                 and saved[k].shape != full_shapes[k]]
        if missing or unexpected or wrong:
            raise hookloop.CheckpointError(
                f"checkpoint belongs to a different model (missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}, other shapes {wrong[:5]}): pass the checkpoint of this model")
        with torch.no_grad():
            for key, tensor in own.items():
                if self._owned(key):
                    tensor.copy_(saved[key])
        optimizer_states, scheduler_states = hookloop.optimizer_and_scheduler_states(checkpoint)
        if trainer.optimizers and optimizer_states:
            if len(optimizer_states) != len(trainer.optimizers):
                raise hookloop.CheckpointError(
                    f"the checkpoint holds {len(optimizer_states)} optimizer state(s) and "
                    f"configure_optimizers returned {len(trainer.optimizers)}")
            mine = {id(p) for p in self._own_parameters}
            for optimizer, state in zip(trainer.optimizers, optimizer_states):
                params = [p for group in optimizer.param_groups for p in group["params"]]
                keep = {i for i, p in enumerate(params) if id(p) in mine}
                optimizer.load_state_dict({**state, "state": {i: s for i, s in state["state"].items() if i in keep}})
        hookloop.load_scheduler_states(trainer, scheduler_states)
        return True


def _state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """State-dict keys to the module's own parameter and buffer objects."""
    found = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        found[name] = p
    for name, b in module.named_buffers(remove_duplicate=False):
        found[name] = b
    return found


# ---------------------------------------------------------------------------------------
# One step through the pipeline
# ---------------------------------------------------------------------------------------


class _Step:
    """What one call of the step module on this rank is doing."""

    def __init__(self, kind: str, batch: Any, batch_idx: int, batch_size: int):
        self.kind, self.batch, self.batch_idx, self.batch_size = kind, batch, batch_idx, batch_size
        self.used = False
        self.full_output: torch.Tensor | None = None
        # last stage, training: per micro-batch outputs, then the whole-batch step
        self.outputs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.result: Any = None
        self.run_user_step = None
        self.accumulate = 1
        self.shape_inference_pending = False

    def micro_batch_loss(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch (see :meth:`_PipelineRunner._train_last_stage`)."""
        if self.shape_inference_pending:
            # torch.distributed.pipelining's first training step of a schedule infers the
            # gradient shapes by calling the loss once on its own inference output; any loss
            # of that output serves (only the shapes of the gradients are used).
            self.shape_inference_pending = False
            return output.sum() * 0
        self.outputs.append(output)
        position = len(self.outputs) - 1
        if sum(o.shape[0] for o in self.outputs) == self.batch_size:
            whole = torch.cat([o.detach() for o in self.outputs]).requires_grad_()
            self.full_output = whole
            self.result = self.run_user_step()
            loss = _loss_of(self.result)
            (grad,) = torch.autograd.grad(loss / self.accumulate, whole, allow_unused=True)
            grad = torch.zeros_like(whole) if grad is None else grad
            self.grads = list(grad.split([o.shape[0] for o in self.outputs]))
        return _FromWholeBatch.apply(output, self, position)


class _FromWholeBatch(torch.autograd.Function):
    """A micro-batch's stand-in loss, whose gradient with respect to the micro-batch's
    output is that of the whole batch's loss (known once every micro-batch ran forward,
    which GPipe guarantees before the first backward)."""

    @staticmethod
    def forward(ctx, output, step, position):
        ctx.step, ctx.position = step, position
        return output.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return ctx.step.grads[ctx.position] * grad, None, None


def _loss_of(result: Any) -> torch.Tensor:
    if isinstance(result, dict):
        result = result.get("loss")
    if not isinstance(result, torch.Tensor) or result.ndim != 0:
        raise TypeError("training_step must return a scalar loss tensor (or a dict with a 'loss' entry)")
    return result


class _PipelineRunner(nn.Module):
    """What the loop calls under ddp_sequential: the step module, with the step recorded
    for ``sequential_module``'s forward; on the last stage a training step runs the
    pipeline schedule first (the user's step runs inside it)."""

    def __init__(self, step_module: nn.Module, strategy: DDPSequential):
        super().__init__()
        self.module = step_module
        self.strategy = strategy

    def forward(self, kind: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None):
        strategy = self.strategy
        if strategy.layout[0] == 1:  # one stage: no pipeline, plain data parallel
            return self.module(kind, batch, batch_idx, dataloader_idx)
        step = strategy._step = _Step(kind, batch, batch_idx, hookloop.batch_size_of(batch))
        try:
            if kind == "train" and strategy.is_last:
                return self._train_last_stage(step, dataloader_idx)
            result = self.module(kind, batch, batch_idx, dataloader_idx)
            if not step.used:
                raise hookloop.ConfigurationError(
                    f"the {kind} step never called self.sequential_module(...): under ddp_sequential "
                    f"every step must run the pipeline once")
            return result
        finally:
            strategy._step = None

    def _train_last_stage(self, step: _Step, dataloader_idx):
        strategy = self.strategy
        step.accumulate = strategy._accumulate
        step.run_user_step = lambda: self.module("train", step.batch, step.batch_idx, dataloader_idx)
        schedule = strategy.schedule(step.batch_size, train=True)
        step.shape_inference_pending = step.batch_size not in strategy._trained_batch_sizes
        schedule.step(target=torch.arange(step.batch_size, device=strategy._device()))
        strategy._trained_batch_sizes.add(step.batch_size)
        if step.full_output is None or not step.used:
            raise hookloop.ConfigurationError(
                "the training step never called self.sequential_module(...): under ddp_sequential "
                "every step must run the pipeline once")
        _broadcast_output(strategy, step.full_output.detach())
        return step.result


class _ThroughPipeline:
    """``sequential_module.forward`` during a ddp_sequential run."""

    def __init__(self, strategy: DDPSequential):
        self.strategy = strategy

    def __call__(self, input):
        strategy = self.strategy
        if strategy.layout[0] == 1:
            return nn.Sequential.forward(strategy._sequential, input)
        step = strategy._step
        if step is None:
            raise hookloop.ConfigurationError(
                "sequential_module was called outside a step: under ddp_sequential its layers are "
                "spread over processes and only a step (training_step, validation_step, "
                "test_step) runs them, through the pipeline")
        if step.used:
            raise hookloop.ConfigurationError(
                "sequential_module was called twice in one step: under ddp_sequential a step runs "
                "the pipeline once (concatenate the inputs into one batch instead)")
        step.used = True
        if step.kind == "train" and strategy.is_last:
            return step.full_output  # inside the schedule: the whole batch's output
        if strategy.is_first:
            if not isinstance(input, torch.Tensor) or input.shape[0] != step.batch_size:
                raise hookloop.ConfigurationError(
                    f"ddp_sequential feeds sequential_module's input into the pipeline in micro-batches "
                    f"along its first dimension, which must be the batch size ({step.batch_size}); got "
                    f"{type(input).__name__}{tuple(input.shape) if isinstance(input, torch.Tensor) else ''}")
            args = (input.to(strategy._device()),)
        else:
            args = ()
        train = step.kind == "train"
        schedule = strategy.schedule(step.batch_size, train)
        if train:
            schedule.step(*args)
            output = None
        else:
            output = schedule.step(*args)  # a schedule without a loss function runs forward only
        return _broadcast_output(strategy, output if strategy.is_last else None)


def _broadcast_output(strategy: DDPSequential, output: torch.Tensor | None) -> torch.Tensor:
    """The last stage's output on every rank of the pipeline (detached elsewhere)."""
    source = strategy._pipeline_ranks[-1]
    group = strategy._pipeline_group
    meta = [(tuple(output.shape), output.dtype) if output is not None else None]
    dist.broadcast_object_list(meta, src=source, group=group)
    shape, dtype = meta[0]
    if output is None:
        output = torch.empty(shape, dtype=dtype, device=strategy._device())
    dist.broadcast(output, src=source, group=group)
    return output
