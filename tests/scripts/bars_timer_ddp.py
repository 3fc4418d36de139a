"""The TQDM progress bar and the Timer on 2 processes: rank 0 draws, rank 1's bar is
disabled, and rank 0's clock stops every rank at the same step.

Run in the shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2
bars_timer_ddp.py OUT``), read by tests/test_bars_summary.py (whose module and data it
uses). The bar draws into a buffer (the fit's stdout, redirected), not the console. Every
rank writes ``OUT/rank<R>.pt``: whether its bar is enabled, its count, the global step and
whether it drew.
"""

from __future__ import annotations

import io
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from jobs import begin_battery  # noqa: E402
from test_bars_summary import _data, _module, frameworks  # noqa: E402

OUT, RANK = begin_battery()  # tests/jobs.py: a watchdog, the output folder as working directory

torch.manual_seed(0)
fw = frameworks.load("hookloop")
bar, timer = hookloop.TQDMProgressBar(), hookloop.Timer(duration="01:00:00:00", verbose=False)


class TimeUp(type(_module(fw))):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 0:
            timer._duration = 0.0  # rank 0's clock decides for both ranks
        return super().training_step(batch, batch_idx)


with tempfile.TemporaryDirectory() as root, redirect_stdout(io.StringIO()) as out:
    # the ranks agree on rank 0's clock at every step: its vote at boundary 2 is read at 3
    trainer = hookloop.Trainer(plugins=["ddp"], accelerator="cpu", default_root_dir=root, callbacks=[bar, timer],
                               max_epochs=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
                               stop_check_every_n_steps=1)
    trainer.fit(TimeUp(), DataLoader(_data(16), batch_size=2))
train = bar.train_progress_bar
torch.save({"enabled": bar.is_enabled, "n": train.n, "step": trainer.global_step, "drew": "Epoch 0" in out.getvalue()},
           OUT / f"rank{RANK}.pt")
