"""The learning-rate and batch-size finders' module and data (tests/test_tuner.py).

Run as a script (``hookloop run --plugins ddp --devices 2 tuner_job.py OUT MODE``): each
rank writes what ``Tuner`` returned to ``OUT/rank<R>.json``. ``MODE``: ``lr`` (the lr
finder on BATCH samples per rank) or ``bs`` (the batch-size finder, with rank 1 running
out of memory above OOM_ABOVE samples per batch)."""

from __future__ import annotations

import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

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
        return DataLoader(data(), batch_size=self.batch_size, shuffle=False)


def main(out: str, mode: str) -> None:
    trainer = hookloop.Trainer(max_epochs=1, enable_progress_bar=False, enable_model_summary=False)
    rank = int(__import__("os").environ.get("RANK", "0"))
    if mode == "lr":
        model = Regression()
        found = hookloop.Tuner(trainer).lr_find(model, num_training=NUM_TRAINING, min_lr=1e-4, max_lr=1.0)
        result = {"lr": found.results["lr"], "loss": found.results["loss"], "suggestion": found.suggestion(),
                  "model_lr": model.lr}
    else:
        model = Regression(oom_rank=1)
        size = hookloop.Tuner(trainer).scale_batch_size(model, mode="power", init_val=2, steps_per_trial=2)
        result = {"batch_size": size, "model_batch_size": model.batch_size}
    # the run after the search trains from step 0 with the found settings
    trainer.fit(model)
    result["global_step_after_fit"] = trainer.global_step
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
