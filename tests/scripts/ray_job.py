"""A small deterministic job for tests/test_ray.py, under any launcher.

``python ray_job.py OUT [--plugins ddp,ray] [--ray-option NAME=VALUE ...] [--devices N]
[--nodes N] [--fault step|save --at S]``: with ``--plugins``, ``fit`` in this plain process
(function mode, as Ray Train's ``TorchTrainer``); without, the plugins come from
``hookloop run`` (script mode, or the torchrun reference). 64 samples, batches of 8 over 2
ranks: 4 steps an epoch, 8 in all; ``last.ckpt`` every 2 steps under ``OUT/root``.

Faults, in the first attempt only (``HOOKLOOP_ATTEMPT`` 0), with SIGKILL to the worker's
Ray actor (its parent process; the worker dies with it):

* ``--fault step``: global rank 1, mid-step ``S`` (after its backward, before the
  optimizer step);
* ``--fault save``: global rank 0, inside the save of ``last.ckpt`` at step ``S`` (the
  temporary file written, about to be renamed over ``last.ckpt``).

Every rank writes its place (``RANK``, ``GROUP_RANK``... as ``KEY=VALUE`` lines) to
``OUT/place.rank<R>`` and appends ``STEP TIME`` for each optimizer step it takes to
``OUT/steps.rank<R>.attempt<A>``; the process that holds rank 0's weights at the end (the
worker, or the caller in function mode) saves them to ``OUT/weights.pt``.
"""

import argparse
import faulthandler
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.distributed.ranks import attempt
from hookloop.testing import TinyClassifier, tiny_dataset, weights

faulthandler.enable()
parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--plugins", default=None)
parser.add_argument("--ray-option", action="append", default=[])
parser.add_argument("--devices", type=int, default=None)
parser.add_argument("--nodes", type=int, default=None)
parser.add_argument("--fault", choices=["step", "save"], default=None)
parser.add_argument("--at", type=int, default=3)
parser.add_argument("--slow", type=float, default=0.0)
ARGS = parser.parse_args()
OUT = ARGS.out


def faulty() -> bool:
    return ARGS.fault is not None and attempt()[0] == 0


def kill_in_save(trainer) -> None:
    """Patch os.replace in this worker: SIGKILL its actor inside the save of last.ckpt at step S."""
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if (faulty() and Path(dst).name == "last.ckpt" and str(src).endswith(".tmp")
                and trainer.global_rank == 0 and trainer.global_step == ARGS.at):
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(30)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace


PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "HOOKLOOP_ATTEMPT", "HOOKLOOP_RUN_TOKEN")


class Job(TinyClassifier):
    def on_fit_start(self):
        # the worker's place as its launcher gave it, for the test to check
        place = {name: os.environ.get(name, "-") for name in PLACE}
        place["HOOKLOOP_TRAINER_DEFAULTS_SET"] = "1" if os.environ.get("HOOKLOOP_TRAINER_DEFAULTS") else "0"
        (OUT / f"place.rank{self.trainer.global_rank}").write_text("\n".join(f"{k}={v}" for k, v in place.items()))
        if ARGS.fault == "save":  # here, in the worker: in function mode the script does not run there
            kill_in_save(self.trainer)

    def on_after_backward(self):
        trainer = self.trainer
        if faulty() and ARGS.fault == "step" and trainer.global_rank == 1 and trainer.global_step == ARGS.at:
            os.kill(os.getppid(), signal.SIGKILL)  # the actor; this worker dies with it
            time.sleep(30)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        trainer = self.trainer
        with open(OUT / f"steps.rank{trainer.global_rank}.attempt{attempt()[0]}", "a") as f:
            f.write(f"{trainer.global_step} {time.time()}\n")
        time.sleep(ARGS.slow)


def value(text: str):
    """An option's value: JSON where it is JSON (1, {"CPU": 1}, null), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    module = Job(seed=0)
    settings = {}
    if ARGS.plugins:
        options = dict(item.split("=", 1) for item in ARGS.ray_option)
        options = {k: value(v) for k, v in options.items()}
        settings["plugins"] = [hookloop.plugin(n, **options) if n == "ray" else n for n in ARGS.plugins.split(",")]
    settings.update({k: v for k, v in (("devices", ARGS.devices), ("nodes", ARGS.nodes)) if v})
    trainer = hookloop.Trainer(
        max_epochs=2, default_root_dir=str(OUT / "root"), num_sanity_val_steps=0,
        enable_progress_bar=False, callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=2)], **settings)
    trainer.fit(module, DataLoader(tiny_dataset(64), batch_size=8, shuffle=True))
    if trainer.global_rank == 0:
        torch.save(weights(module), OUT / "weights.pt")
        print(f"done: global step {trainer.global_step}, run directory {trainer.log_dir}", flush=True)


if __name__ == "__main__":
    main()
