"""hookloop-fsdp: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) as a hookloop strategy.

    hookloop run --plugins fsdp --devices 2 train.py
    Trainer(plugins=["fsdp"], devices=2, precision="bf16-mixed")
    Trainer(plugins=[hookloop.plugin("fsdp", auto_wrap_policy={Block}, state_dict_type="sharded")])

:class:`FSDP` subclasses :class:`hookloop_ddp.DDP` (launching, process group, samplers,
collectives); ``hookloop fsdp collate CKPT_DIR OUT.pt`` turns a sharded checkpoint into
one plain state dict.
"""

from .memory import memory_report
from .strategy import FSDP, FSDPCPUOffload, FSDPStrategy

__all__ = ["FSDP", "FSDPCPUOffload", "FSDPStrategy", "memory_report"]
