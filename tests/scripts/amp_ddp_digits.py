"""Digits under ddp on the launcher's processes, fp32 then bf16-mixed; rank 0 prints both.

Run in the shared ddp job (tests/jobs.py), read by tests/test_amp.py:

    hookloop run --plugins ddp --devices 2 tests/scripts/amp_ddp_digits.py OUT EPOCHS

The runs' root directory is the working directory, OUT.
"""

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import hookloop

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from digits import DigitsClassifier, digits_datasets  # noqa: E402

OUT, epochs = Path(sys.argv[1]), int(sys.argv[2])
os.chdir(OUT)  # the runs' default root (the job driver puts the working directory back)
threads = torch.get_num_threads()
torch.set_num_threads(1)  # two ranks on two cores
for precision in ("32", "bf16-mixed"):
    hookloop.seed_everything(0)
    train, val = digits_datasets()
    trainer = hookloop.Trainer(max_epochs=epochs, precision=precision, enable_checkpointing=False)
    trainer.fit(DigitsClassifier(), DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=128))
    names = [getattr(p, "hookloop_name", type(p).__name__) for p in trainer.plugins]
    trainer.print(f"RESULT {precision} world={trainer.world_size} plugins={','.join(names)} "
                  f"val_acc={trainer.callback_metrics['val_acc']:.6f}", flush=True)
torch.set_num_threads(threads)  # the next script's as it was
