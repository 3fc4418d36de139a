"""A small deterministic ddp job that may fault one of its workers (tests/test_faults.py).

Run as ``hookloop run --plugins ddp --devices 2 --max-restarts 1 restart_job.py OUT [AT]
[--fault KIND] [--rerun N] [--ckpt-last] [--timeout S] [--slow S] [--stop-every K]``
(``--stop-every``: ``Trainer(stop_check_every_n_steps=K)``, how often the ranks agree on
a SIGTERM; the default's 16 is more than the job's 8 steps).
With ``AT``, in the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0) of run 0 (``--rerun 0``):

* ``--fault kill`` (default): global rank 1 sends itself SIGKILL at the end of the batch
  that makes ``global_step == AT``;
* ``--fault term``: global rank 1 sends itself SIGTERM there (a preempted worker);
* ``--fault term-agent``: global rank 0 sends SIGTERM to its parent, the elastic agent,
  there; every later step then sleeps ``--slow`` seconds, so the SIGTERM the agent
  forwards arrives mid-epoch;
* ``--fault term-launcher``: the same, to the agent's parent, ``hookloop run`` (which
  passes it on to the agent);
* ``--fault stop``: global rank 1 sends itself SIGSTOP at the start of the batch after
  step ``AT`` (a rank that stops making progress).

The elastic agent then restarts both workers, which run this script again from the top.
There is no resume code here (``--ckpt-last`` passes ``ckpt_path="last"``, what a re-run
of a whole job passes): resuming is hookloop's job. Every rank appends the global step of
each optimizer step it takes to ``OUT/steps.rank<R>.attempt<A>`` (``OUT/steps.run<N>.
rank<R>.attempt<A>`` for ``--rerun N`` > 0); global rank 0 saves the final weights to
``OUT/weights.pt``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import TinyClassifier, tiny_dataset, weights

# A hang must fail the test with the stacks, not leave workers behind.
faulthandler.enable()
faulthandler.dump_traceback_later(90, exit=True)
parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("at", type=int, nargs="?")
parser.add_argument("--fault", default="kill", choices=["kill", "term", "term-agent", "term-launcher", "stop"])
parser.add_argument("--rerun", type=int, default=0)
parser.add_argument("--ckpt-last", action="store_true")
parser.add_argument("--timeout", type=float, default=None)
parser.add_argument("--slow", type=float, default=0.0)
parser.add_argument("--stop-every", type=int, default=None)
ARGS = parser.parse_args()
OUT, KILL_AT, FAULT = ARGS.out, ARGS.at, ARGS.fault
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FAULTY = KILL_AT is not None and ATTEMPT == 0 and ARGS.rerun == 0
STEPS = f"steps.run{ARGS.rerun}." if ARGS.rerun else "steps."


def parent_of(pid: int) -> int:
    """The parent process id of ``pid`` (Linux: field 4 of /proc/PID/stat, after the name)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


class Job(TinyClassifier):
    def on_train_batch_start(self, batch, batch_idx):
        trainer = self.trainer
        if FAULTY and FAULT == "stop" and trainer.global_rank == 1 and trainer.global_step == KILL_AT:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        trainer = self.trainer
        # The optimizer steps each attempt of each rank took, one line per step.
        with open(OUT / f"{STEPS}rank{trainer.global_rank}.attempt{ATTEMPT}", "a") as f:
            f.write(f"{trainer.global_step}\n")
        if not FAULTY:
            return
        if FAULT in ("term-agent", "term-launcher") and trainer.global_step >= KILL_AT:
            if trainer.global_rank == 0 and trainer.global_step == KILL_AT:
                agent = os.getppid()
                os.kill(agent if FAULT == "term-agent" else parent_of(agent), signal.SIGTERM)
            time.sleep(ARGS.slow)
        if trainer.global_rank != 1 or trainer.global_step != KILL_AT:
            return
        sys.stdout.flush()
        if FAULT == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif FAULT == "term":
            os.kill(os.getpid(), signal.SIGTERM)


# 64 samples, 2 ranks, batches of 8: 4 steps per epoch, 8 in all; last.ckpt every 2 steps.
module = Job(seed=0)
trainer = hookloop.Trainer(
    max_epochs=2, default_root_dir=str(OUT / "root"), num_sanity_val_steps=0,
    callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=2)],
    **({"process_group_timeout": ARGS.timeout} if ARGS.timeout else {}),
    **({"stop_check_every_n_steps": ARGS.stop_every} if ARGS.stop_every else {}),
)
trainer.fit(module, DataLoader(tiny_dataset(64), batch_size=8, shuffle=True),
            ckpt_path="last" if ARGS.ckpt_last else None)
if trainer.global_rank == 0:
    torch.save(weights(module), OUT / "weights.pt")
    print(f"done: epoch {trainer.current_epoch}, global step {trainer.global_step}", flush=True)
