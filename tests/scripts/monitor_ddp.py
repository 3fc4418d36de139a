"""device_stats and throughput on 2 processes: rank 0's training_step sleeps 20 ms, rank 1's 60 ms.

Run in the shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2
monitor_ddp.py OUT``), read by tests/test_monitor.py. The two plugins and their option
``every_n_steps=4`` are given in code (what ``--plugins ddp,device_stats,throughput
--plugin-option device_stats.every_n_steps=4 --plugin-option throughput.every_n_steps=4``
would set). Every rank writes ``OUT/rank<R>.json``: its callback_metrics, its pid and its
resident memory as /proc reads it after ``fit``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402

faulthandler.enable()  # a crash prints every thread
faulthandler.dump_traceback_later(120, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
DELAYS = (0.02, 0.06)  # seconds of sleep in each rank's training_step


class Sleepy(TinyModule):
    def training_step(self, batch, batch_idx):
        time.sleep(DELAYS[RANK])
        return super().training_step(batch, batch_idx)


def vmrss_mib() -> float:
    """This process's resident memory as the kernel reports it (not through psutil)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmRSS in /proc/self/status")


os.chdir(OUT)  # the working directory a launch of its own had (the job driver puts it back)
trainer = hookloop.Trainer(max_epochs=2, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=OUT,
                           plugins=["device_stats", "throughput"],
                           plugin_options={"device_stats": {"every_n_steps": 4}, "throughput": {"every_n_steps": 4}})
trainer.fit(Sleepy(), DataLoader(tiny_data(64), batch_size=4))  # 8 steps per rank and epoch
record = {
    "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    "vmrss_mib": vmrss_mib(),
    "pid": os.getpid(),
    "log_dir": str(trainer.log_dir),
    "world_size": trainer.world_size,
}
(OUT / f"rank{RANK}.json").write_text(json.dumps(record))
