"""Lightning's loops and module API under ddp, in one 2-process run.

Run in the shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2``), read
by tests/test_lightning_ddp.py. Every rank writes ``OUT/rank<R>.pt`` with what it observed;
the test compares those records with references computed by hand. The runs' directories
(no ``default_root_dir``: the working directory) are in OUT too.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Sampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402
from test_lightning_module import ManualTiny, TwoNets  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
os.chdir(OUT)  # the runs' default root, as a launch of its own in OUT had (the job driver puts it back)
record: dict = {}


def state(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def trainer(**kw) -> hookloop.Trainer:
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("num_sanity_val_steps", 0)
    return hookloop.Trainer(**kw)


# -- predict: every sample once, in dataset order ---------------------------------------------


class Predicts(TinyModule):
    def predict_step(self, batch, batch_idx):
        x, y = batch
        return {"logits": self(x), "pair": (x[:, :2], y)}

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)
        self.log("test_samples", float(len(y)), reduce_fx="sum", sync_dist=True)


class Reversed(Sampler):
    """A user's own sampler (wrapped per rank by hookloop): the dataset backwards."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


module = Predicts(seed=3)
t = trainer()
record["predict"] = t.predict(module, DataLoader(tiny_data(21, seed=4), batch_size=4))
record["predict_user_sampler"] = t.predict(module, DataLoader(tiny_data(9, seed=4), batch_size=2, sampler=Reversed(9)))
record["predict_module_state"] = state(module)
record["test"] = t.test(module, DataLoader(tiny_data(20, seed=5), batch_size=4), verbose=False)

# -- manual optimization: the same as automatic under ddp --------------------------------------

torch.manual_seed(1)
automatic = TinyModule()
trainer(max_epochs=2, gradient_clip_val=0.05).fit(automatic, DataLoader(tiny_data(64), batch_size=8, shuffle=True))
torch.manual_seed(1)
manual = ManualTiny()
t = trainer(max_epochs=2)
t.fit(manual, DataLoader(tiny_data(64), batch_size=8, shuffle=True))
record["automatic"], record["manual"], record["manual_steps"] = state(automatic), state(manual), t.global_step

# -- two optimizers: gradients synchronised ------------------------------------------------------
# Each rank sees its own share: without synchronisation the ranks would drift apart.
gan = TwoNets()
trainer(max_epochs=2, plugin_options={"ddp": {"find_unused_parameters": True}}).fit(
    gan, DataLoader(tiny_data(48), batch_size=8))
record["gan_sharded"] = state(gan)
# Both ranks see the same data: averaging identical gradients must give the 1-process result.
gan = TwoNets()
trainer(max_epochs=2, use_distributed_sampler=False, plugin_options={"ddp": {"find_unused_parameters": True}}).fit(
    gan, DataLoader(tiny_data(48), batch_size=8))
record["gan_same_data"] = state(gan)

# -- a DataModule: prepare_data once per node, before any rank's setup ----------------------------


class Prepared(hookloop.DataModule):
    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def prepare_data(self):
        marker = self.root / "prepared"
        # Written slowly, so a rank that did not wait would find it missing or partial.
        with open(self.root / f"prepare_data.rank{RANK}", "w") as f:
            f.write("called")
        import time

        time.sleep(0.5)
        torch.save(tiny_data(32), marker)

    def setup(self, stage):
        self.data = torch.load(self.root / "prepared", weights_only=False)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)


dm = Prepared(OUT)
t = trainer(max_epochs=1)
t.fit(TinyModule(), datamodule=dm)
record["datamodule_steps"] = t.global_step

torch.save(record, OUT / f"rank{RANK}.pt")
