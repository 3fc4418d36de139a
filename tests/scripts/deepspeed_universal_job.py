"""Digits with Adam, stopped and resumed on another number of processes
(tests/test_deepspeed_universal.py).

    python -m torch.distributed.run --standalone --nproc-per-node N \
        deepspeed_universal_job.py OUT --strategy NAME --steps S [--ckpt PATH]

Trains scikit-learn's digits (batches of 32 per process) with torch's Adam and a
per-step StepLR for ``S`` optimizer steps under ``NAME`` (``ddp``, ``deepspeed_stage_1``,
``deepspeed_stage_2`` or ``deepspeed_stage_3`` with every parameter partitioned), resuming
from ``PATH`` when given; ``last.ckpt`` is written where it stops, under ``OUT/root``.
Global rank 0 writes ``OUT/state.pt``: the whole model and optimizer state (fp32 weights,
Adam's two moments and step count per parameter, gathered across ranks with DeepSpeed's
``safe_get_full_*`` helpers; a ddp rank holds them whole) once the run has restored its
checkpoint (``start``) and when it ends (``end``), the learning rate and loss of every step.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import hookloop

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from digits import DigitsClassifier, digits_datasets  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(540, exit=True)  # a hang fails the test with the stacks (2 busy cores: slow, not hung)
parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--strategy", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--ckpt", default=None)
parser.add_argument("--precision", default="32")
parser.add_argument("--hidden", type=int, default=64)  # wider: the conversion's cost on a larger model
ARGS = parser.parse_args()

# ZeRO-3 keeps parameters below this many elements whole on every rank; 0 partitions all
# of them (the digits model is tiny), so the conversion has partitions to join.
STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class AdamDigits(DigitsClassifier):
    def __init__(self, hidden: int):
        super().__init__(hidden=hidden)
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        self.lrs.append(float(self.lr_schedulers().get_last_lr()[0]))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        # Halves the rate every 10 steps: a resume that restarted the schedule would show.
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def full_state(trainer) -> dict:
    """Every parameter's fp32 weights, Adam moments and step, whole (collective under ZeRO)."""
    module, optimizer = trainer.module, trainer.optimizer
    state = {}
    if ARGS.strategy == "ddp":
        for name, p in module.named_parameters():
            held = optimizer.state.get(p, {})
            state[name] = {"fp32": p.detach().clone(), **{k: torch.as_tensor(v).clone() for k, v in held.items()}}
        return state
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from hookloop_deepspeed import memory

    base = memory.base_optimizer(optimizer)
    # One flat group per param group: every parameter's step is its group's.
    steps = {float(s["step"]) for s in base.state.values() if "step" in s}
    step = steps.pop() if len(steps) == 1 else float("nan") if steps else None
    for name, p in module.named_parameters():
        entry = {"fp32": safe_get_full_fp32_param(p).clone()}
        for key in ("exp_avg", "exp_avg_sq") if trainer.global_step else ():  # none before the first step
            value = safe_get_full_optimizer_state(p, key)
            if value is not None:
                entry[key] = value.clone()
        if step is not None:
            entry["step"] = torch.tensor(step)
        state[name] = entry
    return state


class Recorder:
    hookloop_name = "recorder"
    hookloop_role = "observer"

    def __init__(self):
        self.result: dict = {"losses": []}

    @hookloop.hookimpl
    def on_train_start(self, trainer):
        self.result["start"] = full_state(trainer)
        self.result["start_step"] = trainer.global_step

    @hookloop.hookimpl
    def on_train_batch_end(self, loss):
        self.result["losses"].append(float(loss))

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        self.result["end"] = full_state(trainer)
        self.result["global_step"] = trainer.global_step
        self.result["world_size"] = trainer.world_size


hookloop.seed_everything(0)
train, val = digits_datasets()
module = AdamDigits(ARGS.hidden)
recorder = Recorder()
strategy = (hookloop.plugin("deepspeed_stage_3", config=STAGE3) if ARGS.strategy == "deepspeed_stage_3"
            else ARGS.strategy)
trainer = hookloop.Trainer(plugins=[strategy, recorder], max_steps=ARGS.steps, max_epochs=-1, precision=ARGS.precision,
                           default_root_dir=str(ARGS.out / "root"), num_sanity_val_steps=0,
                           enable_progress_bar=False, devices=hookloop.env_int("WORLD_SIZE", default=1))
trainer.fit(module, DataLoader(train, batch_size=32, shuffle=True), ckpt_path=ARGS.ckpt)
if trainer.global_rank == 0:
    torch.save({**recorder.result, "lrs": module.lrs}, ARGS.out / "state.pt")
