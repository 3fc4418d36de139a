"""Saves a sharded checkpoint over and over until it is killed (tests/test_fsdp.py sends
SIGKILL mid-run): save ``i`` holds weights all equal to ``i`` and notes ``i`` in the
loop's state, so whatever the directory holds afterwards can be checked for coherence.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hookloop

OUT = Path(sys.argv[1])


class Wide(hookloop.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])  # ~25 MB

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class SaveForever:
    hookloop_name, hookloop_role = "crash", "observer"

    def __init__(self):
        self.i = 0

    @hookloop.hookimpl
    def on_save_checkpoint(self, checkpoint):
        checkpoint["plugins"]["crash"] = {"i": self.i}

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        while True:
            self.i += 1
            with torch.no_grad():
                for p in trainer.module.parameters():
                    p.to_local().fill_(float(self.i))
            trainer.save_checkpoint(OUT / "loop.ckpt")
            (OUT / "saved").write_text(str(self.i))


trainer = hookloop.Trainer(plugins=[hookloop.plugin("fsdp", state_dict_type="sharded"), SaveForever()],
                           max_steps=1, enable_checkpointing=False, num_sanity_val_steps=0)
trainer.fit(Wide(), DataLoader(TensorDataset(torch.randn(4, 1024)), batch_size=4))
