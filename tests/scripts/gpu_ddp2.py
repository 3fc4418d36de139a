"""One node of ddp2 on a GPU machine: DataParallel over 2 GPUs inside it, DDP outside.

Run by tests/gpu/test_gpu.py as ``hookloop run --plugins ddp2 --devices 2
gpu_ddp2.py OUT``: one process, each batch split over GPUs 0 and 1; the module's
``training_step_end`` receives the node's gathered per-sample losses.
"""

import sys
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402


class Gathered(TinyModule):
    def __init__(self):
        super().__init__(seed=0)
        self.gathered_sizes = []
        self.devices_seen = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.devices_seen.add(str(x.device))  # in each replica: its own GPU
        return F.cross_entropy(self(x), y, reduction="none")  # per sample: gathered

    def training_step_end(self, outputs):
        self.gathered_sizes.append(outputs.shape[0])
        return outputs.mean()


if __name__ == "__main__":
    module = Gathered()
    trainer = hookloop.Trainer(max_epochs=2, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(tiny_data(96), batch_size=16))
    torch.save({
        "state": {k: v.detach().cpu() for k, v in module.state_dict().items()},
        "gathered_sizes": module.gathered_sizes,
        "devices_seen": sorted(module.devices_seen),
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
    }, Path(sys.argv[1]) / "ddp2.pt")
