"""The DeepSpeed strategy: the engine owns the model, optimizer, backward, step and checkpoints.

deepspeed is imported inside the hooks, never at module level, so ``hookloop plugins
--load`` and option checks do not pay for (or need) the backend.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

import hookloop
from hookloop import CheckpointError, ConfigurationError, MissingDependencyError

from . import activations, universal
from .safe_globals import checkpoint_safe_globals
from .config import (
    CONFIG_ENV,
    DEFAULT_OPTIONS,
    build_config,
    check_options,
    load_custom_config,
    offload_device,
    zero_stage,
)

_PREFIX = "hookloop-deepspeed:"
# The loop's own state travels in the engine's client state under this key.
_CLIENT_KEY = "hookloop_checkpoint"
# Client state keys that the engine's own files already hold (sharded), so they are not
# written a second time into the checkpoint.
_ENGINE_OWNED = ("state_dict", "optimizer_states", "optimizer")


class DeepSpeedStrategy(hookloop.TorchDistributed):
    """Train with DeepSpeed's engine: ZeRO stages 0-3, CPU/NVMe offload, sharded checkpoints.

    The engine wraps the loop's step module; the user's ``configure_optimizers``
    optimizer is handed to it (with optimizer offload, torch's Adam/AdamW become
    ``DeepSpeedCPUAdam`` with the same settings, and other optimizers are refused unless
    the config says ``"zero_force_ds_cpu_optimizer": false``). Gradient accumulation,
    gradient clipping and precision (``--precision`` / hookloop-amp) are mapped into the
    DeepSpeed config. Manual optimization works with one optimizer (the engine has one):
    ``manual_backward`` is ``engine.backward`` and ``step()`` is ``engine.step()``.

    :param stage: ZeRO stage: 0 (plain data parallel), 1 (shard optimizer state), 2 (+
        gradients), 3 (+ parameters).
    :param offload_optimizer: keep optimizer state (and the step) on the CPU or NVMe.
    :param offload_parameters: keep parameters on the CPU or NVMe (stage 3 only).
    :param offload_optimizer_device: ``"cpu"`` or ``"nvme"``.
    :param offload_params_device: ``"cpu"`` or ``"nvme"``.
    :param nvme_path: directory on a fast local disk for NVMe offload.
    :param pin_memory: page-lock offloaded CPU memory (faster copies to a GPU).
    :param allgather_bucket_size: elements gathered at once (stages 1-2).
    :param reduce_bucket_size: elements reduced at once.
    :param contiguous_gradients: copy gradients into one buffer as they are produced.
    :param overlap_comm: overlap gradient reduction with the backward pass.
    :param partition_activations: partition activation checkpoints across ranks.
    :param cpu_checkpointing: move (partitioned) activation checkpoints to the CPU.
    :param synchronize_checkpoint_boundary: synchronise at each checkpoint boundary.
    :param config: a full DeepSpeed config (dict or JSON path) that replaces the options
        above; ``HOOKLOOP_DEEPSPEED_CONFIG`` names one when ``config`` is not given.
    :param logging_level: the level of DeepSpeed's own logger (default: warnings).
    :param sampler_seed: seed of the distributed samplers (the same on every rank);
        ``None``: the seed ``hookloop.seed_everything`` set, as ddp's.

    The samplers, ``sync_dist`` reductions, barriers, broadcasts and the process group
    are :class:`hookloop.TorchDistributed`'s (shared with ddp and fsdp).
    """

    hookloop_name = "deepspeed"
    #: owns the model/optimizer lifecycle (its engine) alone: no mesh plugin beside it
    hookloop_composes = False
    hookloop_role = "strategy"
    #: variables that change the run, said in its first lines (docs/environment.md)
    hookloop_environment = {CONFIG_ENV: "the DeepSpeed config file, where the strategy is given no config"}
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    # Precision plugins hand their setting over: the engine casts the model itself.
    # and the engine clips (its config's gradient_clipping), so self.clip_gradients is refused.
    hookloop_owns = frozenset({"precision", "gradient_clipping"})
    # Checkpoints are directories of shards (the checkpoint plugin checks before training).
    hookloop_checkpoint_format = "directory"
    #: ``ModelCheckpoint(async_save=True)``: the engine's shard writes (its checkpoint
    #: engine's ``save``) take a CPU snapshot and are written by the background writer;
    #: the tag is committed there once every rank's shards are on disk.
    hookloop_async_save = True
    # `hookloop plugins` shows "not built: ..." until DeepSpeed's CPU ops are compiled.
    @staticmethod
    def hookloop_build_status():
        """``None`` when DeepSpeed's CPU ops are compiled, else the command that builds them."""
        # Imported here: `python -m hookloop_deepspeed.build_ops` must not find it imported.
        from .build_ops import build_status

        return build_status()

    def __init__(
        self,
        stage: int = DEFAULT_OPTIONS["stage"],
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_optimizer_device: str = "cpu",
        offload_params_device: str = "cpu",
        nvme_path: str | os.PathLike | None = None,
        pin_memory: bool = False,
        allgather_bucket_size: int = DEFAULT_OPTIONS["allgather_bucket_size"],
        reduce_bucket_size: int = DEFAULT_OPTIONS["reduce_bucket_size"],
        contiguous_gradients: bool = True,
        overlap_comm: bool = True,
        partition_activations: bool = False,
        cpu_checkpointing: bool = False,
        synchronize_checkpoint_boundary: bool = False,
        config: dict | str | os.PathLike | None = None,
        logging_level: int = logging.WARNING,
        sampler_seed: int | None = None,
    ):
        self.stage = stage
        self.offload_optimizer = offload_optimizer
        self.offload_parameters = offload_parameters
        self.offload_optimizer_device = offload_optimizer_device
        self.offload_params_device = offload_params_device
        self.nvme_path = nvme_path
        self.pin_memory = pin_memory
        self.allgather_bucket_size = allgather_bucket_size
        self.reduce_bucket_size = reduce_bucket_size
        self.contiguous_gradients = contiguous_gradients
        self.overlap_comm = overlap_comm
        self.partition_activations = partition_activations
        self.cpu_checkpointing = cpu_checkpointing
        self.synchronize_checkpoint_boundary = synchronize_checkpoint_boundary
        self.config = config
        self.logging_level = logging_level
        self.sampler_seed = sampler_seed
        # nvme_path may still arrive through plugin_options: it is required from launch on.
        self.check(final=False)
        # Run state, set by the hooks.
        self.engine: Any = None
        self.ds_config: dict | None = None
        self._cast_handle: Any = None
        self._set_local_rank = False

    # -- options -------------------------------------------------------------------------

    @property
    def options(self) -> dict[str, Any]:
        """The current option values (``plugin_options`` may have changed them)."""
        return {name: getattr(self, name) for name in DEFAULT_OPTIONS}

    def check(self, final: bool = True) -> None:
        """Raise ``ConfigurationError`` for options that cannot work, and read the custom
        config once so that a missing or malformed file is reported at once.

        ``final=False`` (at construction) tolerates a missing ``nvme_path``, which
        ``plugin_options`` may still set; from launch on it is required.
        """
        check_options(self.options, require_nvme_path=final)
        hookloop.check_sampler_seed(self.hookloop_name, self.sampler_seed)
        load_custom_config(self.config)

    # -- launching -----------------------------------------------------------------------

    @hookloop.hookimpl(tryfirst=True)  # a check, not a launch: before the launcher answers
    def launch_command(self, config):
        """Check the options in the launching process, before any worker starts.

        ``plugin_options`` are applied after ``__init__``, so this is the first moment
        their values are final. Returns ``None``: DeepSpeed runs under the default
        launcher (torchrun).
        """
        self.check()
        return None

    # -- environment ---------------------------------------------------------------------

    @hookloop.hookimpl
    def setup_environment(self, trainer):
        """Start DeepSpeed's communication layer on torch's process group; set ranks and device.

        Without CUDA (or with ``accelerator="cpu"``) DeepSpeed's CPU accelerator is chosen
        (``DS_ACCELERATOR=cpu``) before deepspeed is imported, and the backend is gloo.
        """
        self.check()
        want_cuda = trainer.config.accelerator in ("cuda", "gpu") or (
            trainer.config.accelerator == "auto" and torch.cuda.is_available()
        )
        if not want_cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        deepspeed = _import_deepspeed()
        logging.getLogger("DeepSpeed").setLevel(self.logging_level)
        import torch.distributed as dist

        backend = "nccl" if want_cuda else "gloo"
        # reset_seed first (as Lightning's DeepSpeed strategy); env:// from torchrun, with
        # keys of its own per group (a world of one: none).
        self.start_process_group(backend, hookloop.env_int("RANK", default=0),
                                 hookloop.env_int("WORLD_SIZE", default=1),
                                 timeout=trainer.config.process_group_timeout)
        if "LOCAL_RANK" not in os.environ:
            # DeepSpeed reads LOCAL_RANK, which only launchers set; for the length of this
            # run only (hookloop reads it to tell a launched worker from a user's process).
            os.environ["LOCAL_RANK"] = "0"
            self._set_local_rank = True
        # DeepSpeed adopts the existing group; it would otherwise try MPI discovery.
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        trainer.world_size = dist.get_world_size()
        trainer.global_rank = dist.get_rank()
        trainer.local_rank = hookloop.env_int("LOCAL_RANK", default=0)
        trainer.node_rank = hookloop.env_int("GROUP_RANK", "NODE_RANK", default=0)
        trainer.root_device = hookloop.local_rank_device(trainer, trainer.local_rank)
        if trainer.root_device.type == "cuda":
            torch.cuda.set_device(trainer.root_device)
        return True

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        """Build the DeepSpeed config from the options (or the custom config) and the trainer."""
        custom, source = load_custom_config(self.config)
        loader = trainer.train_dataloader if stage == "fit" else trainer.val_dataloader
        micro = getattr(loader, "batch_size", None) or 1
        self.ds_config, notes = build_config(
            self.options,
            custom,
            precision=trainer.precision,
            accumulate=trainer.accumulate_grad_batches,
            clip_val=trainer.gradient_clip_val,
            clip_algorithm=trainer.config.gradient_clip_algorithm,
            micro_batch_size=micro,
            world_size=trainer.world_size,
        )
        if source is not None:
            notes.insert(0, f"DeepSpeed config from {source}")
        if stage != "fit" and zero_stage(self.ds_config) in (1, 2):
            # Stages 1 and 2 shard optimizer state and gradients, which validation has
            # none of; DeepSpeed refuses them without an optimizer, so the engine runs as
            # stage 0 (every rank holds the model, as under stages 1 and 2 anyway).
            zero = self.ds_config["zero_optimization"]
            self.ds_config["zero_optimization"] = {"stage": 0}
            notes.append(f"validate: ZeRO stage {zero['stage']} shards training state only; the model runs unsharded")
        self._check_backend_support()
        for note in notes:
            trainer.print(f"{_PREFIX} {note}", flush=True)

    def _check_backend_support(self) -> None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        fp16 = (self.ds_config.get("fp16") or {}).get("enabled")
        if fp16 and not accelerator.is_fp16_supported():
            raise ConfigurationError(
                f"precision 16-mixed: DeepSpeed's {accelerator.device_name()!r} accelerator has no "
                f"fp16 support on this machine; use precision='bf16-mixed' or '32'"
            )
        bf16 = (self.ds_config.get("bf16") or {}).get("enabled")
        if bf16 and not accelerator.is_bf16_supported():
            raise ConfigurationError(
                f"precision bf16-mixed: DeepSpeed's {accelerator.device_name()!r} accelerator has "
                f"no bf16 support on this machine; use precision='16-mixed' or '32'"
            )
        nvme = [k for k in ("offload_optimizer", "offload_param") if offload_device(self.ds_config, k) == "nvme"]
        if nvme:
            from deepspeed.ops.op_builder import AsyncIOBuilder

            if not AsyncIOBuilder().is_compatible(verbose=False):
                raise MissingDependencyError(
                    f"NVMe offload ({', '.join(nvme)}) needs DeepSpeed's async_io op, which needs "
                    f"libaio: apt-get install libaio-dev (then it builds on first use), or offload "
                    f"to the CPU instead (offload_*_device='cpu')"
                )

    @hookloop.hookimpl
    def teardown(self, trainer, stage):
        """Release the engine, hand back the unwrapped model, and destroy the process
        group this plugin made (DeepSpeed adopts a new one in the next run's
        ``init_distributed``)."""
        activations.deactivate()
        if self._set_local_rank:
            os.environ.pop("LOCAL_RANK", None)
            self._set_local_rank = False
        if self._cast_handle is not None:
            self._cast_handle.remove()
            self._cast_handle = None
        engine, self.engine = self.engine, None
        if engine is not None:
            if trainer.model is engine:
                trainer.model = engine.module
            with contextlib.suppress(Exception):
                engine.destroy()
        if self._owns_process_group:
            import deepspeed.comm

            # DeepSpeed's own destroy also drops the groups it caches (world, data parallel).
            self.release_owned_process_group(deepspeed.comm.destroy_process_group)

    # -- model and data ------------------------------------------------------------------

    @hookloop.hookimpl
    def model_init_context(self, trainer):
        """Stage 3: ``deepspeed.zero.Init``, so ``configure_model()`` creates partitioned layers."""
        if zero_stage(self.ds_config) != 3:
            return None
        import deepspeed

        return deepspeed.zero.Init(
            config_dict_or_path=self.ds_config,
            remote_device=offload_device(self.ds_config, "offload_param"),
            pin_memory=bool(((self.ds_config["zero_optimization"].get("offload_param") or {}).get("pin_memory"))),
        )

    @hookloop.hookimpl
    def wrap_model(self, trainer, model, optimizer, optimizers):
        """``deepspeed.initialize`` around the loop's step module; returns the engine."""
        import deepspeed

        if len(optimizers) > 1:
            raise ConfigurationError(
                f"configure_optimizers returned {len(optimizers)} optimizers, and a DeepSpeed "
                f"engine trains with one: use one optimizer (with several param groups), or "
                f"another strategy (ddp) for several"
            )
        config = self.ds_config
        optimizer = self._offload_optimizer(trainer, optimizer)
        model_parameters = None
        if "optimizer" in config and optimizer is not None:
            trainer.print(
                f"{_PREFIX} the DeepSpeed config defines an optimizer; it replaces "
                f"{type(optimizer).__name__} from configure_optimizers",
                flush=True,
            )
            self._drop_scheduler(trainer, optimizer)
            optimizer, model_parameters = None, [p for p in model.parameters() if p.requires_grad]
        dtype = torch.bfloat16 if (config.get("bf16") or {}).get("enabled") else (
            torch.float16 if (config.get("fp16") or {}).get("enabled") else None
        )
        if dtype is not None:
            # The engine holds the model in half precision; the loader yields fp32 batches.
            self._cast_handle = model.register_forward_pre_hook(_cast_batch_hook(dtype))
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            config=config,
        )
        self.engine = engine
        if optimizer is not None or model_parameters is not None:
            # The loop decides where accumulation windows end (see accumulation_context).
            engine.set_gradient_accumulation_boundary(True)
        self._configure_activation_checkpointing()
        return engine

    def _configure_activation_checkpointing(self) -> None:
        import deepspeed

        # contiguous_memory_optimization also needs number_checkpoints: both come only
        # from a custom config's activation_checkpointing section.
        section = self.ds_config.get("activation_checkpointing") or {}
        deepspeed.checkpointing.configure(
            mpu_=None,
            partition_activations=bool(section.get("partition_activations", False)),
            contiguous_checkpointing=bool(section.get("contiguous_memory_optimization", False)),
            num_checkpoints=section.get("number_checkpoints"),
            checkpoint_in_cpu=bool(section.get("cpu_checkpointing", False)),
            synchronize=bool(section.get("synchronize_checkpoint_boundary", False)),
            profile=bool(section.get("profile", False)),
        )
        activations.activate()

    def _offload_optimizer(self, trainer, optimizer):
        """With optimizer offload, DeepSpeed steps on the CPU with its own C++ Adam.

        ``torch.optim.Adam`` / ``AdamW`` become ``DeepSpeedCPUAdam`` with every group's
        hyper-parameters; a ``DeepSpeedCPUAdam`` (or ``DeepSpeedCPULion``) is used as is;
        with ``"zero_force_ds_cpu_optimizer": false`` in the config DeepSpeed steps the
        user's optimizer itself. Anything else raises ``ConfigurationError``: a silent
        switch to another optimizer would train a different model.
        """
        if optimizer is None or offload_device(self.ds_config, "offload_optimizer") is None or "optimizer" in self.ds_config:
            return optimizer
        name = type(optimizer).__name__
        if not self.ds_config.get("zero_force_ds_cpu_optimizer", True):
            # DeepSpeed's own opt-out (its default refuses client optimizers under offload).
            trainer.print(
                f"{_PREFIX} optimizer offload: {name} from configure_optimizers steps on the CPU "
                f"unchanged (zero_force_ds_cpu_optimizer=false)",
                flush=True,
            )
            return optimizer
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.lion import DeepSpeedCPULion

        if isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion)):
            return optimizer
        groups, adamw = _cpu_adam_groups(optimizer)
        replacement = DeepSpeedCPUAdam(groups, adamw_mode=adamw)
        trainer.print(
            f"{_PREFIX} optimizer offload: {name} from configure_optimizers is replaced by "
            f"DeepSpeedCPUAdam ({'AdamW' if adamw else 'Adam'} mode, the same lr, betas, eps and "
            f"weight_decay in each of its {len(groups)} param group(s)), which steps the offloaded "
            f"state on the CPU",
            flush=True,
        )
        for scheduler in hookloop.schedulers_of(trainer, optimizer):
            hookloop.repoint_lr_scheduler(scheduler, replacement)  # the schedule drives the replacement's lr
        return replacement

    @staticmethod
    def _drop_scheduler(trainer, optimizer) -> None:
        for scheduler in hookloop.schedulers_of(trainer, optimizer):
            trainer.print(
                f"{_PREFIX} {type(scheduler).__name__} from configure_optimizers drove the replaced "
                f"optimizer and is dropped; define the schedule in the DeepSpeed config's "
                f"'scheduler' section",
                flush=True,
            )
        trainer.lr_scheduler_configs = [
            c for c in trainer.lr_scheduler_configs if getattr(c.scheduler, "optimizer", None) is not optimizer
        ]

    @hookloop.hookimpl
    def wrap_optimizer(self, trainer, model, optimizer):
        """The engine's optimizer (a ZeRO optimizer around the user's, or the replacement)."""
        if self.engine is None or self.engine.optimizer is None:
            return None
        return self.engine.optimizer

    # -- the step ------------------------------------------------------------------------

    @hookloop.hookimpl
    def accumulation_context(self, trainer, model):
        """Mark a micro-batch that does not end an accumulation window.

        The loop decides where windows end (also a short last window of an epoch); the
        engine is told through ``set_gradient_accumulation_boundary`` so that ZeRO
        reduces and steps exactly there, however ``gradient_accumulation_steps`` counts.
        """
        return _not_a_boundary(self.engine)

    @hookloop.hookimpl
    def backward(self, trainer, loss):
        """``engine.backward``, without the engine's own division by the accumulation steps.

        The loop already divided the loss by ``accumulate_grad_batches``; scaling again
        (DeepSpeed's default) would shrink accumulated gradients twice.
        """
        retain = trainer.backward_kwargs.get("retain_graph")
        self.engine.backward(loss, scale_wrt_gas=False, **({} if retain is None else {"retain_graph": retain}))
        self._unstepped = True  # gradients in the engine until engine.step() (or zero_grad) drops them
        return True

    @hookloop.hookimpl
    def optimizer_step(self, trainer, optimizer):
        """``engine.step()``: reduce (ZeRO), clip (``gradient_clipping``), step, zero the grads.

        Returns False when the step was skipped (fp16 overflow).
        """
        hookloop.before_optimizer_step(trainer, optimizer, clip=False)  # the engine clips
        self.engine.step()
        self._unstepped = False
        return bool(self.engine.was_step_applied())

    @hookloop.hookimpl
    def zero_grad(self):
        """Nothing to do after ``engine.step()``, which zeroes the gradients itself. A
        window whose step the loop did not take (``nan_guard``'s skip: its
        ``optimizer_step`` comes first and returns False) left its gradients in the engine
        (ZeRO's partitions, offload's CPU accumulators): they are dropped here, as an
        overflow step drops them (:func:`drop_gradients`), before the next window's."""
        if getattr(self, "_unstepped", False):
            self._unstepped = False
            drop_gradients(self.engine)
        return True

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        """``nan_guard(action="skip")`` needs the window's gradients dropped in the engine
        (:func:`drop_gradients`): refused here where they cannot be."""
        self._unstepped = False
        guard = next((p for p in trainer.plugin_manager.get_plugins()
                      if isinstance(p, hookloop.NanGuard) and p.action == "skip"), None)
        if guard is not None and self.engine is not None and not can_drop_gradients(self.engine):
            raise ConfigurationError(
                f"nan_guard(action='skip') under DeepSpeed needs a skipped step's gradients dropped in the "
                f"engine, which hookloop does for ZeRO stages 0 (fp32), 1 and 2; this engine's optimizer is "
                f"{type(self.engine.optimizer).__name__} (ZeRO stage {self.engine.zero_optimization_stage()}"
                f"{', bf16' if self.engine.bfloat16_enabled() else ''}{', fp16' if self.engine.fp16_enabled() else ''})"
                f": use nan_guard(action='stop'), or ZeRO stage 1 or 2")

    # reduce (half precision in float32), barrier, broadcast and configure_sampler:
    # hookloop.TorchDistributed's.

    # -- checkpoints ---------------------------------------------------------------------

    @hookloop.hookimpl
    def save_checkpoint(self, trainer, checkpoint, path):
        """Write a sharded checkpoint *directory* at ``path`` through the engine.

        Every rank writes its own shard; the loop, RNG, scheduler and plugin state travel
        as the engine's client state. Each save goes to a new tag of a
        :class:`hookloop.TaggedCheckpointDir`: DeepSpeed writes no ``latest`` itself
        (``save_latest=False``: its own is a plain write by rank 0 before the other ranks
        have finished their shards); after a barrier rank 0 marks the tag complete and
        replaces ``latest`` atomically, then removes the older tags, so an interrupted
        save leaves the previous checkpoint committed.
        """
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise CheckpointError(
                f"{str(path)!r} is a file (a single-file checkpoint?), but the deepspeed strategy "
                f"writes a sharded checkpoint directory there: remove it, or choose another "
                f"default_root_dir / path"
            )
        client_state = {_CLIENT_KEY: {k: v for k, v in checkpoint.items() if k not in _ENGINE_OWNED}}
        tags = _tagged(path)
        tag = trainer.broadcast(tags.new_tag(trainer.global_step) if trainer.is_global_zero else None, 0)
        if hookloop.deferring():  # ModelCheckpoint(async_save=True)
            group = hookloop.cpu_process_group("checkpoint.deepspeed")
            with _shard_writes_in_background(self.engine):
                self.engine.save_checkpoint(str(path), tag=tag, client_state=client_state, save_latest=False)
            hookloop.defer(lambda: _commit_when_written(trainer.is_global_zero, group, tags, tag))
            return path
        self.engine.save_checkpoint(str(path), tag=tag, client_state=client_state, save_latest=False)
        trainer.barrier("deepspeed_save_checkpoint")  # every rank's shards are written
        if trainer.is_global_zero:
            tags.commit(tag)
            tags.prune()
        trainer.barrier("deepspeed_prune_checkpoint")
        return path

    @hookloop.hookimpl
    def load_checkpoint(self, trainer, path):
        """Load model and optimizer shards into the engine; return the loop's state."""
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
        if not path.is_dir():
            raise CheckpointError(
                f"{str(path)!r} is a single-file checkpoint, and the deepspeed strategy resumes "
                f"only from the checkpoint directory it wrote. To start from those weights, load "
                f"them into the module before fit: module.load_state_dict(torch.load(path, "
                f"weights_only=True)['state_dict'])"
            )
        tags = _tagged(path)
        if not (path / "latest").is_file() and not tags.tags():
            raise CheckpointError(
                f"{str(path)!r} is not a DeepSpeed checkpoint directory (it has no 'latest' file)"
            )
        # The tag 'latest' names, or the newest complete one when it names an interrupted save's.
        tag = tags.committed(warn=trainer.is_global_zero).name
        written, stage = check_zero_shards(path, tag, zero_stage(self.ds_config))
        load_dir, load_tag, reshard = path, tag, False
        if trainer.optimizer is not None and stage >= 1 and written is not None and written != trainer.world_size:
            # Partitioned for `written` ranks: loaded through its universal copy.
            load_dir, load_tag, reshard = self._universal_copy(trainer, path, tag, written, stage), universal.UNIVERSAL, True
        try:
            # DeepSpeed reads its shards with torch.load(weights_only=False): inside this
            # block every load is weights-only, so a shared checkpoint cannot run code.
            with hookloop.weights_only_loads(path, checkpoint_safe_globals()):
                if trainer.optimizer is None and zero_stage(self.ds_config) == 3:
                    client_state = self._load_zero3_weights(trainer, path, tag)
                else:
                    with universal.universal_loading(self.engine) if reshard else contextlib.nullcontext():
                        loaded, client_state = self.engine.load_checkpoint(
                            str(load_dir),
                            tag=load_tag,
                            load_optimizer_states=trainer.optimizer is not None,
                            # The engine holds a scheduler only from the config's 'scheduler'
                            # section (the loop's own travels in the client state): skipping its
                            # state would restart that schedule from its first step.
                            load_lr_scheduler_states=self.engine.lr_scheduler is not None,
                            load_module_strict=True,
                        )
                    if loaded is None:
                        raise CheckpointError(f"DeepSpeed found no checkpoint in {str(path)!r}")
        except CheckpointError:
            raise
        except Exception as exc:  # DeepSpeed raises assorted types for a foreign checkpoint
            raise CheckpointError(
                f"DeepSpeed could not load {str(path)!r}: {type(exc).__name__}: {exc}. A ZeRO "
                f"checkpoint loads into the model, stage and number of processes it was saved "
                f"with; `hookloop deepspeed collate` turns it into one fp32 state dict otherwise"
            ) from exc
        if not isinstance(client_state, dict) or _CLIENT_KEY not in client_state:
            raise CheckpointError(f"{str(path)!r} was not written by hookloop's deepspeed strategy (no loop state)")
        return dict(client_state[_CLIENT_KEY])

    def _universal_copy(self, trainer, path: Path, tag: str, written: int, stage: int) -> Path:
        """The load directory of ``tag``'s universal copy (converted by global rank 0 when
        there is none yet; the other ranks wait in the broadcast of its outcome). Refused,
        on every rank alike, where the conversion cannot carry the state over whole."""
        error = seconds = None
        if trainer.is_global_zero:
            try:
                shards = sorted((path / tag).glob("*zero_pp_rank_0_*optim_states.pt"))
                keys = universal.optimizer_state_keys(shards[0]) if shards else set()
                universal.check_convertible(path, tag, written, trainer.world_size, keys, stage,
                                            nvme_offload=offload_device(self.ds_config, "offload_optimizer") == "nvme")
                _, seconds = universal.timed_copy(path, tag)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait
                error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        error, seconds = trainer.broadcast((error, seconds), 0)
        if error is not None:
            raise CheckpointError(error)
        target = path / tag / universal.UNIVERSAL
        done = f"converted in {seconds:.2f} s" if seconds is not None else "converted by an earlier resume"
        trainer.print(f"{_PREFIX} {str(path)!r} is a ZeRO-{stage} checkpoint of {_processes(written)} and this run has "
                      f"{trainer.world_size}: loading its universal copy {str(target)!r} ({done}; DeepSpeed's "
                      f"ds_to_universal), which re-partitions the weights and the optimizer state", flush=True)
        return path / tag

    def _load_zero3_weights(self, trainer, path: Path, tag: str) -> dict:
        """ZeRO-3 without an optimizer (``validate``): the engine cannot restore weights
        from its optimizer shards, so gather the fp32 weights from the files and let rank 0
        write them into the partitioned parameters."""
        import deepspeed
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
        module = self.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            if trainer.global_rank == 0:
                module.load_state_dict(state, strict=True)
        files = sorted((path / tag).glob(f"zero_pp_rank_{trainer.global_rank}_*model_states.pt")) or sorted(
            (path / tag).glob("*model_states.pt"))
        # Called inside weights_only_loads: DeepSpeed's classes are the only others accepted.
        return torch.load(files[0], map_location="cpu", weights_only=True)


    @hookloop.hookimpl
    def load_model_state(self, trainer, checkpoint):
        """The engine restored model and optimizer in ``load_checkpoint``; restore the
        schedulers of ``configure_optimizers``."""
        if self.engine is None:
            return None
        _, scheduler_states = hookloop.optimizer_and_scheduler_states(checkpoint)
        hookloop.load_scheduler_states(trainer, scheduler_states)
        return True


# Settings of a torch Adam/AdamW group that only choose torch's implementation (the
# math is the same), so DeepSpeedCPUAdam reproduces the group without them.
_ADAM_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def _offload_refusal(what: str) -> ConfigurationError:
    return ConfigurationError(
        f"optimizer offload steps the optimizer on the CPU with DeepSpeed's DeepSpeedCPUAdam, "
        f"which cannot reproduce {what} from configure_optimizers (hookloop does not swap in "
        f"another optimizer silently). Fix one of: return torch.optim.Adam or torch.optim.AdamW "
        f"(mapped exactly to DeepSpeedCPUAdam); return deepspeed.ops.adam.DeepSpeedCPUAdam "
        f"yourself; set \"zero_force_ds_cpu_optimizer\": false in a custom DeepSpeed config "
        f"(config=...) so that DeepSpeed steps your optimizer itself on the CPU (slower); or "
        f"turn optimizer offload off (offload_optimizer=False, a preset without '_offload')"
    )


def _cpu_adam_groups(optimizer: torch.optim.Optimizer) -> tuple[list[dict], bool]:
    """The param groups of a ``DeepSpeedCPUAdam`` that steps exactly as ``optimizer``, and
    its ``adamw_mode``; ``ConfigurationError`` for any other optimizer or setting."""
    # Exact types only: a subclass may change the step, which the mapping cannot see.
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise _offload_refusal(f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
    name = type(optimizer).__name__
    groups, modes = [], set()
    for index, group in enumerate(optimizer.param_groups):
        for setting in ("amsgrad", "maximize"):
            if group.get(setting):
                raise _offload_refusal(f"{name} with {setting}=True (param group {index})")
        # torch's AdamW is Adam with decoupled weight decay; DeepSpeedCPUAdam has one mode
        # for all its groups.
        modes.add(bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))))
        new = {k: v for k, v in group.items()
               if k not in ("amsgrad", "maximize", "decoupled_weight_decay", *_ADAM_IMPLEMENTATION)}
        # Tensor rates (torch allows them) go to the C++ step as plain numbers.
        new["lr"], new["eps"], new["weight_decay"] = (_as_float(group[k]) for k in ("lr", "eps", "weight_decay"))
        new["betas"] = tuple(_as_float(b) for b in group["betas"])
        groups.append(new)
    if len(modes) > 1:
        raise _offload_refusal(f"{name} with decoupled_weight_decay differing between param groups")
    return groups, modes.pop()


def _as_float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


# ---------------------------------------------------------------------------------------
# Presets: the same strategy with other defaults (every option can still be passed)
# ---------------------------------------------------------------------------------------


class DeepSpeedStage1(DeepSpeedStrategy):
    """ZeRO stage 1: optimizer state sharded across ranks."""

    hookloop_name = "deepspeed_stage_1"

    def __init__(self, **options: Any):
        super().__init__(**{"stage": 1, **options})


class DeepSpeedStage2(DeepSpeedStrategy):
    """ZeRO stage 2: optimizer state and gradients sharded."""

    hookloop_name = "deepspeed_stage_2"

    def __init__(self, **options: Any):
        super().__init__(**{"stage": 2, **options})


class DeepSpeedStage2Offload(DeepSpeedStrategy):
    """ZeRO stage 2 with optimizer state (and the step) offloaded to the CPU."""

    hookloop_name = "deepspeed_stage_2_offload"

    def __init__(self, **options: Any):
        super().__init__(**{"stage": 2, "offload_optimizer": True, **options})


class DeepSpeedStage3(DeepSpeedStrategy):
    """ZeRO stage 3: optimizer state, gradients and parameters sharded."""

    hookloop_name = "deepspeed_stage_3"

    def __init__(self, **options: Any):
        super().__init__(**{"stage": 3, **options})


class DeepSpeedStage3Offload(DeepSpeedStrategy):
    """ZeRO stage 3 with optimizer state and parameters offloaded to the CPU."""

    hookloop_name = "deepspeed_stage_3_offload"

    def __init__(self, **options: Any):
        super().__init__(**{"stage": 3, "offload_optimizer": True, "offload_parameters": True, **options})


class DeepSpeedStage3OffloadNVMe(DeepSpeedStrategy):
    """ZeRO stage 3 with optimizer state and parameters offloaded to NVMe (``nvme_path``)."""

    hookloop_name = "deepspeed_stage_3_offload_nvme"

    def __init__(self, **options: Any):
        super().__init__(**{
            "stage": 3,
            "offload_optimizer": True,
            "offload_parameters": True,
            "offload_optimizer_device": "nvme",
            "offload_params_device": "nvme",
            **options,
        })


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError as exc:
        raise MissingDependencyError(
            f"the deepspeed strategy needs deepspeed ({exc}): pip install deepspeed "
            f"(after torch, so that pip does not replace your torch build)"
        ) from exc
    return deepspeed


def can_drop_gradients(engine) -> bool:
    """Whether :func:`drop_gradients` knows this engine's optimizer: ZeRO stage 1/2's
    (``DeepSpeedZeroOptimizer``, any precision) or, without ZeRO in fp32, the torch
    optimizer itself."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return True
    return (engine.zero_optimization_stage() == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()
            and isinstance(optimizer, torch.optim.Optimizer))


def drop_gradients(engine) -> None:
    """Drop the gradients of a window whose optimizer step was not taken, as DeepSpeed
    drops an overflow step's: ZeRO 1/2 run ``engine.step()`` through their own overflow
    path (forced for this call: the partitions, offload's CPU accumulators and the
    micro-step count are reset, ``engine.skipped_steps`` counts it, DeepSpeed's scheduler
    does not step; the fp16 loss scale is left as it was: the step was not an overflow);
    without ZeRO (fp32) the torch optimizer's gradients are zeroed."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        if not can_drop_gradients(engine):  # refused at fit start (on_fit_start)
            raise ConfigurationError(f"cannot drop a skipped step's gradients in {type(optimizer).__name__}")
        engine.zero_grad()
        return
    checked = optimizer.check_grad_overflow
    optimizer.check_grad_overflow = True
    optimizer.check_overflow = lambda partition_gradients=True: setattr(optimizer, "overflow", True)
    optimizer._update_scale = lambda has_overflow=False: None
    try:
        engine.step()
    finally:
        del optimizer.check_overflow, optimizer._update_scale  # the class's again
        optimizer.check_grad_overflow = checked
        optimizer.overflow = False


@contextlib.contextmanager
def _not_a_boundary(engine):
    engine.set_gradient_accumulation_boundary(False)
    try:
        yield
    finally:
        engine.set_gradient_accumulation_boundary(True)


def _cast_batch_hook(dtype: torch.dtype):
    def cast(module, args):
        kind, batch, batch_idx = args
        return kind, hookloop.apply_to_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t), batch_idx

    return cast


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def _tagged(path: Path) -> hookloop.TaggedCheckpointDir:
    """``path`` as a directory of tags (``global_step<N>``, DeepSpeed's names); a tag of an
    older hookloop, without the complete marker, is trusted when it holds model states."""
    return hookloop.TaggedCheckpointDir(path, prefix="global_step",
                                        legacy_complete=lambda tag: any(tag.glob("*model_states.pt")))


_SHARD_RANK = re.compile(r"zero_pp_rank_(\d+)_")


def check_zero_shards(path: Path, tag: str, stage: int) -> tuple[int | None, int]:
    """Refuse, before DeepSpeed touches the engine, a tag of ``path`` whose shards are not
    all there, naming the missing files and the number of processes that wrote it (the
    model states' ``dp_world_size``, read weights-only without DeepSpeed). Returns that
    number (``None``: unknown) and the ZeRO stage the tag was written with (``stage``
    where it does not say): a resume on another number of processes goes through a
    universal checkpoint (:mod:`hookloop_deepspeed.universal`)."""
    shard_dir = path / tag
    written, saved_stage = _written_with(shard_dir)
    stage = saved_stage if saved_stage is not None else stage
    optim = {int(_SHARD_RANK.search(p.name)[1]): p.name for p in shard_dir.glob("*zero_pp_rank_*_optim_states.pt")}
    models = {int(_SHARD_RANK.search(p.name)[1]): p.name for p in shard_dir.glob("zero_pp_rank_*_model_states.pt")}
    if written is None:  # no readable model states: the shard files are all there is to go by
        written = max([*optim, *models], default=-1) + 1 or None
    missing = []
    if not any(shard_dir.glob("*model_states.pt")):
        missing.append("mp_rank_00_model_states.pt")
    if written is not None:
        for shards, example in ((optim, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                                (models, "zero_pp_rank_0_mp_rank_00_model_states.pt")):
            if not shards and (shards is models or stage < 1):
                continue  # ZeRO 1/2 keep one model states file; ZeRO 0 no optimizer shards
            pattern = next(iter(shards.values()), example)
            missing += [_SHARD_RANK.sub(f"zero_pp_rank_{rank}_", pattern, count=1)
                        for rank in range(written) if rank not in shards]
    if missing:
        by = f"written by {written} process{'es' if written != 1 else ''}" if written else "written by DeepSpeed"
        raise CheckpointError(
            f"{str(path)!r} is a ZeRO-{stage} checkpoint {by}, and its tag {tag!r} lacks {', '.join(missing)}: every "
            f"process writes its own shard, so the checkpoint is incomplete (a file lost in a copy, or a save that "
            f"did not finish) and no number of processes can resume it. Resume from an earlier checkpoint "
            f"(last.prev.ckpt is the one before last.ckpt)")
    return written, stage


def _written_with(shard_dir: Path) -> tuple[int | None, int | None]:
    """(processes, ZeRO stage) that wrote the tag, from its first model states file's
    ``dp_world_size`` and config: a weights-only, memory-mapped load (plain data, no
    DeepSpeed class); ``(None, None)`` when there is none, or it cannot be read."""
    for states in sorted(shard_dir.glob("*model_states.pt")):
        try:
            saved = torch.load(states, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - unreadable: DeepSpeed's own load says why
            continue
        world = saved.get("dp_world_size") if isinstance(saved, dict) else None
        config = saved.get("ds_config") if isinstance(saved, dict) else None
        stage = (config.get("zero_optimization") or {}).get("stage") if isinstance(config, dict) else None
        return (int(world) if isinstance(world, int) else None), (int(stage) if isinstance(stage, int) else None)
    return None, None


@contextlib.contextmanager
def _shard_writes_in_background(engine):
    """Inside an asynchronous save: each file the engine's checkpoint engine saves is a
    CPU snapshot now (``hookloop.resume.checkpoint.cpu_snapshot``), written by the background
    writer later (``hookloop.defer``), with the checkpoint engine's own ``save``."""
    from hookloop.resume.checkpoint import cpu_snapshot

    writer = engine.checkpoint_engine
    real, own = writer.save, writer.__dict__.get("save")

    def save(state_dict, path):
        snapshot = cpu_snapshot(state_dict)
        hookloop.defer(lambda: real(snapshot, path))

    writer.save = save
    try:
        yield
    finally:
        if own is None:
            del writer.save  # the class's again
        else:
            writer.save = own


def _commit_when_written(rank_zero: bool, group, tags, tag: str) -> None:
    """The end of an asynchronous save, in the background writer (after this rank's shard
    writes): a barrier on a gloo group of its own (every rank's shards are on disk), then
    rank 0 commits the tag. A rank killed before leaves ``latest`` on the previous tag."""
    import torch.distributed as torch_dist

    torch_dist.barrier(group=group)
    if rank_zero:
        tags.commit(tag)
        tags.prune()

