"""``LightningModule.all_gather`` on 2 processes with ``sync_grads=True``: each rank's
tensors stacked in rank order, and the gradients flowing back through the gather.

Run in the shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2
all_gather_ddp.py OUT``), read by tests/test_lightning_names.py. Every rank writes
``OUT/rank<R>.pt``: what it gathered in its one step, its ranks and its weights after.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from jobs import begin_battery  # noqa: E402
from hookloop.distributed.ranks import rank_zero_only  # noqa: E402

OUT, RANK = begin_battery()  # tests/jobs.py: a watchdog, the output folder as working directory
out: dict = {}

class Gather(hookloop.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))

    def training_step(self, batch, batch_idx):
        rank = float(self.global_rank)
        gathered = self.all_gather({"v": self.w * (rank + 1), "n": rank, "pair": [torch.tensor(rank)]},
                                   sync_grads=True)
        out.update(v=gathered["v"].detach().clone(), n=gathered["n"].clone(), pair=gathered["pair"][0].clone(),
                   ranks=(self.global_rank, self.local_rank, rank_zero_only.rank),
                   last=self.trainer.is_last_batch)
        return gathered["v"].sum()  # through the gather: each rank's slice's gradient reaches it

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)



def fit(module):
    with tempfile.TemporaryDirectory() as root:
        hookloop.Trainer(plugins=["ddp"], accelerator="cpu", max_steps=1, enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, default_root_dir=root,
                         use_distributed_sampler=False).fit(module, DataLoader(TensorDataset(torch.ones(2, 1)), batch_size=2))


# A fit before the observed one, as in a notebook or a script that fits twice: torch binds
# the default group of torch.distributed.nn.functional (what all_gather(sync_grads=True)
# calls) when this first fit imports it, and that group is destroyed when the fit ends.
# The second fit's gather must use its own group (it gathered on the destroyed one: its
# backward failed with "not initialized in the world group map").
fit(Gather())
out.clear()
module = Gather()
fit(module)
out["w"] = module.w.detach().clone()
torch.save(out, OUT / f"rank{RANK}.pt")
