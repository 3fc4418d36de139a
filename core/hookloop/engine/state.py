"""``trainer.state``: the loop's state, in one object.

:class:`LoopState` is what the loop, the session and the observers read and write while
a run goes on (what used to be some thirty private ``Trainer`` attributes): the loop's
position beyond ``current_epoch``/``global_step``/``batch_idx`` (which stay plain
``Trainer`` attributes, read on every step by plugins), the metrics ``self.log``
recorded, the run's events resolved once per run, the loaders ``fit`` iterates, and
what a resume needs. It is also Lightning's ``trainer.state`` (``fn``, ``stage``,
``status``, ``finished``), and compares equal to the running entry point's name
(``trainer.state == "fit"``).

``state_dict()``/``load_state_dict()`` are the loop position a checkpoint holds (its
``"loop"`` entry). Layer: above :mod:`hookloop.metrics`, below the step, the loop, the
session and the trainer; it imports none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hookloop.distributed.strategy import data_parallel_rank
from hookloop.engine.metrics import Metrics
from hookloop.resume.checkpoint import AsyncCheckpointWriter

# What does not travel when a spawn-based strategy pickles the trainer: hook callers
# (pluggy's hold the hook-spec module), and what is rebuilt in every run.
_NOT_PICKLED = ("on_before_optimizer_step", "on_before_zero_grad", "on_log_metrics",
                "loop_optimizer_cache", "backward_events", "fit_train_loader", "fit_val_loaders")


class LoopState:
    """The run state of one :class:`hookloop.Trainer` (``trainer.state``).

    Lightning's part: ``fn`` (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``; kept
    after the run), ``stage`` (``"train"``, ``"sanity_check"``, ``"validate"``,
    ``"test"``, ``"predict"``; ``None`` outside a run), ``status`` (``"initializing"``,
    ``"running"``, ``"finished"``, ``"interrupted"``) and ``finished``. It compares equal
    to the running entry point's name during a run, ``None`` outside one.

    The loop's part (public attributes, for the core and for plugins that need them):

    * ``loop_stage``: how far the loop got after ``trainer.batch_idx`` batches of the
      epoch: ``"train"``, ``"validated"`` or ``"epoch_end"`` (saved in checkpoints);
    * ``total_batch_idx``: training batches run in this fit, across epochs;
    * ``fetched_batch_idx``: the last training batch fetched (``fit_loop.batch_idx``);
    * ``epoch_val_metrics``: the last validation's metrics in this epoch;
    * ``epoch_row``: the epoch's row for the loggers, until logged;
    * ``epoch_rng``: the random generators' state at the epoch's start (a mid-epoch
      resume draws the epoch's shuffle from it);
    * ``metrics``: what ``self.log`` recorded (:class:`hookloop.engine.metrics.Metrics`);
    * ``current_batch``: the batch being run (for ``self.log``'s batch size);
    * ``logged_metrics``/``logged_step``: what went to the loggers, and at which step;
    * ``after_validation``: functions called after each validation of ``fit``, once
      its position is ``"validated"`` (the checkpoint observer saves there);
    * ``ckpt_path``, ``verbose``, ``return_predictions``: the entry point's arguments;
    * the events resolved once per run (``on_before_optimizer_step``,
      ``on_before_zero_grad``, ``on_log_metrics``, ``backward_events``,
      ``module_epoch_end``), the loaders ``fit`` iterates (``fit_train_loader``,
      ``fit_val_loaders``) and their saved positions (``loader_resume_state``,
      ``loader_state_pending``), the SIGTERM handler (``preemption``), the run directory
      (``log_dir``, ``run_index``), the background checkpoint writer
      (``checkpoint_writer``), manual optimization's optimizers and clipping requests
      (``loop_optimizer_cache``, ``clip_requests``) and what prediction writers read
      (``prediction_writing``).
    """

    def __init__(self, trainer: Any, run_index: int = 0):
        self._trainer = trainer
        self.fn: str | None = None
        self.status = "initializing"
        self.metrics = Metrics(trainer)
        self.loop_stage = "train"
        self.total_batch_idx = 0
        self.fetched_batch_idx = 0
        self.epoch_val_metrics: dict[str, float] = {}
        self.epoch_row: dict | None = None
        self.epoch_rng: dict | None = None
        self.current_batch: Any = None
        self.train_batch_size: int | None = None
        self.logged_step = 0
        self.logged_metrics: dict[str, float] = {}
        self.after_validation: list = []
        self.ckpt_path: Any = None
        self.verbose = True
        self.return_predictions = True
        self.accumulation_scheduled = False
        # resolved once per run (session), read on the step path
        self.on_before_optimizer_step = None
        self.on_before_zero_grad = None
        self.on_log_metrics = None
        self.backward_events: tuple | None = None  # manual_backward's, resolved per fit
        self.module_epoch_end = None
        # the training loader fit iterates, and its saved / pending position (loader_state)
        self.fit_train_loader: Any = None
        self.fit_val_loaders: list | None = None
        self.loader_resume_state: dict | None = None
        self.loader_state_pending: Any = None
        self.preemption = None
        self.prediction_writing = None
        self.loop_optimizer_cache: list | None = None
        self.clip_requests: dict[int, tuple] = {}
        # the optimizer whose configure_gradient_clipping runs now: self.clip_gradients clips now
        self.clipping_optimizer: Any = None
        # ModelCheckpoint(async_save=True)'s background writes: one at a time, waited for by
        # every synchronous save (save_checkpoint) so files are written in the order asked
        self.checkpoint_writer = AsyncCheckpointWriter()
        # This Trainer's run directory (rundir.py): decided in its first run, kept after.
        self.log_dir: Path | None = None
        #: what rank 0 claimed: [run directory, each logger's or None] (adopt_run_dirs)
        self.run_dirs: list | None = None
        self.run_index = run_index

    # -- Lightning's trainer.state -------------------------------------------------------

    @property
    def stage(self) -> str | None:
        if self.status != "running":
            return None
        if self.fn != "fit":
            return self.fn
        if self._trainer.sanity_checking:
            return "sanity_check"
        return "validate" if self.metrics.stage == "validate" else "train"

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def stopped(self) -> bool:
        return self.status == "interrupted"

    def _running(self) -> str | None:
        return self.fn if self.status == "running" else None

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, LoopState):
            return other is self
        return self._running() == other

    def __hash__(self) -> int:
        return hash(self._running())

    def __repr__(self) -> str:
        return f"LoopState(fn={self.fn!r}, stage={self.stage!r}, status={self.status!r})"

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The loop's position, as a checkpoint's ``"loop"`` entry.

        ``stage`` says how far the loop got after ``batch_idx`` batches of ``epoch``
        (``loop_stage``). ``world_size``, ``replicas`` (data-parallel: a tp group is one),
        ``batch_size``, ``accumulate_grad_batches``
        and ``epoch_batches`` say what the position means in samples, for a resume on
        another number of processes (checkpoints without them are taken as written on
        the world size that resumes them)."""
        trainer = self._trainer
        return {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "batch_idx": trainer.batch_idx,
            "stage": self.loop_stage,
            "total_batch_idx": self.total_batch_idx,
            "epoch_val_metrics": dict(self.epoch_val_metrics),
            "world_size": trainer.world_size,
            "replicas": data_parallel_rank(trainer)[0],  # the processes that split the data
            "batch_size": self.train_batch_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "epoch_batches": getattr(trainer, "num_training_batches", None),
        }

    def load_state_dict(self, loop: dict) -> None:
        """Take the position of a checkpoint's ``"loop"`` entry (older checkpoints may
        lack ``batch_idx``, ``stage``, ``total_batch_idx``, ``epoch_val_metrics``)."""
        trainer = self._trainer
        trainer.current_epoch = int(loop["epoch"])
        trainer.global_step = int(loop["global_step"])
        trainer.batch_idx = int(loop.get("batch_idx", 0))
        self.loop_stage = loop.get("stage", "train")
        self.total_batch_idx = int(loop.get("total_batch_idx", 0))
        self.epoch_val_metrics = dict(loop.get("epoch_val_metrics") or {})

    # -- pickling, for strategies that send the trainer to spawned workers ---------------

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in _NOT_PICKLED:
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for key in _NOT_PICKLED:
            self.__dict__.setdefault(key, None)
