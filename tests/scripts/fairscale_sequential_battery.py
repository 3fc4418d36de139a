"""ddp_sequential checks in one 2-process run.

Run by tests/test_fairscale_sequential.py as
``hookloop run --plugins ddp_sequential --devices 2 fairscale_sequential_battery.py OUT``:
2 pipeline stages on 2 processes (and, in the same workers, 1 stage x 2 replicas). Every
rank writes ``OUT/rank<R>.pt``; the test compares with one-process runs it makes itself.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import tiny_data  # noqa: E402

DATA = tiny_data(48)
VAL = tiny_data(24, seed=2)


class SeqNet(hookloop.Module):
    """Every trainable layer in ``sequential_module`` (what ddp_sequential splits)."""

    def __init__(self, seed: int = 0, optimizer: str = "sgd"):
        super().__init__()
        torch.manual_seed(seed)
        self.sequential_module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                                               nn.Linear(16, 3))
        self.optimizer = optimizer

    def forward(self, x):
        return self.sequential_module(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Losses:
    """The loss of every step, as the loop sees it on this rank."""

    hookloop_name, hookloop_role = "losses", "observer"

    def __init__(self):
        self.losses: list[float] = []
        self.stage_parameters = 0

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        # What this rank holds of sequential_module while it trains (its stage's layers).
        self.stage_parameters = sum(p.numel() for p in trainer.module.parameters())

    @hookloop.hookimpl
    def on_train_batch_end(self, loss):
        self.losses.append(float(loss))


def state(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit(rank, plugin, epochs=2, optimizer="sgd", ckpt_path=None, **kwargs):
    losses = Losses()
    kwargs.setdefault("enable_checkpointing", False)
    trainer = hookloop.Trainer(plugins=[plugin, losses], max_epochs=epochs, num_sanity_val_steps=1, **kwargs)
    module = SeqNet(seed=rank, optimizer=optimizer)  # rank 0's weights must win
    train = DataLoader(DATA, batch_size=8)
    if getattr(plugin, "stages", None) == 1:
        # 1 stage x 2 replicas: each replica's share in order, through the loader's own
        # DistributedSampler (a training loader is otherwise shuffled, as in Lightning)
        train = DataLoader(DATA, batch_size=8, sampler=DistributedSampler(DATA, num_replicas=2, rank=rank, shuffle=False))
    trainer.fit(module, train, DataLoader(VAL, batch_size=6), ckpt_path=ckpt_path)
    assert not dist.is_initialized()
    return {"state": state(module), "losses": losses.losses, "metrics": dict(trainer.callback_metrics),
            "global_step": trainer.global_step, "stage_parameters": losses.stage_parameters,
            "model_after": type(trainer.model).__name__}


def main() -> None:
    faulthandler.enable()
    faulthandler.dump_traceback_later(420, exit=True)
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    pipeline = lambda **options: hookloop.plugin("ddp_sequential", **{"balance": [2, 3], "chunks": 4, **options})  # noqa: E731
    record: dict = {}
    record["pipeline"] = fit(rank, pipeline(), enable_checkpointing=True, default_root_dir=str(out / "run"))
    record["last_ckpt"] = str(next((out / "run").rglob("last.ckpt")))
    record["accumulate_clip"] = fit(rank, pipeline(), optimizer="adam", accumulate_grad_batches=2,
                                    gradient_clip_val=0.05)
    record["bf16"] = fit(rank, pipeline(), precision="bf16-mixed")
    record["replicas"] = fit(rank, hookloop.plugin("ddp_sequential", stages=1))
    record["auto_balance"] = fit(rank, hookloop.plugin("ddp_sequential", stages=2), epochs=1)
    # Stopped after one epoch with a checkpoint, then resumed by a module with other weights.
    fit(rank, pipeline(), epochs=1, enable_checkpointing=True, default_root_dir=str(out / "first"))
    first = next((out / "first").rglob("last.ckpt"))
    record["resumed"] = fit(rank, pipeline(), ckpt_path=str(first))
    trainer = hookloop.Trainer(plugins=[pipeline()])
    record["validate"] = trainer.validate(SeqNet(seed=3), DataLoader(VAL, batch_size=6))
    torch.save(record, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
