"""``OnExceptionCheckpoint``: Lightning's callback that writes a checkpoint when ``fit``
(or ``validate``/``test``/``predict``) raises.

On the ``on_exception`` event (any exception but ``KeyboardInterrupt``/``SystemExit``:
hookloop sends the event for neither; a SIGTERM has its own checkpoint, hookloop.faults),
``trainer.save_checkpoint(dirpath/filename.ckpt)`` is called, then the exception goes on.
The checkpoint holds the loop's position at the failing batch: the optimizer steps done
(``global_step``) and the batch to run next, so ``fit(ckpt_path=...)`` resumes with the
batch that raised. A run that ends without an exception removes the file (as Lightning's
``teardown``), so a stale one does not outlive a successful resume.

Several processes: saving is collective (every rank calls it; rank 0 writes, then a
barrier). When every rank raises at the same point (a deterministic error: bad data, a
shape error), every rank saves and the checkpoint is written. An exception raised on one
rank only cannot start a collective save: the other ranks are inside a collective of the
step (DDP's gradient all-reduce) and the failing rank's save would meet that collective,
not theirs. Lightning (which calls the same save on the failing rank) has the same limit;
here the others then fail within ``process_group_timeout`` and the elastic agent's
restart resumes from the last periodic or preemption checkpoint instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from hookloop.contract.errors import ConfigurationError
from hookloop.contract.hookspecs import hookimpl


class OnExceptionCheckpoint:
    """Write a checkpoint when a run raises.

    dirpath: the directory of the checkpoint (required: an exception can come at any time,
        before a run directory exists)
    filename: its name without the extension (default ``"on_exception"``: ``on_exception.ckpt``)
    """

    hookloop_name = "on_exception_checkpoint"
    hookloop_role = "observer"
    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception"):
        if not filename:
            raise ConfigurationError("OnExceptionCheckpoint(filename=...): the filename cannot be empty")
        if dirpath is None or str(dirpath) == "":
            raise ConfigurationError("OnExceptionCheckpoint(dirpath=...): give the directory to write the checkpoint to")
        self.dirpath = dirpath
        self.filename = filename

    @property
    def ckpt_path(self) -> str:
        """``dirpath/filename.ckpt``."""
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    @hookimpl
    def on_exception(self, trainer, exception):
        if trainer.state.fn == "fit" and not trainer.optimizers:
            return  # nothing to save yet (fit failed before configure_optimizers)
        Path(self.dirpath).mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(self.ckpt_path)

    @hookimpl
    def teardown(self, trainer):
        # Lightning's teardown (not called after an exception) removes the file.
        if trainer.state.status == "interrupted" or not trainer.is_global_zero:
            return
        path = Path(self.ckpt_path)
        if path.is_dir():
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
