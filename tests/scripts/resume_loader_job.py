"""Two ddp ranks, each with two persistent workers that draw an augmentation per sample,
stopped mid-epoch and resumed (tests/test_resume_loader.py).

Run as ``hookloop run --plugins ddp --devices 2 resume_loader_job.py OUT --epochs E
[--steps S] [--ckpt PATH]``. Every rank writes ``OUT/seen_<rank>.json``: the batches it
trained on (sample indices, augmentations) and its final weights.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import hookloop

faulthandler.enable()
faulthandler.dump_traceback_later(90, exit=True)  # a hang fails the test with the stacks
parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--ckpt", default=None)
parser.add_argument("--steps", type=int, default=None)
ARGS = parser.parse_args()


class AugmentedData(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor(i), torch.rand(1)


class Recorder(hookloop.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(1, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        index, aug = batch
        self.seen.append((index.tolist(), aug.flatten().tolist()))
        return ((self.net(aug).flatten() - index.float() / 40) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


hookloop.seed_everything(0)
module = Recorder()
trainer = hookloop.Trainer(max_epochs=ARGS.epochs, max_steps=ARGS.steps, default_root_dir=str(ARGS.out / "root"),
                           enable_progress_bar=False)
loader = DataLoader(AugmentedData(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
                    multiprocessing_context="fork")
trainer.fit(module, loader, ckpt_path=ARGS.ckpt)
weights = [p.detach().flatten().tolist() for p in module.parameters()]
(ARGS.out / f"seen_{trainer.global_rank}.json").write_text(json.dumps({"seen": module.seen, "weights": weights}))
