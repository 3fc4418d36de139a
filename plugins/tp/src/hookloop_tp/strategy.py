"""The ``tp`` strategy: tensor parallelism with DTensor's ``parallelize_module``.

Built on :class:`hookloop_ddp.DDP` for a tp-only run (launching, the launcher's
environment, the process group, the collectives: ddp's ``ClusterEnvironment`` is what
reads torchrun's and SLURM's variables); this class changes the model (its layers split
over the ``tp`` dimension of the device mesh), the samplers (the processes of a tp group
see the same batches) and checkpoints (``torch.distributed.checkpoint`` in the core's
format, :mod:`hookloop.dcp`: resumable under another layout, loadable by one process).

Beside a data-parallel mesh plugin (fsdp on ``dp_shard``, HSDP on ``dp_replicate`` x
``dp_shard``; ddp x tp is refused at construction, see ``hookloop_ddp.strategy.DDP_X_TP``)
tp only transforms the model: the data-parallel
plugin leads the lifecycle (process group, samplers, gradient accumulation, backward,
optimizer, checkpoints, teardown's gathering) and tp's ``wrap_model`` splits the layers
in place and returns ``None``, so the leader's ``wrap_model`` (called next: the core
orders the transforms) wraps the already-DTensor model (docs/decisions.md, "fsdp x tp").
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookloop
from hookloop import ConfigurationError
from hookloop_ddp import DDP
from hookloop.resume import dcp as dcp_checkpoint
from hookloop.distributed.mesh import DATA_PARALLEL_DIMS, lifecycle_lead, mesh_dims

from . import plan as plans
from . import verify as checks

_DDP_OPTIONS_KEPT = ("process_group_backend", "sampler_seed", "timeout")


class _Parallelized:
    """One run's tensor-parallel module (the shape :mod:`hookloop.dcp` reads)."""

    def __init__(self, module: nn.Module, hooks: dict):
        self.module = module
        self.hooks = hooks  # {submodule: {hook dict name: keys there before}}


class _LossParallel:
    """torch's ``loss_parallel()`` as a re-entrant context (entered every step)."""

    def __enter__(self):
        from torch.distributed.tensor.parallel import loss_parallel

        self._context = loss_parallel()
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
               "_backward_pre_hooks")


class TP(DDP):
    """Tensor parallelism: each of the ``tp`` processes holds a slice of the split layers
    and computes its part of every step; all of them see the same batches.

    The plan (which layers are split, and how; :func:`hookloop_tp.resolve`): the option
    ``plan`` when it is a dict, else in this order of precedence:

    1. the module's ``configure_tensor_parallel(self, mesh)`` hook, which calls
       ``parallelize_module`` (or anything else) itself on the ``tp`` mesh;
    2. the module's ``tensor_parallel_plan`` attribute: a dict for
       ``torch.distributed.tensor.parallel.parallelize_module``
       (``{"mlp.fc1": ColwiseParallel(), "mlp.fc2": "rowwise", "layers.*.attn.q": "colwise"}``:
       torch's styles or their names, wildcards one level of the name at a time);
    3. a Hugging Face model's ``config.base_model_tp_plan`` (:func:`hookloop_tp.hf_plan`);
    4. the automatic plan (:func:`hookloop_tp.auto_plan`): separate attention q/k/v
       projections colwise and the output projection rowwise (a fused q/k/v left whole),
       gated MLPs' gate and up colwise and down rowwise, consecutive ``nn.Linear`` pairs
       colwise then rowwise, everything else replicated.

    Options (constructor arguments, ``plugin_options={"tp": {...}}`` or
    ``--plugin-option tp.NAME=VALUE``):

    ``plan``
        ``"auto"`` (default: the precedence above), ``"hf"`` (the Hugging Face plan;
        refused when the module carries none), ``"infer"`` (the automatic plan, whatever
        the module carries) or the plan itself, a dict as ``tensor_parallel_plan``
        (JSON on the command line).
    ``colwise`` / ``rowwise``
        the automatic plan's attention projection names (fnmatch patterns matched
        against a ``nn.Linear``'s attribute name): defaults
        :data:`hookloop_tp.plan.COLWISE` / :data:`hookloop_tp.plan.ROWWISE`.
    ``sequence_parallel``
        the automatic plan made sequence parallel (:func:`hookloop_tp.plan.sequence_parallel_plan`,
        torchtitan's Llama plan): the activations between the split blocks, norms and
        dropouts included, sharded on the sequence dimension (dimension 1) instead of
        replicated; the module's input split on entry and its output gathered on exit.
        A module's own plan asks for it with torch's styles itself (``SequenceParallel``,
        ``input_layouts=Shard(1)``); ``hookloop_tp.auto_plan(self, sequence_parallel=True)``
        in its ``tensor_parallel_plan`` starts from the automatic one.
    ``loss_parallel``
        compute the loss inside torch's ``loss_parallel()`` context (step and backward),
        for a model whose output is a DTensor sharded on the class dimension (a plan
        whose last layer is ``ColwiseParallel(use_local_output=False)``): the
        cross-entropy is computed without gathering the logits.
    ``verify``
        on (``True``, the default): at the start of every run the split model checks
        itself (:mod:`hookloop_tp.verify`): on the first batch, before its forward, the
        split module's forward and an unsharded copy's (the same weights) run on the same
        input (no gradients, eval mode, the random state restored); an output that
        differs beyond the dtype's tolerance stops the run on every process with a
        ``ConfigurationError`` naming the first module that differs and the likely cause
        (an attention viewing its heads with the global head count, a fused q/k/v
        projection split contiguously, an unpaired gate). Costs one unsharded copy of the
        module during the first step. ``False`` skips it. Not run beside the pipeline
        (each process holds only its stages).
    ``process_group_backend``, ``sampler_seed``, ``timeout``
        as for ddp.

    The plan applied is printed once, on global rank 0, at the start of every run
    (:func:`hookloop_tp.describe_plan`); ``hookloop plan --plugins tp ... train.py`` prints
    it without training.

    The mesh: the ``tp`` dimension of ``trainer.device_mesh`` when the core made one,
    else a 1-D mesh over all processes (a tp-only run).
    """

    hookloop_name = "tp"
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    hookloop_mesh_dims = ("tp",)

    _TP_OPTIONS = ("plan", "colwise", "rowwise", "loss_parallel", "sequence_parallel", "verify")
    # ddp's DistributedDataParallel options are not tp's (its constructor does not take them).
    _OPTIONS = _DDP_OPTIONS_KEPT + _TP_OPTIONS

    def __init__(
        self,
        plan: str | dict = "auto",
        colwise: tuple[str, ...] | list[str] | str = plans.COLWISE,
        rowwise: tuple[str, ...] | list[str] | str = plans.ROWWISE,
        loss_parallel: bool = False,
        sequence_parallel: bool = False,
        verify: bool = True,
        process_group_backend: str | None = None,
        sampler_seed: int | None = None,
        timeout: float | None = None,
    ):
        super().__init__(process_group_backend=process_group_backend, sampler_seed=sampler_seed, timeout=timeout)
        self.plan = plan
        self.colwise = colwise
        self.rowwise = rowwise
        self.loss_parallel = loss_parallel
        self.sequence_parallel = sequence_parallel
        self.verify = verify
        self._check: checks.SelfCheck | None = None
        self.mesh: Any = None
        self.parallel: _Parallelized | None = None
        self._own_mesh = False
        self._failed = False
        self.lead: str | None = None  # the data-parallel plugin leading the run, if any
        self._leader_gathers = False  # that leader gathers the split parameters at its teardown

    def _check_option(self, name: str, value: Any) -> None:
        if name == "plan":
            plans.check_plan_option(value)
        elif name in ("colwise", "rowwise"):
            _patterns(name, value)
        elif name in ("loss_parallel", "sequence_parallel", "verify"):
            if not isinstance(value, bool):
                raise ConfigurationError(f"tp option {name}={value!r} must be True or False")
        elif name == "sampler_seed":
            hookloop.check_sampler_seed("tp", value)
        else:
            super()._check_option(name, value)

    # -- environment ----------------------------------------------------------------------

    def _find_lead(self, trainer) -> str | None:
        """The strategy leading the lifecycle when it is not tp (the data-parallel one,
        :func:`hookloop.distributed.mesh.lifecycle_lead`), by name; ``None`` for a tp-only run."""
        lead = lifecycle_lead(getattr(trainer, "plugins", None) or ())
        # a data-parallel leader (fsdp) shards the split model further and gathers it at its
        # teardown; any other leader (the pipeline) leaves tp's DTensors to tp
        self._leader_gathers = bool(set(mesh_dims(lead) or ()) & set(DATA_PARALLEL_DIMS)) if lead is not None else False
        if lead is None or lead is self:
            return None
        return getattr(lead, "hookloop_name", None) or type(lead).__name__

    @hookloop.hookimpl
    def setup_environment(self, trainer):
        """ddp's (ranks, device, process group) in a tp-only run; beside a data-parallel
        plugin, ``None``: that plugin sets the environment up."""
        self.lead = self._find_lead(trainer)
        if self.lead is not None:
            return None
        return super().setup_environment(trainer)

    @hookloop.hookimpl
    def setup(self, trainer):
        """Take the ``tp`` mesh: the core's ``trainer.device_mesh["tp"]``, or one made here
        over all processes (kept as ``trainer.device_mesh`` for the samplers)."""
        self._failed = False
        # again here: beside the pipeline (whose ddp setup_environment answers first) tp's
        # setup_environment is not called, and a stale None would end wrap_model at tp
        # before fsdp (fsdp x tp x pipeline). Beside the pipeline alone tp stays a strategy
        # of its own (its process group, its gather at teardown), as in pp x tp.
        lead = self._find_lead(trainer)
        self.lead = lead if self._leader_gathers else None
        if self.lead is None:
            super().setup(trainer)
        mesh = getattr(trainer, "device_mesh", None)
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            self.mesh, self._own_mesh = mesh["tp"], False
        else:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(trainer.root_device.type, (trainer.world_size,), mesh_dim_names=("tp",))
            trainer.device_mesh, self._own_mesh = self.mesh, True
        if trainer.global_rank == 0:
            led = f" (the lifecycle led by {self.lead!r})" if self.lead else ""
            print(f"hookloop-tp: tensor parallel over {self.mesh.size()} processes{led}", flush=True)

    @hookloop.hookimpl
    def on_exception(self, trainer):
        """A failed run gathers nothing at teardown: the other ranks may not be there."""
        self._failed = True

    @hookloop.hookimpl
    def teardown(self, trainer):
        """The module whole again (each split parameter gathered: a collective), the
        plan's hooks removed, then ddp's teardown (the process group)."""
        parallel, self.parallel = self.parallel, None
        check, self._check = self._check, None
        if check is not None:
            check.disarm()  # a run that ended before its first forward: the copy freed
        try:
            if parallel is not None:
                # Led by a data-parallel plugin: the plan's hooks go, and the leader (teardown
                # next) gathers or keeps the shards; alone or beside the pipeline, tp gathers.
                gather = not self._leader_gathers and not self._failed and dist.is_initialized()
                _unparallelize(parallel, list(trainer.optimizers or []), gather)
        finally:
            if self._own_mesh:
                trainer.device_mesh = None
            self.mesh, self._own_mesh = None, False
            if self.lead is None:
                super().teardown(trainer)

    # -- model ----------------------------------------------------------------------------

    @hookloop.hookimpl
    def wrap_model(self, trainer, model, optimizers):
        """Split the user's module over the ``tp`` mesh with its plan (see :class:`TP`);
        point the optimizers of ``configure_optimizers`` at the distributed parameters.
        Every process starts from global rank 0's weights. Returns ``None``: the module is
        split in place, and the next transform (compile), then the leader beside a
        data-parallel plugin (or the core's default alone), wraps it."""
        from torch.distributed.tensor.parallel import parallelize_module

        module = model.module
        device = trainer.root_device
        model.to(device)
        with torch.no_grad():
            tensors = [t.data for t in (*module.parameters(), *module.buffers())]
            for t in tensors:
                dist.broadcast(t, src=0)
        names = {id(p): n for n, p in module.named_parameters()}
        hooks = {m: {d: set(getattr(m, d, {}).keys()) for d in _HOOK_DICTS} for m in module.modules()}
        self.parallel = _Parallelized(module, hooks)
        self._wrapped = None
        # the unsharded copy for the self-check, before the split (rank 0's weights)
        check = checks.SelfCheck(module, trainer) if self.verify and not _beside_pipeline(trainer) else None
        plan = self._plan(module)
        if trainer.global_rank == 0:
            for note in plan.notes:
                print(f"hookloop-tp: {note}", flush=True)
        if plan.source == "configure_tensor_parallel":
            module.configure_tensor_parallel(self.mesh)
            labels = checks.plan_of_parameters(module)
            table = checks.describe_plan(module, labels, "the module's configure_tensor_parallel", self.mesh.size())
        else:
            if not plan.styles and trainer.global_rank == 0:
                found = "the automatic plan found" if plan.source == "automatic" else f"the {plan.source} plan has"
                print(f"hookloop-tp: {found} nothing to split in {type(module).__name__}: "
                      f"every process computes the whole model (give it a tensor_parallel_plan)", flush=True)
            if plan.styles:
                plans.check_sizes(module, plan.styles, self.mesh.size())
                parallelize_module(module, self.mesh, plan.styles)
            labels = {n: checks.style_name(s) for n, s in plan.styles.items()}
            table = (checks.describe_plan(module, plan.styles, self._source(plan), self.mesh.size())
                     if plan.styles else None)
        if table and trainer.global_rank == 0:
            print(table, flush=True)
        if check is not None and labels:
            check.arm(labels, hooks)
            self._check = check
        hookloop.repoint_optimizers(optimizers or [], names, module, owner="tp")
        return None  # split in place: the next transform (compile), then the leader or the default, wraps

    def _plan(self, module: nn.Module) -> "plans.Plan":
        """The run's plan (the ``plan`` option; by default the module's hook or
        ``tensor_parallel_plan``, a Hugging Face plan, else the automatic one)."""
        return plans.resolve(module, self.plan, _patterns("colwise", self.colwise), _patterns("rowwise", self.rowwise),
                             sequence_parallel=self.sequence_parallel)

    def _source(self, plan: "plans.Plan") -> str:
        """Where ``plan`` came from, in the words of the printed table."""
        return {"tensor_parallel_plan": "the module's tensor_parallel_plan", "option": "the tp option plan",
                "hf": "the Hugging Face model's config.base_model_tp_plan",
                "automatic": "automatic" + (", sequence parallel" if self.sequence_parallel else "")}.get(
                    plan.source, plan.source)

    @hookloop.hookimpl
    def describe_model(self, trainer, module):
        """``hookloop plan``: the plan this run would apply to ``module``, as a table,
        without a mesh or a process group (the tp size from the run's ``--mesh`` or
        its number of processes)."""
        mesh = dict(getattr(trainer.config, "mesh", None) or {})
        size = trainer.config.num_processes() * (trainer.config.nodes or 1)
        if mesh.get("tp"):
            size = mesh["tp"]
        elif mesh:  # tp left out (or None): it takes what the other dimensions leave
            for other in (v for k, v in mesh.items() if k != "tp" and v):
                size //= other
        plan = self._plan(module)
        if plan.source == "configure_tensor_parallel":
            return (f"hookloop-tp: {type(module).__name__} splits itself in configure_tensor_parallel(mesh): its plan "
                    f"is known once a run calls it (printed at the start of the run, on rank 0)")
        table = checks.describe_plan(module, plan.styles, self._source(plan),
                                     size if isinstance(size, int) and size > 0 else None)
        return "\n".join([*(f"hookloop-tp: {note}" for note in plan.notes), table])

    @hookloop.hookimpl
    def wrap_optimizer(self, optimizer):
        """Nothing to wrap: ``wrap_model`` pointed the optimizer at the distributed parameters."""
        return None

    @hookloop.hookimpl
    def forward_context(self, trainer):
        """``loss_parallel()`` around each step when the option is on."""
        return _LossParallel() if self.loss_parallel else None

    @hookloop.hookimpl
    def backward(self, trainer, loss, model, optimizer):
        """Under ``loss_parallel``, the backward inside its context too (torch requires it)."""
        if not self.loss_parallel:
            return None
        with _LossParallel():
            loss.backward(**trainer.backward_kwargs)
        return True

    @hookloop.hookimpl
    def accumulation_context(self, model):
        """Nothing to skip: a tp step has no gradient all-reduce to defer (the leader's,
        beside a data-parallel plugin)."""
        return None if self.lead is not None else contextlib.nullcontext()

    @hookloop.hookimpl
    def configure_sampler(self, trainer, dataloader, training):
        """The data-parallel share (``hookloop.data_parallel_rank``): one for the whole tp group.
        Alone (one replica) the user's loader as it is: its own sampler, in the order global
        rank 0 draws, as one process would (:class:`hookloop.distributed.strategy.RankZeroOrder`)."""
        if self.lead is not None:
            return None  # the leader's: the same split (data_parallel_rank)
        return hookloop.DistributedSampling.configure_sampler(self, trainer, dataloader, training)

    # -- checkpoints ----------------------------------------------------------------------

    #: checkpoints are the core's sharded directories (:mod:`hookloop.dcp`)
    hookloop_checkpoint_format = "directory"

    @contextlib.contextmanager
    def sharded_state_dicts(self):
        """The module's ``state_dict()`` holds DTensors throughout a run (nothing to switch)."""
        yield

    @property
    def sharded(self):
        """The run's module, for :mod:`hookloop.dcp` (``None`` outside a run)."""
        return self.parallel

    @hookloop.hookimpl
    def save_checkpoint(self, trainer, checkpoint, path):
        """During a run, a directory of per-process shards written by every process
        (``torch.distributed.checkpoint``; committed atomically). After ``fit`` the module
        is whole again: ``None``, so the core writes its single file. Beside a
        data-parallel plugin: ``None``, the leader writes (the same format)."""
        if self.parallel is None or self.lead is not None:
            return None
        return dcp_checkpoint.save_sharded(self, trainer, checkpoint, Path(path))

    @hookloop.hookimpl
    def load_checkpoint(self, trainer, path):
        """A sharded directory (of tp or fsdp, any number of processes) or a file."""
        if self.lead is not None:
            return None
        return dcp_checkpoint.load(trainer, Path(path))

    @hookloop.hookimpl
    def load_model_state(self, trainer, checkpoint):
        """The checkpoint's model and optimizer state into this run's split layers
        (resharded by ``torch.distributed.checkpoint``), then the schedulers."""
        if self.parallel is None or self.lead is not None:
            return None
        dcp_checkpoint.load_model_state(self, trainer, checkpoint)
        return True


TensorParallel = TP


def _beside_pipeline(trainer) -> bool:
    """A pipeline plugin in the run: each process holds only its stages (no self-check)."""
    return any("pp" in (mesh_dims(p) or ()) for p in getattr(trainer, "plugins", None) or ())


def _patterns(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = tuple(v.strip() for v in value.split(",") if v.strip())
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigurationError(
            f"tp option {name}={value!r} must be module names (fnmatch patterns): a list of strings "
            f"or one comma-separated string")
    return tuple(value)


def _unparallelize(parallel: _Parallelized, optimizers: list, gather: bool) -> None:
    """Take tensor parallelism off the module: the plan's hooks removed, and with
    ``gather`` every DTensor parameter (and its optimizer state) a plain full tensor
    again, the optimizers pointed at them (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    module = parallel.module
    for m, before in parallel.hooks.items():
        for attr, keys in before.items():
            table = getattr(m, attr, None)
            if table is None:
                continue
            for key in [k for k in table if k not in keys]:
                del table[key]
    if not gather:
        return
    names = {id(p): n for n, p in module.named_parameters()}
    states = [[{k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in o.state.get(p, {}).items()}
               for g in o.param_groups for p in g["params"]] for o in optimizers]
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            if isinstance(p, DTensor):
                m._parameters[key] = nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad)
    for o in optimizers:
        o.state.clear()
    hookloop.repoint_optimizers(optimizers, names, module, owner="tp")
    for o, state in zip(optimizers, states):
        params = [p for g in o.param_groups for p in g["params"]]
        for p, s in zip(params, state):
            if s:
                o.state[p] = s
