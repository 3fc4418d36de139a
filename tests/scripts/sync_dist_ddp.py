"""``self.log(..., sync_dist=True)`` with ``on_step`` and ``on_epoch`` on 2 processes: the
epoch value is reduced once, from each rank's local values; the same module under
pytorch-lightning's ddp, the reference.

Run in the shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2
sync_dist_ddp.py OUT``), read by tests/test_defects_metrics.py (whose module it uses).
Every rank writes ``OUT/rank<R>.pt``: its rank and each framework's ``callback_metrics``.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from jobs import begin_battery  # noqa: E402
import pytorch_lightning as pl  # noqa: E402  the reference (tests only)
from test_defects_metrics import STEPS_PER_RANK, _quiet, sync_logged_class  # noqa: E402

OUT, RANK = begin_battery()  # tests/jobs.py: a watchdog, the output folder as working directory

# Lightning's ddp makes its default process group with torch's own key names, the same
# for every group a process makes; the launcher's store (torchelastic's agent store,
# which every group of this job's workers shares) still holds an earlier script's keys
# under those names, so Lightning's ranks would meet stale peers. The group is made here
# first, with keys of its own (hookloop.init_process_group), and Lightning, finding one,
# uses it (as it does any group made before its fit); a launch of its own had no earlier
# keys. Released after, as hookloop's own groups are.

loader = DataLoader(TensorDataset(torch.arange(2.0 * 2 * STEPS_PER_RANK).unsqueeze(1)), batch_size=2)
out = {}
with warnings.catch_warnings():  # _quiet's filters for this script only, not the next script
    trainer = hookloop.Trainer(plugins=["ddp"], max_epochs=1, default_root_dir=str(OUT / "hl"),
                               enable_checkpointing=False, enable_progress_bar=False, logger=False)
    trainer.fit(sync_logged_class(hookloop.Module)(), loader)
    out["hookloop"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    hookloop.init_process_group("gloo", RANK, int(os.environ["WORLD_SIZE"]))  # see above
    _quiet()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(OUT / "pl"))
    trainer.fit(sync_logged_class(pl.LightningModule)(), loader)
    out["lightning"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
out["rank"] = RANK
del trainer
gc.collect()  # Lightning's DDP wrapper goes while the process group it holds still exists
hookloop.release_process_group()
torch.save(out, OUT / f"rank{RANK}.pt")
