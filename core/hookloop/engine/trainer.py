"""``Trainer``: the configuration and the public API.

What runs inside a worker is below it: :mod:`hookloop.session` (set-up, loaders,
teardown) around :mod:`hookloop.loop` (the epochs) and :mod:`hookloop.step` (one
batch), with the run's state in ``trainer.state`` (:mod:`hookloop.state`) and
checkpoints in :mod:`hookloop.resume`. Its settings come from
:mod:`hookloop.engine.resolution`; it imports nothing of ``hookloop.lightning``,
``hookloop.tools`` or ``hookloop.testing``. Nothing in the engine imports this module."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader

from hookloop.contract import registry as plugin_registry
from hookloop.contract import translators
from hookloop.contract.errors import AutomaticOptimizationError, ConfigurationError
from hookloop.distributed import mesh as mesh_module
from hookloop.distributed.launch import in_worker, run_command
from hookloop.engine import session
from hookloop.engine.defaults import Defaults
from hookloop.engine.optim import LoopOptimizer
from hookloop.engine.resolution import CONFIG_FIELDS, PLUGIN_ALIASES, default, resolve_settings
from hookloop.engine.session import (
    adopt_run_dirs,
    as_loader_list,
    check_loader,
    claim_run_dirs,
    run_evaluation,
    run_predict,
)
from hookloop.engine.settings import check_devices_on_cpu
from hookloop.engine.state import LoopState
from hookloop.engine.step import (
    STEP_METHODS,
    TEST,
    VALIDATE,
    epoch_row_values,
    log_row,
    loop_optimizers,
    manual_backward,
    manual_optimizer_step,
)
from hookloop.helpers import clip_gradients
from hookloop.resume import rundir
from hookloop.resume.run import checkpoint_dict

__all__ = ["Trainer", "TrainerState", "default"]

_UNSET: Any = object()


#: Lightning's name for ``trainer.state``'s class (now the loop's whole state)
TrainerState = LoopState


class Trainer:
    """Runs a training module's steps; plugins supply every technique.

    The arguments are resolved by
    :func:`hookloop.engine.resolution.resolve_settings` (docs/configurations.md, "Where a
    setting comes from"): arguments not given in code fall back to the options of
    ``hookloop run`` (passed through the environment), then to the defaults of
    :class:`TrainerConfig`; ``trainer.settings`` is the result, read-only, and
    ``trainer.config`` its working copy. ``strategy`` (a strategy plugin's name or object,
    or Lightning's strategy strings) and ``callbacks`` (plugin objects, and Lightning-style
    :class:`hookloop.Callback` objects, run in list order by one adapter plugin; any other
    object there is an error) are Lightning's names for entries of ``plugins``. ``logger``
    is ``True`` (or ``None``: the built-in CSV logger), ``False``, or logger objects
    (``hookloop.CSVLogger(save_dir, name)``, ``hookloop_tensorboard.TensorBoardLogger``,
    ``hookloop_mlflow.MLFlowLogger``, or a list), which are plugins first in the run
    (``trainer.logger``, ``trainer.loggers``). Those Lightning names are translated by the
    ``lightning`` built-in (:mod:`hookloop.lightning.plugin`), not by the engine;
    ``plugins=["no:lightning"]`` turns it off, and refuses them (docs/lightning.md).

    ``mesh``: the device mesh's sizes, ``{"dp_shard": 2, "tp": 2}`` or ``"dp_shard=2,tp=2"``
    (:mod:`hookloop.mesh`; ``hookloop run --mesh``, ``HOOKLOOP_MESH``); the mesh over the
    dimensions the plugins claim is ``trainer.device_mesh`` during a run.

    ``global_batch_size``: samples per optimizer step over all the data-parallel processes
    (``hookloop run --global-batch-size``); ``fit`` sets ``accumulate_grad_batches`` to
    ``global_batch_size / (the loader's batch_size x data-parallel processes)`` once that
    size is known, or refuses to start when it does not divide. A script that builds its
    own per-process loaders gets ``(replicas, rank)`` from
    :func:`hookloop.data_parallel_rank` (from ``setup`` on).

    ``nodes``: machines, or ``"MIN:MAX"`` for an elastic job (torchrun's ``--nnodes``;
    :mod:`hookloop.distributed.elastic`): it trains on fewer machines from the run's last
    checkpoint when one is lost and grows back when it returns; ``elastic_batch`` says what
    happens to the batch then (``"global"``, the default: the global batch is kept and the
    accumulation recomputed; ``"per-device"``), ``rdzv_conf`` gives torchrun's
    ``--rdzv-conf`` (``"join_timeout=60,last_call_timeout=5"``), and ``max_restarts``
    defaults to 3 there (docs/how-to/elastic.md).

    ``max_epochs``/``max_steps``: ``-1`` is Lightning's "no limit". ``min_epochs``/``min_steps``:
    ``trainer.should_stop`` (an ``EarlyStopping``, a ``Timer``) ends training only once that
    many epochs and optimizer steps are done, as Lightning's (``min_steps`` alone makes
    ``min_epochs`` 1).

    ``max_time``: Lightning's time limit ("DD:HH:MM:SS", a timedelta or a dict such as
    ``{"hours": 12}``; ``hookloop run --max-time``): a :class:`hookloop.Timer` with that
    duration checked after every training batch, rank 0's clock deciding for every rank
    (with several processes: its vote rides the stop agreement, ``stop_check_every_n_steps``).

    Faults (:mod:`hookloop.faults`): ``process_group_timeout`` (seconds a collective may
    wait; default gloo 300, nccl 600), ``requeue_on_preemption`` (under SLURM, global
    rank 0 runs ``scontrol requeue`` after the checkpoint a SIGTERM causes) and
    ``stop_check_every_n_steps`` (with several processes, how often the ranks agree on
    stopping for a SIGTERM or ``max_time``, without waiting: the all-reduce started at one
    agreement is read at the next, and the steps between do nothing; every rank stops at
    the same step. Default ``"auto"``: about once a second of the slowest rank's steps
    (every step for steps of a second or more), so a stop comes about 2 s or 2 steps after
    the signal; an int K fixes it: within 2K steps; 1: every step, as before issue 33).

    Attributes plugins read (see :mod:`hookloop.hookspecs`): ``config``, ``module`` (the
    user's module), ``model`` (what the strategy wrapped), ``optimizers`` (and
    ``optimizer``, the first), ``lr_scheduler_configs``, ``world_size``, ``global_rank``,
    ``local_rank``, ``node_rank``, ``root_device``, ``precision``, ``current_epoch``,
    ``global_step``, ``callback_metrics``, ``datamodule``, ``train_dataloader``,
    ``val_dataloaders``, ``state`` (:class:`TrainerState`: equal to ``"fit"``, ``"validate"``,
    ``"test"`` or ``"predict"`` during a run, with Lightning's ``fn``/``stage``/``finished``),
    ``sanity_checking``, ``should_stop``, ``plugin_manager``, ``strategy``, ``device_mesh``.
    """

    def __init__(
        self,
        *,
        plugins: Any = _UNSET,
        strategy: Any = _UNSET,
        callbacks: Any = _UNSET,
        devices: Any = _UNSET,
        accelerator: str = _UNSET,
        nodes: int | str = _UNSET,
        node_rank: int = _UNSET,
        rdzv_endpoint: str | None = _UNSET,
        rdzv_conf: str | None = _UNSET,
        max_restarts: int | None = _UNSET,
        elastic_batch: str = _UNSET,
        max_epochs: int | None = _UNSET,
        max_steps: int | None = _UNSET,
        min_epochs: int | None = _UNSET,
        min_steps: int | None = _UNSET,
        max_time: Any = _UNSET,
        accumulate_grad_batches: int = _UNSET,
        global_batch_size: int | None = _UNSET,
        gradient_clip_val: float | None = _UNSET,
        gradient_clip_algorithm: str = _UNSET,
        precision: Any = _UNSET,
        default_root_dir: str = _UNSET,
        enable_checkpointing: bool = _UNSET,
        limit_train_batches: int | float | None = _UNSET,  # noqa: PYI041 (a count or a fraction)
        limit_val_batches: int | float | None = _UNSET,  # noqa: PYI041 (a count or a fraction)
        limit_test_batches: int | float | None = _UNSET,  # noqa: PYI041 (a count or a fraction)
        limit_predict_batches: int | float | None = _UNSET,  # noqa: PYI041 (a count or a fraction)
        val_check_interval: int | float = _UNSET,  # noqa: PYI041
        check_val_every_n_epoch: int | None = _UNSET,
        num_sanity_val_steps: int = _UNSET,
        fast_dev_run: bool | int = _UNSET,
        overfit_batches: int | float = _UNSET,  # noqa: PYI041
        log_every_n_steps: int = _UNSET,
        enable_progress_bar: bool = _UNSET,
        enable_model_summary: bool = _UNSET,
        logger: Any = _UNSET,
        use_distributed_sampler: bool = _UNSET,
        stateful_dataloader: bool = _UNSET,
        autoload_plugins: bool = _UNSET,
        plugin_options: dict = _UNSET,
        mesh: Any = _UNSET,
        process_group_timeout: float | None = _UNSET,
        requeue_on_preemption: bool = _UNSET,
        stop_check_every_n_steps: int | str = _UNSET,
        benchmark: bool | None = _UNSET,
        deterministic: bool | str | None = _UNSET,
    ):
        arguments = {k: v for k, v in locals().items() if k in _ARGUMENTS and v is not _UNSET}
        settings, plan = resolve_settings(arguments, os.environ)
        #: the resolved settings, read-only (hookloop.engine.resolution.Settings), and the
        #: run's working copy of them, which plugins read (and may narrow) as trainer.config
        self.settings, self.config = settings, settings.trainer_config()
        self.plugins = chosen = list(plan.plugins)
        self._callback_hooks = plan.adapter  # Lightning's Callbacks' adapter (trainer.callbacks)
        self._translators = plan.translators  # the compatibility layers left on (fit's entry)
        #: what the environment changed in this run, said in its first lines (rank 0)
        self._environment_settings = list(plan.environment_lines)
        self.config.apply_torch_flags()
        if self.config.fast_dev_run:
            print(f"hookloop: fast_dev_run: {self.config.max_steps} batch(es) of every loop, one "
                  f"epoch, no sanity check and no checkpoints", flush=True)
        self.plugin_manager = plugin_registry.make_plugin_manager(chosen, Defaults())
        self.hook = self.plugin_manager.hook
        # the lifecycle's owner: beside tp, the data-parallel strategy (fsdp), whatever the order
        self.strategy = mesh_module.lifecycle_lead(chosen)

        # Run state: written by setup_environment (ranks, device) and by the loops.
        self.world_size, self.global_rank, self.local_rank, self.node_rank = 1, 0, 0, 0
        self.root_device = torch.device("cpu")
        #: the run's DeviceMesh (hookloop.mesh), built after setup_environment when an
        #: enabled plugin claims a mesh dimension; None otherwise
        self.device_mesh: Any = None
        self.module: nn.Module | None = None
        self.datamodule: Any = None
        self.model: nn.Module | None = None
        self.optimizers: list = []
        self.lr_scheduler_configs: list = []
        self.current_epoch = 0
        self.global_step = 0
        self.batch_idx = 0
        #: batches of a training epoch (after limit_train_batches), known from fit's setup;
        #: None before, or for an unsized loader
        self.num_training_batches: int | None = None
        #: batches of each validation/test/predict loader (after the limits), and of the
        #: sanity check: set when that loop starts; empty before (Lightning's)
        self.num_val_batches: list = []
        self.num_test_batches: list = []
        self.num_predict_batches: list = []
        self.num_sanity_val_batches: list = []
        #: the loop's state (hookloop.state.LoopState), also Lightning's trainer.state
        self.state = LoopState(self, rundir.next_index())
        #: whether the training batch being run is the epoch's last (Lightning's)
        self.is_last_batch = False
        self.sanity_checking = False
        self.should_stop = False
        #: True during ``on_train_batch_end`` of a step whose row the loggers get right
        #: after that event (Lightning's order): a logger that checkpoints its row count
        #: (csv) counts that row in a checkpoint written at that event
        self.step_row_pending = False
        self.train_dataloader: DataLoader | None = None
        self.val_dataloaders: list[DataLoader] | None = None
        self.test_dataloaders: list[DataLoader] | None = None
        self.predict_dataloaders: list[DataLoader] | None = None
        #: keyword arguments of ``Tensor.backward`` for the backward hook (manual_backward's)
        self.backward_kwargs: dict = {}

    # -- plain attributes plugins read ---------------------------------------------------

    @property
    def precision(self) -> str:
        return self.config.precision

    @property
    def accumulate_grad_batches(self) -> int:
        return self.config.accumulate_grad_batches

    @accumulate_grad_batches.setter
    def accumulate_grad_batches(self, value: int) -> None:
        # Lightning's GradientAccumulationScheduler sets it at an epoch's start; the loop
        # reads it at every epoch's start.
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"accumulate_grad_batches={value!r} must be an int >= 1")
        self.config.accumulate_grad_batches = value

    @property
    def callbacks(self) -> list:
        """The run's plugins and :class:`hookloop.Callback` objects, in order (Lightning's
        ``trainer.callbacks``; the Callbacks where their adapter stands)."""
        out: list = []
        for p in self.plugins:
            out += p.callbacks if p is self._callback_hooks else [p]
        return out

    @property
    def gradient_clip_val(self) -> float | None:
        return self.config.gradient_clip_val

    @property
    def max_epochs(self) -> int | None:
        return self.config.max_epochs

    @property
    def max_steps(self) -> int:
        """The step limit; -1 without one (Lightning's value: ``Trainer(max_steps=-1)``, its
        default, and ``max_steps=None`` read back as -1)."""
        return -1 if self.config.max_steps is None else self.config.max_steps

    @property
    def min_epochs(self) -> int:
        """The epochs before ``should_stop`` may end training: the setting, else 1 with
        ``min_steps``, else 0 (Lightning's, as it reads once a fit has started)."""
        given = self.config.min_epochs
        return given if given is not None else 0 if self.config.min_steps is None else 1

    @property
    def min_steps(self) -> int | None:
        return self.config.min_steps

    @property
    def default_root_dir(self) -> Path:
        """The run's root directory; for a URL (``s3://bucket/run``), its local staging
        directory, whose checkpoints are committed to the store and whose logs are
        uploaded (docs/how-to/object-storage.md): :func:`hookloop.resume.storage.local_root`."""
        from hookloop.resume.storage import local_root

        return local_root(self.config.default_root_dir)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first (usually only) optimizer of the run."""
        return self.optimizers[0] if self.optimizers else None

    @property
    def lr_scheduler(self) -> Any:
        """The first LR scheduler of the run (``lr_scheduler_configs`` has them all)."""
        return self.lr_scheduler_configs[0].scheduler if self.lr_scheduler_configs else None

    @property
    def val_dataloader(self) -> DataLoader | None:
        """The first validation loader (``val_dataloaders`` has them all)."""
        return self.val_dataloaders[0] if self.val_dataloaders else None

    @property
    def automatic_optimization(self) -> bool:
        """False when the module steps its optimizers itself (manual optimization)."""
        return getattr(self.module, "automatic_optimization", True) is not False

    @property
    def callback_metrics(self) -> dict[str, float]:
        """The last value of every logged metric, as floats (reads step values from the
        device when asked)."""
        return self.state.metrics.read()

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        metrics = self.callback_metrics
        # a forked metric (on_step and on_epoch) shows as name_step / name_epoch only
        shown, forked = self.state.metrics.prog_bar, self.state.metrics.forked
        out = {k: v for k, v in metrics.items() if k in shown and k not in forked}
        eval_steps = self.state.metrics.eval_step_pbar  # Lightning shows them, as step values
        return {**{k: float(v) for k, v in eval_steps.items()}, **out} if eval_steps else out

    @property
    def logged_metrics(self) -> dict[str, float]:
        """The last value of every metric handed to the loggers in this run (what
        Lightning's ``trainer.logged_metrics`` holds; empty without a logger). In
        ``on_train_epoch_end`` it has the epoch's values already, as Lightning's."""
        row = self.state.epoch_row
        if row is None or self.state.on_log_metrics is None:
            return self.state.logged_metrics
        hidden = self.state.metrics.not_for_logger
        pending = {k: float(v) for k, v in epoch_row_values(self, row).items() if k not in hidden}
        return {**self.state.logged_metrics, **pending}

    @property
    def loggers(self) -> list:
        """The enabled logger plugins (those implementing ``on_log_metrics``: ``csv``,
        ``tensorboard``, ``mlflow``...), in plugin order: the objects given as
        ``Trainer(logger=...)`` first, in their order."""
        return [p for p in self.plugins if callable(getattr(p, "on_log_metrics", None))]

    @property
    def logger(self) -> Any:
        """The first logger plugin, or ``None`` without one."""
        loggers = self.loggers
        return loggers[0] if loggers else None

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def log_dir(self) -> Path:
        """This run's directory, ``<default_root_dir>/logs/version_N``, or the first
        logger's version directory when it has one (``CSVLogger(save_dir, name)``:
        ``save_dir/name/version_N``, as Lightning): its logs and checkpoints. The same on
        every rank and after every elastic restart. Without a logger (``logger=False``),
        ``default_root_dir``, as Lightning's."""
        if self.state.log_dir is None:  # outside a run (one process): as rank 0 decides in one
            adopt_run_dirs(self, claim_run_dirs(self))
        return cast(Path, self.state.log_dir)

    @property
    def checkpoint_callback(self) -> Any:
        """The checkpoint plugin of the run (``best_model_path``, ``last_model_path``), or
        ``None`` with checkpointing off."""
        name = plugin_registry.plugin_name
        return next((p for p in self.plugins if name(p) == "checkpoint"), None)

    def __getattr__(self, name: str) -> Any:
        # Only for names the Trainer lacks: a compatibility layer's read-only views over
        # the run's plugins (Lightning's trainer.early_stopping_callbacks...; registered in
        # hookloop.contract.translators by the facade).
        view = translators.view(name) if not name.startswith("__") else None
        if view is None:
            if hasattr(type(self), name):  # a property's own AttributeError: let it surface
                return object.__getattribute__(self, name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return view(self)

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        """Hand a row of metrics (names to numbers) to the loggers, for plugins that
        measure something themselves (learning rates, device statistics); ``step``
        defaults to ``global_step``. Also in ``callback_metrics``."""
        floats = {k: float(v) for k, v in metrics.items()}
        self.state.metrics.callback_metrics.update(floats)
        log_row(self, floats, step)

    def has_plugin(self, role: str) -> bool:
        """Whether a plugin of ``role`` (``"strategy"``, ``"precision"``...) is enabled."""
        return any(plugin_registry.plugin_role(p) == role for p in self.plugins)

    def strategy_owns(self, concern: str) -> bool:
        """Whether the strategy takes over ``concern`` (e.g. ``"precision"``) itself."""
        return self.strategy is not None and concern in plugin_registry.plugin_owns(self.strategy)

    # -- collectives, as plugins and modules call them ----------------------------------

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return self.hook.reduce(trainer=self, tensor=tensor, op=op)

    def barrier(self, name: str = "") -> None:
        """Wait for every rank (the ``barrier`` hook; nothing to wait for in a world of 1)."""
        if self.world_size > 1:
            self.hook.barrier(trainer=self, name=name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as global rank ``src`` holds it, on every rank (``None`` included:
        the object travels in a one-element list, so a firstresult hook never mistakes
        a broadcast ``None`` for "not handled"). In a world of 1: ``obj``, no hook call."""
        if self.world_size == 1:
            return obj
        return self.hook.broadcast(trainer=self, obj=[obj], src=src)[0]

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order, on every rank (one broadcast per rank,
        so any strategy's ``broadcast`` serves)."""
        if self.world_size == 1:
            return [obj]
        return [self.broadcast(obj if self.global_rank == rank else None, src=rank)
                for rank in range(self.world_size)]

    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on every rank) stacked along a new first
        dimension, in rank order, as Lightning's strategies do; in a world of 1 the tensor
        itself. ``sync_grads=True`` lets gradients flow back through the gather (needs a
        ``torch.distributed`` strategy)."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            tensor = tensor.contiguous()
            if sync_grads:
                from torch.distributed.nn.functional import all_gather as differentiable_all_gather

                # group= given: its default (group.WORLD) is bound when torch first imports the
                # module, so a process that made a new group since (a second fit) would gather
                # on the destroyed one ("not initialized in the world group map" in backward).
                return torch.stack(differentiable_all_gather(tensor, group=dist.group.WORLD))
            with torch.no_grad():
                parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
                dist.all_gather(parts, tensor)
            return torch.stack(parts)
        if sync_grads:
            raise ConfigurationError(
                f"all_gather(..., sync_grads=True) needs a torch.distributed strategy (ddp, fsdp, "
                f"deepspeed); the strategy {plugin_registry.plugin_name(self.strategy)!r} gathers "
                f"without gradients: pass sync_grads=False"
            )
        parts = self.all_gather_object(tensor.detach().cpu())
        return torch.stack(parts).to(tensor.device)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    # -- pickling, for strategies that send the trainer to spawned workers ---------------

    def __getstate__(self) -> dict:
        # pluggy's hook callers hold the hook-spec module, which cannot be pickled: the
        # plugin manager is rebuilt from the (pickled) plugins on arrival.
        state = self.__dict__.copy()
        for key in ("plugin_manager", "hook"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.plugin_manager = plugin_registry.make_plugin_manager(self.plugins, Defaults())
        self.hook = self.plugin_manager.hook

    # -- entry points -------------------------------------------------------------------

    def fit(
        self,
        model: nn.Module,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: str | os.PathLike | None = None,
    ) -> None:
        """Train ``model`` on ``train_dataloaders`` (or the DataModule's loaders);
        validate as ``val_check_interval`` says when validation loaders are given.

        ``ckpt_path`` resumes from a checkpoint file, ``"last"`` for the newest run's
        ``<default_root_dir>/logs/version_N/checkpoints/last.ckpt`` (none yet: training
        starts from scratch, with a warning), or ``"best"`` for the checkpoint callback's
        best. Without ``ckpt_path``, a worker that an elastic agent restarted
        (``hookloop run --max-restarts``) resumes from this run's own ``last.ckpt``, if it
        wrote one. With ``devices > 1`` and no launcher around this process, the script
        is re-launched through the strategy's launcher (torchrun by default) and this
        process exits with the workers' status.
        """
        if _is_datamodule(train_dataloaders):
            datamodule, train_dataloaders = train_dataloaders, None
        _check_module(model, needs=("training_step", "configure_optimizers"))
        _check_ckpt_path("fit", ckpt_path)
        given = train_dataloaders is not None or val_dataloaders is not None
        if datamodule is not None and given:
            raise ConfigurationError(
                "fit got both dataloaders and a datamodule: pass one or the other")
        if train_dataloaders is not None:
            check_loader(train_dataloaders, "train_dataloaders")
        val = as_loader_list(val_dataloaders, "val_dataloaders")
        if val and not callable(getattr(model, "validation_step", None)):
            raise ConfigurationError(
                f"val_dataloaders were given but {type(model).__name__} has no "
                f"validation_step(batch, batch_idx): define one, or leave val_dataloaders out"
            )
        _check_training_step(model)
        if os.environ.get(PLAN_ENV) == "1":
            describe_from_environment(self, model)  # `hookloop plan`: ends here
        for translator in self._translators:  # Lightning's: `hookloop tune` ends here
            translator.before_fit(self, model, train_dataloaders, datamodule)
        self._start(model, datamodule, ckpt_path, train=train_dataloaders, val=val)
        self._launch_or_run(session.fit)

    def validate(self, model: nn.Module | None = None, dataloaders: Any = None,
                 ckpt_path: Any = None, verbose: bool = True, datamodule: Any = None) -> list[dict]:
        """Run ``validation_step`` over ``dataloaders``; one dict of metrics per loader."""
        return self._evaluate(VALIDATE, model, dataloaders, ckpt_path, verbose, datamodule)

    def test(self, model: nn.Module | None = None, dataloaders: Any = None, ckpt_path: Any = None,
             verbose: bool = True, datamodule: Any = None) -> list[dict]:
        """Run ``test_step`` over ``dataloaders``; one dict of metrics per loader."""
        return self._evaluate(TEST, model, dataloaders, ckpt_path, verbose, datamodule)

    def predict(self, model: nn.Module | None = None, dataloaders: Any = None,
                datamodule: Any = None, return_predictions: bool | None = None,
                ckpt_path: Any = None) -> Any:
        """Run ``predict_step`` (default: ``forward(batch)``) over ``dataloaders``.

        Returns the per-batch outputs in dataset order (a list per loader when there are
        several). Under several processes every rank predicts its share and the shares
        are gathered back into the order one process would give, each sample exactly
        once (predictions then come back on the CPU).
        """
        if _is_datamodule(dataloaders):
            datamodule, dataloaders = dataloaders, None
        model = self._model_for("predict", model)
        _check_lightning_import(model)
        _check_ckpt_path("predict", ckpt_path)
        loaders = as_loader_list(dataloaders, "dataloaders")
        self._start(model, datamodule, ckpt_path, predict=loaders)
        self.state.return_predictions = return_predictions is not False
        result = self._launch_or_run(run_predict)
        return None if result is True else result

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint of the whole run state to ``path`` (call on every rank).

        Synchronous: it first waits for a background save in flight
        (``ModelCheckpoint(async_save=True)``), whose error it then raises. A URL
        (``s3://bucket/model.ckpt``) is written in its local staging directory, then
        committed to the store (docs/how-to/object-storage.md)."""
        self.state.checkpoint_writer.wait()
        checkpoint = checkpoint_dict(self)
        from hookloop.resume import storage

        # a URL (s3://...): written in its staging directory, then committed to the store
        local = storage.local_root(path) if storage.is_url(path) else Path(path)
        saved = self.hook.save_checkpoint(trainer=self, checkpoint=checkpoint, path=local)
        if storage.is_url(path):
            if getattr(self.strategy, "hookloop_checkpoint_format", "file") == "directory":
                from hookloop.resume import sharded_store

                # every rank: each machine's local rank 0 uploads the shards on its disk
                sharded_store.commit_directory(self, local, self.global_step)
            elif self.is_global_zero:
                storage.sync_file(local)
        return saved

    # -- helpers of the entry points ----------------------------------------------------

    def _evaluate(self, stage, model, dataloaders, ckpt_path, verbose, datamodule) -> list[dict]:
        if _is_datamodule(dataloaders):
            datamodule, dataloaders = dataloaders, None
        model = self._model_for(stage, model)
        _check_module(model, needs=(STEP_METHODS[stage],))
        _check_ckpt_path(stage, ckpt_path)
        loaders = as_loader_list(dataloaders, "dataloaders")
        if stage == VALIDATE:
            self._start(model, datamodule, ckpt_path, val=loaders)
        else:
            self._start(model, datamodule, ckpt_path, test=loaders)
        self.state.verbose = verbose
        result = self._launch_or_run(_run_validate if stage == VALIDATE else _run_test)
        return result if isinstance(result, list) else [dict(self.callback_metrics)]

    def _model_for(self, stage: str, model: nn.Module | None) -> nn.Module:
        if model is None:
            model = self.module
        if model is None:
            raise ConfigurationError(
                f"trainer.{stage}() needs the module: trainer.{stage}(model, dataloaders)")
        return model

    def _start(self, model, datamodule, ckpt_path, train=None, val=None, test=None,
               predict=None) -> None:
        self.module, self.datamodule, self.state.ckpt_path = model, datamodule, ckpt_path
        self.train_dataloader, self.val_dataloaders = train, val
        self.test_dataloaders, self.predict_dataloaders = test, predict
        self.should_stop = False
        self.state.loop_optimizer_cache = None

    # Manual optimization: called by the module's optimizers()/manual_backward().

    def _loop_optimizers(self) -> list:
        return loop_optimizers(self)

    def _manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        manual_backward(self, loss, *args, **kwargs)

    def _manual_optimizer_step(self, optimizer: Any) -> None:
        manual_optimizer_step(self, optimizer)

    def _request_clip(self, optimizer: Any, value: float | None, algorithm: str | None) -> None:
        if self.strategy_owns("gradient_clipping"):
            raise ConfigurationError(
                f"the strategy {plugin_registry.plugin_name(self.strategy)!r} clips gradients "
                f"itself: set Trainer(gradient_clip_val=...) instead of calling self.clip_gradients"
            )
        # NaN clipped every weight into NaN; 0 does not clip (Lightning's, kept)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and math.isfinite(value) and value >= 0):
            raise ConfigurationError(
                f"self.clip_gradients(gradient_clip_val={value!r}): gradient_clip_val must be a "
                "finite number (> 0 clips the gradients' norm, or values, to it; 0 does not clip), "
                "or None for Trainer(gradient_clip_val=...)'s")
        algorithm = algorithm or self.config.gradient_clip_algorithm
        if algorithm not in ("norm", "value"):
            raise ConfigurationError(
                f"gradient_clip_algorithm={algorithm!r} must be 'norm' or 'value'")
        real = optimizer
        if isinstance(optimizer, LoopOptimizer):
            real = getattr(optimizer, "optimizer", optimizer)
        value = value if value is not None else self.gradient_clip_val
        now = self.state.clipping_optimizer
        # inside configure_gradient_clipping
        if now is not None and (real is now or optimizer is now):
            clip_gradients(self, cast(torch.optim.Optimizer, now), value, algorithm)
            return
        self.state.clip_requests[id(real)] = (value, algorithm)

    # -- launching ----------------------------------------------------------------------

    def _launch_or_run(self, function):
        self._check_devices()
        spawned = self.hook.spawn(trainer=self, function=function)
        if spawned is not None:
            return spawned
        world = self.config.num_processes() * self.config.nodes
        if world > 1 and not in_worker():
            script = sys.argv[0]
            if not script or not Path(script).is_file():
                raise ConfigurationError(
                    f"devices={self.config.devices} needs worker processes, and hookloop "
                    f"re-launches the running script to start them, but this process has no "
                    f"script file (an interactive session or notebook?). Use a spawn-based "
                    f"strategy (plugins=['ddp_spawn']) or run a script with `hookloop run`."
                )
            cmd = self.hook.launch_command(config=self.config, script=script,
                                           script_args=sys.argv[1:])
            raise SystemExit(run_command(cmd, root=self.default_root_dir))
        return function(self)

    def _check_devices(self) -> None:
        # The devices plugin chooses first: it may narrow ``config.devices`` (gpus="3"
        # is GPU 3, one process), so the process count is read after its choice.
        self.device_ids = self.hook.select_devices(config=self.config)
        check_devices_on_cpu(self.config)  # after the devices plugin resolved the accelerator
        nproc = self.config.num_processes()
        if nproc * self.config.nodes > 1 and self.strategy is None:
            installed = sorted(plugin_registry.installed_plugins())
            raise ConfigurationError(
                f"devices={self.config.devices!r} x nodes={self.config.nodes} asks for "
                f"{nproc * self.config.nodes} processes, but no strategy plugin is enabled to "
                f"run them (the built-in default is one process). Enable one by name, e.g. "
                f"plugins=['ddp'] or --plugins ddp (pip install hookloop-ddp). Installed "
                f"plugins: {', '.join(installed) or 'none'}."
            )


# Module-level (not lambdas): a spawn-based strategy pickles the function it runs.
#: set to ``1`` by ``hookloop plan``: the script's first ``fit`` describes the model and ends
PLAN_ENV = "HOOKLOOP_PLAN"


def describe_from_environment(trainer: Trainer, model: nn.Module) -> None:
    """``hookloop plan``'s end of a script's first ``fit``: the module built
    (``configure_model``), every plugin's ``describe_model`` answer printed, and the
    process ended (status 0) before any process group, run directory or training."""
    configure_model = getattr(model, "configure_model", None)
    if callable(configure_model):
        configure_model()
    answers = [a for a in trainer.hook.describe_model(trainer=trainer, module=model) if a]
    params = sum(p.numel() for p in model.parameters())
    names = ", ".join(plugin_registry.plugin_name(p) for p in trainer.plugins
                      if plugin_registry.plugin_role(p) != "observer") or "none"
    world = trainer.config.num_processes() * (trainer.config.nodes or 1)
    mesh = trainer.config.mesh
    print(f"hookloop plan: {type(model).__name__} ({params:,} parameters) on {world} process(es)"
          f"{' (mesh ' + ','.join(f'{k}={v}' for k, v in mesh.items()) + ')' if mesh else ''}; "
          f"plugins: {names}")
    # pluggy answers the last registered first: the order the run lists them
    for answer in reversed(answers):
        print(answer)
    if not answers:
        print(f"hookloop plan: no plugin of this run transforms {type(model).__name__}: every "
              "process holds it whole (nothing was trained)")
    sys.stdout.flush()
    raise SystemExit(0)


def _run_validate(trainer) -> list[dict]:
    return run_evaluation(trainer, VALIDATE)


def _run_test(trainer) -> list[dict]:
    return run_evaluation(trainer, TEST)


#: the Trainer's arguments: the settings (TrainerConfig's fields) and Lightning's names for
#: plugins (strategy, callbacks), which a compatibility layer translates
_ARGUMENTS = CONFIG_FIELDS | set(PLUGIN_ALIASES)


def _is_datamodule(obj: Any) -> bool:
    """A DataModule by duck type (not a subclass of hookloop.DataModule): an object, not a
    loader or a collection of loaders, with one of the ``*_dataloader()`` methods."""
    return obj is not None and not isinstance(obj, (DataLoader, list, tuple, dict)) and any(
        callable(getattr(obj, m, None))
        for m in ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader"))


def _check_module(module: Any, needs: tuple[str, ...]) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    _check_lightning_import(module)
    missing = [m for m in needs if not callable(getattr(module, m, None))]
    if missing:
        raise ConfigurationError(
            f"{type(module).__name__} must define {' and '.join(m + '()' for m in missing)}; "
            f"see hookloop.Module"
        )


def _check_lightning_import(module: nn.Module) -> None:
    """A ``lightning.pytorch``/``pytorch_lightning`` ``LightningModule`` whose import was not
    changed: its stubs (``val_dataloader`` "must be implemented to be used with the
    Lightning Trainer") would fail deep inside the run. Found by the classes' module names;
    hookloop never imports Lightning."""
    cls = type(module)
    lightning = next((c for c in cls.__mro__ if c.__name__ == "LightningModule"
                      and c.__module__.split(".")[0] in ("lightning", "pytorch_lightning")), None)
    if lightning is None:
        return
    package = lightning.__module__.split(".")[0]
    where = "pytorch_lightning" if package == "pytorch_lightning" else "lightning.pytorch"
    raise ConfigurationError(
        f"{cls.__name__} subclasses {where}.LightningModule (Lightning's own: the import was not "
        f"changed), which hookloop's Trainer does not run: change `from {where} import "
        "LightningModule` (or "
        f"`import {where} as pl`; pl.LightningModule) to `from hookloop import Module` and "
        "subclass Module: the same hooks (docs/lightning.md lists the other names)"
    )


def _check_ckpt_path(entry: str, ckpt_path: Any) -> None:
    """Before any process starts: ``ckpt_path`` is a path, ``"last"``, ``"best"`` or None."""
    if ckpt_path is None or isinstance(ckpt_path, (str, os.PathLike)):
        return
    raise ConfigurationError(
        f"{entry}(ckpt_path={ckpt_path!r}): ckpt_path must be the path of a checkpoint (a str or "
        f"os.PathLike), 'last', 'best' or None, got {type(ckpt_path).__name__}: 'last' is the "
        "newest last.ckpt under default_root_dir, 'best' the checkpoint callback's best, None no "
        "checkpoint"
    )


def _check_training_step(module: nn.Module) -> None:
    import inspect

    try:
        step: Any = module.training_step
        params = inspect.signature(step).parameters
    except (TypeError, ValueError):
        return
    if "optimizer_idx" in params:
        raise AutomaticOptimizationError(
            f"Training with multiple optimizers is only supported with manual optimization "
            f"({type(module).__name__}.training_step takes optimizer_idx: Lightning 1.x's "
            f"automatic optimization with several optimizers). Remove the `optimizer_idx` "
            f"argument from `training_step`, set `self.automatic_optimization = False` and step "
            "each optimizer in training_step (opt_g, opt_d = self.optimizers(); "
            "self.manual_backward(loss); opt_g.step())"
        )
