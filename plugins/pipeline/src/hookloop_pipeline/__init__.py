"""hookloop-pipeline: pipeline parallelism with ``torch.distributed.pipelining``'s schedules.

    hookloop run --plugins pipeline --devices 2 train.py
    hookloop run --plugins pipeline,ddp --mesh pp=2,dp_replicate=2 --devices 4 train.py
    Trainer(plugins=[hookloop.plugin("pipeline", schedule="1f1b", microbatches=4)], devices=2)

The stages come from the module (``pipeline_stages`` or ``configure_pipeline(num_stages)``)
or from an automatic split of its ``nn.Sequential``/``nn.ModuleList`` of blocks
(:func:`split_blocks`); the loss from ``pipeline_loss(output, target)`` or ``loss_fn``.
"""

from .split import split_blocks, stage_modules
from .strategy import SCHEDULES, Pipeline, PipelineParallel

__all__ = ["Pipeline", "PipelineParallel", "SCHEDULES", "split_blocks", "stage_modules"]
