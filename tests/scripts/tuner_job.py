"""The learning-rate and batch-size finders' module and data (tests/test_tuner.py).

Run as a script in the shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2
tuner_job.py OUT``, read by tests/test_tuner.py), its runs' root directory OUT (what
``--default-root-dir OUT`` would set; also the working directory): each rank
writes what ``Tuner`` returned to ``OUT/rank<R>.json``: the lr finder on BATCH samples per
rank, then the batch-size finder with rank 1 alone running out of memory above OOM_ABOVE
samples per batch. Under several processes rank R trains on samples R, R + W, R + 2W, ...
in order (``use_distributed_sampler=False``), so the ranks' batch k together are the
sequential batch k of W * BATCH samples."""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

import hookloop

N, FEATURES, BATCH, NUM_TRAINING, OOM_ABOVE = 256, 6, 4, 24, 8


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, FEATURES, generator=g)
    y = x @ torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1) + 0.3 + 0.1 * torch.randn(N, 1, generator=g)
    return TensorDataset(x, y)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


class Regression(hookloop.Module):
    def __init__(self, batch_size: int = BATCH, oom_rank: int | None = None):
        super().__init__()
        self.net = net()
        self.lr = 0.01
        self.batch_size = batch_size
        self.oom_rank = oom_rank

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.oom_rank is not None and self.trainer.global_rank == self.oom_rank and len(x) > OOM_ABOVE:
            raise torch.OutOfMemoryError(f"out of memory: batch of {len(x)} on rank {self.oom_rank}")
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        return DataLoader(Subset(data(), range(rank, N, world)), batch_size=self.batch_size, shuffle=False)


def main(out: str, default_root_dir: str | None = None) -> None:
    root = {} if default_root_dir is None else {"default_root_dir": default_root_dir}
    trainer = hookloop.Trainer(max_epochs=1, enable_progress_bar=False, enable_model_summary=False,
                               use_distributed_sampler=False, **root)
    tuner = hookloop.Tuner(trainer)
    model = Regression()
    found = tuner.lr_find(model, num_training=NUM_TRAINING, min_lr=1e-4, max_lr=1.0)
    result = {"lr": found.results["lr"], "loss": found.results["loss"], "suggestion": found.suggestion(),
              "model_lr": model.lr}
    # the run after the search trains from step 0 with the suggested lr
    trainer.fit(model)
    result["global_step_after_fit"] = trainer.global_step
    oom = Regression(oom_rank=1)
    result["batch_size"] = tuner.scale_batch_size(oom, mode="power", init_val=2, steps_per_trial=2)
    result["model_batch_size"] = oom.batch_size
    with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    os.chdir(sys.argv[1])  # the job driver puts the working directory back
    main(sys.argv[1], default_root_dir=sys.argv[1])
