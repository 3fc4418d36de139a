"""The ``fsdp`` strategy: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Built on :class:`hookloop_ddp.DDP` through its extension points: launching (torchrun,
several nodes), the launcher's environment, the process group and its teardown, the
samplers and the collectives are ddp's; this class changes the model (sharded units,
activation checkpointing, meta-device creation), precision, gradient accumulation and
checkpoints (``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookloop
from hookloop import ConfigurationError
from hookloop_ddp import DDP

from . import checkpoint as ckpt
from . import options as opts
from .sharding import (
    FSDPRoot,
    Sharded,
    broadcast_from_rank0,
    checkpoint_activations,
    detach_stale,
    materialise,
    reattach,
    repoint_optimizers,
    snapshot,
    unshard_module,
)

#: The key of this plugin's state in ``checkpoint["plugins"]`` (the fp16 scaler's).
CHECKPOINT_KEY = "fsdp"

# ddp's options that mean something under FSDP too; the others (DistributedDataParallel's
# own) are refused with a message rather than silently ignored.
_DDP_OPTIONS_KEPT = ("process_group_backend", "sampler_seed", "timeout")
_DDP_DEFAULTS = {n: p.default for n, p in inspect.signature(DDP.__init__).parameters.items() if n != "self"}


class FSDP(DDP):
    """Fully sharded data parallel training with PyTorch's FSDP2 (``fully_shard``).

    Each rank keeps a shard of every parameter, gradient and optimizer state; a unit's
    parameters are all-gathered for its forward and backward and its gradients are
    reduce-scattered. Launching, multi-node, the samplers and ``sync_dist`` are ddp's
    (``hookloop run --plugins fsdp --devices N [--nodes M ...]``).

    Options (constructor arguments, ``plugin_options={"fsdp": {...}}`` or
    ``--plugin-option fsdp.NAME=VALUE``), with Lightning's ``FSDPStrategy`` names:

    ``auto_wrap_policy``
        which submodules become FSDP units of their own (all-gathered one at a time):
        a set of ``nn.Module`` classes (or class names, e.g. ``{"Block"}``), a minimum
        number of parameters per unit (torch's size-based policy), a function
        ``module -> bool``, or ``None`` (default: the whole model is one unit). A class
        the model does not contain is an error.
    ``sharding_strategy``
        ``"FULL_SHARD"`` (default: parameters resharded after forward),
        ``"SHARD_GRAD_OP"`` (kept gathered from forward to backward:
        ``reshard_after_forward=False``), ``"NO_SHARD"`` (every rank holds everything;
        gradients all-reduced), ``"HYBRID_SHARD"`` (a 2-D mesh: replicate across
        nodes, shard within each; see ``device_mesh``). torch's ``ShardingStrategy``
        enum is accepted too.
    ``device_mesh``
        ``HYBRID_SHARD``'s mesh as ``(replicas, shard size)``; default ``(nodes,
        processes per node)``. Its product must be the number of processes.
    ``cpu_offload``
        keep sharded parameters, gradients and the optimizer step on the CPU
        (``CPUOffloadPolicy``).
    ``activation_checkpointing_policy``
        modules whose activations are recomputed in backward (torch's non-reentrant
        ``torch.utils.checkpoint``): a set of classes or class names, or a function
        ``module -> bool``.
    ``state_dict_type``
        ``"full"`` (default): ``module.state_dict()`` gathers plain full tensors
        (a collective), checkpoints are hookloop's single file written by rank 0, and
        after ``fit`` the module holds its full trained parameters again on every rank.
        ``"sharded"``: ``module.state_dict()`` holds this rank's DTensor shards,
        checkpoints are directories written by every rank in parallel with
        ``torch.distributed.checkpoint`` (resumable on another number of processes;
        ``hookloop fsdp collate`` makes one file of them), and after ``fit`` the
        module keeps its shards (nothing is ever gathered).
    ``meta_init``
        run the module's ``configure_model()`` on the meta device (default True), so
        the model is created sharded; ``False`` builds it normally on every rank.
    ``allow_cpu_fp16``
        run ``precision="16-mixed"``/``"16-true"`` on the CPU (meant for CUDA; for tests).
    ``process_group_backend``, ``sampler_seed``, ``timeout``
        as for ddp: the backend (gloo on CPU, nccl on CUDA), the samplers' seed, the
        collectives' timeout in seconds.

    Precision comes from ``--precision`` (the strategy owns it: hookloop-amp steps
    aside): ``bf16-mixed`` / ``16-mixed`` compute in half precision on fp32 sharded
    weights (``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``; fp16 with a
    sharded gradient scaler), ``bf16-true`` / ``16-true`` keep the weights in half
    precision.
    """

    hookloop_name = "fsdp"
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    hookloop_owns = frozenset({"precision"})

    @property
    def hookloop_mesh_dims(self) -> tuple[str, ...]:
        """The device-mesh dimensions it shards over (:mod:`hookloop.mesh`): ``dp_shard``,
        and ``dp_replicate`` too under ``HYBRID_SHARD`` (HSDP)."""
        if opts.sharding_strategy(self.sharding_strategy) in ("HYBRID_SHARD", "NO_SHARD"):
            return ("dp_replicate", "dp_shard")
        return ("dp_shard",)

    @property
    def hookloop_refuses_beside(self) -> dict[str, str]:
        """The layouts of an fsdp variant that no test checks yet, refused at construction
        (:func:`hookloop.distributed.mesh.check_refusals`; docs/configurations.md, "Every pair of mesh
        plugins"): ``cpu_offload`` and ``NO_SHARD`` beside tp, the pipeline or compile;
        ``HYBRID_SHARD`` (HSDP, checked beside tp) beside the pipeline or compile. The
        default (``FULL_SHARD``) is checked beside all three; ``SHARD_GRAD_OP`` (the same
        ``fully_shard`` without resharding after the forward) is taken as it."""
        strategy = opts.sharding_strategy(self.sharding_strategy)
        variant = [f"sharding_strategy={strategy!r}"] if strategy in ("HYBRID_SHARD", "NO_SHARD") else []
        if self.cpu_offload:
            variant.append("cpu_offload=True")
        if not variant:
            return {}
        others = {"pp": "the pipeline", "compile": "compile"}
        if self.cpu_offload or strategy == "NO_SHARD":
            others["tp"] = "tp"
        return {key: (f"fsdp with {' and '.join(variant)} is not checked beside {what} by any test yet: beside "
                      f"{what} use fsdp's default sharding (FULL_SHARD) without cpu_offload, or run fsdp with "
                      f"{' and '.join(variant)} without {what}") for key, what in others.items()}

    def hookloop_mesh_sizes(self, trainer) -> dict[str, int]:
        """Sizes of its own dimensions when the run gives none (``--mesh`` wins):
        ``HYBRID_SHARD``'s ``device_mesh`` option or (nodes, processes per node), and
        ``NO_SHARD``'s (world, 1)."""
        dims = self.hookloop_mesh_dims
        if len(dims) == 1 or all(trainer.config.mesh.get(d) for d in dims):
            return {}  # the user's sizes win: nothing to propose (nor to check against nodes)
        others = math.prod(s for d, s in trainer.config.mesh.items() if d not in dims and s)
        data_parallel = trainer.world_size // others
        # (nodes, data-parallel processes per node): a node's processes are also split by
        # the other dimensions (tp inside a node), so its share is local_world_size / others.
        per_node = self.cluster.local_world_size if self.cluster else None
        if per_node is not None:
            per_node = per_node // others if per_node % others == 0 else None
        shape = opts.mesh_shape(opts.sharding_strategy(self.sharding_strategy), opts.device_mesh(self.device_mesh),
                                data_parallel, per_node)
        return dict(zip(dims, shape))

    _FSDP_OPTIONS = (
        "auto_wrap_policy", "sharding_strategy", "device_mesh", "cpu_offload",
        "activation_checkpointing_policy", "state_dict_type", "meta_init", "allow_cpu_fp16",
    )
    _OPTIONS = DDP._OPTIONS + _FSDP_OPTIONS

    def __init__(
        self,
        auto_wrap_policy: Any = None,
        sharding_strategy: Any = "FULL_SHARD",
        device_mesh: tuple[int, int] | None = None,
        cpu_offload: bool = False,
        activation_checkpointing_policy: Any = None,
        state_dict_type: str = "full",
        meta_init: bool = True,
        allow_cpu_fp16: bool = False,
        process_group_backend: str | None = None,
        sampler_seed: int | None = None,
        timeout: float | None = None,
    ):
        super().__init__(process_group_backend=process_group_backend, sampler_seed=sampler_seed, timeout=timeout)
        self.auto_wrap_policy = auto_wrap_policy
        self.sharding_strategy = sharding_strategy
        self.device_mesh = device_mesh
        self.cpu_offload = cpu_offload
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self.state_dict_type = state_dict_type
        self.meta_init = meta_init
        self.allow_cpu_fp16 = allow_cpu_fp16
        # Run state.
        self.mesh: Any = None
        self.sharded: Sharded | None = None
        self._full_hooks: list = []
        self._gather_state_dicts = True
        self._failed = False
        self._scaling: _GradScaling | None = None

    def _check_option(self, name: str, value: Any) -> None:
        if name in DDP._OPTIONS and name not in _DDP_OPTIONS_KEPT:
            if value is not _DDP_DEFAULTS.get(name) and value != _DDP_DEFAULTS.get(name):
                raise ConfigurationError(
                    f"fsdp option {name}={value!r} is one of DistributedDataParallel's, which the fsdp "
                    f"strategy does not use (FSDP all-gathers parameters and reduce-scatters gradients "
                    f"itself). Its options: {', '.join(self._FSDP_OPTIONS + _DDP_OPTIONS_KEPT)}")
            return
        if name == "auto_wrap_policy":
            opts.module_policy(name, value, sizes=True)
        elif name == "activation_checkpointing_policy":
            opts.module_policy(name, value, sizes=False)
        elif name == "sharding_strategy":
            opts.sharding_strategy(value)
        elif name == "state_dict_type":
            opts.state_dict_type(value)
        elif name == "device_mesh":
            opts.device_mesh(value)
        elif name in ("cpu_offload", "meta_init", "allow_cpu_fp16"):
            opts.check_bool(name, value)
        else:
            super()._check_option(name, value)

    # -- launching ------------------------------------------------------------------------

    @hookloop.hookimpl(tryfirst=True)  # a check, not a launch: before the launcher answers
    def launch_command(self, config):
        """Check the mesh against the processes about to start, in the launching process
        (``plugin_options`` are final only now). Returns ``None``: torchrun, as ddp."""
        if isinstance(config.devices, int) and config.devices >= 1:
            per_node = config.num_processes()
            opts.mesh_shape(opts.sharding_strategy(self.sharding_strategy), opts.device_mesh(self.device_mesh),
                            per_node * config.nodes, per_node)
        return None

    # -- environment ----------------------------------------------------------------------

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        """Check precision and the mesh against this run, make the device mesh, and for
        ``16-mixed`` register the sharded gradient scaler."""
        self._failed = False
        opts.check_precision(trainer.precision, trainer.root_device, self.allow_cpu_fp16)
        shape = self.make_mesh(trainer)
        if trainer.precision == "16-mixed" and stage == "fit":
            scaler = trainer.hook.configure_grad_scaler(trainer=trainer, device=trainer.root_device, options={})
            self._scaling = _GradScaling(scaler)
            trainer.plugin_manager.register(self._scaling, name=f"{self.hookloop_name}.grad_scaling")
        if trainer.global_rank == 0:
            dims = " x ".join(map(str, shape))
            strategy = opts.sharding_strategy(self.sharding_strategy)
            print(f"hookloop-fsdp: {strategy} on a {dims} mesh, precision {trainer.precision}, "
                  f"state_dict_type {opts.state_dict_type(self.state_dict_type)}", flush=True)

    def make_mesh(self, trainer) -> tuple[int, ...]:
        """The device mesh of this run (``self.mesh``) for ``sharding_strategy`` on
        ``trainer.world_size`` processes; returns its shape."""
        from torch.distributed.device_mesh import init_device_mesh

        own = hookloop.submesh(trainer, self)
        if own is not None:  # the run's mesh (hookloop.mesh): fsdp's dimensions of it
            # the options checked against the processes fsdp spans (device_mesh is HSDP's)
            whole = own.size() == trainer.world_size
            opts.mesh_shape(opts.sharding_strategy(self.sharding_strategy), opts.device_mesh(self.device_mesh),
                            own.size(), self.cluster.local_world_size if self.cluster and whole else None)
            self.mesh = own
            return tuple(own.shape)
        shape = opts.mesh_shape(opts.sharding_strategy(self.sharding_strategy), opts.device_mesh(self.device_mesh),
                                trainer.world_size, self.cluster.local_world_size if self.cluster else None)
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        self.mesh = init_device_mesh(trainer.root_device.type, shape, mesh_dim_names=names)
        return shape

    @hookloop.hookimpl
    def configure_grad_scaler(self, device, options):
        """torch's ``ShardedGradScaler``: each rank checks its gradient shards for inf/nan
        and the verdict is all-reduced, so every rank skips the same steps."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type, **options)

    @hookloop.hookimpl
    def on_exception(self, trainer):
        """A failed run gathers nothing at teardown: the other ranks may not be there."""
        self._failed = True

    @hookloop.hookimpl
    def teardown(self, trainer):
        """Take FSDP off the module (gathering it whole under ``state_dict_type="full"``),
        then ddp's teardown: the unwrapped step module back in ``trainer.model``, the
        process group destroyed."""
        for handle in self._full_hooks:
            handle.remove()
        self._full_hooks = []
        scaling, self._scaling = self._scaling, None
        if scaling is not None:
            trainer.plugin_manager.unregister(scaling)
        sharded, self.sharded = self.sharded, None
        try:
            if sharded is not None:
                gather = self._full and not self._failed and dist.is_initialized()
                unshard_module(sharded, list(trainer.optimizers), gather=gather)
        finally:
            self.mesh = None
            super().teardown(trainer)

    @property
    def _full(self) -> bool:
        return opts.state_dict_type(self.state_dict_type) == "full"

    @property
    def hookloop_checkpoint_format(self) -> str:
        """``"directory"`` under ``state_dict_type="sharded"`` (a ``TaggedCheckpointDir`` of
        shards): the checkpoint observer then installs ``last.ckpt`` as a directory and a
        restart finds it."""
        return "file" if self._full else "directory"

    #: ``ModelCheckpoint(async_save=True)`` writes in the background: under
    #: ``state_dict_type="full"`` the gathered state is one ``atomic_save`` on rank 0 (a CPU
    #: snapshot, written by the checkpoint writer); under ``"sharded"`` every rank's shards
    #: go through ``torch.distributed.checkpoint.async_save`` and the tag is committed by
    #: the writer once they are on disk (``hookloop.defer``).
    hookloop_async_save = True

    # -- model ----------------------------------------------------------------------------

    @hookloop.hookimpl
    def model_init_context(self, trainer):
        """``configure_model()`` runs on the meta device: no tensor is allocated until the
        model is sharded (``meta_init=False``: normally). Beside a plugin that splits the
        model before fsdp shards it (tp), ``meta_init=True`` is refused: tp splits real
        weights, every process starting from rank 0's."""
        if self.meta_init:
            splitters = _splitters(trainer, self)
            if splitters:
                raise ConfigurationError(
                    f"fsdp option meta_init=True creates the model of configure_model() on the meta "
                    f"device, and {', '.join(repr(n) for n in splitters)} splits the model before fsdp "
                    f"shards it, which needs real weights (every process takes rank 0's, then keeps "
                    f"its slice): set --plugin-option fsdp.meta_init=false (or "
                    f"hookloop.plugin('fsdp', meta_init=False)); configure_model then builds the model "
                    f"whole on every process (docs/configurations.md, 'fsdp x tp', FT1)")
        return torch.device("meta") if self.meta_init else contextlib.nullcontext()

    @hookloop.hookimpl
    def wrap_model(self, trainer, model, optimizers):
        """Shard the user's module into FSDP units under a root unit; point the optimizers
        of ``configure_optimizers`` at the sharded parameters."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        from torch.distributed.tensor import DTensor

        module = model.module
        strategy = opts.sharding_strategy(self.sharding_strategy)
        # The policies are checked against the model before anything is changed.
        units = opts.wrap_units(opts.module_policy("auto_wrap_policy", self.auto_wrap_policy, sizes=True), module)
        recomputed = opts.checkpointed_modules(
            opts.module_policy("activation_checkpointing_policy", self.activation_checkpointing_policy, sizes=False), module)
        names = {id(p): n for n, p in module.named_parameters()}
        stale = detach_stale(module, self.mesh)
        real = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
        device = trainer.root_device
        with torch.no_grad():
            for t in real:
                t.data = t.data.to(device)
        # tp's DTensors (fsdp x tp) took rank 0's weights before tp split them: each tp
        # rank holds another slice, which a broadcast from rank 0 would overwrite.
        broadcast_from_rank0([t.data for t in real if not isinstance(t, DTensor)])
        stored, computed = opts.PRECISIONS[trainer.precision]
        dtypes = {(id(m), n): t.dtype for m in module.modules()
                  for n, t in (*m._parameters.items(), *m._buffers.items()) if t is not None and t.is_meta}
        if stored is not None:
            module.to(stored)  # bf16-true: the weights themselves in half precision
        root = FSDPRoot(model)
        snapshots = snapshot(root)
        checkpoint_activations(recomputed)
        kwargs: dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": strategy != "SHARD_GRAD_OP"}
        if computed is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=computed,
                                                       reduce_dtype=torch.float32 if stored is None else computed)
        kwargs["offload_policy"] = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available() and device.type == "cuda")
                                    if self.cpu_offload else OffloadPolicy())
        root_reshard = None  # torch's choice for a root: kept gathered from forward to backward
        if not trainer.automatic_optimization:
            # Manual optimization steps inside the root's forward (training_step runs in
            # it): a unit gathered once per forward would run on its weights from before
            # the step. So every module with parameters of its own is a unit, gathered at
            # each call and resharded after it, and the root holds none.
            chosen = set(units) | {m for m in module.modules() if any(True for _ in m.parameters(recurse=False))}
            units = opts.wrap_units(chosen.__contains__, module)
            kwargs["reshard_after_forward"] = root_reshard = True
        # From here on teardown takes FSDP off again, whatever fails.
        self.sharded = Sharded(root=root, module=module, snapshots=snapshots)
        self._wrapped = (model, root)  # ddp's teardown gives trainer.model back
        stages = getattr(trainer, "pipeline_stages", None)
        if stages:
            # Under a pipeline (pp > 1) each rank shards its own stage modules only, per
            # block then each stage as a root (torchtitan's per model part); the schedule
            # drives them across micro-batches; the other stages stay whole, untrained here.
            inside = {id(m) for stage in stages for m in stage.modules()}
            for unit in units:
                if id(unit) in inside and all(unit is not stage for stage in stages):
                    fully_shard(unit, **kwargs)
            for stage in stages:
                fully_shard(stage, **{**kwargs, "reshard_after_forward": root_reshard})
        else:
            for unit in units:
                fully_shard(unit, **kwargs)
            fully_shard(root, **{**kwargs, "reshard_after_forward": root_reshard})
        materialise(root, torch.device("cpu") if self.cpu_offload else device, dtypes, keep=set(stale))
        reattach(module, stale)
        repoint_optimizers(optimizers, names, module)
        if self._full:
            self._install_full_state_dict(module)
        return root

    @hookloop.hookimpl
    def wrap_optimizer(self, optimizer):
        """Nothing to wrap: ``wrap_model`` pointed the optimizer at the sharded parameters."""
        return None

    def _install_full_state_dict(self, module: nn.Module) -> None:
        """``state_dict_type="full"``: ``state_dict()`` of the module (or of any part of
        it) returns plain full tensors, gathered from the shards on every rank (to the
        CPU), as FSDP's full state dicts are. A collective: call it on every rank."""
        from torch.distributed.tensor import DTensor

        def gather(m, state_dict, prefix, local_metadata):
            if not self._gather_state_dicts:
                return
            for name, value in m._parameters.items():
                key = prefix + name
                if isinstance(state_dict.get(key), DTensor):
                    state_dict[key] = state_dict[key].full_tensor().detach().cpu()

        for m in module.modules():
            if any(isinstance(p, DTensor) for p in m._parameters.values()):
                self._full_hooks.append(m.register_state_dict_post_hook(gather))

    @contextlib.contextmanager
    def sharded_state_dicts(self):
        """Inside it, ``state_dict()`` returns DTensor shards even under
        ``state_dict_type="full"`` (for ``torch.distributed.checkpoint``'s own calls)."""
        previous, self._gather_state_dicts = self._gather_state_dicts, False
        try:
            yield
        finally:
            self._gather_state_dicts = previous

    # -- the step -------------------------------------------------------------------------

    @hookloop.hookimpl
    def accumulation_context(self, model):
        """Non-boundary micro-batches accumulate unsharded gradients without reducing
        them: ``set_requires_gradient_sync(False)`` on every unit, for that micro-batch."""
        return _no_gradient_sync(model)

    # reduce (half precision in float32), barrier, broadcast: hookloop.TorchDistributed's.

    # -- checkpoints ----------------------------------------------------------------------

    @hookloop.hookimpl
    def save_checkpoint(self, trainer, checkpoint, path):
        """Write the configured format, on every rank: ``full``, hookloop's file (rank 0,
        atomic, gathered optimizer state); ``sharded``, a directory of per-rank shards
        (``torch.distributed.checkpoint``, committed atomically). After ``fit`` (no process
        group) a sharded module is re-attached to a process group made for the write."""
        path = Path(path)
        if self.sharded is None and not self._full and dist.is_available() and not dist.is_initialized():
            return ckpt.save_after_run(self, trainer, checkpoint, path)
        if self._full:
            return ckpt.save_full(self, trainer, checkpoint, path)
        return ckpt.save_sharded(self, trainer, checkpoint, path)

    @hookloop.hookimpl
    def load_checkpoint(self, trainer, path):
        """A checkpoint file (``full``, or any hookloop checkpoint) or a sharded directory;
        either loads under either ``state_dict_type``."""
        return ckpt.load(trainer, Path(path))

    @hookloop.hookimpl
    def load_model_state(self, trainer, checkpoint):
        """Put the checkpoint's model and optimizer state into the shards (a full state
        dict is sliced on every rank; a sharded one is resharded by
        ``torch.distributed.checkpoint`` for this number of processes), then the
        schedulers."""
        if self.sharded is None:
            return None
        ckpt.load_model_state(self, trainer, checkpoint)
        return True


FSDPStrategy = FSDP  # Lightning's name


class FSDPCPUOffload(FSDP):
    """FSDP with parameters, gradients and the optimizer step offloaded to the CPU
    (Lightning's ``"fsdp_cpu_offload"``); every :class:`FSDP` option applies."""

    hookloop_name = "fsdp_cpu_offload"

    def __init__(self, **options: Any):
        super().__init__(**{"cpu_offload": True, **options})


def _splitters(trainer, fsdp) -> list[str]:
    """The enabled mesh plugins whose ``wrap_model`` splits the model before fsdp's
    (the pipeline and tp-like: :func:`hookloop.distributed.mesh.transform_stage` 0 or 1), by name."""
    from hookloop.distributed.mesh import transform_stage
    from hookloop.contract.pluginspec import plugin_name

    return [plugin_name(p) for p in getattr(trainer, "plugins", None) or ()
            if p is not fsdp and transform_stage(p) in (0, 1)]


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module):
    if not callable(getattr(model, "set_requires_gradient_sync", None)):
        yield  # the stages of a pipeline: its schedule syncs each stage's last micro-batch
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class _GradScaling:
    """``precision="16-mixed"``: the scaled backward and step of
    :class:`hookloop.GradScaling`, with the scaler of the ``configure_grad_scaler`` hook
    (fsdp's own: torch's ``ShardedGradScaler``). Registered by :meth:`FSDP.setup` for
    fp16 runs only."""

    hookloop_role = "extension"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self, scaler: Any):
        self.scaling = hookloop.GradScaling(scaler)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because a rank found inf/nan, in this run."""
        return self.scaling.skipped_steps

    @hookloop.hookimpl
    def backward(self, trainer, loss):
        """Backpropagate the scaled loss."""
        return self.scaling.backward(trainer, loss)

    @hookloop.hookimpl
    def optimizer_step(self, trainer, optimizer):
        """Unscale the gradient shards, clip, step unless a rank found inf/nan, update the
        scale; returns whether the step was taken."""
        with warnings.catch_warnings():
            # found_inf, a one-element tensor, meets the DTensor gradients as a replica.
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            return self.scaling.step(trainer, optimizer)

    @hookloop.hookimpl
    def on_save_checkpoint(self, checkpoint):
        """The scaler's state, under ``checkpoint["plugins"]["fsdp"]["scaler"]``."""
        checkpoint["plugins"].setdefault(CHECKPOINT_KEY, {})["scaler"] = self.scaling.scaler.state_dict()

    @hookloop.hookimpl
    def on_load_checkpoint(self, checkpoint):
        """Restore the scaler's state, if the checkpoint has one."""
        saved = checkpoint.get("plugins", {}).get(CHECKPOINT_KEY, {}).get("scaler")
        if saved:
            self.scaling.load_state_dict(saved)
