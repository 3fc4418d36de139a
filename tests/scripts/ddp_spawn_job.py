"""``hookloop run --plugins ddp_spawn --devices 2 ddp_spawn_job.py OUT`` (tests/test_ddp_spawn.py).

The script runs once; ``fit`` and ``validate`` each spawn two workers. Afterwards this,
the calling process, writes what its own module and trainer hold to ``OUT/parent.pt``.
"""

import os
import sys
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402


class SyncedTiny(TinyModule):
    """TinyModule whose validation metrics are reduced across ranks."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    print(f"hookloop-test: script body ran in process {os.getpid()}", flush=True)
    module = SyncedTiny(seed=0)
    val = DataLoader(tiny_data(40, seed=2), batch_size=5)
    checkpoint = hookloop.ModelCheckpoint(monitor="val_loss", save_top_k=1, save_last=True)
    trainer = hookloop.Trainer(max_epochs=2, callbacks=[checkpoint], default_root_dir=str(out))
    trainer.fit(module, DataLoader(tiny_data(96), batch_size=8, shuffle=True), val)
    record = {
        "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "callback_metrics": dict(trainer.callback_metrics),
        "logged_metrics": dict(trainer.logged_metrics),
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        # what the workers wrote, as the caller's trainer names it (issue 36: the caller
        # claimed a second, empty version_N+1 when it read log_dir)
        "log_dir": str(trainer.log_dir),
        "versions": sorted(p.name for p in (out / "logs").iterdir()),
        "best_model_path": checkpoint.best_model_path,
        "best_model_score": checkpoint.best_model_score,
        "last_model_path": checkpoint.last_model_path,
    }
    (record["validate"],) = hookloop.Trainer().validate(module, val)
    torch.save(record, out / "parent.pt")
