"""hookloop-fairscale: fairscale's sharding and pipelining as hookloop plugins.

``ddp_sharded`` / ``ddp_sharded_spawn``
    data parallel with the optimizer state sharded across ranks (fairscale's OSS) and
    gradients reduced to their owner (ShardedDataParallel); launched like ddp / ddp_spawn.
``pipe``
    pipeline parallelism of the module's ``sequential_module`` (an ``nn.Sequential``)
    over several devices of one process (``fairscale.nn.Pipe``): ``balance``, ``chunks``
    (micro-batches), ``checkpoint``.
``ddp_sequential``
    pipeline stages on separate processes (torch.distributed.pipelining, GPipe) with
    data parallelism across pipeline replicas: ``devices = stages x replicas``.
``activation_checkpointing``
    an extension for any strategy: the module classes you name recompute their
    activations in the backward pass (``fairscale.nn.checkpoint_wrapper``).

Nothing here imports fairscale until a run needs it.
"""

from .activations import ActivationCheckpointing
from .balance import balance_by_parameters
from .pipe import PipeStrategy
from .sequential import DDPSequential
from .sharded import DDPSharded, DDPShardedSpawn

__all__ = [
    "ActivationCheckpointing",
    "DDPSequential",
    "DDPSharded",
    "DDPShardedSpawn",
    "PipeStrategy",
    "balance_by_parameters",
]
