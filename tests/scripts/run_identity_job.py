"""A job of tests/test_run_identity.py: trains 2 epochs with the default checkpoints under
ROOT and writes rank 0's run directory and final weights to OUT.

``run_identity_job.py ROOT OUT SEED`` runs as one node of a 2-node job (``hookloop run
--nodes 2 ...``) or as a plain ``python`` script; with ``CRASH_FIRST_ATTEMPT=1`` every
rank of the job's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) dies at the start of
epoch 1 (``last.ckpt`` of epoch 0 written), so the restarted attempt resumes from it.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
CRASH = os.environ.get("CRASH_FIRST_ATTEMPT") == "1" and ATTEMPT == 0


class Job(TinyModule):
    def on_train_batch_start(self, batch, batch_idx):
        if CRASH and self.trainer.current_epoch == 1:
            os._exit(3)


if __name__ == "__main__":
    root, out, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    module = Job(seed=seed)
    trainer = hookloop.Trainer(max_epochs=2, default_root_dir=root, enable_progress_bar=False,
                               enable_model_summary=False)
    trainer.fit(module, DataLoader(tiny_data(32, seed=seed), batch_size=8))
    if trainer.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, out / "final.pt")
        (out / "run.json").write_text(json.dumps({"log_dir": str(trainer.log_dir), "attempt": ATTEMPT}))
