"""The Trainer's settings, and how ``hookloop run`` hands its options to the script.

``hookloop run --devices 2 --plugins ddp script.py`` puts its options, as JSON, in the
environment variable ``HOOKLOOP_TRAINER_DEFAULTS``; every ``Trainer`` the script creates
starts from them, and arguments given in code win.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from hookloop.contract.errors import ConfigurationError

#: How often, in optimizer steps, the processes agree on stopping (a SIGTERM, ``max_time``)
#: unless ``Trainer(stop_check_every_n_steps=...)`` says otherwise: "auto", about once a
#: second of the slowest rank's steps (hookloop.faults.AGREEMENT_SECONDS; docs/decisions.md,
#: "The stop agreement off the critical path")
DEFAULT_STOP_CHECK_EVERY_N_STEPS = "auto"

DEFAULTS_ENV = "HOOKLOOP_TRAINER_DEFAULTS"
PRECISIONS = ("32", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
_PRECISION_ALIASES = {
    "32": "32", "32-true": "32", 32: "32",
    "16": "16-mixed", 16: "16-mixed", "16-mixed": "16-mixed", "fp16": "16-mixed",
    "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
    "16-true": "16-true", "bf16-true": "bf16-true",
}


@dataclass
class TrainerConfig:
    """Everything a run is configured with. Plugins read it as ``trainer.config``."""

    plugins: list = field(default_factory=list)
    devices: Any = 1
    accelerator: str = "auto"
    #: machines: a number, or "MIN:MAX" for an elastic job (torchrun's ``--nnodes``), which
    #: validate() turns into ``nodes`` = MAX and ``min_nodes`` = MIN (hookloop.distributed.elastic)
    nodes: Any = 1  # an int after validate()
    #: the fewest machines an elastic job trains on; None: a fixed number (``nodes``)
    min_nodes: int | None = None
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    #: torchrun's ``--rdzv-conf`` for several nodes, "KEY=VALUE,...": the elastic rendezvous's
    #: ``join_timeout``, ``last_call_timeout`` (seconds) and the like; hookloop adds ``is_host``
    rdzv_conf: str | None = None
    #: restarts of failed workers; None: 0, or 3 for an elastic job (torchrun's example: a
    #: lost node uses one on every other node, a node that joins uses none)
    max_restarts: int | None = None
    #: an elastic job's batch when its world size changes: "global" keeps the global batch
    #: (accumulation recomputed), "per-device" keeps the loader's batch per process
    elastic_batch: str = "global"
    max_epochs: int | None = None
    max_steps: int | None = None
    #: Lightning's minimums: should_stop (early stopping) ends training only once this many
    #: epochs (steps) are done; None: none (min_steps alone makes min_epochs 1, as Lightning)
    min_epochs: int | None = None
    min_steps: int | None = None
    #: Lightning's time limit: "DD:HH:MM:SS", a timedelta or a dict of its arguments; fit
    #: stops after the batch where the training time reaches it (a Timer, interval "step")
    max_time: Any = None
    accumulate_grad_batches: int = 1
    #: samples per optimizer step over all the data-parallel processes; hookloop derives
    #: accumulate_grad_batches from it once the data-parallel size is known (at fit)
    global_batch_size: int | None = None
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    precision: str = "32"
    default_root_dir: str = "."
    enable_checkpointing: bool = True
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    val_check_interval: int | float = 1.0
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int = 2
    fast_dev_run: bool | int = False
    overfit_batches: int | float = 0
    log_every_n_steps: int = 50
    enable_progress_bar: bool = True
    #: print the model summary table at fit start (the ``model_summary`` observer)
    enable_model_summary: bool = True
    logger: bool = True
    use_distributed_sampler: bool = True
    #: fit iterates torchdata's StatefulDataLoader built from the training DataLoader
    #: (hookloop.loader_state.stateful_loader; Accelerate's use_stateful_dataloader)
    stateful_dataloader: bool = False
    autoload_plugins: bool = False
    plugin_options: dict = field(default_factory=dict)
    #: the device mesh's sizes, ``{"dp_shard": 2, "tp": 2}`` (hookloop.mesh; ``--mesh``,
    #: ``HOOKLOOP_MESH``); a claimed dimension left out takes the rest of the world
    mesh: dict = field(default_factory=dict)
    #: seconds a collective may wait (None: hookloop.faults.DEFAULT_TIMEOUTS per backend)
    process_group_timeout: float | None = None
    #: after a SIGTERM checkpoint, global rank 0 runs `scontrol requeue $SLURM_JOB_ID`
    requeue_on_preemption: bool = False
    #: with several processes, the ranks agree on stopping (SIGTERM, max_time) at every
    #: this many optimizer steps, asynchronously: a stop comes at most 2x this many steps
    #: after the signal; "auto" (default): about once a second of steps (hookloop.faults)
    stop_check_every_n_steps: int | str = DEFAULT_STOP_CHECK_EVERY_N_STEPS
    #: Lightning's: torch.backends.cudnn.benchmark for the process (None: left as it is;
    #: False when ``deterministic``)
    benchmark: bool | None = None
    #: Lightning's: torch.use_deterministic_algorithms (True, False, "warn"; None: left as it is)
    deterministic: bool | str | None = None

    def _check_global_batch_size(self) -> None:
        value = self.global_batch_size
        if value is None:
            return
        if not _is_int(value) or value < 1:
            raise ConfigurationError(f"global_batch_size={value!r} must be an integer >= 1 "
                                     "(samples per optimizer step over all the data-parallel "
                                     "processes), or None")
        if self.accumulate_grad_batches != 1:
            raise ConfigurationError(
                f"global_batch_size={value} and "
                f"accumulate_grad_batches={self.accumulate_grad_batches} are both set: hookloop "
                "derives the accumulation from global_batch_size (global_batch_size / (batch_size "
                "x data-parallel processes)); give one of the two")

    def validate(self) -> None:
        """Check every value and normalise aliases; raise ``ConfigurationError``."""
        self.precision = normalize_precision(self.precision)
        if self.accelerator not in ("auto", "cpu", "cuda", "gpu"):
            raise ConfigurationError(
                f"accelerator={self.accelerator!r} is not one of 'auto', 'cpu', 'cuda'/'gpu'"
            )
        from hookloop.distributed.elastic import check_elastic_settings

        # nodes="MIN:MAX" -> nodes, min_nodes; max_restarts; elastic_batch
        check_elastic_settings(self)
        for name in ("accumulate_grad_batches", "nodes", "log_every_n_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{name}={value!r} must be an integer >= 1")
        self._check_global_batch_size()
        every = self.check_val_every_n_epoch
        if every is not None and (not _is_int(every) or every < 1):
            raise ConfigurationError(f"check_val_every_n_epoch={every!r} must be an integer >= 1, "
                                     "or None (count batches across epochs)")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nodes:
            raise ConfigurationError(
                f"node_rank={self.node_rank!r} must be in 0..nodes-1 (nodes={self.nodes})"
            )
        for name in ("max_epochs", "max_steps", "min_epochs", "min_steps"):
            value = getattr(self, name)
            is_max = name.startswith("max")  # -1: Lightning's "no limit"
            endless = is_max and value == -1
            if value is not None and (not _is_int(value) or value < 0) and not endless:
                limit = "an integer >= 0" + (", or -1 for no limit" if is_max else "")
                raise ConfigurationError(f"{name}={value!r} must be None or {limit}")
        if self.max_steps == -1:  # Lightning's default: no step limit, as None
            self.max_steps = None
        for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches",
                     "limit_predict_batches", "overfit_batches"):
            value = getattr(self, name)
            if value is None and name != "overfit_batches":
                continue
            if not is_count_or_fraction(value):
                raise ConfigurationError(
                    f"{name}={value!r} must be a number of batches (an integer >= 0) or a "
                    f"fraction of the loader (a float in [0.0, 1.0])"
                )
        interval = self.val_check_interval
        if isinstance(interval, (str, dict, datetime.timedelta)):
            raise ConfigurationError(
                f"val_check_interval={interval!r} is a duration (Lightning's time-based "
                "validation), which hookloop does not support (docs/lightning.md): give a number "
                "of training batches (val_check_interval=N) or a fraction of the epoch (a float "
                "in (0.0, 1.0])"
            )
        if not (_is_int(interval) and interval >= 1) and not (
                isinstance(interval, float) and 0.0 < interval <= 1.0):
            raise ConfigurationError(
                f"val_check_interval={interval!r} must be a number of training batches (an integer "
                f">= 1) or a fraction of the epoch (a float in (0.0, 1.0])"
            )
        if self.check_val_every_n_epoch is None and not _is_int(interval):
            raise ConfigurationError(
                "`val_check_interval` should be an integer or a time-based duration (str "
                "'DD:HH:MM:SS', datetime.timedelta, or dict kwargs for timedelta) when "
                "`check_val_every_n_epoch=None`. hookloop refuses the durations "
                "(docs/lightning.md): check_val_every_n_epoch=None counts batches across epochs, "
                "so give val_check_interval a number of batches (an integer), or keep "
                f"{interval!r} (a fraction of the epoch) with check_val_every_n_epoch=1"
            )
        if not _is_int(self.num_sanity_val_steps) or self.num_sanity_val_steps < -1:
            raise ConfigurationError(
                f"num_sanity_val_steps={self.num_sanity_val_steps!r} must be an integer >= 0, or "
                "-1 for the whole validation set"
            )
        fast = self.fast_dev_run
        if not isinstance(fast, (bool, int)) or (not isinstance(fast, bool) and fast < 0):
            raise ConfigurationError(f"fast_dev_run={fast!r} must be True/False or a number of "
                                     "batches >= 0")
        if fast:
            # Lightning's debugging run: n batches of every loop, once, nothing saved.
            n = 1 if fast is True else int(fast)
            self.limit_train_batches = self.limit_val_batches = n
            self.limit_test_batches = self.limit_predict_batches = n
            self.max_steps, self.max_epochs = n, 1
            self.num_sanity_val_steps = 0
            self.val_check_interval, self.check_val_every_n_epoch = 1.0, 1
            self.enable_checkpointing = False
            self.logger = False
        if self.overfit_batches:
            # Lightning: the same first batches for training and validation, unshuffled.
            self.limit_train_batches = self.limit_val_batches = self.overfit_batches
        clip = self.gradient_clip_val
        # NaN compares false with everything: `clip <= 0` let it through, and clipping to NaN
        # made every weight NaN.
        if clip is not None and not (_is_number(clip) and math.isfinite(clip) and clip > 0):
            raise ConfigurationError(
                f"gradient_clip_val={clip!r} must be a finite number > 0 (the largest gradient "
                "norm, or value, to keep), or None for no clipping"
            )
        if self.gradient_clip_algorithm not in ("norm", "value"):
            raise ConfigurationError(
                f"gradient_clip_algorithm={self.gradient_clip_algorithm!r} must be 'norm' or "
                "'value'"
            )
        check_timeout_seconds("process_group_timeout", self.process_group_timeout)
        stop_every = self.stop_check_every_n_steps
        if stop_every != "auto" and (not isinstance(stop_every, int) or isinstance(stop_every, bool)
                                     or stop_every < 1):
            raise ConfigurationError(
                f"stop_check_every_n_steps={stop_every!r} must be 'auto' or a whole number of "
                "optimizer steps >= 1: how often the processes agree on stopping for a SIGTERM or "
                "max_time (1: at every step, a stop comes 1 step after the signal; K: within 2K "
                "steps, with nothing done at the steps between; the default 'auto': about once a "
                "second of steps, a stop within about 2 seconds or 2 steps)")
        for name in _SWITCHES:
            # A string is truthy: enable_checkpointing="no" would silently mean yes.
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigurationError(f"{name}={value!r} must be True or False")
        if self.benchmark is not None and not isinstance(self.benchmark, bool):
            raise ConfigurationError(f"benchmark={self.benchmark!r} must be True, False or None "
                                     "(leave cudnn's setting)")
        det = self.deterministic
        if det is not None and not isinstance(det, bool) and det != "warn":
            raise ConfigurationError(
                f"deterministic={self.deterministic!r} must be True, False, 'warn' (warn on "
                "nondeterministic operations instead of failing) or None (leave torch's setting)")
        restarts = self.max_restarts  # an int here: check_elastic_settings resolved None
        if not _is_int(restarts) or restarts is None or restarts < 0:
            raise ConfigurationError(f"max_restarts={self.max_restarts!r} must be an integer >= 0")
        if not isinstance(self.default_root_dir, (str, os.PathLike)):
            raise ConfigurationError(f"default_root_dir={self.default_root_dir!r} must be a path "
                                     "(a str or os.PathLike)")
        from hookloop.resume import storage

        if storage.is_url(self.default_root_dir):  # a store fsspec serves, never a local path
            storage.filesystem(str(self.default_root_dir))
        self.num_processes()  # validates devices

    def apply_torch_flags(self) -> None:
        """Lightning's ``benchmark`` and ``deterministic``: set torch's process-wide flags."""
        import warnings

        import torch

        benchmark, deterministic = self.benchmark, self.deterministic
        if deterministic:
            if benchmark is None:
                benchmark = False  # cudnn's autotuner picks algorithms by timing
            elif benchmark:
                warnings.warn("You passed `deterministic=True` and `benchmark=True`. Note that "
                              "PyTorch ignores torch.backends.cudnn.deterministic=True when "
                              "torch.backends.cudnn.benchmark=True.",
                              stacklevel=3)
        if benchmark is not None:
            torch.backends.cudnn.benchmark = benchmark
        if deterministic == "warn":
            torch.use_deterministic_algorithms(True, warn_only=True)
        elif isinstance(deterministic, bool):
            torch.use_deterministic_algorithms(deterministic)
        if deterministic:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's reproducibility setting

    def num_processes(self) -> int:
        """Processes per node that ``devices`` asks for."""
        return count_devices(self.devices)



#: the on/off settings, checked to be real booleans
_SWITCHES = ("enable_checkpointing", "enable_progress_bar", "enable_model_summary", "logger",
             "use_distributed_sampler", "stateful_dataloader", "autoload_plugins",
             "requeue_on_preemption")


#: The longest process-group timeout, in seconds (about 31 years). torch turns a timeout
#: into int64 milliseconds (gloo refuses ~9.2e12 s and more) and ``datetime.timedelta``
#: overflows at ~8.6e13 s; infinity fails in every worker with an OverflowError.
MAX_PROCESS_GROUP_TIMEOUT = 1e9


def check_timeout_seconds(name: str, value: Any) -> None:
    """Refuse a collective timeout that is not a number of seconds in
    ``(0, MAX_PROCESS_GROUP_TIMEOUT]`` (``None`` passes: the backend's default):
    ``Trainer(process_group_timeout=...)`` and the strategies' own ``timeout`` option."""
    if value is None or (_is_number(value) and 0 < value <= MAX_PROCESS_GROUP_TIMEOUT):
        return
    raise ConfigurationError(
        f"{name}={value!r} must be a number of seconds > 0 and at most "
        f"{MAX_PROCESS_GROUP_TIMEOUT:g} (about 31 years: torch cannot wait without a limit), or "
        "None for the backend's default (gloo 300, nccl 600)"
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_count_or_fraction(value: Any) -> bool:
    """Whether ``value`` is a ``limit_*_batches``: a count >= 0 or a fraction in [0, 1]."""
    if _is_int(value):
        return value >= 0
    return isinstance(value, float) and 0.0 <= value <= 1.0


def count_devices(devices: Any) -> int:
    if devices in (None, "auto"):
        return 1 if devices is None else _auto_devices()
    if isinstance(devices, bool):
        raise ConfigurationError(f"devices={devices!r} is not a device count or list")
    if isinstance(devices, int):
        if devices == -1:
            return _auto_devices()
        if devices < 1:
            raise ConfigurationError(
                f"devices={devices} must be a positive number of processes per node, -1 "
                f"or 'auto' for all devices, or a list of device indices"
            )
        return devices
    if isinstance(devices, float):
        raise _not_whole(devices, devices)
    if isinstance(devices, str):
        text = devices.strip()
        if text.lstrip("-").isdigit():
            return count_devices(int(text))
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is not None:
            raise _not_whole(devices, number)
        parts = [p for p in text.split(",") if p.strip()]
        if parts and all(p.strip().isdigit() for p in parts):
            return len(parts)
        raise ConfigurationError(f"devices={devices!r} is not a number, 'auto' or a list")
    if isinstance(devices, (list, tuple)):
        if not devices or not all(isinstance(d, int) and d >= 0 for d in devices):
            raise ConfigurationError(
                f"devices={devices!r}: a device list must hold non-negative indices"
            )
        if len(set(devices)) != len(devices):
            raise ConfigurationError(f"devices={devices!r} names a device twice")
        return len(devices)
    raise ConfigurationError(f"devices={devices!r} is not a number, 'auto' or a list")


def _not_whole(devices: Any, number: float) -> ConfigurationError:
    """``devices=2.5``: the error that says which whole numbers to write instead."""
    if math.isfinite(number) and number >= 1:
        low, high = math.floor(number), math.ceil(number)
        instead = f"devices={low}" if low == high else f"devices={low} or devices={high}"
    else:
        instead = "e.g. devices=2"
    return ConfigurationError(
        f"devices={devices!r} is not a whole number: give the number of processes per node as an "
        f"integer ({instead}), -1 or 'auto' for all devices, or a list of GPU indices"
    )


def check_devices_on_cpu(config: TrainerConfig) -> None:
    """A list of device indices names GPUs: on the CPU (``accelerator="cpu"``, or ``"auto"``
    on a machine without CUDA; read after a devices plugin resolved it) it is refused, as
    Lightning refuses it, instead of running one process per entry."""
    devices = config.devices
    listed = isinstance(devices, (list, tuple)) or (isinstance(devices, str) and "," in devices)
    if not listed or not _on_cpu(config.accelerator):
        return
    n = count_devices(devices)
    raise ConfigurationError(
        f"devices={devices!r}: device indices name GPUs, and this run is on the CPU (accelerator="
        f"{config.accelerator!r}{', no CUDA GPU here' if config.accelerator == 'auto' else ''}): "
        f"give a number of processes instead, devices={n} (--devices {n}), or run on GPUs with "
        "accelerator='gpu'"
    )


def _on_cpu(accelerator: str) -> bool:
    if accelerator == "cpu":
        return True
    if accelerator != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def _auto_devices() -> int:
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def normalize_precision(precision: Any) -> str:
    try:
        return _PRECISION_ALIASES[precision]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"precision={precision!r} is not one of {', '.join(PRECISIONS)}"
        ) from None


def env_defaults(environ: Mapping[str, str] | None = None, launched: bool | None = None) -> dict:
    """The defaults ``hookloop run`` left for this process, or ``{}``, read from ``environ``
    (default: ``os.environ``).

    :data:`DEFAULTS_ENV` is the launcher's private channel to the processes it starts: it
    is honoured only in a process a hookloop launcher started for its job (``launched``;
    when ``None``: :data:`hookloop.distributed.ranks.LAUNCHER_ENV` names an ancestor of this
    process). Anywhere else (a shell that exported it, a child of a worker run on its own)
    it is left over from another job and ignored, with a warning naming it."""
    from hookloop.distributed.ranks import LAUNCHER_ENV, descends_from

    environ = os.environ if environ is None else environ
    raw = environ.get(DEFAULTS_ENV)
    if not raw:
        return {}
    if launched is None:
        try:
            launcher: int | None = int(environ.get(LAUNCHER_ENV, ""))
        except ValueError:
            launcher = None
        launched = (launcher is not None and launcher != os.getpid()
                    and descends_from(launcher) is not False)
    if not launched:
        warnings.warn(
            f"{DEFAULTS_ENV} is set, but no hookloop launcher started this process ({LAUNCHER_ENV} "
            "does not name its parent): the settings are left over from another `hookloop run` and "
            f"are ignored ({raw[:200]}). Unset it: `unset {DEFAULTS_ENV}`; give settings to "
            "Trainer(...) or to `hookloop run` (docs/environment.md)",
            stacklevel=3,
        )
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{DEFAULTS_ENV} is not valid JSON: {exc}") from None
    known = {f.name for f in fields(TrainerConfig)}
    unknown = set(data) - known
    if unknown:
        raise ConfigurationError(f"{DEFAULTS_ENV} has unknown settings {sorted(unknown)}")
    return data
