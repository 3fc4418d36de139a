"""Many ddp_sharded checks in one 2-process run (process start-up is the expensive part).

Run by tests/test_fairscale_sharded.py as
``hookloop run --plugins ddp_sharded --devices 2 fairscale_sharded_battery.py OUT``.
The reference runs name ``ddp`` in code (code wins over ``--plugins``). Every rank writes
``OUT/rank<R>.pt`` with what it observed; the test compares with ddp's runs and with
references computed by hand.
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

DATA = tiny_data(64)
VAL = tiny_data(16, seed=2)


def state(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Net(hookloop.Module):
    """Linear 8 -> 16 -> ReLU -> 3 (195 parameters: OSS's greedy split is 128 / 67)."""

    def __init__(self, seed: int = 0, optimizer: str = "sgd", scheduler: bool = False, inf_at: int | None = None):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.optimizer, self.scheduler, self.inf_at = optimizer, scheduler, inf_at

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.inf_at is not None and self.trainer.global_step == self.inf_at and self.trainer.global_rank == 1:
            # An inf in one parameter's gradient, on one rank only: that parameter's owner
            # sees it after the reduce, the other rank's partition stays finite.
            loss = loss + float("inf") * self.net[2].bias.sum()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)
        self.log("rank_mean", float(self.trainer.global_rank + 1), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if self.scheduler:
            return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return optimizer


class Probe:
    """What the run holds at its end, before teardown."""

    hookloop_name, hookloop_role = "probe", "observer"

    def __init__(self):
        self.seen: dict = {}
        self.norms: list[float] = []

    @hookloop.hookimpl
    def on_before_optimizer_step(self, trainer, optimizer):
        if trainer.strategy.hookloop_name == "ddp":  # whole gradients: their norm, before clipping
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        optimizer = trainer.optimizer
        self.seen = {
            "optimizer_type": type(optimizer).__name__,
            "model_type": type(trainer.model).__name__,
            "lr": optimizer.param_groups[0]["lr"],
            "metrics": dict(trainer.callback_metrics),
            "norms": list(self.norms),
        }
        if hasattr(optimizer, "local_state_bytes"):  # OSS: this rank's partition only
            self.seen["state_bytes"] = optimizer.local_state_bytes()
            self.seen["partition"] = optimizer.partition_numels()
            self.seen["inner_params"] = sum(p.numel() for g in optimizer.optim.param_groups for p in g["params"])
        else:
            self.seen["state_bytes"] = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                                           for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
            self.seen["optimizer_state"] = optimizer.state_dict()


def fit(rank, strategy, optimizer="sgd", epochs=2, shuffle=True, plugins=(), module=None, ckpt_path=None, **kwargs):
    probe = Probe()
    kwargs.setdefault("enable_checkpointing", False)
    trainer = hookloop.Trainer(plugins=[strategy, probe, *plugins], max_epochs=epochs, num_sanity_val_steps=0, **kwargs)
    module = module if module is not None else Net(seed=rank, optimizer=optimizer)  # rank 0's must win
    # In order: the loader's own DistributedSampler (a training loader is otherwise shuffled
    # under several processes, as in Lightning)
    train = (DataLoader(DATA, batch_size=8, shuffle=True) if shuffle else
             DataLoader(DATA, batch_size=8, sampler=DistributedSampler(DATA, num_replicas=2, rank=rank, shuffle=False)))
    trainer.fit(module, train, DataLoader(VAL, batch_size=4),
                ckpt_path=ckpt_path)
    assert not dist.is_initialized()
    return trainer, module, probe.seen


def main() -> None:
    faulthandler.enable()
    faulthandler.dump_traceback_later(420, exit=True)  # a hang fails with the stacks
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    record: dict = {}

    # -- ddp_sharded against ddp: SGD + momentum (with a StepLR) and Adam; accumulation, clipping

    record["parity"] = {}
    for optimizer in ("sgd", "adam"):
        for accumulate, clip in ((1, None), (2, 0.05)):
            runs = {}
            for strategy in ("ddp", "ddp_sharded"):
                module = Net(seed=rank, optimizer=optimizer, scheduler=optimizer == "sgd")
                trainer, module, seen = fit(rank, strategy, module=module, accumulate_grad_batches=accumulate,
                                            gradient_clip_val=clip)
                runs[strategy] = {"state": state(module), "seen": seen, "global_step": trainer.global_step}
            record["parity"][(optimizer, accumulate, clip)] = runs

    # -- precision: bf16 composes; fp16 steps through ShardedGradScaler (an inf on one rank) --

    record["bf16"] = {s: state(fit(rank, s, precision="bf16-mixed")[1]) for s in ("ddp", "ddp_sharded")}
    record["fp16"] = {}
    for strategy in ("ddp", "ddp_sharded"):
        amp = hookloop.plugin("amp", allow_cpu_fp16=True, init_scale=2.0**10)
        trainer, module, _ = fit(rank, strategy, plugins=[amp], precision="16-mixed", module=Net(seed=rank, inf_at=2))
        record["fp16"][strategy] = {"state": state(module), "skipped": amp.skipped_steps,
                                    "scale": amp.scaler.get_scale(), "scaler": type(amp.scaler).__name__}

    # -- validate (no optimizer: nothing to shard) and sync_dist metrics --------------------

    trainer = hookloop.Trainer(plugins=["ddp_sharded"])
    record["validate"] = trainer.validate(Net(seed=0), DataLoader(VAL, batch_size=4))

    # -- activation checkpointing composes with ddp_sharded ----------------------------------

    checkpointing = hookloop.plugin("activation_checkpointing", modules=["Linear"])
    record["checkpointed"] = state(fit(rank, "ddp_sharded", plugins=[checkpointing])[1])
    record["not_checkpointed"] = state(fit(rank, "ddp_sharded")[1])

    # -- checkpoints: unshuffled, so that 1 process on batches of 16 is the same run ---------

    straight = fit(rank, "ddp_sharded", optimizer="adam", shuffle=False)[1]
    record["straight"] = state(straight)
    trainer, module, _ = fit(rank, "ddp_sharded", optimizer="adam", shuffle=False, epochs=1,
                             enable_checkpointing=True, default_root_dir=str(out / "sharded"))
    record["one_epoch_state"] = state(module)
    trainer.save_checkpoint(out / "after_fit.ckpt")  # the process group is gone: rank 0 writes alone
    last = next((out / "sharded").rglob("last.ckpt"))  # where the loop writes it (<root>/.../checkpoints)
    record["last_ckpt"] = str(last)
    ddp_one = fit(rank, "ddp", optimizer="adam", shuffle=False, epochs=1)[2]
    record["ddp_one_epoch_optimizer"] = ddp_one["optimizer_state"]
    for strategy in ("ddp", "ddp_sharded"):
        resumed = fit(rank, strategy, optimizer="adam", shuffle=False, ckpt_path=str(last))[1]
        record[f"resumed_{strategy}"] = state(resumed)

    torch.save(record, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
