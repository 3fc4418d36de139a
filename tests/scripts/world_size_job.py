"""Digits under ddp, stopped and resumed on another number of processes
(tests/test_world_size_change.py).

Run as ``hookloop run --plugins ddp --devices N world_size_job.py OUT --epochs E
[--ckpt PATH] [--steps S]``: trains scikit-learn's digits (80/20 split, batches of 32
per process) up to epoch ``E`` (or ``S`` optimizer steps), resuming from ``PATH`` when
given; ``last.ckpt`` is written at every epoch end (and where ``--steps`` stops) under
``OUT/root``. Global rank 0 writes ``OUT/result.json``: the validation accuracy of the
final weights on the whole validation split (computed in that one process, so it is the
same number whatever the world size), the epoch and the global step.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import hookloop

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from digits import DigitsClassifier, digits_datasets  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(90, exit=True)  # a hang fails the test with the stacks
parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--ckpt", default=None)
parser.add_argument("--steps", type=int, default=None)
ARGS = parser.parse_args()

hookloop.seed_everything(0)
train, val = digits_datasets()
module = DigitsClassifier()
trainer = hookloop.Trainer(max_epochs=ARGS.epochs, max_steps=ARGS.steps, default_root_dir=str(ARGS.out / "root"),
                           num_sanity_val_steps=0, enable_progress_bar=False)
trainer.fit(module, DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=128),
            ckpt_path=ARGS.ckpt)
if trainer.global_rank == 0:
    with torch.no_grad():
        x, y = val.tensors
        acc = float((module(x).argmax(-1) == y).float().mean())
    (ARGS.out / "result.json").write_text(json.dumps(
        {"val_acc": acc, "epoch": trainer.current_epoch, "global_step": trainer.global_step}))
