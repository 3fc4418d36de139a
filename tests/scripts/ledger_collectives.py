"""Run in the shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2
ledger_collectives.py OUT``), read by tests/test_ledger.py: a plugin calls
``torch.distributed.all_reduce`` twice per training batch; every rank writes its ledger's
rows to ``OUT/rank<R>.json``. Then the stop agreement (hookloop.faults) in the core's row:
the same fit, with the ledger alone, at ``stop_check_every_n_steps`` auto (the default), 4
and 2; the ledger counts steps 2 and 6 of the 8 (``OUT/agreement<K>.rank<R>.json``)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
os.chdir(OUT)  # the working directory a launch of its own had (the job driver puts it back)


class TwoAllReduces:
    hookloop_name = "two_all_reduces"
    hookloop_role = "observer"

    def __init__(self):
        self.tensor = torch.ones(1)

    @hookloop.hookimpl
    def on_train_batch_end(self):
        dist.all_reduce(self.tensor)
        dist.all_reduce(self.tensor)


ledger = hookloop.Ledger()
trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(OUT / "root"), enable_progress_bar=False,
                           enable_checkpointing=False, logger=False, plugins=[ledger, TwoAllReduces()])
trainer.fit(TinyModule(), DataLoader(tiny_data(64), batch_size=4))  # 8 batches per rank
(OUT / f"rank{RANK}.json").write_text(json.dumps({"rows": ledger.rows, "log_dir": str(trainer.log_dir),
                                                  "timed": ledger._timed, "counted": ledger._counted}))



class Schedule:
    """Keeps the fit's agreement boundaries (``Preemption.agreements``: where the ranks agreed)."""

    hookloop_name = "schedule"
    hookloop_role = "observer"
    agreements: list = []

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer):
        self.agreements = trainer.state.preemption.agreements


for every in (None, 4, 2):
    ledger, schedule = hookloop.Ledger(print_table=False), Schedule()
    # a root of its own: without a logger the run directory is default_root_dir itself
    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(OUT / f"root-{every}"), enable_progress_bar=False,
                               enable_checkpointing=False, logger=False, plugins=[ledger, schedule],
                               **({"stop_check_every_n_steps": every} if every else {}))
    trainer.fit(TinyModule(), DataLoader(tiny_data(64), batch_size=4))
    (OUT / f"agreement{every or 'default'}.rank{RANK}.json").write_text(json.dumps(
        {"rows": ledger.rows, "counted": ledger._counted, "every": trainer.config.stop_check_every_n_steps,
         "agreements": list(schedule.agreements)}))
