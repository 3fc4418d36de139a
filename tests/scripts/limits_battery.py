"""max_time, OnExceptionCheckpoint and nan_guard under 2 processes, in one run.

Run by tests/test_limits.py as ``hookloop run --plugins ddp --devices 2 limits_battery.py
OUT``. Every rank writes ``OUT/rank<R>.pt`` with what it saw; the test compares it with a
hand-written loop over the batches each rank trained on.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import tiny_data  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])

# Collectives started from Python (DDP's gradient all-reduce is not one: it is the same
# with and without the guard), counted per training step.
CALLS = {"n": 0}
ORIGINALS = {}  # put back at the end: the job's next scripts run in these processes
for _name in ("all_reduce", "broadcast", "all_gather", "barrier", "broadcast_object_list", "all_gather_object",
              "reduce", "gather", "scatter"):
    _original = ORIGINALS[_name] = getattr(dist, _name)

    def _counted(*args, _original=_original, **kwargs):
        CALLS["n"] += 1
        return _original(*args, **kwargs)

    setattr(dist, _name, _counted)


class Net(hookloop.Module):
    """Linear 8 -> 3, SGD: the test replays its steps by hand."""

    def __init__(self, nan_at=None, raise_at=None, time_up=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 3)
        self.nan_at, self.raise_at, self.time_up = nan_at, raise_at, time_up or {}
        self.batches, self.calls_at_step = [], []

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        self.calls_at_step.append(CALLS["n"])
        self.agreements = self.trainer.state.preemption.agreements  # the stop agreement's boundaries so far
        if step == self.raise_at:
            raise RuntimeError(f"boom at step {step} on rank {RANK}")
        if self.time_up.get(step) == RANK:  # this rank's clock says the time is up
            next(p for p in self.trainer.plugins if isinstance(p, hookloop.Timer))._offset = 1e9
        x, y = batch
        self.batches.append((x.clone(), y.clone()))
        loss = F.cross_entropy(self.net(x), y)
        if step == self.nan_at and RANK == 1:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(name, **kw):
    kw = {"max_epochs": 2, "enable_checkpointing": False, **kw}
    return hookloop.Trainer(default_root_dir=str(OUT / name), logger=False, enable_progress_bar=False,
                            enable_model_summary=False, **kw)


def loader():
    return DataLoader(tiny_data(64), batch_size=8)  # 2 ranks x 4 batches of 8 per epoch


def weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


record = {}

# 1. max_time: rank 1's clock is up after step 1 (ignored: rank 0's decides), rank 0's after
#    step 3. The ranks agree every 2 steps: rank 0's vote goes into boundary 4's all-reduce,
#    read at boundary 6: every rank stops there, global_step 6.
module = Net(time_up={1: 1, 3: 0})
t = trainer("max_time", max_time="00:01:00:00", stop_check_every_n_steps=2)
t.fit(module, loader())
record["max_time"] = {"global_step": t.global_step, "calls": module.calls_at_step}

# 1b. max_time beside nan_guard: both ride the one all-reduce of the step (nan_guard's,
#     before the optimizer step, carries rank 0's clock); NaN on rank 1 at step 2 skipped,
#     rank 0's time up after step 5: every rank stops with global_step 6
module = Net(nan_at=2, time_up={5: 0})
guard = hookloop.NanGuard(action="skip")
t = trainer("max_time_guard", max_time="00:01:00:00", callbacks=[guard])
t.fit(module, loader())
record["max_time_guard"] = {"global_step": t.global_step, "calls": module.calls_at_step, "skipped": guard.skipped_steps}

# 2. the plain run: the reference of the resume, and the collectives per step without the guard
module = Net()
t = trainer("plain")
t.fit(module, loader())
record["plain"] = {"weights": weights(module), "calls": module.calls_at_step, "global_step": t.global_step,
                   "agreements": list(module.agreements)}

# 3. nan_guard skip: rank 1's loss is NaN at step 3 only
module = Net(nan_at=3)
guard = hookloop.NanGuard(action="skip")
t = trainer("skip", callbacks=[guard])
t.fit(module, loader())
record["skip"] = {"weights": weights(module), "batches": module.batches, "calls": module.calls_at_step,
                  "global_step": t.global_step, "events": guard.events, "skipped": guard.skipped_steps}

# 4. nan_guard stop
module = Net(nan_at=3)
guard = hookloop.NanGuard(action="stop")
t = trainer("stop", callbacks=[guard], enable_checkpointing=True)
t.fit(module, loader())
record["stop"] = {"weights": weights(module), "global_step": t.global_step, "events": guard.events,
                  "log_dir": str(t.log_dir)}

# 5. OnExceptionCheckpoint: every rank raises at step 5; the checkpoint resumes to the plain run
module = Net(raise_at=5)
t = trainer("exception", callbacks=[hookloop.OnExceptionCheckpoint(OUT / "exception", "crash")])
try:
    t.fit(module, loader())
    raised = None
except RuntimeError as exc:
    raised = str(exc)
path = OUT / "exception" / "crash.ckpt"
module = Net()
t = trainer("resumed")
t.fit(module, loader(), ckpt_path=str(path))
record["exception"] = {"raised": raised, "saved_step": torch.load(path, weights_only=False)["loop"]["global_step"],
                       "weights": weights(module), "global_step": t.global_step}

torch.save(record, OUT / f"rank{RANK}.pt")
for _name, _original in ORIGINALS.items():
    setattr(dist, _name, _original)
