"""A plain training script for ``hookloop tune`` (tests/test_tuner.py): its fit is where
the finder runs; "trained" printed would mean the script went on past it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hookloop  # noqa: E402
from tuner_job import Regression  # noqa: E402

model = Regression(oom_rank=0 if "--oom" in sys.argv else None)
trainer = hookloop.Trainer(max_epochs=1, enable_progress_bar=False, enable_model_summary=False,
                           use_distributed_sampler=False)
trainer.fit(model)
print("trained", flush=True)
