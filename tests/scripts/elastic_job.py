"""An elastic ddp job of 1 to 2 nodes that loses a node and gets it back (tests/test_elastic.py).

Run on each node as ``hookloop run --plugins ddp --nodes 1:2 --node-rank R --rdzv-endpoint
HOST:PORT ... elastic_job.py OUT``, with ``ELASTIC_NODE`` naming the node (``a``, ``b``)
and, on node b, ``ELASTIC_LEAVE_AT=K``: in the job's first rendezvous round its worker
writes ``OUT/leaving`` at the start of the batch after optimizer step K (step K's
``last.ckpt`` is written by then) and waits there for the test to SIGKILL its node. The
survivor's collective fails, its agent restarts it alone (round 1), and it resumes from
step K's checkpoint. Alone, it trains up to step ``ELASTIC_HOLD_AT`` and holds at its end
until its agent stops it (SIGTERM: the returned node is waiting in the rendezvous), so
that the steps each world size trains are known; hookloop then checkpoints that step,
and the two nodes resume from it together (round 2) and finish.

The data is split by the script itself (``use_distributed_sampler=False``) so that every
world size trains the same global batches: optimizer step s covers samples
``[s*G, (s+1)*G)`` (G = 8), cut into micro-batches of 2; with W processes and
``A = G / (2 W)`` accumulated batches, rank r's a-th micro-batch of the step is the
``(a W + r)``-th. A one-process loop over those global batches is the reference
(``elastic_batch='global'``: the accumulation is 2 on 2 nodes, 4 on one).

Every worker appends ``global_step world_size attempt accumulate node`` for each optimizer
step it takes to ``OUT/steps.<node>``; global rank 0 saves the final weights to
``OUT/weights.pt``.

Under hookloop-ray (tests/test_ray_elastic.py), whose workers get none of these variables
from the caller, they come as ``KEY=VALUE`` arguments after ``OUT``, and
``ELASTIC_LEAVE_RANK=R`` makes only global rank R leave; a worker's node is then named
``rank<R>``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import hookloop

faulthandler.enable()
faulthandler.dump_traceback_later(150, exit=True)  # a hang fails the test with the stacks

OUT = Path(sys.argv[1])
SETTINGS = {**os.environ, **dict(arg.split("=", 1) for arg in sys.argv[2:])}
NODE = SETTINGS.get("ELASTIC_NODE") or f"rank{os.environ.get('RANK', '0')}"
LEAVE_AT = int(SETTINGS.get("ELASTIC_LEAVE_AT", "0"))
LEAVE_RANK = SETTINGS.get("ELASTIC_LEAVE_RANK")
HOLD_AT = int(SETTINGS.get("ELASTIC_HOLD_AT", "0"))
ATTEMPT = int(os.environ.get("HOOKLOOP_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
GLOBAL, MICRO, STEPS = 8, 2, 12
STOPPING = {"term": False}


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL * STEPS, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


class GlobalBatches(Sampler):
    """Rank ``rank``'s share of every global batch, in micro-batch order (see above)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.accumulate = GLOBAL // (MICRO * world)

    def __iter__(self):
        for step in range(STEPS):
            for a in range(self.accumulate):
                start = step * GLOBAL + (a * self.world + self.rank) * MICRO
                yield from range(start, start + MICRO)

    def __len__(self) -> int:
        return STEPS * GLOBAL // self.world


class Net(hookloop.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_batch_start(self, batch, batch_idx):
        trainer = self.trainer
        leaving = LEAVE_RANK is None or int(LEAVE_RANK) == trainer.global_rank
        if (LEAVE_AT and leaving and ATTEMPT == 0 and trainer.global_step == LEAVE_AT
                and batch_idx % trainer.accumulate_grad_batches == 0):
            (OUT / "leaving").write_text(f"{os.getpid()}\n")
            time.sleep(120)  # the test kills this node meanwhile

    def on_train_batch_end(self, outputs, batch, batch_idx):
        trainer = self.trainer
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # not an optimizer step's last batch
        with open(OUT / f"steps.{NODE}", "a") as f:
            f.write(f"{trainer.global_step} {trainer.world_size} {ATTEMPT} {trainer.accumulate_grad_batches} {NODE}\n")
        if trainer.world_size == 1 and trainer.global_step == HOLD_AT:
            hold_until_stopped()


def hold_until_stopped() -> None:
    """Wait (at most 120 s) for the agent's SIGTERM, passed on to hookloop's handler (set
    during fit, before this one), which checkpoints at the step boundary and stops."""
    previous = signal.getsignal(signal.SIGTERM)

    def term(signum, frame):
        STOPPING["term"] = True
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, term)
    deadline = time.monotonic() + 120
    while not STOPPING["term"] and time.monotonic() < deadline:
        time.sleep(0.05)


world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
trainer = hookloop.Trainer(
    max_epochs=1, default_root_dir=str(OUT / "root"), num_sanity_val_steps=0, use_distributed_sampler=False,
    enable_progress_bar=False, enable_model_summary=False, stop_check_every_n_steps=1, global_batch_size=GLOBAL,
    callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=1)],
)
module = Net()
trainer.fit(module, DataLoader(data(), batch_size=MICRO, sampler=GlobalBatches(rank, world)))
if trainer.global_rank == 0:
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, OUT / "weights.pt")
    print(f"done: global step {trainer.global_step} on {trainer.world_size} process(es)", flush=True)
