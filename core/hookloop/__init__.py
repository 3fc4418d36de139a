"""hookloop: a minimal PyTorch training loop whose every technique is a pluggy plugin.

Users::

    from hookloop import Trainer, Module
    Trainer(plugins=["ddp", "amp"], devices=2).fit(module, loader)

Plugin authors: implement hooks from :mod:`hookloop.hookspecs` with ``@hookloop.hookimpl``
and register the plugin under the entry-point group ``hookloop.plugins``.
"""

from hookloop import _moved

_moved.install()  # `import hookloop.step` and the other module paths of 0.10 (deprecated)

from hookloop.lightning.callbacks import (
    BackboneFinetuning,
    BaseFinetuning,
    BasePredictionWriter,
    Callback,
    GradientAccumulationScheduler,
)

# Lightning names hookloop refuses: making one is an error naming what to use instead
# (docs/lightning.md); importable so that a ported import reaches that error (not in __all__)
from hookloop.lightning.callbacks import (  # noqa: F401
    BatchSizeFinder,
    CombinedLoader,
    LearningRateFinder,
    WeightAveraging,
)
from hookloop.resume.checkpoint import (
    TaggedCheckpointDir,
    atomic_copy_tree,
    atomic_save,
    atomic_write_text,
    check_state_dict,
    defer,
    deferring,
    optimizer_and_scheduler_states,
    safe_load,
    tag_entry,
)
from hookloop.engine.settings import TrainerConfig
from hookloop.lightning.datamodule import DataModule
from hookloop.contract.errors import (
    CheckpointError,
    CollectiveTimeoutError,
    ConfigurationError,
    HookloopError,
    MissingDependencyError,
    PluginConflictError,
    PluginNotFoundError,
    PluginValidationError,
)
from hookloop.distributed.collectives import init_process_group, release_process_group, torch_reduce_op
from hookloop.distributed.mesh import CANONICAL_DIMS, submesh
from hookloop.helpers import (
    DistributedSamplerWrapper,
    apply_to_tensors,
    batch_size_of,
    clip_gradients,
    clip_parameters,
    cpu_process_group,
    distributed_sampler,
    gather_per_rank,
    local_rank_device,
    move_to_device,
    own_entry,
    rebuild_dataloader,
    repoint_lr_scheduler,
    reset_seed,
    run_hparams,
    seed_everything,
)
from hookloop.distributed.strategy import DistributedSampling, TorchCollectives, TorchDistributed, check_sampler_seed, data_parallel_rank
from hookloop.contract.hookspecs import hookimpl, hookspec
from hookloop.distributed.launch import as_launcher, die_with_launcher, elastic_command, in_worker
from hookloop.distributed.results import adopt_worker_error, adopt_worker_result, worker_error, worker_result
from hookloop.distributed.failures import install_worker_hook
from hookloop.lightning.module import Module
from hookloop.observers.checkpoint import ModelCheckpoint
from hookloop.observers.csvlog import CSVLogger
from hookloop.observers.early_stopping import EarlyStopping, EarlyStoppingReason
from hookloop.observers.ledger import Ledger
from hookloop.observers.lr_monitor import LearningRateMonitor
from hookloop.observers.bars import RichProgressBar, RichProgressBarTheme, TQDMProgressBar
from hookloop.observers.model_summary import ModelSummary
from hookloop.observers.progress import ProgressBar
from hookloop.observers.nan_guard import NanGuard
from hookloop.observers.on_exception import OnExceptionCheckpoint
from hookloop.observers.timer import Timer
from hookloop.engine.optim import SchedulerConfig, before_optimizer_step, GradScaling, load_scheduler_states, repoint_optimizers, schedulers_of
from hookloop.contract.registry import installed_plugins, resolve as plugin
from hookloop.engine.trainer import Trainer, default
from hookloop.lightning.tuner import LRFinder, Tuner
from hookloop.lightning.states import RunningStage, TrainerFn
from hookloop.resume.unpickling import refused_object, unsafe_checkpoint_error, weights_only_loads
from hookloop.distributed.ranks import env_int, rank_zero_info, rank_zero_only, rank_zero_warn
from hookloop.contract.versioning import CONTRACT_VERSION, HookloopContractWarning, HookloopDeprecationWarning

from hookloop._version import __version__

# Lightning compatibility joins the engine here, as a translator of the Trainer's arguments
# (the engine never imports hookloop.lightning; `no:lightning` blocks it: docs/lightning.md)
from hookloop.contract import translators as _translators
from hookloop.lightning.plugin import LIGHTNING as _LIGHTNING
from hookloop.lightning.views import PROPERTIES as _PROPERTIES
from hookloop.lightning.views import VIEWS as _VIEWS

_translators.register(_LIGHTNING)
for _name, _view in _VIEWS.items():
    _translators.register_view(_name, _view)
# Lightning's settable Trainer attributes (limit_*_batches, fit_loop.max_epochs...): properties
# of the Trainer class, put there by the facade, not written in the engine
for _name, _property in _PROPERTIES.items():
    setattr(Trainer, _name, _property)


def __getattr__(name: str):
    # jsonargparse is optional (pip install 'hookloop[cli]'): imported on first use only.
    if name == "LightningCLI":
        from hookloop.lightning.cli import LightningCLI

        return LightningCLI
    # a module path of hookloop 0.10 (``hookloop.step``): deprecated, at its new place
    return _moved.attribute(name)


__all__ = [
    "CONTRACT_VERSION",
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "CSVLogger",
    "Callback",
    "CheckpointError",
    "CollectiveTimeoutError",
    "ConfigurationError",
    "DataModule",
    "EarlyStopping",
    "EarlyStoppingReason",
    "GradientAccumulationScheduler",
    "DistributedSamplerWrapper",
    "HookloopContractWarning",
    "HookloopDeprecationWarning",
    "HookloopError",
    "Ledger",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "MissingDependencyError",
    "Module",
    "PluginConflictError",
    "PluginNotFoundError",
    "PluginValidationError",
    "ProgressBar",
    "RichProgressBar",
    "RichProgressBarTheme",
    "SchedulerConfig",
    "TQDMProgressBar",
    "TaggedCheckpointDir",
    "NanGuard",
    "OnExceptionCheckpoint",
    "Timer",
    "Trainer",
    "TrainerFn",
    "RunningStage",
    "Tuner",
    "LRFinder",
    "TrainerConfig",
    "apply_to_tensors",
    "as_launcher",
    "adopt_worker_result",
    "worker_result",
    "adopt_worker_error",
    "worker_error",
    "atomic_copy_tree",
    "atomic_save",
    "atomic_write_text",
    "batch_size_of",
    "before_optimizer_step",
    "check_state_dict",
    "clip_gradients",
    "clip_parameters",
    "check_sampler_seed",
    "DistributedSampling",
    "TorchCollectives",
    "TorchDistributed",
    "load_scheduler_states",
    "GradScaling",
    "cpu_process_group",
    "default",
    "defer",
    "deferring",
    "die_with_launcher",
    "data_parallel_rank",
    "distributed_sampler",
    "elastic_command",
    "env_int",
    "gather_per_rank",
    "hookimpl",
    "hookspec",
    "in_worker",
    "init_process_group",
    "submesh",
    "CANONICAL_DIMS",
    "installed_plugins",
    "local_rank_device",
    "move_to_device",
    "optimizer_and_scheduler_states",
    "repoint_optimizers",
    "own_entry",
    "plugin",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "rebuild_dataloader",
    "refused_object",
    "release_process_group",
    "repoint_lr_scheduler",
    "run_hparams",
    "safe_load",
    "tag_entry",
    "schedulers_of",
    "reset_seed",
    "seed_everything",
    "torch_reduce_op",
    "unsafe_checkpoint_error",
    "weights_only_loads",
]

install_worker_hook()  # its uncaught exception goes to a log, reported once by the launcher (failures.py)
die_with_launcher()  # a launched worker ends with its launcher, from its first import of hookloop
