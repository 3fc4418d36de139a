"""ddp_sharded with each optimizer class of torch.optim, against ddp, in one 2-process run.

Run by tests/test_defects_launch.py as
``hookloop run --plugins ddp_sharded --devices 2 sharded_optimizers.py OUT``; the ddp runs
name ``ddp`` in code (code wins over ``--plugins``). Every rank writes ``OUT/rank<R>.pt``:
per optimizer and strategy, the final weights, the optimizer that stepped and the
hyperparameters of its parameter groups. An optimizer that ddp_sharded refuses is
recorded with its error instead (the test fails on it), so one refusal does not hide
the others.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from fairscale_sharded_battery import DATA, Net, state  # noqa: E402

# Non-default options where a class has them, so that each must reach the re-created one.
OPTIMIZERS = {
    "SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": dict(lr=0.01, amsgrad=True, weight_decay=0.01),
    "AdamW": dict(lr=0.01, weight_decay=0.1),
    "Adamax": dict(lr=0.02, weight_decay=0.01),
    "Adadelta": dict(lr=1.0, rho=0.8),
    "Adagrad": dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "ASGD": dict(lr=0.05, t0=2.0, lambd=1e-3),
    "NAdam": dict(lr=0.01, momentum_decay=0.005, decoupled_weight_decay=True, weight_decay=0.01),
    "RAdam": dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.01),
    "RMSprop": dict(lr=0.01, momentum=0.5, centered=True),
    "Rprop": dict(lr=0.01, etas=(0.4, 1.3)),
    "Adafactor": dict(lr=0.02, beta2_decay=-0.7),
    "Muon": dict(lr=0.02, momentum=0.9),  # 2-d parameters only: given the weights, the biases frozen
}


class ScaledSGD(torch.optim.SGD):
    """An SGD whose constructor scales the learning rate of the groups it is given: built
    again from its groups (as ddp_sharded builds each rank's shard), it would step with
    another learning rate than the optimizer configure_optimizers returned."""

    def __init__(self, params, lr=0.1, scale=0.5):
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group["lr"] = group["lr"] * scale


class OptimizerNet(Net):
    def __init__(self, seed: int, name: str):
        super().__init__(seed=seed)
        self.name = name

    def configure_optimizers(self):
        if self.name == "ScaledSGD":
            return ScaledSGD(self.parameters())
        parameters = list(self.parameters())
        if self.name == "Muon":
            for p in parameters:
                p.requires_grad_(p.ndim == 2)
            parameters = [p for p in parameters if p.ndim == 2]
        return getattr(torch.optim, self.name)(parameters, **OPTIMIZERS[self.name])


def hyperparameters(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


class Probe:
    hookloop_name, hookloop_role = "optimizer_probe", "observer"

    def __init__(self):
        self.seen: dict = {}

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        optimizer = trainer.optimizer
        inner = getattr(optimizer, "optim", optimizer)  # OSS steps this rank's partition with it
        self.seen = {"optimizer_type": type(optimizer).__name__, "inner_type": type(inner).__name__,
                     "groups": hyperparameters(optimizer), "inner_groups": hyperparameters(inner)}


def main() -> None:
    faulthandler.enable()
    faulthandler.dump_traceback_later(300, exit=True)  # a hang fails with the stacks
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    record: dict = {}
    for name in [*OPTIMIZERS, "ScaledSGD"]:
        record[name] = {}
        for strategy in ("ddp", "ddp_sharded"):
            probe = Probe()
            trainer = hookloop.Trainer(plugins=[strategy, probe], max_epochs=1, num_sanity_val_steps=0,
                                       enable_checkpointing=False, logger=False, enable_progress_bar=False)
            module = OptimizerNet(seed=rank, name=name)  # rank 0's weights must win
            try:
                trainer.fit(module, DataLoader(DATA, batch_size=8, shuffle=True))
            except hookloop.ConfigurationError as exc:  # the same on both ranks, before any collective
                record[name][strategy] = {"error": str(exc)}
                if dist.is_initialized():
                    dist.destroy_process_group()
                continue
            record[name][strategy] = {"state": state(module), "global_step": trainer.global_step, **probe.seen}
    torch.save(record, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
