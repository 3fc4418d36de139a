"""The ``ddp`` strategy: one process per device, gradients all-reduced by DDP.

The processes come from a launcher (``hookloop run --plugins ddp --devices N``, plain
``torchrun``, or a SLURM job step); each one runs the user's script, so nothing has to
be pickled. Advanced users subclass :class:`DDP` and override
:meth:`DDP.init_process_group` or :meth:`DDP.configure_ddp` (see the README).
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookloop
from hookloop.helpers import check_timeout_seconds

from . import comm
from .environment import ClusterEnvironment

#: The key ``ddp`` itself saves its state under in ``checkpoint["plugins"]``. A subclass
#: saves under its own plugin name (``ddp_spawn``, ``localsgd``...), and loads from its own
#: key, else from the first of these present: the key every ddp subclass used before
#: issue 20 ("ddp"), and ddp's own family, so a checkpoint of one resumes under another.
CHECKPOINT_KEY = "ddp"
FALLBACK_KEYS = ("ddp", "ddp_spawn", "ddp2")



def check_backend(name: Any) -> None:
    """Raise ``ConfigurationError`` unless ``name`` is a process-group backend this torch has.

    Accepts a backend (``"gloo"``), or a per-device list (``"cpu:gloo,cuda:nccl"``).
    """
    if name is None:
        return
    if not isinstance(name, str) or not name.strip():
        raise hookloop.ConfigurationError(
            f"process_group_backend={name!r} must be a backend name such as 'gloo' or 'nccl' "
            f"(or None for gloo on CPU, nccl on CUDA)"
        )
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    for part in name.split(","):
        backend = part.split(":")[-1].strip().lower()
        if backend not in dist.Backend.backend_list:
            raise hookloop.ConfigurationError(
                f"process_group_backend={name!r}: {backend!r} is not a torch.distributed "
                f"backend. Known: {', '.join(known)}; use 'gloo' on CPU, 'nccl' on CUDA, or "
                f"None to choose by device. A third-party backend must be registered with "
                f"torch.distributed.Backend.register_backend before the Trainer is created."
            )
        if not dist.is_backend_available(backend):
            raise hookloop.ConfigurationError(
                f"process_group_backend={name!r}: this torch build ({torch.__version__}) has "
                f"no {backend!r} backend. Use 'gloo' (every build has it), or None to choose "
                f"by device."
            )


def _check_type(name: str, value: Any, kinds: tuple, rule: str, ok: bool = True) -> None:
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds or not ok:
        raise hookloop.ConfigurationError(f"ddp option {name}={value!r}: {rule}")


#: Why ddp x tp is refused, and what to run instead (docs/configurations.md).
DDP_X_TP = ("DistributedDataParallel replicates plain tensors, and tp's split layers hold DTensors, so "
            "--plugins ddp,tp --mesh dp_replicate=R,tp=T is not supported. For R data-parallel replicas of a "
            "tensor-parallel model use fsdp: --plugins fsdp,tp --mesh dp_shard=R,tp=T, or replicas of fsdp "
            "shards (HSDP): --plugins fsdp,tp --plugin-option fsdp.sharding_strategy=HYBRID_SHARD "
            "--mesh dp_replicate=R,dp_shard=S,tp=T (dp_shard=1: whole replicas, ddp's layout)")


class DDP(hookloop.TorchDistributed):
    """Distributed data parallel training with ``torch.nn.parallel.DistributedDataParallel``.

    Options (constructor arguments, or ``plugin_options={"ddp": {...}}``):

    ``process_group_backend``
        ``None`` (gloo on CPU, nccl on CUDA), or a torch.distributed backend name.
    ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
    ``bucket_cap_mb``, ``broadcast_buffers``
        passed to ``DistributedDataParallel`` (``None`` keeps torch's default).
    ``comm_hook``
        ``None``, ``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"post_localsgd"``, or your own
        hook ``hook(state, bucket) -> Future`` with ``comm_state``.
    ``powersgd_rank``, ``powersgd_start_iter``, ``powersgd_min_compression_rate``
        PowerSGD's matrix rank, the step it starts compressing at, and the smallest
        compression worth doing.
    ``localsgd_start_iter``, ``model_averaging_period``, ``localsgd_group_size``,
    ``localsgd_gradient_allreduce``
        post-localSGD: global all-reduce for the first steps, then gradients are
        all-reduced only within subgroups of ``localsgd_group_size`` ranks (default: the
        processes of a node; ``localsgd_gradient_allreduce=False``: not at all) and the
        parameters of all ranks are averaged every ``model_averaging_period`` steps.
    ``sampler_seed``
        seed of the distributed samplers (the same on every rank); ``None``: the seed
        ``hookloop.seed_everything`` set (``PL_GLOBAL_SEED``, else 0), as in Lightning.
    ``timeout``
        seconds a collective may wait before failing (``None``: the Trainer's
        ``process_group_timeout``, whose default is gloo 300 s, nccl 600 s).
    """

    hookloop_name = "ddp"
    #: the device-mesh dimension it replicates over (hookloop.mesh): it composes with
    #: mesh plugins on other dimensions (tp, pp), one data-parallel wrapper per run
    hookloop_mesh_dims = ("dp_replicate",)
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    @property
    def hookloop_refuses_beside(self) -> dict[str, str]:
        """ddp x tp is refused at construction (hookloop.distributed.mesh.check_refusals; docs/decisions.md,
        "ddp x tp is refused"). A property: fsdp, the pipeline and tp inherit this class and
        compose with tp; only DistributedDataParallel on ``dp_replicate`` alone refuses it."""
        from hookloop.distributed.mesh import mesh_dims

        if tuple(mesh_dims(self) or ()) != ("dp_replicate",):
            return {}
        return {"tp": DDP_X_TP}

    _OPTIONS = (
        "process_group_backend", "find_unused_parameters", "static_graph",
        "gradient_as_bucket_view", "bucket_cap_mb", "broadcast_buffers", "comm_hook",
        "comm_state", "powersgd_rank", "powersgd_start_iter", "powersgd_min_compression_rate",
        "localsgd_start_iter", "model_averaging_period", "localsgd_group_size",
        "localsgd_gradient_allreduce", "sampler_seed", "timeout",
    )

    def __init__(
        self,
        process_group_backend: str | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool | None = None,
        comm_hook: Any = None,
        comm_state: Any = None,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 1000,
        powersgd_min_compression_rate: float = 2.0,
        localsgd_start_iter: int = 1000,
        model_averaging_period: int = 4,
        localsgd_group_size: int | None = None,
        localsgd_gradient_allreduce: bool = True,
        sampler_seed: int | None = None,
        timeout: float | None = None,
    ):
        options = dict(locals())
        for name in DDP._OPTIONS:
            setattr(self, name, options[name])
        self.cluster: ClusterEnvironment | None = None
        self.comm_hook_state: Any = None
        self._wrapped: tuple[nn.Module, nn.Module] | None = None  # (inner, DDP wrapper)
        self._manual_backward: Any = None  # registered for manual optimization only

    # Options are checked whenever they are set, so ``plugin_options`` given to the
    # Trainer fail at ``Trainer(...)``, before any process starts.
    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OPTIONS:
            self._check_option(name, value)
        object.__setattr__(self, name, value)

    def _check_option(self, name: str, value: Any) -> None:
        if name == "process_group_backend":
            check_backend(value)
        elif name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "localsgd_gradient_allreduce"):
            _check_type(name, value, (bool,), "must be True or False")
        elif name == "broadcast_buffers":
            _check_type(name, value, (bool, type(None)), "must be True, False or None")
        elif name == "timeout":
            # the process group's timeout: the range of Trainer(process_group_timeout=...)
            check_timeout_seconds(f"{self.hookloop_name} option timeout", value)
        elif name == "bucket_cap_mb":
            if value is not None:
                _check_type(name, value, (int, float), "must be a finite number of MiB > 0, or None",
                            ok=isinstance(value, (int, float)) and math.isfinite(value) and value > 0)
        elif name == "comm_hook":
            if value is not None and not callable(value) and value not in comm.COMM_HOOKS:
                raise hookloop.ConfigurationError(
                    f"ddp option comm_hook={value!r} must be None, one of "
                    f"{', '.join(repr(h) for h in comm.COMM_HOOKS)}, or a DDP communication "
                    f"hook function hook(state, bucket) -> torch.futures.Future"
                )
        elif name == "powersgd_rank":
            _check_type(name, value, (int,), "must be an integer >= 1", ok=isinstance(value, int) and value >= 1)
        elif name == "powersgd_start_iter":
            # PowerSGD keeps per-bucket state; DDP rebuilds its buckets after step 1.
            _check_type(name, value, (int,), "must be an integer >= 2 (PowerSGD can only start after DDP's first two steps)", ok=isinstance(value, int) and value >= 2)
        elif name == "powersgd_min_compression_rate":
            _check_type(name, value, (int, float), "must be a number >= 1", ok=isinstance(value, (int, float)) and value >= 1)
        elif name == "localsgd_start_iter":
            _check_type(name, value, (int,), "must be an integer >= 0", ok=isinstance(value, int) and value >= 0)
        elif name == "model_averaging_period":
            _check_type(name, value, (int,), "must be an integer >= 1", ok=isinstance(value, int) and value >= 1)
        elif name == "localsgd_group_size":
            if value is not None:
                _check_type(name, value, (int,), "must be None or an integer >= 1", ok=isinstance(value, int) and value >= 1)
        elif name == "sampler_seed":
            hookloop.check_sampler_seed("ddp", value)

    # -- extension points: override in a subclass --------------------------------------

    def init_process_group(self, trainer) -> None:
        """Initialise ``torch.distributed`` for this process (Lightning's ``init_ddp_connection``).

        Called by :meth:`setup_environment` when no process group exists yet, after
        ``trainer.world_size``, ``global_rank``, ``local_rank``, ``node_rank`` and
        ``root_device`` are set from the launcher's environment (``self.cluster``).
        Override it to rendezvous differently (a file store, your own timeout...); it
        must leave the default process group initialised with those ranks. The group it
        creates is destroyed at teardown.
        """
        cluster = self.cluster
        if cluster.world_size > 1 and not (cluster.master_addr and cluster.master_port):
            raise hookloop.ConfigurationError(
                f"{cluster.source} started {cluster.world_size} processes but MASTER_ADDR / "
                f"MASTER_PORT are not set, so the processes cannot find each other: launch "
                f"with `hookloop run --plugins ddp --devices N` or torchrun"
            )
        # Each group gets fresh keys in the launcher's store (hookloop.init_process_group).
        # The plugin's own timeout wins over the Trainer's; None: the backend's default.
        timeout = self.timeout if self.timeout is not None else trainer.config.process_group_timeout
        hookloop.init_process_group(self.backend(trainer), cluster.global_rank, cluster.world_size,
                                    timeout=timeout, master_addr=cluster.master_addr,
                                    master_port=cluster.master_port)

    def configure_ddp(self, trainer, model: nn.Module) -> nn.Module:
        """Wrap ``model`` (already on ``trainer.root_device``) for data-parallel training.

        Override it to use your own wrapper or DDP arguments that are not options here.
        Whatever it returns is what the loop calls (``model(kind, batch, batch_idx)``),
        so it must forward to ``model``; ``no_sync()`` is used for gradient accumulation
        when the wrapper has it, and ``register_comm_hook`` when a ``comm_hook`` is set.
        DistributedDataParallel broadcasts rank 0's parameters and buffers when it wraps,
        so every rank starts from the same weights.
        """
        device = trainer.root_device
        return self.configure_ddp_module(trainer, model, [device.index] if device.type == "cuda" else None)

    def configure_ddp_module(self, trainer, model: nn.Module, device_ids: list[int] | None) -> nn.Module:
        """``DistributedDataParallel(model, device_ids)`` with this plugin's DDP options."""
        kwargs: dict[str, Any] = {
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        if self.broadcast_buffers is not None:
            kwargs["broadcast_buffers"] = self.broadcast_buffers
        mesh = hookloop.submesh(trainer, self)
        if mesh is not None and mesh.size() != trainer.world_size:
            kwargs["process_group"] = mesh.get_group()  # replicas on dp_replicate of a larger mesh
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **kwargs)

    def check_process_count(self, trainer, cluster: ClusterEnvironment) -> None:
        """Refuse a launch that started another number of processes than ``devices`` asks
        for (one per device). ``ddp2`` overrides it: one process per node."""
        _check_process_count(trainer.config.devices, cluster)

    def root_device(self, trainer, cluster: ClusterEnvironment) -> torch.device:
        """This process's device: the local rank's (``hookloop.local_rank_device``)."""
        return hookloop.local_rank_device(trainer, cluster.local_rank)

    def backend(self, trainer) -> str:
        """The process-group backend: the option, else nccl on CUDA and gloo otherwise."""
        if self.process_group_backend is not None:
            return self.process_group_backend
        return "nccl" if trainer.root_device.type == "cuda" else "gloo"

    # -- environment --------------------------------------------------------------------

    @hookloop.hookimpl
    def setup_environment(self, trainer):
        """Read ranks from the launcher, pick this rank's device, initialise the process group.

        First the generators are seeded again from ``seed_everything``'s seed
        (:func:`hookloop.reset_seed`), as Lightning's DDP strategy does there; the group is
        made by :meth:`init_process_group` unless one exists
        (:meth:`hookloop.TorchDistributed.start_process_group`)."""
        check_backend(self.process_group_backend)
        cluster = self.cluster = ClusterEnvironment.detect()
        self.check_process_count(trainer, cluster)
        device = self.root_device(trainer, cluster)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        trainer.world_size, trainer.global_rank = cluster.world_size, cluster.global_rank
        trainer.local_rank, trainer.node_rank = cluster.local_rank, cluster.node_rank
        trainer.root_device = device
        excepthook = sys.excepthook
        # A group the user (or a launcher of theirs) made is theirs to destroy.
        if self.start_process_group(None, 0, 0, init=lambda: self.init_process_group(trainer)):
            if getattr(excepthook, "__name__", "") == "_distributed_excepthook":
                # torch prefixes tracebacks with "[rankN]:" by wrapping the excepthook at
                # every init; keep one prefix however often this process trains.
                sys.excepthook = excepthook
        trainer.world_size, trainer.global_rank = dist.get_world_size(), dist.get_rank()
        return True

    @hookloop.hookimpl
    def setup(self, trainer):
        """Under manual optimization, prepare DDP's reducer before each backward.

        ``self.manual_backward(loss)`` runs inside DDP's forward (the step module calls
        ``training_step`` there), before the reducer expects a backward; the hook that
        prepares it is registered for manual runs only, so automatic runs keep a backward
        that costs nothing extra per step.
        """
        if not trainer.automatic_optimization:
            self._manual_backward = _PrepareReducer()
            trainer.plugin_manager.register(self._manual_backward, name=f"{self.hookloop_name}.manual_backward")

    @hookloop.hookimpl
    def teardown(self, trainer):
        """Destroy the process group this plugin created (not one the user made).

        ``trainer.model`` goes back to the unwrapped model: a DDP wrapper whose group is
        destroyed cannot run another step. The group's C++ object is kept until the
        next teardown (or exit): see :func:`hookloop.release_process_group` for why.
        """
        self.comm_hook_state = None
        manual, self._manual_backward = self._manual_backward, None
        if manual is not None:
            trainer.plugin_manager.unregister(manual)
        wrapped, self._wrapped = self._wrapped, None
        if wrapped is not None and trainer.model is wrapped[1]:
            trainer.model = wrapped[0]
        self.release_owned_process_group()

    # -- model, optimizer, data ---------------------------------------------------------

    @hookloop.hookimpl
    def wrap_model(self, trainer, model):
        """Move the model to this rank's device and wrap it with :meth:`configure_ddp`."""
        wrapped = self.configure_ddp(trainer, model.to(trainer.root_device))
        self._wrapped = (model, wrapped)
        if self.comm_hook is not None:
            self.comm_hook_state = comm.register(self, trainer, wrapped, self.cluster.local_world_size)
        return wrapped

    @hookloop.hookimpl
    def wrap_optimizer(self, optimizer):
        """With post-localSGD, average the parameters of all ranks after optimizer steps."""
        if self.comm_hook == "post_localsgd" and optimizer is not None:
            return comm.model_averaging_optimizer(self, optimizer)
        return None

    # -- the step -----------------------------------------------------------------------

    @hookloop.hookimpl
    def accumulation_context(self, model):
        """Skip DDP's all-reduce on micro-batches that do not step: ``model.no_sync()``."""
        no_sync = getattr(model, "no_sync", None)
        return no_sync() if callable(no_sync) else contextlib.nullcontext()

    # reduce, barrier, broadcast and configure_sampler: hookloop.TorchDistributed's.

    # -- checkpoints --------------------------------------------------------------------

    def checkpoint_key(self) -> str:
        """This plugin's key in ``checkpoint["plugins"]``: its plugin name (a subclass's own)."""
        return getattr(self, "hookloop_name", None) or type(self).__name__

    @hookloop.hookimpl
    def on_save_checkpoint(self, checkpoint):
        """Save the communication hook's state (PowerSGD's error feedback, iteration...)."""
        state = comm.state_to_checkpoint(self.comm_hook, self.comm_hook_state)
        if state is not None:
            checkpoint["plugins"][self.checkpoint_key()] = {"comm_hook": state}

    @hookloop.hookimpl
    def on_load_checkpoint(self, checkpoint):
        """Restore the communication hook's state saved by :meth:`on_save_checkpoint`:
        under this plugin's name, else under a key of :data:`FALLBACK_KEYS` (a checkpoint
        a subclass saved under "ddp" before issue 20, or one of ddp_spawn's)."""
        plugins = checkpoint.get("plugins", {})
        key = next((k for k in (self.checkpoint_key(),) + FALLBACK_KEYS if k in plugins), None)
        saved = plugins.get(key, {}).get("comm_hook") if key is not None else None
        if saved is not None:
            comm.state_from_checkpoint(self.comm_hook, self.comm_hook_state, saved)


class _PrepareReducer:
    """``backward`` for manual optimization under DDP (see :meth:`DDP.setup`).

    DDP's own forward prepares the reducer when it returns, for a backward that comes
    after it; under manual optimization every backward ran inside the forward already,
    and a reducer left waiting fails the next forward ("initialize_buckets must NOT be
    called during autograd execution"). So gradient synchronisation is switched on only
    around each ``manual_backward``, and the forward leaves the reducer alone.
    """

    hookloop_role = "extension"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    @hookloop.hookimpl(wrapper=True)
    def backward(self, loss, model):
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            return (yield)
        model.require_backward_grad_sync = True
        prepare_for_backward(model, loss)
        try:
            return (yield)
        finally:
            model.require_backward_grad_sync = False


def prepare_for_backward(model: nn.parallel.DistributedDataParallel, output: Any) -> None:
    """What DDP's forward does on return, for a backward that runs before it returns.

    The reducer must know a backward is coming (and, with ``find_unused_parameters``,
    which parameters ``output`` does not depend on); Lightning prepares it the same way
    for manual optimization.
    """
    if torch.is_grad_enabled() and model.require_backward_grad_sync:
        from torch.nn.parallel.distributed import _find_tensors

        model.require_forward_param_sync = True
        tensors = list(_find_tensors(output)) if model.find_unused_parameters and not model.static_graph else []
        model.reducer._rebuild_buckets()
        model.reducer.prepare_for_backward(tensors)
    else:
        model.require_forward_param_sync = False


def _check_process_count(devices: Any, cluster: ClusterEnvironment) -> None:
    """A ``devices`` list names the devices of a node: more processes than that is an error."""
    local = cluster.local_world_size
    if isinstance(devices, str) and "," in devices:
        devices = [int(d) for d in devices.split(",") if d.strip()]
    if isinstance(devices, (list, tuple)) and local > len(devices):
        raise hookloop.ConfigurationError(
            f"devices={list(devices)} names {len(devices)} device(s) per node, but "
            f"{cluster.source} started {local} processes on this node (LOCAL_WORLD_SIZE="
            f"{local}): list one device per process, e.g. devices={list(range(local))}, or "
            f"start {len(devices)} process(es) per node (--devices {len(devices)})"
        )
    if isinstance(devices, int) and devices > 1 and cluster.source != "single" and local != devices:
        raise hookloop.ConfigurationError(
            f"devices={devices} asks for {devices} processes per node, but {cluster.source} "
            f"started {local} on this node: launch with --nproc-per-node {devices} (or "
            f"`hookloop run --devices {devices}`), or set devices to match the launcher"
        )
