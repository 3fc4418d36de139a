"""A training script for ``hookloop run --devices 2`` (tests/test_defects_launch.py).

``launch_code_strategy.py OUT code``: the script names its strategy in code
(``Trainer(plugins=["ddp"])``) and the command line names none. ``... OUT cli``: the
script names none and the command line gives ``--plugins ddp``. Every process that
trains writes ``OUT/rank<R>.pt``: its world size, rank, strategy and final weights.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, state_of, tiny_data  # noqa: E402


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    plugins = ["ddp"] if mode == "code" else []
    trainer = hookloop.Trainer(plugins=plugins, max_epochs=2, num_sanity_val_steps=0,
                               enable_checkpointing=False, logger=False, enable_progress_bar=False)
    module = TinyModule(seed=0)
    trainer.fit(module, DataLoader(tiny_data(64), batch_size=8))
    record = {
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "strategy": getattr(trainer.strategy, "hookloop_name", None),
        "global_step": trainer.global_step,
        "pid_rank_env": os.environ.get("RANK"),
        "state": state_of(module),
    }
    torch.save(record, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
