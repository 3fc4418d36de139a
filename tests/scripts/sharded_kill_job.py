"""A small deterministic job with sharded checkpoint directories, killed inside a save
(tests/test_sharded_atomic.py).

Run as ``hookloop run --plugins deepspeed_stage_2 --devices 2 --max-restarts 1
sharded_kill_job.py OUT [--fault KIND] [--save-top-k K]``. 64 samples, 2 ranks, batches
of 8: 4 steps per epoch, 8 in all; a checkpoint every 2 steps. In the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0) the script wraps a library function, so that the kill
lands at an exact point of the real save (the product code has no hook for it):

* ``--fault last-rename``: global rank 0 sends itself SIGKILL when ``last.ckpt`` is
  about to be installed as a directory (``os.rename``/``os.replace`` onto it) for the
  second time (step 4: a ``last.ckpt`` of step 2 exists), i.e. after the old one was
  moved (or removed) and before the new one takes its name;
* ``--fault shard-write``: global rank 1 writes half of its ZeRO optimizer shard of tag
  ``global_step4`` (``torch.save`` wrapped), waits until global rank 0 has written its
  own shards and reached the barrier after them, then sends itself SIGKILL.
* ``--fault dcp-background-write`` (fsdp ``state_dict_type="sharded"`` with
  ``--async-save``): global rank 1 sends itself SIGKILL in DCP's background thread, when
  it starts writing its shards of the step-4 tag (``FileSystemWriter.write_data``
  wrapped), while the training thread has gone on.

The elastic agent restarts both workers, which resume by themselves. Every rank appends
the global step of each optimizer step to ``OUT/steps.rank<R>.attempt<A>``; global rank
0 saves the final weights to ``OUT/weights.pt``.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import TinyClassifier, tiny_dataset, weights

faulthandler.enable()
faulthandler.dump_traceback_later(120, exit=True)
parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--fault", default="none", choices=["none", "last-rename", "shard-write", "dcp-background-write"])
parser.add_argument("--save-top-k", type=int, default=1)
parser.add_argument("--async-save", action="store_true")
ARGS = parser.parse_args()
OUT = ARGS.out
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))
FAULTY = ATTEMPT == 0 and ARGS.fault != "none"
RANK0_AT_BARRIER = OUT / "rank0_at_barrier"


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if FAULTY and ARGS.fault == "last-rename" and RANK == 0:
    installs = []

    def killing(real):
        def rename(src, dst, *args, **kwargs):
            if Path(dst).name == "last.ckpt" and Path(src).is_dir():
                installs.append(dst)
                if len(installs) == 2:
                    (OUT / "killed_at_rename").write_text(f"{src} -> {dst}\n")
                    die()
            return real(src, dst, *args, **kwargs)
        return rename

    os.rename, os.replace = killing(os.rename), killing(os.replace)

if FAULTY and ARGS.fault == "shard-write":
    real_save = torch.save
    state = {"rank0_shards_done": False}

    def save(obj, f, *args, **kwargs):
        name = Path(f).name if isinstance(f, (str, os.PathLike)) else ""
        in_tag = isinstance(f, (str, os.PathLike)) and Path(f).parent.name == "global_step4"
        if RANK == 1 and in_tag and name.startswith("zero_pp_rank_1_"):
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            with open(f, "wb") as out:  # half a shard, as a kill in the middle of the write leaves
                out.write(data[: len(data) // 2])
            (OUT / "killed_in_shard").write_text(
                f"{f}: {len(data) // 2} of {len(data)} bytes ({threading.current_thread().name})\n")
            deadline = time.monotonic() + 60
            while not RANK0_AT_BARRIER.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            die()
        result = real_save(obj, f, *args, **kwargs)
        if RANK == 0 and in_tag and name.startswith("zero_pp_rank_0_"):
            state["rank0_shards_done"] = True
        return result

    real_barrier = dist.barrier

    def barrier(*args, **kwargs):
        if state["rank0_shards_done"] and not RANK0_AT_BARRIER.exists():
            RANK0_AT_BARRIER.write_text("rank 0 wrote its shards of global_step4 and waits at a barrier\n")
        return real_barrier(*args, **kwargs)

    torch.save, dist.barrier = save, barrier


if FAULTY and ARGS.fault == "dcp-background-write" and RANK == 1:
    import torch.distributed.checkpoint.filesystem as dcp_fs

    real_write_data = dcp_fs.FileSystemWriter.write_data

    def write_data(writer, plan, planner):
        if Path(str(writer.path)).parent.name == "step4":
            (OUT / "killed_in_background_write").write_text(f"{writer.path} ({threading.current_thread().name})\n")
            die()
        return real_write_data(writer, plan, planner)

    dcp_fs.FileSystemWriter.write_data = write_data


class Job(TinyClassifier):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        trainer = self.trainer
        with open(OUT / f"steps.rank{trainer.global_rank}.attempt{ATTEMPT}", "a") as f:
            f.write(f"{trainer.global_step}\n")


module = Job(seed=0)
trainer = hookloop.Trainer(
    max_epochs=2, default_root_dir=str(OUT / "root"), num_sanity_val_steps=0,
    callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=2, save_top_k=ARGS.save_top_k,
                                        async_save=ARGS.async_save)],
)
trainer.fit(module, DataLoader(tiny_dataset(64), batch_size=8, shuffle=True))
if trainer.global_rank == 0:
    torch.save(weights(module), OUT / "weights.pt")
    print(f"done: epoch {trainer.current_epoch}, global step {trainer.global_step}", flush=True)
