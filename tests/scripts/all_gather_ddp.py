"""``LightningModule.all_gather`` on 2 processes with ``sync_grads=True``: each rank's
tensors stacked in rank order, and the gradients flowing back through the gather.

Run in the shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2
all_gather_ddp.py OUT``), read by tests/test_lightning_names.py. Every rank writes
``OUT/rank<R>.pt``: what it gathered in its one step, its ranks and its weights after.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from hookloop.utilities import rank_zero_only  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
os.chdir(OUT)  # the working directory a launch of its own had (the job driver puts it back)
out: dict = {}

# torch.distributed.nn.functional.all_gather (what all_gather(sync_grads=True) calls) binds
# its default group, group.WORLD, when the module is first imported. A launch of its own
# imports it in this fit, with this fit's group; in the shared job an earlier script's
# workers imported it with their group, since destroyed (its backward then fails). So it
# is imported afresh here, as in a new process, and the earlier module put back after.
EARLIER = sys.modules.pop("torch.distributed.nn.functional", None)


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


module = Gather()
with tempfile.TemporaryDirectory() as root:
    hookloop.Trainer(plugins=["ddp"], accelerator="cpu", max_steps=1, enable_checkpointing=False, logger=False,
                     enable_progress_bar=False, default_root_dir=root,
                     use_distributed_sampler=False).fit(module, DataLoader(TensorDataset(torch.ones(2, 1)), batch_size=2))
out["w"] = module.w.detach().clone()
torch.save(out, OUT / f"rank{RANK}.pt")
if EARLIER is not None:
    import torch.distributed.nn

    sys.modules["torch.distributed.nn.functional"] = torch.distributed.nn.functional = EARLIER
