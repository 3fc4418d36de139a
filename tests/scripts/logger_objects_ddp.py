"""Logger objects (``Trainer(logger=[TensorBoardLogger(...), CSVLogger(...)])``) on 2
processes: only rank 0 writes, into rank 0's directories.

Run in the shared ddp job (tests/jobs.py: ``hookloop run --plugins ddp --devices 2
logger_objects_ddp.py OUT``), read by tests/test_logger_objects.py (whose module and data
it uses). The loggers' root, also the working directory, is ``OUT/root`` (nothing else is
written there, so the test can tell that rank 1 wrote nothing anywhere). Every rank writes
``OUT/rank<R>.pt``: its rank, run directory, loggers' versions and experiment, global step.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
import hookloop_tensorboard  # noqa: E402
from test_logger_objects import loaders, make_module  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
ROOT = OUT / "root"
ROOT.mkdir(exist_ok=True)
os.chdir(ROOT)  # as the test's own processes had (the job driver puts it back)
root = str(ROOT)

module = make_module(hookloop.Module, histogram=True)
loggers = [hookloop_tensorboard.TensorBoardLogger(root, name="ddp_tb"), hookloop.CSVLogger(root, name="ddp")]
trainer = hookloop.Trainer(plugins=["ddp"], devices=2, accelerator="cpu", max_epochs=1, log_every_n_steps=1,
                           logger=loggers, enable_progress_bar=False, enable_checkpointing=False,
                           default_root_dir=root, num_sanity_val_steps=0)
trainer.fit(module, *loaders())
torch.save({"rank": trainer.global_rank, "log_dir": str(trainer.log_dir), "versions": [lg.version for lg in loggers],
            "experiment": type(loggers[0].experiment).__name__, "global_step": trainer.global_step},
           OUT / f"rank{RANK}.pt")
