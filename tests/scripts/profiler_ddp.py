"""The profiler plugin on 2 processes: a trace per rank.

Run in the shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2
profiler_ddp.py OUT``), read by tests/test_profiler.py. wandb_job.py's run (16 samples in
batches of 4, 2 epochs) with the ``profiler`` plugin and its options ``wait=0, warmup=1,
active=2`` given in code (what ``--plugins ddp,profiler --plugin-option profiler.wait=0
--plugin-option profiler.warmup=1 --plugin-option profiler.active=2`` would set). Every
rank writes ``OUT/rank<R>.json``: its run directory and world size.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wandb_job  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
os.chdir(OUT)  # the working directory a launch of its own had (the job driver puts it back)

trainer = wandb_job.fit(str(OUT), plugins=["profiler"], epochs=2,
                        plugin_options={"profiler": {"wait": 0, "warmup": 1, "active": 2}})
(OUT / f"rank{RANK}.json").write_text(json.dumps({"log_dir": str(trainer.log_dir), "world_size": trainer.world_size}))
