"""A model that tp splits into another function (a fused q/k/v projection split
contiguously), trained under ``hookloop run --plugins tp --devices 2``: the self-check
(tp.verify) must stop the run at the start of fit, on every rank, with one error (the
launch exits non-zero; no rank waits for the other). Run by tests/test_tp.py."""

from __future__ import annotations

import sys
from pathlib import Path

from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from jobs import begin_battery  # noqa: E402
from tp_models import FusedNet, data  # noqa: E402

OUT, RANK = begin_battery()
trainer = hookloop.Trainer(max_steps=4, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                           num_sanity_val_steps=0)
trainer.fit(FusedNet(), DataLoader(data(), batch_size=4))
(OUT / f"trained{RANK}").write_text(str(trainer.global_step))  # not reached: the check stops fit
