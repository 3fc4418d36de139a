"""hookloop-deepspeed: DeepSpeed's ZeRO stages 1-3, CPU/NVMe offload and sharded checkpoints.

    hookloop run --plugins deepspeed_stage_3 --devices 2 train.py
    Trainer(plugins=["deepspeed"], plugin_options={"deepspeed": {"stage": 3}}, devices=2)
    Trainer(plugins=[DeepSpeedStrategy(stage=2, offload_optimizer=True)], devices=2)

deepspeed itself is imported only when a run starts.
"""

from .activations import checkpoint
from .strategy import (
    DeepSpeedStage1,
    DeepSpeedStage2,
    DeepSpeedStage2Offload,
    DeepSpeedStage3,
    DeepSpeedStage3Offload,
    DeepSpeedStage3OffloadNVMe,
    DeepSpeedStrategy,
)

__all__ = [
    "DeepSpeedStage1",
    "DeepSpeedStage2",
    "DeepSpeedStage2Offload",
    "DeepSpeedStage3",
    "DeepSpeedStage3Offload",
    "DeepSpeedStage3OffloadNVMe",
    "DeepSpeedStrategy",
    "checkpoint",
]
