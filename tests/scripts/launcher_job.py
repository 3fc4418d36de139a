"""A fit under a launcher named beside the strategy (tests/test_launchers.py).

``python launcher_job.py OUT PLUGINS [MAX_RESTARTS [CRASH_AT_STEP]]``: ``PLUGINS`` is a
comma-separated list (``ddp,spawn``, ``fsdp,spawn``); two devices, a checkpoint every
step. With ``CRASH_AT_STEP``, rank 1 of the first attempt (``HOOKLOOP_ATTEMPT`` 0) exits
at once when that step begins, as a killed worker does. The calling process writes what
its own module and trainer hold to ``OUT/parent.pt``, and which launcher ran to its
``launcher`` entry.
"""

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402


class CrashAt:
    """Rank 1 of the first attempt dies (os._exit, no cleanup) when step ``step`` begins."""

    hookloop_name, hookloop_role = "crash_at", "observer"

    def __init__(self, step: int):
        self.step = step

    @hookloop.hookimpl
    def on_train_batch_start(self, trainer, batch, batch_idx):
        if (trainer.global_step == self.step and trainer.global_rank == 1
                and os.environ.get("HOOKLOOP_ATTEMPT") == "0"):
            os._exit(3)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    plugins: list = sys.argv[2].split(",")
    max_restarts = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    if len(sys.argv) > 4:
        plugins.append(CrashAt(int(sys.argv[4])))
    module = TinyModule(seed=0)
    checkpoint = hookloop.ModelCheckpoint(every_n_train_steps=1, save_last=True)
    trainer = hookloop.Trainer(plugins=plugins, devices=2, max_epochs=2, callbacks=[checkpoint],
                               max_restarts=max_restarts, default_root_dir=str(out),
                               enable_progress_bar=False)
    trainer.fit(module, DataLoader(tiny_data(96), batch_size=8, shuffle=True))
    launchers = [p.hookloop_name for p in trainer.plugins if getattr(p, "hookloop_role", None) == "launcher"]
    torch.save({"state": {k: v.detach().clone() for k, v in module.state_dict().items()},
                "global_step": trainer.global_step, "launchers": launchers,
                "log_dir": str(trainer.log_dir)}, out / "parent.pt")
