"""The hook contract between the hookloop core and its plugins.

This module is the whole protocol a plugin author needs to read. Hooks are grouped by
the phase in which the loop calls them, in the order it calls them:

0. types           -- what a hook receives (the trainer and configuration protocols)
1. launching       -- before any worker process exists (CLI, or ``Trainer.fit`` re-launch)
2. environment     -- inside each worker: process group, ranks, device
3. model and data  -- building, wrapping and placing the model, optimizer and loaders
4. the step        -- forward context, backward, gradient accumulation, optimizer step
5. collectives     -- reduce, barrier, broadcast for metrics and checkpoints
6. checkpoints     -- saving and loading, and each plugin's own state in them
7. observers       -- events for callbacks (progress, loggers, monitors)

How to read a hook below:

* ``firstresult``: the core stops at the first implementation that returns something
  other than ``None`` and uses that value ("Stops at first non-None result"). The core's
  built-in plugin, named ``hookloop.defaults`` (``hookloop/engine/defaults.py``), implements the
  single-process default of every ``firstresult`` hook except ``select_devices``,
  ``spawn``, ``wrap_optimizer`` and ``configure_sampler``, whose default is "nothing to
  do" (``None``: keep the devices, run in this process, keep the optimizer, keep the
  loader). It is registered *first* and marked ``trylast``, so pluggy calls it *last*:
  your implementation runs before the default and wins by returning a value, or defers
  to it by returning ``None``.
* Hooks without ``firstresult`` call every implementation; their return values are
  collected in a list (most hooks here return nothing).
* Implement a hook with ``@hookloop.hookimpl`` on a function (module plugin) or method
  (object plugin). Take only the arguments you need, by name; an argument that the spec
  does not have is an error at start naming your plugin and the hook.
* Every hook is typed (section 0 below): ``trainer`` is a :class:`TrainerLike` and
  ``config`` a :class:`ConfigLike`, protocols of what hooks read.
* ``trainer`` is always the :class:`hookloop.Trainer`; its documented attributes
  (``world_size``, ``global_rank``, ``local_rank``, ``node_rank``, ``root_device``,
  ``precision``, ``accumulate_grad_batches``, ``gradient_clip_val``, ``module``,
  ``model``, ``optimizer``, ``lr_scheduler``, ``current_epoch``, ``global_step``,
  ``default_root_dir``, ``config``) are the state plugins read. Only a strategy's
  ``setup_environment`` writes the rank and device attributes.

Per-step hooks (phase 4) are resolved once per ``fit``: a hook that only the built-in
default implements is called directly, and an observer hook that nobody implements costs
nothing. A plugin that implements a per-step hook pays one pluggy call per step.

Several plugins implementing one hook: pluggy calls the implementations in reverse
order of registration (the built-in defaults first registered, so last called; then the
plugins in the order the run lists them: code, then ``--plugins``, then
``HOOKLOOP_PLUGINS``, so the last listed runs first). Put ``@hookloop.hookimpl(tryfirst=
True)`` or ``(trylast=True)`` on an implementation to move it to the front or the back,
and ``(wrapper=True)`` to run around the others (``result = yield``; Horovod wraps
``optimizer_step`` this way). A subclass that overrides an inherited implementation
keeps it a hook implementation, with the inherited options, even without repeating the
decorator. The user's module hooks run first (``tryfirst``).

Options: a plugin's options are its class's constructor arguments. Users set them with
``hookloop.plugin("amp", init_scale=1024)``, ``Trainer(plugin_options={"amp":
{"init_scale": 1024}})``, ``hookloop run --plugin-option amp.init_scale=1024``
(repeatable) or ``HOOKLOOP_PLUGIN_OPTIONS="amp.init_scale=1024; ddp.timeout=60"``; per
option, code beats the command line, which beats the environment. Document each option
in the class docstring (``hookloop check`` looks for it).

State in checkpoints: ``on_save_checkpoint`` / ``on_load_checkpoint`` for state that is
the same on every rank (written by rank 0); ``on_save_rank_checkpoint`` /
``on_load_rank_checkpoint`` for state each rank holds on its own (gathered into the
checkpoint by rank, restored to the same rank).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import pluggy
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Sampler

from hookloop.contract.types import STEP_OUTPUT

hookspec = pluggy.HookspecMarker("hookloop")
#: Decorator for plugin authors: ``@hookloop.hookimpl`` marks a hook implementation.
hookimpl = pluggy.HookimplMarker("hookloop")


# ---------------------------------------------------------------------------------------
# 0. What a hook receives: the types of the arguments below
# ---------------------------------------------------------------------------------------
#
# The hooks are typed; ``trainer`` and ``config`` are described by protocols (read-only
# properties unless said otherwise) rather than by hookloop's own classes, so that this
# module depends on nothing of the core above it. A plugin annotates its hook
# implementations with these types (``trainer: hookloop.contract.hookspecs.TrainerLike``) or with
# the concrete classes (``hookloop.Trainer``, which has every attribute listed here and
# more); docs/plugin-authors.md, "Type-checking a plugin", shows how mypy checks it.

#: ``setup``/``teardown``'s ``stage``: the entry point that runs.
Stage = Literal["fit", "validate", "test", "predict"]
#: ``reduce``'s ``op``.
ReduceOp = Literal["mean", "sum", "max", "min"]
#: ``clip_gradients``'s ``algorithm``: the total 2-norm, or each element.
ClipAlgorithm = Literal["norm", "value"]
#: What ``spawn``'s function and ``broadcast``'s object are, given back unchanged.
T = TypeVar("T")


class ConfigLike(Protocol):
    """The run's configuration as hooks read it (``hookloop.TrainerConfig``;
    ``trainer.config``)."""

    @property
    def devices(self) -> int | str | Sequence[int]:
        """Processes per node: a count, ``"auto"``, or device indices."""
        ...

    @property
    def accelerator(self) -> str:
        """``"auto"``, ``"cpu"``, ``"cuda"`` or ``"gpu"``."""
        ...

    @property
    def nodes(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def rdzv_endpoint(self) -> str | None:
        """``HOST:PORT`` of node 0 (several nodes)."""
        ...

    @property
    def max_restarts(self) -> int: ...

    @property
    def precision(self) -> str:
        """Normalised: ``"32"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``,
        ``"bf16-true"``."""
        ...

    @property
    def gradient_clip_algorithm(self) -> str: ...

    @property
    def global_batch_size(self) -> int | None: ...

    @property
    def use_distributed_sampler(self) -> bool: ...

    @property
    def process_group_timeout(self) -> float | None:
        """Seconds a collective may wait (``None``: the backend's default)."""
        ...

    @property
    def mesh(self) -> Mapping[str, int | None]:
        """The device mesh's sizes (``--mesh``); ``None``: the rest of the world."""
        ...

    @property
    def plugin_options(self) -> Mapping[str, Mapping[str, Any]]:
        """Options by plugin name, then option name."""
        ...

    def num_processes(self) -> int:
        """Processes per node that ``devices`` asks for."""
        ...


class StateLike(Protocol):
    """``trainer.state``: Lightning's view of the run, and the loop's position."""

    @property
    def fn(self) -> str | None:
        """``"fit"``, ``"validate"``, ``"test"`` or ``"predict"`` (kept after the run)."""
        ...

    @property
    def stage(self) -> str | None:
        """``"train"``, ``"sanity_check"``, ``"validate"``, ``"test"``, ``"predict"``;
        ``None`` outside a run."""
        ...

    @property
    def status(self) -> str:
        """``"initializing"``, ``"running"``, ``"finished"`` or ``"interrupted"``."""
        ...

    @property
    def finished(self) -> bool: ...

    @property
    def loop_stage(self) -> str:
        """How far the loop got after ``trainer.batch_idx`` batches: ``"train"``,
        ``"validated"`` or ``"epoch_end"``."""
        ...

    @property
    def total_batch_idx(self) -> int:
        """Training batches run in this ``fit``, across epochs."""
        ...


class TrainerLike(Protocol):
    """The :class:`hookloop.Trainer` as a hook receives it: what plugins read, and the
    few attributes they write."""

    #: written by a strategy's ``setup_environment`` (and read by everyone after it)
    world_size: int
    global_rank: int
    local_rank: int
    node_rank: int
    root_device: torch.device
    #: set by an observer to end ``fit`` after the current batch (early stopping)
    should_stop: bool

    @property
    def config(self) -> ConfigLike: ...

    @property
    def state(self) -> StateLike: ...

    @property
    def module(self) -> torch.nn.Module:
        """The user's module."""
        ...

    @property
    def model(self) -> torch.nn.Module | None:
        """What ``wrap_model`` returned (``None`` before it)."""
        ...

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first of ``optimizers``."""
        ...

    @property
    def lr_scheduler_configs(self) -> Sequence[Any]: ...

    @property
    def precision(self) -> str: ...

    @property
    def accumulate_grad_batches(self) -> int: ...

    @property
    def gradient_clip_val(self) -> float | None: ...

    @property
    def current_epoch(self) -> int: ...

    @property
    def global_step(self) -> int:
        """Optimizer steps taken."""
        ...

    @property
    def batch_idx(self) -> int: ...

    @property
    def max_epochs(self) -> int | None: ...

    @property
    def max_steps(self) -> int: ...  # -1: no limit (Lightning's)

    @property
    def default_root_dir(self) -> Path: ...

    @property
    def log_dir(self) -> Path:
        """The run directory (``version_N``)."""
        ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def sanity_checking(self) -> bool: ...

    @property
    def automatic_optimization(self) -> bool: ...

    @property
    def backward_kwargs(self) -> Mapping[str, Any]:
        """Keyword arguments of ``Tensor.backward`` (``manual_backward``'s)."""
        ...

    @property
    def callback_metrics(self) -> Mapping[str, float]: ...

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The run's mesh, when a plugin claims a mesh dimension."""
        ...

    @property
    def train_dataloader(self) -> DataLoader[Any] | None: ...

    @property
    def val_dataloaders(self) -> Sequence[DataLoader[Any]] | None: ...

    @property
    def plugins(self) -> Sequence[Any]:
        """The run's plugin objects, in the order the run lists them."""
        ...

    @property
    def plugin_manager(self) -> pluggy.PluginManager: ...

    @property
    def hook(self) -> pluggy.HookRelay:
        """``trainer.hook.NAME(...)`` calls a hook by keyword arguments."""
        ...

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor: ...

    def barrier(self, name: str = "") -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def print(self, *args: Any, **kwargs: Any) -> None: ...

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path: ...

    def has_plugin(self, role: str) -> bool: ...

    def strategy_owns(self, concern: str) -> bool: ...


class GradScalerLike(Protocol):
    """What ``configure_grad_scaler`` returns: ``torch.amp.GradScaler``'s interface."""

    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None: ...

    def update(self, new_scale: float | torch.Tensor | None = None) -> None: ...

    def get_scale(self) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...


# ---------------------------------------------------------------------------------------
# 1. Launching: before any worker process exists
#
# ``launch_command`` and ``spawn`` are the hooks of the ``launcher`` role (contract 2.6):
# a plugin with ``hookloop_role = "launcher"`` starts the workers (torchrun, spawn,
# horovodrun, ray) and composes with any strategy, which only runs inside them. A run has
# at most one launcher: the one it names (``plugins=["fsdp", "spawn"]``, ``hookloop run
# --launcher ray``), else its strategy's (``hookloop_launcher``), else ``torchrun``. The
# launcher is registered last, so its answer comes before any other plugin's (a strategy
# written for contract 2.5 that still implements these hooks answers only when the
# launcher defers). docs/plugin-authors.md, "Writing a launcher".
# ---------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def select_devices(config: ConfigLike) -> list[int] | None:
    """Decide which accelerator devices this run uses, before any process starts.

    Called once in the launching process (``hookloop run``, or ``Trainer.fit`` before it
    re-launches), and again in each worker so every rank sees the same answer.

    :param config: the :class:`hookloop.TrainerConfig` (``devices``, ``accelerator``,
        ``nodes``, plugin options ...).
    :returns: a list of CUDA device indices (``[1, 3]``), ``[]`` for CPU, or ``None`` to
        leave the choice to the default (``devices`` processes on the default device of
        each rank). A devices plugin that auto-selects free GPUs makes its choice here and
        publishes it through the environment (``CUDA_VISIBLE_DEVICES``) so that every rank
        agrees.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def launch_command(config: ConfigLike, script: str, script_args: list[str]) -> list[str] | None:
    """Return the command that starts the worker processes for ``script``.

    Called by ``hookloop run SCRIPT`` and by ``Trainer.fit`` when ``devices > 1`` and the
    process is not already a launched worker. The core runs the command, waits for it and
    exits with its status. The default (built-in) returns PyTorch's elastic agent,
    ``python -m torch.distributed.run --nproc-per-node N [--nnodes M --node-rank R
    --rdzv-endpoint HOST:PORT] [--max-restarts K] script args...``, or the plain
    interpreter when one process suffices. A strategy with its own launcher (Horovod's
    ``horovodrun``) or none (``ddp_spawn``, which spawns from inside ``fit``) returns its
    own.

    :param config: the :class:`hookloop.TrainerConfig` of the run.
    :param script: path of the user script.
    :param script_args: list of the script's own arguments.
    :returns: ``list[str]`` argv, or ``None`` to defer.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def spawn(trainer: TrainerLike, function: Callable[[TrainerLike], T]) -> T | None:
    """Run ``function(trainer)`` in worker processes started from inside ``fit``.

    For strategies that start their workers from the user's process rather than through
    a launcher (``ddp_spawn``). Called by ``fit``/``validate`` in the user's process.

    What comes back: the worker of global rank 0 builds
    ``hookloop.worker_result(trainer, value)`` when ``function`` returns (plain data and
    CPU tensors: pickle it or ``torch.save`` it to the caller), and the implementation
    returns ``hookloop.adopt_worker_result(trainer, result)``. The caller's
    ``trainer.module`` then holds the trained weights, and the caller's ``Trainer`` the
    run's ``callback_metrics``/``logged_metrics``, ``current_epoch``/``global_step``, its
    run directory (``trainer.log_dir`` is the workers' ``version_N``, no new one is
    claimed) and each checkpoint observer's ``best_model_path``/``last_model_path``/
    ``best_k_models``; the value returned is ``function``'s (``True`` for ``None``).

    :returns: the function's result, or ``None`` to run ``function`` in this process.

    Stops at first non-None result. Return a non-None sentinel (e.g. ``True``) if the
    function itself returned ``None``.
    """


# ---------------------------------------------------------------------------------------
# 2. Environment: inside each worker
# ---------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def setup_environment(trainer: TrainerLike) -> bool | None:
    """Initialise the distributed environment of this process; strategies only.

    Called once per ``fit``/``validate``/``test``/``predict`` in every worker, before any
    other ``setup``.
    A strategy initialises its process group (or ``hvd.init()``) here and sets
    ``trainer.world_size``, ``trainer.global_rank``, ``trainer.local_rank``,
    ``trainer.node_rank`` and ``trainer.root_device``. The built-in default sets a world
    of one on ``cuda:0`` if CUDA is available and wanted, else on the CPU.

    :returns: ``True`` when handled. Stops at first non-None result.
    """


@hookspec
def on_device_mesh(trainer: TrainerLike, mesh: DeviceMesh) -> None:
    """The run's device mesh is built; mesh plugins take their part of it.

    Called in every worker right after ``setup_environment`` (the process group exists)
    and before any ``setup``, only when an enabled plugin claims a mesh dimension
    (``hookloop_mesh_dims``). ``mesh`` is the ``torch.distributed.device_mesh.DeviceMesh``
    over the claimed dimensions in the order pp, dp_replicate, dp_shard, cp, tp, then
    others; it is also ``trainer.device_mesh``. Take a plugin's own part with
    ``hookloop.submesh(trainer, self)`` (``mesh[self.hookloop_mesh_dims]``).

    :param mesh: the run's ``DeviceMesh``.
    """


@hookspec
def setup(trainer: TrainerLike, stage: Stage) -> None:
    """Prepare a plugin for a run; every plugin.

    Called once per ``fit``/``validate``/``test``/``predict`` in every worker, after
    ``setup_environment`` (so ranks and ``root_device`` are known), after the
    DataModule's ``prepare_data``/``setup`` and the module's ``setup`` (so
    ``trainer.train_dataloader`` and ``trainer.val_dataloaders`` are known) and before the
    model is built. Create
    scalers, open log files, check composition with the other plugins here (raise a
    :class:`hookloop.ConfigurationError` for impossible combinations).

    :param stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``.
    """


@hookspec
def teardown(trainer: TrainerLike, stage: Stage) -> None:
    """Release what ``setup`` acquired; every plugin.

    Called once at the end of ``fit``/``validate``/``test``/``predict``, also after an
    exception. Destroy
    process groups, close files. Must not raise for resources never acquired.
    """


# ---------------------------------------------------------------------------------------
# 3. Model, optimizer and data
# ---------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def model_init_context(trainer: TrainerLike) -> AbstractContextManager[Any] | None:
    """Return a context manager in which the user's ``configure_model()`` runs.

    Strategies that shard parameters as they are created (DeepSpeed's ``zero.Init``,
    meta-device initialisation for FSDP) return their context. Called only when the
    user's module defines ``configure_model``. The default is a null context.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def wrap_model(
    trainer: TrainerLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    optimizers: Sequence[torch.optim.Optimizer],
) -> torch.nn.Module | None:
    """Place and wrap the model for training; strategies.

    :param model: a ``torch.nn.Module`` (the *step module*) whose
        ``forward(kind, batch, batch_idx, dataloader_idx=None)`` calls the user's step
        for ``kind``: ``"train"`` -> ``training_step``, ``"validate"`` ->
        ``validation_step``, ``"test"`` -> ``test_step``, ``"predict"`` ->
        ``predict_step`` (or the module's ``forward``). Wrappers such as
        ``DistributedDataParallel`` wrap *this* module so their forward hooks see every
        step. ``model.module`` is the user's module.
    :param optimizer: the first optimizer from the user's ``configure_optimizers`` (or
        ``None`` outside ``fit``). Strategies that need it to wrap (fairscale's
        ShardedDataParallel, DeepSpeed's engine) take it here and hand their replacement
        back through :func:`wrap_optimizer`.
    :param optimizers: all of them, in order (several only with manual optimization).
    :returns: the module the loop will call. The default moves ``model`` to
        ``trainer.root_device`` and returns it.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def wrap_optimizer(
    trainer: TrainerLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> torch.optim.Optimizer | None:
    """Replace or wrap the optimizer; strategies.

    Called after :func:`wrap_model` with the wrapped ``model``, once per optimizer of
    ``configure_optimizers``. Horovod returns its ``DistributedOptimizer``; fairscale
    returns ``OSS``; DeepSpeed returns the engine's optimizer. A replacement must keep
    ``param_groups`` shared with the original, or re-point the schedulers that drive
    ``optimizer`` (:func:`hookloop.schedulers_of`) at itself with
    :func:`hookloop.repoint_lr_scheduler`.

    :returns: the optimizer to step, or ``None`` to keep ``optimizer``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def configure_sampler(
    trainer: TrainerLike, dataloader: DataLoader[Any], training: bool
) -> Sampler[Any] | None:
    """Return the sampler the loop should use for ``dataloader`` in this process.

    Called once per loader at the start of a run. Distributed strategies return a
    sampler that gives this rank its share (see :func:`hookloop.distributed_sampler`);
    the core rebuilds the loader around it (:func:`hookloop.rebuild_dataloader`) and
    calls ``sampler.set_epoch(epoch)`` at each epoch when the sampler has it.

    :param dataloader: the user's ``torch.utils.data.DataLoader``.
    :param training: ``True`` for the training loader, ``False`` for validation, test
        and prediction loaders (never shuffled).
    :returns: a ``Sampler``, or ``None`` to leave the loader as it is (iterable
        datasets, or the user opted out).

    Stops at first non-None result.
    """


@hookspec
def describe_model(trainer: TrainerLike, module: torch.nn.Module) -> str | None:
    """Say what this plugin would do to ``module``, without training; ``hookloop plan``.

    Called only by ``hookloop plan [run options] SCRIPT``: the script runs in one
    process, and its ``Trainer.fit`` builds the module (``configure_model``, outside any
    ``model_init_context``), calls this hook, prints every answer and ends the process
    (status 0). No ``setup_environment`` ran: there is no process group, no mesh, and
    ``trainer.world_size`` is 1; read the run's sizes from ``trainer.config``
    (``num_processes()``, ``nodes``, ``mesh``: the ``--mesh`` sizes, a dict or ``None``).
    A model-transforming plugin (tensor parallelism: the plan it would apply, split
    dimensions that do not divide) answers; the others leave it unimplemented.
    Added in contract 2.4.0.

    :param module: the user's module (``configure_model`` already called).
    :returns: text to print (one or more lines), or ``None`` for nothing to say. Every
        implementation is called.
    """


# ---------------------------------------------------------------------------------------
# 4. The step
# ---------------------------------------------------------------------------------------


@hookspec
def forward_context(trainer: TrainerLike) -> AbstractContextManager[Any] | None:
    """Return a context manager to wrap each step (``training_step``, ``validation_step``,
    ``test_step``, ``predict_step``).

    Precision plugins return ``torch.autocast(...)``; ``None``: no context. Every returned
    context is entered, in hook-call order. Called once per ``fit``/``validate``; the
    returned objects are re-entered every step, so return re-entrant context managers
    (``torch.autocast`` is).
    """


@hookspec(firstresult=True)
def accumulation_context(
    trainer: TrainerLike, model: torch.nn.Module
) -> AbstractContextManager[Any] | None:
    """Return a context manager for micro-batches that will not step the optimizer.

    With ``accumulate_grad_batches > 1`` the loop enters it around the forward and
    backward of every micro-batch except the last of each accumulation window. DDP
    returns ``model.no_sync()`` so gradients are only all-reduced once per window.
    Called per micro-batch. The default is a null context.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def backward(
    trainer: TrainerLike,
    loss: torch.Tensor,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> bool | None:
    """Compute gradients of ``loss``.

    Called for every micro-batch with the loss already divided by
    ``accumulate_grad_batches``, and for every ``self.manual_backward(loss)`` under
    manual optimization (``optimizer`` is then ``None`` and ``trainer.automatic_optimization``
    is ``False``: DDP prepares its reducer here, since that backward runs inside the
    wrapped forward). ``trainer.backward_kwargs`` holds the keyword arguments of
    ``Tensor.backward`` to pass on (``manual_backward(loss, retain_graph=True)``'s; else
    empty). The default is ``loss.backward(**trainer.backward_kwargs)``; AMP scales the loss first,
    DeepSpeed calls ``engine.backward``. Per step: implementing it costs one pluggy call
    per micro-batch.

    :returns: ``True`` when handled. Stops at first non-None result.
    """


@hookspec(firstresult=True)
def optimizer_step(
    trainer: TrainerLike, optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> bool | None:
    """Clip gradients (if ``gradient_clip_val``) and step the optimizer.

    Called once per accumulation window, and for every ``optimizer.step()`` of manual
    optimization. Call :func:`hookloop.before_optimizer_step` right before stepping (it
    fires :func:`on_before_optimizer_step` and clips as configured), so all plugins clip
    the same way. The default does that and calls ``optimizer.step()``; AMP unscales
    first, then steps through the ``GradScaler`` and updates the scale.

    :returns: ``True`` when the step was taken, ``False`` when it was skipped (inf/nan
        gradients). Stops at first non-None result.
    """


@hookspec(firstresult=True)
def zero_grad(
    trainer: TrainerLike, optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> bool | None:
    """Reset gradients at the start of an accumulation window: before the forward and
    backward of the window's first micro-batch (``batch_idx % accumulate_grad_batches ==
    0``), as Lightning zeroes before that backward (gradients stay readable in
    ``on_train_batch_end``; the forward comes first only for strategies that run the
    backward inside it, pipelines).
    Preceded by ``on_before_zero_grad``. Default: ``optimizer.zero_grad(set_to_none=True)``.

    :returns: ``True`` when handled. Stops at first non-None result.
    """


@hookspec
def training_step_end(trainer: TrainerLike, outputs: STEP_OUTPUT) -> STEP_OUTPUT:
    """Post-process what ``training_step`` returned before the loop checks it.

    Called after the user's own ``training_step_end`` (which receives DataParallel's
    gathered per-replica outputs). Return the new outputs, or ``None`` to keep them;
    each non-None result replaces ``outputs`` for the next implementation. The dp
    strategy averages gathered per-replica losses here.
    """


@hookspec(firstresult=True)
def configure_grad_scaler(
    trainer: TrainerLike, device: torch.device, options: Mapping[str, Any]
) -> GradScalerLike | None:
    """Return the loss scaler for ``precision="16-mixed"``.

    Called by the precision plugin (hookloop-amp) in its ``setup`` for ``fit``, and by a
    strategy that owns precision (fsdp) for its own: ``device`` is
    ``trainer.root_device`` and ``options`` holds ``torch.amp.GradScaler``'s keyword
    arguments (``init_scale``, ``growth_interval``...). The default is
    ``torch.amp.GradScaler(device.type, **options)``; a sharded strategy returns a
    scaler whose inf/nan verdict is agreed by every rank (fairscale's and torch's
    ``ShardedGradScaler``), so all ranks skip the same steps. Whatever it returns is
    stepped by :class:`hookloop.GradScaling`: it must have ``GradScaler``'s
    ``scale``, ``unscale_``, ``step``, ``update``, ``get_scale`` and ``state_dict``
    (:class:`GradScalerLike`).
    Called once per run, not per step.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def clip_gradients(
    trainer: TrainerLike,
    optimizer: torch.optim.Optimizer,
    clip_val: float,
    algorithm: ClipAlgorithm,
) -> bool | None:
    """Clip the gradients of ``optimizer``'s parameters to ``clip_val``.

    Called by :func:`hookloop.before_optimizer_step` (after unscaling, right before the
    step) when ``gradient_clip_val`` is set, or for a module's
    ``self.clip_gradients(...)`` under manual optimization; never when there is nothing
    to clip. ``algorithm`` is ``"norm"`` (the total 2-norm of all the gradients) or
    ``"value"`` (each element). The default clips the optimizer's parameters with
    ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` in the module's order, bit
    for bit a hand-written loop's ``clip_grad_norm_(model.parameters(), clip_val)``
    (:func:`hookloop.clip_parameters`); a strategy whose gradients are sharded across
    ranks returns ``True`` after clipping by the norm over all shards (fairscale's
    ``OSS.clip_grad_norm``), scaling by torch's coefficient
    (:func:`hookloop.helpers.clip_coefficient`).

    :returns: ``True`` when handled. Stops at first non-None result.
    """


# ---------------------------------------------------------------------------------------
# 5. Collectives
# ---------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def reduce(trainer: TrainerLike, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor | None:
    """Reduce ``tensor`` across all ranks; used for ``self.log(..., sync_dist=True)``.

    :param op: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.
    :returns: the reduced tensor (same value on every rank). Default: ``tensor``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def barrier(trainer: TrainerLike, name: str) -> bool | None:
    """Block until every rank reaches this point. Default: return immediately.

    :returns: ``True`` when handled. Stops at first non-None result.
    """


@hookspec(firstresult=True)
def broadcast(trainer: TrainerLike, obj: T, src: int) -> T | None:
    """Return ``obj`` as held by global rank ``src``, on every rank (picklable objects).

    Called through ``trainer.broadcast(obj, src)``, which wraps the user's object in a
    one-element list so that a broadcast ``None`` still comes back non-None.

    :returns: ``obj`` as rank ``src`` holds it, of the same type.

    Stops at first non-None result.
    """


# ---------------------------------------------------------------------------------------
# 6. Checkpoints
# ---------------------------------------------------------------------------------------


@hookspec
def on_save_checkpoint(trainer: TrainerLike, checkpoint: dict[str, Any]) -> None:
    """Add this plugin's state to ``checkpoint`` before it is written; every plugin.

    Store it under ``checkpoint["plugins"][your_plugin_name]``, using only tensors,
    numbers, strings, lists and dicts: checkpoints are loaded with
    ``torch.load(weights_only=True)``.
    """


@hookspec(firstresult=True)
def save_checkpoint(trainer: TrainerLike, checkpoint: dict[str, Any], path: Path) -> Path | None:
    """Write ``checkpoint`` to ``path``.

    Called on every rank (so sharded strategies can write their shards). The default
    writes on global rank 0 only, atomically (temporary file, fsync, rename) with a
    SHA-256 trailer, keeping a replaced ``last.ckpt`` as ``last.prev.ckpt``
    (:func:`hookloop.atomic_save`), then waits at a barrier so no rank reads before the
    write is complete. DeepSpeed writes a
    sharded directory through its engine.

    :returns: the path written. Stops at first non-None result.
    """


@hookspec(firstresult=True)
def load_checkpoint(trainer: TrainerLike, path: Path) -> dict[str, Any] | None:
    """Read the checkpoint at ``path`` and return it as a dict.

    The default uses ``torch.load(path, map_location="cpu", weights_only=True)`` after
    checking the file's SHA-256 trailer, and raises :class:`hookloop.CheckpointError` for
    a missing, truncated or corrupt file (which ``ckpt_path="last"`` and a restart's
    resume answer by loading ``last.prev.ckpt`` instead).

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def load_model_state(trainer: TrainerLike, checkpoint: dict[str, Any]) -> bool | None:
    """Restore model and optimizer state from ``checkpoint``.

    The default loads ``checkpoint["state_dict"]`` into ``trainer.module`` (checking
    keys and shapes first) and the optimizer and scheduler states. Sharded strategies
    that restored everything inside ``load_checkpoint`` return ``True`` here.

    :returns: ``True`` when handled. Stops at first non-None result.
    """


@hookspec
def on_load_checkpoint(trainer: TrainerLike, checkpoint: dict[str, Any]) -> None:
    """Restore this plugin's state from ``checkpoint["plugins"][your_plugin_name]``."""


@hookspec
def on_save_rank_checkpoint(trainer: TrainerLike, rank_state: dict[str, Any]) -> None:
    """Add *this rank's own* state before a checkpoint is written; every rank.

    ``on_save_checkpoint`` state is rank 0's (the default writes rank 0's checkpoint
    only). A plugin whose ranks hold different state (local SGD's per-rank optimizer
    state, a sharded optimizer's partition, a per-rank RNG) stores it here, under
    ``rank_state[your_plugin_name]``, in the types ``on_save_checkpoint`` allows. The core
    gathers every rank's ``rank_state`` into ``checkpoint["rank_states"]``, a list
    indexed by global rank, before the checkpoint is written (a collective: called on
    every rank, and only when some plugin implements this hook).
    """


@hookspec
def on_load_rank_checkpoint(
    trainer: TrainerLike, rank_state: dict[str, Any] | None, rank_states: list[dict[str, Any]]
) -> None:
    """Restore *this rank's own* state, after ``on_load_checkpoint``; every rank.

    :param rank_state: the ``rank_state`` this global rank saved, or ``None`` when the
        checkpoint was written by another number of processes.
    :param rank_states: every rank's, in rank order, to redistribute when the number of
        processes changed.

    Called only when the checkpoint holds per-rank state.
    """


# ---------------------------------------------------------------------------------------
# 7. Observers: events for callbacks, the user's module hooks among them
# ---------------------------------------------------------------------------------------
#
# Observers run after the math and cannot change it: they receive detached values and
# their return values are ignored (except ``on_train_batch_start``'s ``-1``, below).
#
# The user's module is an observer too: a module that defines ``on_train_epoch_end``
# (or any hook of Lightning's ``LightningModule`` listed in :data:`MODULE_HOOKS`) has it
# called through the event of the same name, before every plugin's implementation (so
# a metric the module logs there is in ``metrics`` for the plugins after it). A module
# that defines none of them costs nothing.
#
# Lightning-style ``hookloop.Callback`` objects (``Trainer(callbacks=[...])``) are called
# through these events too, by one adapter (``hookloop.callbacks.CallbackHooks``), in list
# order and before the module's hook, with Lightning's ``(trainer, pl_module, ...)``
# arguments.
#
# Order of one ``fit`` (docs/hooks.md has the traced sequence, checked by a test):
#   setup -> on_fit_start -> [on_sanity_check_start -> validation events ->
#   on_sanity_check_end] -> on_train_start -> per epoch: on_train_epoch_start -> per
#   batch: on_train_batch_start, on_before_backward, on_after_backward,
#   on_before_optimizer_step, on_before_zero_grad, on_train_batch_end -> (validation
#   events, also mid-epoch with ``val_check_interval``) -> on_train_epoch_end ->
#   on_train_end -> on_fit_end -> teardown.
#
# ``trainer.global_step`` counts optimizer steps; in ``on_train_batch_end`` it already
# includes the step of that batch (if the batch ended an accumulation window).


@hookspec
def on_fit_start(trainer: TrainerLike) -> None:
    """The model, optimizers and loaders are ready; training is about to start.

    Called once per ``fit``, before the sanity check, in every worker.
    """


@hookspec
def on_fit_end(trainer: TrainerLike) -> None:
    """Training finished normally (not called after an exception)."""


@hookspec
def on_sanity_check_start(trainer: TrainerLike) -> None:
    """The sanity check starts: ``num_sanity_val_steps`` validation batches before
    training (``trainer.sanity_checking`` is ``True`` until :func:`on_sanity_check_end`).
    Its metrics never reach ``trainer.callback_metrics``."""


@hookspec
def on_sanity_check_end(trainer: TrainerLike) -> None:
    """The sanity check ended."""


@hookspec
def on_train_start(trainer: TrainerLike) -> None:
    """The first training epoch is about to start (after the sanity check)."""


@hookspec
def on_train_end(trainer: TrainerLike) -> None:
    """The last training epoch ended (before :func:`on_fit_end`)."""


@hookspec
def on_train_epoch_start(trainer: TrainerLike, epoch: int) -> None:
    """An epoch of training starts; ``epoch`` is ``trainer.current_epoch``."""


@hookspec
def on_train_batch_start(trainer: TrainerLike, batch: Any, batch_idx: int) -> Literal[-1] | None:
    """A training micro-batch (already on the device) is about to run.

    Per step: nobody implementing it costs nothing. Returning ``-1`` ends the epoch
    here, as Lightning's ``on_train_batch_start`` does.
    """


@hookspec
def on_before_backward(trainer: TrainerLike, loss: torch.Tensor) -> None:
    """``loss`` (divided by ``accumulate_grad_batches``) is about to be backpropagated."""


@hookspec
def on_after_backward(trainer: TrainerLike) -> None:
    """Gradients of the micro-batch were accumulated (under fp16 still scaled, and under
    DDP not yet averaged on micro-batches that do not step)."""


@hookspec
def on_before_optimizer_step(trainer: TrainerLike, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer is about to step, once per accumulation window.

    Gradients are final: unscaled (fp16), averaged across ranks where the strategy
    averages them (Horovod synchronises first), and not yet clipped. The place for
    gradient-norm monitors. Strategies and precision plugins that step the optimizer
    call :func:`hookloop.before_optimizer_step` right before stepping, which fires this
    event and then clips.
    """


@hookspec
def on_before_zero_grad(trainer: TrainerLike, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer stepped and its gradients are about to be reset."""


@hookspec
def on_train_batch_end(
    trainer: TrainerLike,
    outputs: STEP_OUTPUT,
    loss: torch.Tensor | None,
    batch: Any,
    batch_idx: int,
) -> None:
    """A training micro-batch finished.

    :param outputs: what ``training_step`` returned (after ``training_step_end``).
    :param loss: the detached loss, not divided by ``accumulate_grad_batches``
        (``None`` under manual optimization when ``training_step`` returned none).

    Called every micro-batch, so keep it cheap: do not call ``.item()`` on every step
    unless you need to (it synchronises with the device). ``trainer.global_step``
    already counts this batch's optimizer step.
    """


@hookspec
def on_train_epoch_end(trainer: TrainerLike, epoch: int, metrics: Mapping[str, float]) -> None:
    """An epoch of training ended (after its validation, if any ran).

    :param metrics: the epoch's metrics as floats: what was logged in training this
        epoch (epoch means and the last step values) and the validation metrics of this
        epoch's validation, if one ran; a metric the module logs in its own
        ``on_train_epoch_end`` is added before the plugins see it.

    Epoch-interval LR schedulers have stepped already, except ``ReduceLROnPlateau``
    (stepped after this event, so it can monitor what was logged here).
    """


@hookspec
def on_validation_start(trainer: TrainerLike) -> None:
    """A validation run starts (end of epoch, ``val_check_interval``, sanity check or
    ``trainer.validate``); the model is in eval mode."""


@hookspec
def on_validation_epoch_start(trainer: TrainerLike) -> None:
    """The validation epoch starts (after :func:`on_validation_start`)."""


@hookspec
def on_validation_batch_start(
    trainer: TrainerLike, batch: Any, batch_idx: int, dataloader_idx: int
) -> None:
    """A validation batch (on the device) is about to run."""


@hookspec
def on_validation_batch_end(
    trainer: TrainerLike, outputs: STEP_OUTPUT, batch: Any, batch_idx: int, dataloader_idx: int
) -> None:
    """A validation batch finished; ``outputs`` is what ``validation_step`` returned."""


@hookspec
def on_validation_epoch_end(trainer: TrainerLike) -> None:
    """Every validation batch ran; metrics are not reduced yet (the module may log
    epoch-level values here)."""


@hookspec
def on_validation_end(
    trainer: TrainerLike, metrics: Mapping[str, float], sanity_checking: bool
) -> None:
    """Validation finished; ``metrics`` maps logged names to floats, already reduced
    across ranks where the user asked for ``sync_dist``.

    :param sanity_checking: ``True`` when this is the sanity check before training
        (``num_sanity_val_steps`` batches; ``metrics`` are the sanity batches' and are
        discarded after): an observer that writes rows or ranks checkpoints returns then.
        Every ``on_validation_*`` hook fires during the sanity check, as Lightning's do;
        the others tell it by ``trainer.sanity_checking`` (contract 2.0, CHANGELOG.md)."""


@hookspec
def on_test_start(trainer: TrainerLike) -> None:
    """``trainer.test`` starts; the model is in eval mode."""


@hookspec
def on_test_epoch_start(trainer: TrainerLike) -> None:
    """The test epoch starts."""


@hookspec
def on_test_batch_start(
    trainer: TrainerLike, batch: Any, batch_idx: int, dataloader_idx: int
) -> None:
    """A test batch (on the device) is about to run."""


@hookspec
def on_test_batch_end(
    trainer: TrainerLike, outputs: STEP_OUTPUT, batch: Any, batch_idx: int, dataloader_idx: int
) -> None:
    """A test batch finished; ``outputs`` is what ``test_step`` returned."""


@hookspec
def on_test_epoch_end(trainer: TrainerLike) -> None:
    """Every test batch ran; metrics are not reduced yet."""


@hookspec
def on_test_end(trainer: TrainerLike, metrics: Mapping[str, float]) -> None:
    """Testing finished; ``metrics`` maps logged names to floats (reduced as logged)."""


@hookspec
def on_predict_start(trainer: TrainerLike) -> None:
    """``trainer.predict`` starts; the model is in eval mode."""


@hookspec
def on_predict_epoch_start(trainer: TrainerLike) -> None:
    """The prediction epoch starts."""


@hookspec
def on_predict_batch_start(
    trainer: TrainerLike, batch: Any, batch_idx: int, dataloader_idx: int
) -> None:
    """A prediction batch (on the device) is about to run."""


@hookspec
def on_predict_batch_end(
    trainer: TrainerLike, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int
) -> None:
    """A prediction batch finished; ``outputs`` is what ``predict_step`` returned."""


@hookspec
def on_predict_epoch_end(trainer: TrainerLike) -> None:
    """Every prediction batch ran (before predictions are gathered across ranks)."""


@hookspec
def on_predict_end(trainer: TrainerLike) -> None:
    """Prediction finished."""


@hookspec
def on_log_metrics(
    trainer: TrainerLike, metrics: Mapping[str, float], step: int, epoch: int | None
) -> None:
    """A row of metrics for the loggers (the CSV, TensorBoard and MLflow plugins).

    :param metrics: names to floats, already reduced across ranks where the module asked
        (metrics logged with ``logger=False`` are left out).
    :param step: ``trainer.global_step`` the row belongs to; ``epoch``: the epoch. A row
        of an evaluation batch's step values (``self.log(on_step=True)`` in
        ``validation_step``/``test_step``) has, as in Lightning, ``step`` = that stage's
        batches logged so far in the run and ``epoch=None``.

    Emitted every ``log_every_n_steps`` optimizer steps (the step metrics), at the end of
    every training epoch (its epoch metrics), of every validation run (not the sanity
    check) and of ``test``, and whenever a plugin calls ``trainer.log_metrics(...)``
    (``lr_monitor``, the device monitors). Called on every rank: write from global rank
    0 (``trainer.is_global_zero``). Nobody implementing it costs nothing.
    """


@hookspec
def on_exception(trainer: TrainerLike, exception: BaseException) -> None:
    """``fit``/``validate``/``test``/``predict`` raised ``exception``; called before it
    propagates (not for ``KeyboardInterrupt``/``SystemExit``)."""


#: Hooks of the user's module (Lightning's ``LightningModule`` names) and the arguments
#: they are called with, in order. Each is called through the event of the same name.
MODULE_HOOKS: dict[str, tuple[str, ...]] = {
    "setup": ("stage",),
    "teardown": ("stage",),
    "on_fit_start": (),
    "on_fit_end": (),
    "on_train_start": (),
    "on_train_end": (),
    "on_train_epoch_start": (),
    "on_train_epoch_end": (),
    "on_train_batch_start": ("batch", "batch_idx"),
    "on_train_batch_end": ("outputs", "batch", "batch_idx"),
    "on_before_backward": ("loss",),
    "on_after_backward": (),
    "on_before_optimizer_step": ("optimizer",),
    "on_before_zero_grad": ("optimizer",),
    "on_validation_start": (),
    "on_validation_end": (),
    "on_validation_epoch_start": (),
    "on_validation_epoch_end": (),
    "on_validation_batch_start": ("batch", "batch_idx", "dataloader_idx"),
    "on_validation_batch_end": ("outputs", "batch", "batch_idx", "dataloader_idx"),
    "on_test_start": (),
    "on_test_end": (),
    "on_test_epoch_start": (),
    "on_test_epoch_end": (),
    "on_test_batch_start": ("batch", "batch_idx", "dataloader_idx"),
    "on_test_batch_end": ("outputs", "batch", "batch_idx", "dataloader_idx"),
    "on_predict_start": (),
    "on_predict_end": (),
    "on_predict_epoch_start": (),
    "on_predict_epoch_end": (),
    "on_predict_batch_start": ("batch", "batch_idx", "dataloader_idx"),
    "on_predict_batch_end": ("outputs", "batch", "batch_idx", "dataloader_idx"),
    "on_save_checkpoint": ("checkpoint",),
    "on_load_checkpoint": ("checkpoint",),
}
