"""One attempt of a single-process job for tests/test_async_save.py.

``python async_save_job.py ROOT OUT``: trains ``Scripted`` (7 batches an epoch) for
``MAX_STEPS`` steps (default 10) with ``ModelCheckpoint(every_n_train_steps=2,
every_n_epochs=0, async_save=ASYNC)`` under ROOT, and writes the final weights and
optimizer state to OUT. With ``HOOKLOOP_RUN_ID`` fixed and
``TORCHELASTIC_RESTART_COUNT=1`` a second attempt is a restarted worker: it resumes from
the run's ``last.ckpt``.

Faults, each a real process at the real point:

* ``SLOW_AT=S``: the background write of the checkpoint of step S stalls after its first
  chunk (the file object's ``write`` wrapped, in this process only): it writes
  ``ROOT/writing`` and sleeps, so the test can SIGKILL the process mid-write.
* ``FSIZE_AT=S``: at step S, before the save, limit the size of any file this process
  writes (``RLIMIT_FSIZE``) to half of the current ``last.ckpt`` (SIGXFSZ ignored, so the
  background write fails with EFBIG: the disk filling up mid-write).
"""

import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import hookloop  # noqa: E402
import hookloop.resume.checkpoint  # noqa: E402
from test_observers import Scripted, train_loader  # noqa: E402

root, out = Path(sys.argv[1]), Path(sys.argv[2])

if os.environ.get("SLOW_AT"):
    slow_name, real_write = f"step={int(os.environ['SLOW_AT'])}.ckpt", hookloop.resume.checkpoint._ChecksumWriter.write

    def write(self, data):
        written = real_write(self, data)
        # the background writer's thread is named after the file it writes
        if threading.current_thread().name.endswith(f"{slow_name})"):
            self.f.flush()
            (root / "writing").write_text(threading.current_thread().name)
            time.sleep(300)  # killed before this ends
        return written

    hookloop.resume.checkpoint._ChecksumWriter.write = write


class LimitFileSize:
    hookloop_role = "observer"

    @hookloop.hookimpl(tryfirst=True)
    def on_train_batch_end(self, trainer):
        if trainer.global_step == int(os.environ["FSIZE_AT"]):
            trainer.state.checkpoint_writer.wait()  # the save before this one is complete: it is not the one to fail
            size = (Path(trainer.log_dir) / "checkpoints" / "last.ckpt").stat().st_size
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))


torch.manual_seed(0)
callbacks = [hookloop.ModelCheckpoint(every_n_train_steps=2, every_n_epochs=0,
                                      async_save=os.environ.get("ASYNC", "1") == "1")]
if os.environ.get("FSIZE_AT"):
    callbacks.append(LimitFileSize())
trainer = hookloop.Trainer(default_root_dir=str(root), logger=True, enable_progress_bar=False, callbacks=callbacks,
                           max_steps=int(os.environ.get("MAX_STEPS", "10")), enable_model_summary=False)
module = Scripted()
try:
    trainer.fit(module, train_loader())
except hookloop.CheckpointError:
    print(f"fit failed at global step {trainer.global_step}", flush=True)
    raise
torch.save({"state_dict": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
            "steps": sorted(module.step_losses)}, out)
