"""One attempt of a single-process job for tests/test_checkpoint_integrity.py.

``python integrity_job.py ROOT OUT``: trains ``Scripted`` (7 batches an epoch) for 2
epochs, or ``MAX_STEPS`` steps, with ``ModelCheckpoint(every_n_train_steps=4,
every_n_epochs=0, save_top_k=SAVE_TOP_K)`` under ROOT, and writes the final weights to
OUT. With ``HOOKLOOP_RUN_ID`` fixed and ``TORCHELASTIC_RESTART_COUNT=1`` a second
attempt is a restarted worker: it resumes from the run's ``last.ckpt``.

Faults, each a real process at the real point:

* ``KILL_AT=S``: SIGKILL this process inside the save at global step S, when the temporary
  file of ``last.ckpt`` is written and fsynced and is about to be renamed over it
  (``os.replace``, patched in this process only).
* ``FSIZE_AT=S``: at step S, before the save, limit the size of any file this process
  writes (``RLIMIT_FSIZE``) to half of the current ``last.ckpt`` (SIGXFSZ ignored, so the
  write fails with EFBIG: the disk filling up mid-write).
"""

import os
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import hookloop  # noqa: E402
from test_observers import Scripted, train_loader  # noqa: E402

root, out = Path(sys.argv[1]), Path(sys.argv[2])
trainer = None

if os.environ.get("KILL_AT"):
    kill_at, real_replace = int(os.environ["KILL_AT"]), os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst).name == "last.ckpt" and str(src).endswith(".tmp") and trainer.global_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace


class LimitFileSize:
    hookloop_role = "observer"

    @hookloop.hookimpl(tryfirst=True)
    def on_train_batch_end(self, trainer):
        if trainer.global_step == int(os.environ["FSIZE_AT"]):
            size = (Path(trainer.log_dir) / "checkpoints" / "last.ckpt").stat().st_size
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))


torch.manual_seed(0)
limits = {"max_steps": int(os.environ["MAX_STEPS"])} if os.environ.get("MAX_STEPS") else {"max_epochs": 2}
callbacks = [hookloop.ModelCheckpoint(every_n_train_steps=4, every_n_epochs=0,
                                      save_top_k=int(os.environ.get("SAVE_TOP_K", "1")))]
if os.environ.get("FSIZE_AT"):
    callbacks.append(LimitFileSize())
trainer = hookloop.Trainer(default_root_dir=str(root), logger=True, enable_progress_bar=False, callbacks=callbacks,
                           **limits)
module = Scripted()
trainer.fit(module, train_loader())
torch.save({"state_dict": module.state_dict(), "steps": sorted(module.step_losses)}, out)
