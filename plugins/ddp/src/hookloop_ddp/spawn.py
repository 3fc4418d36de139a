"""The ``ddp_spawn`` strategy: ``ddp`` under the core's ``spawn`` launcher.

For notebooks and scripts that cannot be re-run by a launcher: ``fit`` starts the worker
processes itself (:class:`hookloop.distributed.launchers.Spawn`), and when it returns the caller's
module and trainer hold what rank 0's run produced (``hookloop.adopt_worker_result``: the
weights, the metrics, ``global_step``/``current_epoch``, the run directory, the checkpoint
paths). The same as ``plugins=["ddp", "spawn"]``; kept as one name because Lightning users
write ``strategy="ddp_spawn"``.
"""

from __future__ import annotations

from typing import Any

import hookloop
from hookloop.distributed.launchers import START_METHODS, Spawn

from .strategy import DDP


class DDPSpawn(DDP):
    """``ddp`` whose processes are started by ``fit`` with ``torch.multiprocessing``.

    Takes every :class:`DDP` option, and ``start_method``: ``"spawn"`` (default: fresh
    interpreters, safe with threads and CUDA), ``"forkserver"``, or ``"fork"`` (Linux and
    macOS; lets a notebook's own classes reach the workers, but must not be used after
    CUDA was initialised in the calling process). The launcher is the core's ``spawn``
    (``hookloop_launcher``); a launcher named beside it (``plugins=["ddp_spawn", "ray"]``)
    replaces it.
    """

    hookloop_name = "ddp_spawn"
    _OPTIONS = DDP._OPTIONS + ("start_method",)

    def __init__(self, start_method: str = "spawn", **ddp_options: Any):
        self.start_method = start_method
        super().__init__(**ddp_options)

    @property
    def hookloop_launcher(self) -> Spawn:
        """The core's ``spawn`` launcher with this strategy's ``start_method``, named as the
        user named the strategy in its messages."""
        return Spawn(start_method=self.start_method, label=self.hookloop_name)

    def _check_option(self, name: str, value: Any) -> None:
        if name == "start_method":
            if value not in START_METHODS:
                raise hookloop.ConfigurationError(
                    f"{self.hookloop_name} option start_method={value!r} must be 'spawn', "
                    f"'fork' or 'forkserver'"
                )
            return
        super()._check_option(name, value)
