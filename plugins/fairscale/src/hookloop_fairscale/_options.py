"""Options hookloop-ddp's DDP has and the strategies built on it here do not use."""

from __future__ import annotations

import inspect
from typing import Any

import hookloop
from hookloop_ddp import DDP

#: DistributedDataParallel's options: neither ShardedDataParallel nor a pipeline uses them.
DDP_ONLY_OPTIONS = (
    "find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb",
    "comm_hook", "comm_state", "powersgd_rank", "powersgd_start_iter",
    "powersgd_min_compression_rate", "localsgd_start_iter", "model_averaging_period",
    "localsgd_group_size", "localsgd_gradient_allreduce",
)
_DDP_DEFAULTS = {name: p.default for name, p in inspect.signature(DDP.__init__).parameters.items()}


def refuse_ddp_only(plugin: str, name: str, value: Any, why: str, own: tuple[str, ...]) -> bool:
    """``True`` when ``name`` is one of DDP's own options (and at its default); a
    ``ConfigurationError`` naming the plugin's options when it is set to anything else."""
    if name not in DDP_ONLY_OPTIONS:
        return False
    default = _DDP_DEFAULTS[name]
    if value is not default and value != default:
        raise hookloop.ConfigurationError(
            f"{plugin} option {name}={value!r}: this is an option of DistributedDataParallel, "
            f"which {plugin} does not use ({why}). Its options: {', '.join(own)}; or use --plugins ddp"
        )
    return True
