"""The plugin's options, their checks, and the DeepSpeed config built from them.

Pure Python: nothing here imports deepspeed, so bad options fail at once (when the
strategy is created, and again before any worker starts), not after a minute of
process start-up.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from hookloop import ConfigurationError

#: Environment variable naming a DeepSpeed JSON config file that replaces the options.
CONFIG_ENV = "HOOKLOOP_DEEPSPEED_CONFIG"

#: Every option of :class:`hookloop_deepspeed.DeepSpeedStrategy` with its default.
DEFAULT_OPTIONS: dict[str, Any] = {
    "stage": 2,
    "offload_optimizer": False,
    "offload_parameters": False,
    "offload_optimizer_device": "cpu",
    "offload_params_device": "cpu",
    "nvme_path": None,
    "pin_memory": False,
    "allgather_bucket_size": 200_000_000,
    "reduce_bucket_size": 200_000_000,
    "contiguous_gradients": True,
    "overlap_comm": True,
    "partition_activations": False,
    "cpu_checkpointing": False,
    "synchronize_checkpoint_boundary": False,
}

OFFLOAD_DEVICES = ("cpu", "nvme")

# Keys the trainer decides (the loader's batch size, accumulate_grad_batches, clipping,
# precision): a custom config may repeat them, but not contradict them.
_PRECISION_SECTIONS = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


def check_options(options: dict[str, Any], require_nvme_path: bool = True) -> None:
    """Raise :class:`hookloop.ConfigurationError` for options that cannot work together."""
    stage = options["stage"]
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ConfigurationError(
            f"deepspeed stage={stage!r} is not a ZeRO stage: use 0 (no sharding), 1 "
            f"(optimizer state), 2 (+ gradients) or 3 (+ parameters)"
        )
    for name in ("offload_optimizer_device", "offload_params_device"):
        if options[name] not in OFFLOAD_DEVICES:
            raise ConfigurationError(
                f"deepspeed {name}={options[name]!r} must be 'cpu' or 'nvme'"
            )
    if options["offload_optimizer"] and stage == 0:
        raise ConfigurationError(
            "deepspeed offload_optimizer=True needs ZeRO stage 1, 2 or 3 (stage=0 keeps the "
            "optimizer on the device): pass stage=2, or use the 'deepspeed_stage_2_offload' "
            "preset"
        )
    if options["offload_parameters"] and stage != 3:
        raise ConfigurationError(
            f"deepspeed offload_parameters=True needs ZeRO stage 3 (stage={stage} keeps a full "
            f"copy of the parameters on every rank): pass stage=3, or use the "
            f"'deepspeed_stage_3_offload' preset"
        )
    for flag, device in (("offload_optimizer", "offload_optimizer_device"), ("offload_parameters", "offload_params_device")):
        if options[device] == "nvme" and not options[flag]:
            raise ConfigurationError(
                f"deepspeed {device}='nvme' has no effect without {flag}=True: pass both"
            )
    nvme = [d for f, d in (("offload_optimizer", "offload_optimizer_device"), ("offload_parameters", "offload_params_device"))
            if options[f] and options[d] == "nvme"]
    if nvme and not options["nvme_path"] and require_nvme_path:
        raise ConfigurationError(
            f"deepspeed {' and '.join(f'{d}=nvme' for d in nvme)} needs nvme_path, the directory "
            f"on a fast local disk where DeepSpeed swaps tensors: e.g. "
            f"plugin_options={{'deepspeed': {{'nvme_path': '/local_nvme'}}}}"
        )
    for name in ("allgather_bucket_size", "reduce_bucket_size"):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or int(value) != value:
            raise ConfigurationError(f"deepspeed {name}={value!r} must be a positive number of elements")
    for name in ("offload_optimizer", "offload_parameters", "pin_memory", "contiguous_gradients", "overlap_comm",
                 "partition_activations", "cpu_checkpointing", "synchronize_checkpoint_boundary"):
        if not isinstance(options[name], bool):
            raise ConfigurationError(f"deepspeed {name}={options[name]!r} must be True or False")
    if options["cpu_checkpointing"] and not options["partition_activations"]:
        # DeepSpeed moves activation checkpoints to the CPU only when it partitions them.
        raise ConfigurationError(
            "deepspeed cpu_checkpointing=True works only with partition_activations=True "
            "(DeepSpeed moves partitioned activation checkpoints to the CPU): pass both"
        )


def load_custom_config(config: Any) -> tuple[dict | None, str | None]:
    """The user's full DeepSpeed config and where it came from, or ``(None, None)``.

    ``config`` (a dict, or the path of a JSON file) wins; else the file named by
    ``HOOKLOOP_DEEPSPEED_CONFIG``.
    """
    if config is None:
        env = os.environ.get(CONFIG_ENV)
        if not env:
            return None, None
        return _read_json(Path(env), f"{CONFIG_ENV}={env}"), f"${CONFIG_ENV} ({env})"
    if isinstance(config, dict):
        return copy.deepcopy(config), "the config dict"
    if isinstance(config, (str, os.PathLike)):
        return _read_json(Path(config), f"config={str(config)!r}"), str(config)
    raise ConfigurationError(
        f"deepspeed config={type(config).__name__} must be a dict or the path of a JSON file"
    )


def _read_json(path: Path, source: str) -> dict:
    if not path.is_file():
        raise ConfigurationError(f"deepspeed {source}: no such file: {str(path)!r}")
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(
            f"deepspeed {source} is not JSON ({exc.msg} at line {exc.lineno}, column "
            f"{exc.colno}): a DeepSpeed config is a JSON object such as "
            f'{{"zero_optimization": {{"stage": 2}}}}'
        ) from None
    if not isinstance(data, dict):
        raise ConfigurationError(
            f"deepspeed {source} holds a JSON {type(data).__name__}, not an object: a DeepSpeed "
            f'config looks like {{"zero_optimization": {{"stage": 2}}}}'
        )
    return data


def config_from_options(options: dict[str, Any]) -> dict:
    """The DeepSpeed config sections that the plugin's options describe."""
    zero: dict[str, Any] = {"stage": options["stage"]}
    if options["stage"] > 0:
        zero.update(
            contiguous_gradients=options["contiguous_gradients"],
            overlap_comm=options["overlap_comm"],
            allgather_bucket_size=int(options["allgather_bucket_size"]),
            reduce_bucket_size=int(options["reduce_bucket_size"]),
        )
    if options["offload_optimizer"]:
        zero["offload_optimizer"] = _offload(options, options["offload_optimizer_device"])
    if options["offload_parameters"]:
        zero["offload_param"] = _offload(options, options["offload_params_device"])
    return {
        "zero_optimization": zero,
        "activation_checkpointing": {
            "partition_activations": options["partition_activations"],
            "cpu_checkpointing": options["cpu_checkpointing"],
            "synchronize_checkpoint_boundary": options["synchronize_checkpoint_boundary"],
        },
    }


def _offload(options: dict, device: str) -> dict:
    section: dict[str, Any] = {"device": device, "pin_memory": options["pin_memory"]}
    if device == "nvme":
        section["nvme_path"] = str(options["nvme_path"])
    return section


def changed_options(options: dict[str, Any]) -> dict[str, Any]:
    """Options that differ from the defaults: what a custom config overrides."""
    return {k: v for k, v in options.items() if DEFAULT_OPTIONS.get(k) != v}


def build_config(
    options: dict[str, Any],
    custom: dict | None,
    *,
    precision: str,
    accumulate: int,
    clip_val: float | None,
    clip_algorithm: str,
    micro_batch_size: int,
    world_size: int,
) -> tuple[dict, list[str]]:
    """The complete DeepSpeed config of a run, and notes for the user.

    ``custom`` (the user's full config) replaces the options; what the trainer decides
    (micro-batch size from the loader, ``accumulate_grad_batches``, gradient clipping,
    precision) is filled in where the config leaves it out, and is an error where the
    config contradicts it, so no setting is silently dropped.
    """
    notes: list[str] = []
    config = copy.deepcopy(custom) if custom is not None else config_from_options(options)

    _agree(config, "train_micro_batch_size_per_gpu", micro_batch_size, "the training loader's batch_size")
    _agree(config, "gradient_accumulation_steps", accumulate, "accumulate_grad_batches")
    total = micro_batch_size * accumulate * world_size
    if "train_batch_size" in config and config["train_batch_size"] != total:
        raise ConfigurationError(
            f"the DeepSpeed config says train_batch_size={config['train_batch_size']}, but this "
            f"run takes {micro_batch_size} per device x {world_size} processes x {accumulate} "
            f"accumulated batches = {total}: drop train_batch_size from the config (hookloop "
            f"derives it) or make them agree"
        )

    if clip_val:
        if clip_algorithm != "norm":
            raise ConfigurationError(
                f"gradient_clip_algorithm={clip_algorithm!r}: DeepSpeed clips the gradient norm "
                f"only; use gradient_clip_algorithm='norm'"
            )
        _agree(config, "gradient_clipping", float(clip_val), "gradient_clip_val")
    else:
        # DeepSpeed's own default clips the gradient norm to 1.0; hookloop (like plain
        # PyTorch) clips only when gradient_clip_val asks for it.
        config.setdefault("gradient_clipping", 0.0)

    section = _PRECISION_SECTIONS.get(precision)
    enabled = [s for s in ("fp16", "bf16") if isinstance(config.get(s), dict) and config[s].get("enabled")]
    if section is not None:
        other = [s for s in enabled if s != section]
        if other:
            raise ConfigurationError(
                f"precision={precision!r} asks for {section}, but the DeepSpeed config enables "
                f"{other[0]}: choose one (remove the section, or set precision to match)"
            )
        entry = config.setdefault(section, {})
        entry["enabled"] = True
        if section == "fp16":
            entry.setdefault("loss_scale", 0)  # 0 = dynamic loss scaling, as AMP does
            entry.setdefault("initial_scale_power", 16)
            entry.setdefault("loss_scale_window", 1000)
            entry.setdefault("hysteresis", 2)
            entry.setdefault("min_loss_scale", 1)
        if precision.endswith("-true"):
            notes.append(
                f"precision={precision!r}: DeepSpeed trains the model in {section} and keeps "
                f"fp32 master weights in the optimizer (as for '{section}-mixed')"
            )
    elif enabled:
        notes.append(f"the DeepSpeed config enables {enabled[0]} (the trainer's precision is {precision!r})")

    # Lightning's default: any torch optimizer from configure_optimizers may be sharded.
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 2**31 - 1)  # hookloop reports progress itself
    config.setdefault("wall_clock_breakdown", False)

    if custom is not None:
        overridden = changed_options(options)
        if overridden:
            listed = ", ".join(f"{k}={v!r}" for k, v in overridden.items())
            notes.append(f"the custom DeepSpeed config overrides the options {listed}")
        else:
            notes.append("the custom DeepSpeed config replaces the plugin's options")
    stage = zero_stage(config)
    if not 0 <= stage <= 3:
        raise ConfigurationError(f"the DeepSpeed config has zero_optimization.stage={stage!r}; use 0-3")
    return config, notes


def _agree(config: dict, key: str, value: Any, source: str) -> None:
    if key in config and config[key] != value:
        raise ConfigurationError(
            f"the DeepSpeed config says {key}={config[key]!r}, but {source} is {value!r}: "
            f"hookloop sets {key} from {source}; drop it from the config or make them agree"
        )
    config[key] = value


def zero_stage(config: dict) -> int:
    zero = config.get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


def offload_device(config: dict, key: str) -> str | None:
    """``"cpu"``/``"nvme"`` if ``zero_optimization.<key>`` offloads, else ``None``."""
    section = (config.get("zero_optimization") or {}).get(key) or {}
    device = section.get("device") if isinstance(section, dict) else None
    return device if device in OFFLOAD_DEVICES else None
