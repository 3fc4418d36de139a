"""``checkpoint``: Lightning's ModelCheckpoint, as a built-in observer.

Saves through ``trainer.save_checkpoint`` (so every strategy writes its own format) into
``<run dir>/checkpoints/``: the ``save_top_k`` best checkpoints by ``monitor`` (or the
latest ones without a monitor) named by ``filename``, and ``last.ckpt``. When, as
Lightning 2 decides: after each validation run of every ``every_n_epochs``-th epoch
(mid-epoch ones too, with ``val_check_interval < 1``) when validation runs more or less
often than once per epoch, else at the end of every ``every_n_epochs``-th epoch (after
its validation); every ``every_n_train_steps`` optimizer steps (a save whose monitored
metric no validation has produced yet waits for the next validation); at the end of
training when it stopped inside an epoch (``max_steps``, ``trainer.should_stop``).
``last.ckpt`` also at every epoch's end, in the run directory's ``checkpoints/`` (what
``ckpt_path="last"`` and a restart load; in ``dirpath`` too only with ``save_last=True``,
as Lightning); the ``last.ckpt`` it replaces is kept as ``last.prev.ckpt``
(every file ends with a SHA-256 checksum, see :mod:`hookloop.checkpoint`). Under several
processes global rank 0's metric values decide what is saved and how it is named. Its
bookkeeping (the best paths and scores) travels in the checkpoints, so a resumed run
continues it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Literal, get_type_hints

from hookloop.resume import sharded_store, storage
from hookloop.resume.checkpoint import LAST, NONFINITE, PREVIOUS, _write_checkpoint, atomic_copy, atomic_copy_tree, deferred_writes
from hookloop.contract.errors import CheckpointError, ConfigurationError
from hookloop.contract.hookspecs import hookimpl
from hookloop.contract.pluginspec import plugin_name
from hookloop.distributed.ranks import rank_zero_info

_GROUP = re.compile(r"\{([A-Za-z_][\w.]*)([:}])")


class ModelCheckpoint:
    """Save checkpoints as a run trains (built in: ``no:checkpoint`` or
    ``enable_checkpointing=False`` turn it off; pass your own instance to configure it:
    ``Trainer(callbacks=[hookloop.ModelCheckpoint(monitor="val_acc", mode="max")])``).

    dirpath: where checkpoints go (default: ``<run dir>/checkpoints``)
    filename: the template of top-k names, with metric values: ``"{epoch}-{val_acc:.3f}"``
        (default ``"{epoch}-{step}"``); with auto_insert_metric_name each becomes
        ``name=value`` (``epoch=3-val_acc=0.912.ckpt``), as in Lightning
    monitor: the metric that ranks checkpoints (None: keep the latest ones)
    mode: "min" or "max": which values of monitor are better
    save_top_k: how many to keep (-1: all, 0: none but last.ckpt)
    save_last: None (default): hookloop's own ``last.ckpt`` (to resume from) in the run
        directory's ``checkpoints/`` at every save and epoch end, nothing more in
        ``dirpath`` (Lightning writes none); True: also ``last.ckpt`` in ``dirpath``, as
        Lightning's ``save_last=True``; ``"link"``: that ``last.ckpt`` is a symbolic link
        to the newest top-k checkpoint (a file while none was saved), as Lightning's;
        False: no ``last.ckpt`` anywhere (no resume file)
    save_on_exception: when ``fit`` raises, save a checkpoint named by ``filename`` (and
        ``last.ckpt``) first, as Lightning's (False): not in a ``fast_dev_run`` or the
        sanity check, nor at a step whose checkpoint was saved
    enable_version_counter: a name already taken in ``dirpath`` (another run's file) gets
        ``-v1``, ``-v2``... (``STARTING_VERSION`` first), as Lightning's; False: written over
    every_n_epochs: save in every n-th epoch (0: never by epochs; None: 1, or 0 when
        every_n_train_steps or train_time_interval is given, as in Lightning)
    every_n_train_steps: save every n optimizer steps (None or 0: not by steps)
    train_time_interval: a ``datetime.timedelta``: save after the training batch at which
        that much time passed since the last such save (None: not by time). At most one of
        every_n_epochs, every_n_train_steps and train_time_interval, as in Lightning
    auto_insert_metric_name: write ``name=`` before each value in filename
    save_on_train_epoch_end: rank at training epochs' ends rather than after each
        validation (None: at epoch ends when validation runs once at every epoch's end or
        never, after each validation otherwise)
    async_save: write in a background thread: a save pauses training only to copy the
        state to new CPU memory (:func:`hookloop.resume.checkpoint.cpu_snapshot`); the write,
        fsync and rename (then last.ckpt's copy and the removal of pushed-out top-k
        files) follow in the background, one save at a time (a save waits for the one
        before). A failed background write raises ``CheckpointError`` at the next save or
        at the end of ``fit``. Strategies that write their own format (deepspeed, fsdp's
        sharded directories) save synchronously, with a warning
    """

    hookloop_name = "checkpoint"
    hookloop_role = "observer"
    #: Lightning's: the first version suffix of a name already taken (``name-v1.ckpt``)
    STARTING_VERSION = 1
    #: Lightning's name of the last checkpoint; only "last" (refused otherwise at setup)
    CHECKPOINT_NAME_LAST = "last"
    #: Lightning's: the extension of the files named by ``filename`` and of ``dirpath``'s
    #: ``last`` (a subclass may change it; hookloop's resume file stays ``last.ckpt``)
    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = None, monitor: str | None = None,
                 mode: str = "min", save_top_k: int = 1, save_last: bool | Literal["link"] | None = None, every_n_epochs: int | None = None,
                 every_n_train_steps: int | None = None, auto_insert_metric_name: bool = True,
                 save_on_train_epoch_end: bool | None = None, async_save: bool = False, save_on_exception: bool = False,
                 enable_version_counter: bool = True, train_time_interval: Any = None):
        # Lightning's refusals, with Lightning's words first
        if mode not in ("min", "max"):
            raise ConfigurationError(
                f"checkpoint `mode` can be min, max but got {mode}: mode={mode!r} must be 'min' (lower "
                f"{monitor or 'monitored value'} is better) or 'max'")
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise ConfigurationError(f"checkpoint: Invalid value for save_top_k={save_top_k!r}. Must be >= -1 "
                                     f"(-1: keep all, 0: none, k: the k best)")
        for name, n in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
                raise ConfigurationError(f"checkpoint: Invalid value for {name}={n!r}. Must be >= 0 (an integer; "
                                         f"0 or None: never by {name[8:].replace('_', ' ')})")
        if sum(bool(t) for t in (every_n_train_steps, every_n_epochs, train_time_interval is not None)) > 1:
            raise ConfigurationError(
                f"checkpoint: Combination of parameters every_n_train_steps={every_n_train_steps}, every_n_epochs="
                f"{every_n_epochs} and train_time_interval={train_time_interval} should be mutually exclusive: "
                f"give one of them (Lightning's rule)")
        if train_time_interval is not None and not hasattr(train_time_interval, "total_seconds"):
            raise ConfigurationError(
                f"checkpoint train_time_interval={train_time_interval!r} must be a datetime.timedelta "
                f"(timedelta(minutes=30)), or None")
        if monitor is None and save_top_k not in (-1, 0, 1):
            # Lightning's refusal: without a metric there is nothing to rank k checkpoints by.
            raise ConfigurationError(
                f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid configuration: no quantity "
                f"for top_k to track. Pass monitor='<a logged metric>' to keep the {save_top_k} best, save_top_k=-1 "
                f"to keep every checkpoint, or save_top_k=1 to keep the newest")
        every_n_train_steps = every_n_train_steps or None  # 0: not by steps, as Lightning
        if every_n_epochs is None:  # Lightning's default: by epochs unless by steps or time
            every_n_epochs = 1 if every_n_train_steps is None and train_time_interval is None else 0
        if save_last not in (None, True, False, "link"):
            raise ConfigurationError(f"checkpoint save_last={save_last!r} must be True, False, 'link' or None")
        if enable_version_counter not in (True, False):
            raise ConfigurationError(
                f"checkpoint enable_version_counter={enable_version_counter!r} must be True or False")
        if save_on_exception not in (True, False):
            raise ConfigurationError(f"checkpoint save_on_exception={save_on_exception!r} must be True or False")
        if save_on_train_epoch_end not in (None, True, False):
            raise ConfigurationError(
                f"checkpoint save_on_train_epoch_end={save_on_train_epoch_end!r} must be True, False or None")
        #: a URL given as dirpath (``s3://...``): written in its local staging directory and
        #: committed to the store (docs/how-to/object-storage.md); save_last="link" refused
        self._remote = str(dirpath) if dirpath and storage.is_url(dirpath) else None
        if self._remote:
            dirpath = str(storage.local_root(self._remote))
        elif dirpath:  # as Lightning: the absolute, resolved directory (setup resolves None)
            dirpath = os.path.realpath(os.path.expanduser(storage.local_path(dirpath)))
        self.dirpath, self.filename, self.monitor, self.mode = dirpath, filename, monitor, mode
        self._dirpath_given = dirpath is not None
        self.save_on_exception = save_on_exception
        self.enable_version_counter = enable_version_counter
        self.save_top_k, self.save_last = save_top_k, save_last
        self.every_n_epochs, self.every_n_train_steps = every_n_epochs, every_n_train_steps
        self.train_time_interval = train_time_interval
        self._last_time_checked: float | None = None  # train_time_interval: when it last saved (monotonic)
        self.auto_insert_metric_name = auto_insert_metric_name
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.async_save = async_save
        self._check_async_save()
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        #: Lightning's: the monitored value of the newest top-k save, and the worst kept
        #: checkpoint (the one the next better value pushes out) once k are kept
        self.current_score: Any = None  # a 0-d tensor, as Lightning's
        self.kth_best_model_path = ""
        self.kth_value: float = math.inf if mode == "min" else -math.inf
        self._last_checkpoint_saved = ""  # the newest top-k file written (save_last="link" points to it)
        #: the checkpoint this fit resumed from: never removed by top-k pruning (Lightning)
        self._resumed_from: str | None = None
        self.latest: list[str] = []  # without a monitor: the newest files, oldest first
        self.dir: Path | None = None
        #: where hookloop's own last.ckpt goes: the run directory's checkpoints/
        self.resume_dir: Path | None = None
        self._last_saved: tuple | None = None
        # every_n_train_steps: the global step it last saved at, so the micro-batches after
        # that optimizer step (accumulation) do not save again; in the checkpoint, so a
        # resume inside such a window does not either.
        self._last_global_step_saved: int | None = None
        #: Lightning's ``_last_global_step_saved``: the step of the newest file written for
        #: the user (top-k, or save_last's last.ckpt; not hookloop's resume file): no
        #: save_on_exception there (0: none before the first step either)
        self._step_saved_for_user = 0
        self._steps: Any = None
        self._validated = False  # a validation of this fit has run: the monitor must be there
        self._deferred = False  # a step's save waits for the next validation's metric
        self._warned_missing = False
        self._warned_names = False  # filename names a metric that was not logged
        self._async = False  # async_save, where this run's strategy allows it (setup)
        self._sharded = False  # this run's strategy writes checkpoint directories (setup)
        self._warned_nonfinite = False

    def _check_async_save(self) -> None:
        if self.async_save not in (True, False):
            raise ConfigurationError(
                f"checkpoint async_save={self.async_save!r} must be True or False")

    # -- the run --------------------------------------------------------------------------

    # pl_module: a Lightning subclass's override calls these hooks through super() with
    # Lightning's arguments (pluggy passes only trainer; the stage is then the run's)
    @hookimpl
    def setup(self, trainer, pl_module=None, stage=None):
        stage = trainer.state.fn if stage is None else stage
        if stage != "fit":
            return
        if self.CHECKPOINT_NAME_LAST != "last":
            raise ConfigurationError(
                f"ModelCheckpoint.CHECKPOINT_NAME_LAST={self.CHECKPOINT_NAME_LAST!r}: hookloop names the last "
                f"checkpoint last.ckpt (ckpt_path='last' and restarts find it by that name); leave it 'last' and copy "
                f"trainer.checkpoint_callback.last_model_path after fit to keep it under another name")
        if self.save_last == "link" and self._remote:
            raise ValueError(f"`ModelCheckpoint(save_last='link')` is only supported for local file paths, got "
                             f"`dirpath={self._remote}`: give a local directory")
        self._validated = self._deferred = False
        self._last_global_step_saved = None  # a new fit; a resume restores it after this
        self._step_saved_for_user = 0
        trainer.state.after_validation.append(self._after_validation)
        checkpoints = Path(trainer.log_dir) / "checkpoints"
        # hookloop's resume file lives in the run directory a logger gives the run; without
        # a logger (Lightning's layout, default_root_dir/checkpoints) only save_last writes
        # a last.ckpt, as Lightning's (docs/decisions.md, "A run without a logger")
        self.resume_dir = checkpoints if trainer.loggers else None
        self.dir = Path(self.dirpath) if self._dirpath_given else checkpoints
        # Lightning's ``dirpath`` after setup: the directory the checkpoints go to
        self.dirpath = str(self.dir)
        self._resumed_from = None
        sharded = self._sharded = getattr(trainer.strategy, "hookloop_checkpoint_format", "file") == "directory"
        for last in self._last_paths():
            if last.exists() and last.is_dir() != sharded:
                # Found now, not after an epoch of training at the first save.
                raise ConfigurationError(
                    f"{str(last)!r} is a {'directory' if last.is_dir() else 'file'}, and this run's strategy writes "
                    f"{'sharded checkpoint directories' if sharded else 'single-file checkpoints'}: use another "
                    f"checkpoint directory (ModelCheckpoint(dirpath=...)) or remove it"
                )
        self._check_async_save()  # also when set by --plugin-option checkpoint.async_save=...
        self._async = bool(self.async_save) and self._async_allowed(trainer, sharded)
        if self.every_n_train_steps or self.train_time_interval is not None:
            # Only runs that ask for it pay a call per step.
            self._steps = _SaveEverySteps(self)
            trainer.plugin_manager.register(self._steps, name="checkpoint.every_n_train_steps")

    def _async_allowed(self, trainer, sharded: bool) -> bool:
        """Whether saves can go to the background: each plugin that writes checkpoints
        itself (``save_checkpoint``) declares ``hookloop_async_save = True``: it writes
        only through :func:`hookloop.atomic_save` and nothing it does after that call
        needs the file on disk, or (checkpoint directories) it starts its own background
        writes when :func:`hookloop.deferring` and hands what must wait for them (the
        commit of its directory) to :func:`hookloop.defer`."""
        refusing = []
        for impl in trainer.plugin_manager.hook.save_checkpoint.get_hookimpls():
            plugin = impl.plugin
            if getattr(plugin, "hookloop_name", None) == "hookloop.defaults" or getattr(plugin, "hookloop_async_save", False):
                continue
            refusing.append(plugin_name(plugin))
        if refusing and trainer.is_global_zero:
            warnings.warn(
                f"checkpoint async_save=True: {', '.join(sorted(set(refusing)))} writes its checkpoints itself and "
                f"does not declare that they can be written in the background (hookloop_async_save); this run "
                f"saves synchronously", stacklevel=3)
        return not refusing

    @hookimpl
    def teardown(self, trainer):
        # The last background save is finished before the run is over. Its error is
        # raised, unless the run is already ending with one (then it is printed).
        try:
            trainer.state.checkpoint_writer.wait()
        except CheckpointError as exc:
            if trainer.state.status != "interrupted":
                raise
            warnings.warn(str(exc), stacklevel=2)
        if self._after_validation in trainer.state.after_validation:
            trainer.state.after_validation.remove(self._after_validation)
        steps, self._steps = self._steps, None
        if steps is not None:
            trainer.plugin_manager.unregister(steps)

    # trylast: as Lightning runs checkpoint callbacks after the others, so what they
    # changed at this event (an early-stopping count) is in the checkpoint.
    @hookimpl(trylast=True)
    def on_train_epoch_end(self, trainer, pl_module=None):
        epoch = trainer.current_epoch
        if self._saves_at_epoch_end(trainer) and self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer)
        elif self._last_paths():
            self.save(trainer, top_k=False)  # last.ckpt at every epoch's end (docs/decisions.md)

    @hookimpl
    def on_validation_end(self, trainer, pl_module=None):
        if trainer.state == "fit" and not trainer.sanity_checking:
            self._validated = True

    def _after_validation(self, trainer) -> None:
        """Called by the loop after each validation run of ``fit`` (its position is then
        "validated", so a resume from this checkpoint goes on with the next batch)."""
        if self._saves_at_epoch_end(trainer):
            return
        if self._deferred:  # a step's save that waited for this validation's metric
            self._deferred = False
            self.save(trainer)
        elif self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer)

    def _validation_enabled(self, trainer) -> bool:
        return bool(trainer.val_dataloaders) and trainer.config.limit_val_batches != 0

    def _saves_at_epoch_end(self, trainer) -> bool:
        """Lightning's choice between ranking at the training epoch's end and after each
        validation: at the end when validation runs at every epoch's end, or never."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if not self._validation_enabled(trainer):
            return True  # (Lightning: never at all when check_val_every_n_epoch != 1)
        config = trainer.config
        return config.check_val_every_n_epoch == 1 and config.val_check_interval == 1.0

    @hookimpl(trylast=True)
    def on_train_end(self, trainer, pl_module=None):
        """Training stopped inside an epoch: save where it stopped, so a resume continues
        at the next batch (a run with hookloop's resume file: without a logger, Lightning's
        layout, nothing more than Lightning saves)."""
        if self.resume_dir is not None and trainer.batch_idx and self._position(trainer) != self._last_saved:
            self.save(trainer)
        if self._async:  # the end of fit waits for the last background save (and its error)
            trainer.state.checkpoint_writer.wait()
            if self._sharded:  # every rank's: then rank 0's commit of the directory is done too
                trainer.barrier("checkpoint_async_committed")

    # -- saving ---------------------------------------------------------------------------

    def _position(self, trainer) -> tuple:
        return trainer.current_epoch, trainer.global_step, trainer.batch_idx, trainer.state.loop_stage

    def _candidate(self, trainer, quiet: bool = False) -> tuple[float | None, str] | None:
        """The monitored value and the file name as global rank 0 sees them, on every rank:
        ranks that logged different values (no ``sync_dist``) still agree on what to
        save, as they must (saving is collective). None: the monitored metric was not
        logged (yet)."""
        found: Any = None
        if trainer.is_global_zero:
            # Lightning's monitor candidates: the logged metrics, and "epoch"/"step" (the
            # run's own counters unless a metric of that name was logged)
            metrics = {"epoch": trainer.current_epoch, "step": trainer.global_step, **trainer.callback_metrics}
            if self.monitor is not None and self.monitor not in metrics:
                found = ("missing", f"ModelCheckpoint(monitor={self.monitor!r}) but no metric of that name was "
                                    f"logged (logged: {', '.join(sorted(trainer.callback_metrics)) or 'none'}): log it with "
                                    f"self.log({self.monitor!r}, ...) or monitor one of those")
            else:
                try:
                    value = None if self.monitor is None else float(metrics[self.monitor])
                    found = ("found", (value, self.format_name(trainer)))
                except ConfigurationError as exc:
                    found = ("error", str(exc))
        if trainer.world_size > 1:
            found = trainer.broadcast(found, 0)
        kind, detail = found
        if kind == "error":
            raise ConfigurationError(detail)
        if kind == "missing":
            if self._validated:  # a validation ran and did not log it
                raise ConfigurationError(detail)
            # Nothing has produced it yet (check_val_every_n_epoch > 1): nothing to rank
            # now, as in Lightning, which warns once.
            if quiet:
                return None
            if trainer.is_global_zero and not self._warned_missing:
                warnings.warn(f"{detail}; no validation has run yet, so no top-k checkpoint is saved now",
                              stacklevel=2)
            self._warned_missing = True
            return None
        return detail

    def format_name(self, trainer) -> str:
        """The filename template with this moment's epoch, step and metric values."""
        template = self.filename or "{epoch}-{step}"
        if self.auto_insert_metric_name:
            template = _GROUP.sub(lambda m: f"{m.group(1)}={{{m.group(1)}{m.group(2)}", template)
        values = _Values({k.replace("/", "_"): v for k, v in
                          {"epoch": trainer.current_epoch, "step": trainer.global_step, **trainer.callback_metrics}.items()})
        name = template.format_map(values)
        if values.missing and not self._warned_names and trainer.is_global_zero:
            # Lightning's: a name not logged (yet) is written as 0
            self._warned_names = True
            warnings.warn(
                f"checkpoint filename={self.filename!r} names {', '.join(map(repr, values.missing))}, which was not "
                f"logged (logged: {', '.join(sorted(trainer.callback_metrics)) or 'none'}): written as 0, as "
                f"Lightning does; log it with self.log(...) or take it out of the filename", stacklevel=3)
        return name if name.endswith(self.FILE_EXTENSION) else name + self.FILE_EXTENSION

    def _better(self, value: float, than: float) -> bool:
        return value < than if self.mode == "min" else value > than

    def save(self, trainer, top_k: bool = True, defer: bool = False) -> None:
        """Save now (every rank calls it: saving is collective): top-k, then last.ckpt.
        ``defer``: when no validation has produced the monitored metric yet, save nothing
        now and save after the next validation instead (Lightning's every_n_train_steps)."""
        position = self._position(trainer)
        if position == self._last_saved:
            return
        written, writes = None, []
        background: list | None = [] if self._async else None  # file operations after the write
        if top_k and self.save_top_k != 0:
            candidate = self._candidate(trainer, quiet=defer)
            if candidate is None and defer:
                self._deferred = True
                return
            value, name = candidate if candidate is not None else (None, "")
            if candidate is None:
                pass  # nothing to rank yet
            elif self.monitor is None or self._qualifies(value):
                if value is not None and math.isnan(value):
                    value = math.inf if self.mode == "min" else -math.inf  # as Lightning: kept as the worst
                # A file of that name that this save does not replace (another run's, in a
                # shared dirpath) is kept: this one gets -v1, -v2, ... (Lightning's versions)
                path = self._versioned(trainer, str(self.dir / name), self._replaced(value))
                drop = self._book(path, value)
                writes = self._write(trainer, path)
                written = self._last_checkpoint_saved = path
                self._step_saved_for_user = trainer.global_step
                self._remove(trainer, drop, background)
        self._last_saved = position
        lasts = self._last_paths()
        if lasts and self.save_last:  # Lightning's last.ckpt (not only hookloop's resume file)
            self._step_saved_for_user = trainer.global_step
        if lasts:
            if lasts[-1].parent == self.dir and self.dir != self.resume_dir:
                # dirpath's last.ckpt (save_last=True/"link"): versioned as the top-k files;
                # the one of this run (resumed: of the run it continues) is replaced
                lasts[-1] = Path(self._versioned(trainer, str(lasts[-1]), self.last_model_path))
                previous = self.last_model_path
                if previous and previous != str(lasts[-1]) and Path(previous).parent == self.dir:
                    self._remove(trainer, [previous], background, keep_last=False)
            self.last_model_path = str(lasts[-1])
            lasts = self._keep_finite_lasts(trainer, lasts)
        for last in lasts:
            link = (self.save_last == "link" and self.save_top_k != 0 and self._last_checkpoint_saved
                    and last.parent == self.dir and self.dir != self.resume_dir and last.name.startswith("last"))
            if link:
                self._link(trainer, self._last_checkpoint_saved, str(last), background)
            elif written is not None:
                self._copy(trainer, written, str(last), background)
            else:
                writes = self._write(trainer, str(last))
                written = str(last)
                if last.parent != self.resume_dir:  # dirpath holds what Lightning writes: no last.prev.ckpt
                    self._drop_previous(trainer, last, background)
        if background is not None and written is not None and (writes or background):
            if trainer.is_global_zero:
                dirs = log_dirs(trainer)
                background.append(lambda: storage.push_logs(dirs))
            trainer.state.checkpoint_writer.submit(
                _Job(writes, background, trainer.state.checkpoint_writer.spare,
                     commit=trainer.global_step if trainer.is_global_zero and not self._sharded else None), written)
        elif written is not None and trainer.is_global_zero:
            storage.push_logs(log_dirs(trainer))  # the logs reach a store at each checkpoint

    def _drop_previous(self, trainer, last: Path, background: list | None) -> None:
        """Remove the ``last.prev.ckpt`` that writing ``last`` (a ``last.ckpt``) kept beside
        it, outside hookloop's resume directory (rank 0; after the write in the background)."""
        previous = last.with_name(PREVIOUS)
        if last.name != LAST or not trainer.is_global_zero:
            return
        if background is not None:
            background.append(lambda: _remove_files([str(previous)]))
        else:
            _remove_files([str(previous)])

    def _keep_finite_lasts(self, trainer, lasts: list[Path]) -> list[Path]:
        """Where this save's ``last.ckpt`` copies go: ``lasts``, or, when the weights are
        not finite (NaN data without nan_guard) and a ``last.ckpt`` is there already,
        :data:`NONFINITE` beside it, so the last finite state stays the one resumed
        (docs/decisions.md, "Checkpoints"). Warns once per run."""
        if _weights_finite(trainer):
            return lasts
        kept = [last.with_name(NONFINITE) if os.path.lexists(last) else last for last in lasts]
        if kept != lasts and not self._warned_nonfinite and trainer.is_global_zero:
            self._warned_nonfinite = True
            resume = next(last for last, target in zip(lasts, kept) if target != last)
            try:
                from hookloop.resume.checkpoint import safe_load

                step = f" (global step {int(safe_load(resume)['loop']['global_step'])})" if resume.is_file() else ""
            except Exception:  # noqa: BLE001 - the warning only names the step where it can
                step = ""
            warnings.warn(
                f"the model's weights are not finite (NaN or inf) at global step {trainer.global_step}: "
                f"{str(resume)!r} keeps the last finite state{step}, and this one and later ones are written to "
                f"{str(resume.with_name(NONFINITE))!r}. Plugins=['nan_guard'] (hookloop.NanGuard) skips or stops "
                f"on a NaN loss before it reaches the weights", stacklevel=2)
        return kept

    def _write(self, trainer, path: str) -> list:
        """``trainer.save_checkpoint(path)``; with async_save, the ``atomic_save`` calls
        inside it only take their CPU snapshots: returned, to be written in the background."""
        if not self._async:
            trainer.save_checkpoint(path)
            if self._sharded:  # every rank: each machine uploads the shards on its disk
                sharded_store.commit_directory(trainer, path, trainer.global_step)
            elif trainer.is_global_zero:
                storage.sync_file(path, trainer.global_step)  # a staged directory's: committed to its store
            return []
        with deferred_writes(trainer.state.checkpoint_writer.spare) as writes:
            trainer.save_checkpoint(path)
        if self._sharded:  # after this rank's shard writes and the strategy's commit, in the background
            commit = sharded_store.commit_directory_later(trainer, path, trainer.global_step)
            if commit is not None:
                writes.append(commit)
        return writes

    def _last_paths(self) -> list[Path]:
        """Where ``last.ckpt`` goes: hookloop's resume file in the run directory (unless
        ``save_last=False``), and ``dirpath``'s with ``save_last=True`` (Lightning's)."""
        if self.save_last is False:
            return []
        paths = [] if self.resume_dir is None else [self.resume_dir / "last.ckpt"]
        if self.save_last and self.dir != self.resume_dir:
            paths.append(self.dir / f"last{self.FILE_EXTENSION}")
        return paths

    def _replaced(self, value: float | None) -> str | None:
        """The kept checkpoint a save of ``value`` takes the place of (Lightning's
        ``del_filepath``): a file of its name may be written over. Without a monitor, the
        newest one; with one, the k-th best once k are kept."""
        if value is None:
            return self.best_model_path or None
        if self.save_top_k != -1 and len(self.best_k_models) >= self.save_top_k and self.best_k_models:
            return self._worst()
        return None

    def _worst(self) -> str:
        pick = max if self.mode == "min" else min
        return pick(self.best_k_models, key=self.best_k_models.__getitem__)

    def _versioned(self, trainer, path: str, replaceable: str | None) -> str:
        """``path``, or ``<name>-v1.ckpt``, ``-v2``, ... while a file of that name exists
        and is not ``replaceable`` (Lightning's version counter). Global rank 0 looks, and
        every rank gets its answer (the name is part of a collective save)."""
        chosen = path
        if not self.enable_version_counter:
            return path  # Lightning's enable_version_counter=False: written over
        if trainer.is_global_zero:
            ext = self.FILE_EXTENSION
            stem, suffix = (path[:-len(ext)], ext) if path.endswith(ext) else (path, "")
            version = self.STARTING_VERSION
            while (os.path.lexists(chosen) or storage.exists_remote(chosen)) and chosen != replaceable:
                chosen = f"{stem}-v{version}{suffix}"
                version += 1
        if trainer.world_size > 1:
            chosen = trainer.broadcast(chosen, 0)
        return chosen

    def _qualifies(self, value: float) -> bool:
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        worst = max(self.best_k_models.values()) if self.mode == "min" else min(self.best_k_models.values())
        return self._better(value, worst)

    def _book(self, path: str, value: float | None) -> list[str]:
        """Record ``path`` before it is written (its own bookkeeping goes into it); return
        the paths it pushes out."""
        drop: list[str] = []
        if value is None:
            self.latest = [p for p in self.latest if p != path] + [path]
            if self.save_top_k != -1:
                while len(self.latest) > self.save_top_k:
                    drop.append(self.latest.pop(0))
            self.best_model_path = path
            return drop
        self.best_k_models[path] = value
        self.current_score = _tensor(value)
        if self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
            worst = self._worst()
            del self.best_k_models[worst]
            drop.append(worst)
        if self.save_top_k == -1 or len(self.best_k_models) == self.save_top_k:
            self.kth_best_model_path = self._worst()
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        best = min(self.best_k_models, key=self.best_k_models.get) if self.mode == "min" else max(
            self.best_k_models, key=self.best_k_models.get)
        self.best_model_path, self.best_model_score = best, self.best_k_models[best]
        return drop

    def _remove(self, trainer, paths: list[str], background: list | None = None, keep_last: bool = True) -> None:
        """Remove the checkpoints pushed out of the top k (rank 0). ``background``: a save
        in the background: queue the removal after the new file's write. As Lightning,
        never the checkpoint this fit resumed from, nor a file outside this directory."""
        if trainer.is_global_zero:
            resumed = os.path.abspath(self._resumed_from) if self._resumed_from else None
            paths = [p for p in paths if (p != self.last_model_path or not keep_last) and p not in self.best_k_models
                     and os.path.abspath(p) != resumed and Path(os.path.abspath(p)).parent == self.dir.absolute()]
            if background is not None:
                if paths:
                    background.append(lambda: _remove_files(paths))
                return
            _remove_files(paths)
        if background is None:
            trainer.barrier("checkpoint_remove")

    def _link(self, trainer, source: str, target: str, background: list | None = None) -> None:
        """``save_last="link"``: ``target`` becomes a relative symbolic link to ``source``
        (installed with a rename: a reader sees the old last.ckpt or the new link)."""
        def install() -> None:
            if os.path.abspath(source) == os.path.abspath(target):
                return
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            tmp = f"{target}.link-tmp"
            if os.path.lexists(tmp):
                os.remove(tmp)
            os.symlink(os.path.relpath(source, os.path.dirname(target)), tmp)
            os.replace(tmp, target)

        if trainer.is_global_zero:
            if background is not None:
                background.append(install)
                return
            install()
        if background is None:
            trainer.barrier("checkpoint_last")

    def _copy(self, trainer, source: str, target: str, background: list | None = None) -> None:
        """last.ckpt as a copy of the checkpoint just written (no second serialisation).
        ``background``: a save in the background (single files): queue the copy after the
        write."""
        if background is not None:
            if trainer.is_global_zero:
                keep = Path(target).parent == self.resume_dir
                if self._sharded:
                    background.append(lambda: atomic_copy_tree(source, target, keep_previous=keep))
                    background.append(lambda step=trainer.global_step: sharded_store.copy_committed(source, target, step))
                else:
                    background.append(lambda step=trainer.global_step: _copy_and_commit(source, target, keep, step))
            return
        if trainer.is_global_zero:
            src, dst = Path(source), Path(target)
            # The last.ckpt it replaces becomes last.prev.ckpt (hookloop's resume file only:
            # a user's dirpath holds what Lightning writes).
            keep = dst.parent == self.resume_dir
            if src.is_dir():  # a strategy's sharded directory: hard-linked, complete before installed
                atomic_copy_tree(src, dst, keep_previous=keep)
                sharded_store.copy_committed(src, dst, trainer.global_step)  # staged: copied on its store
            else:  # fsynced, checksum and all; a staged one committed to its store
                _copy_and_commit(src, dst, keep, trainer.global_step)
        trainer.barrier("checkpoint_last")

    # -- state ------------------------------------------------------------------------------

    @property
    def state_key(self) -> str:
        """Lightning's key of this callback's state in ``checkpoint["callbacks"]``."""
        every_n_epochs = self.every_n_epochs if self.every_n_train_steps is None else 0
        return "ModelCheckpoint" + repr({
            "monitor": self.monitor, "mode": self.mode, "every_n_train_steps": self.every_n_train_steps or 0,
            "every_n_epochs": every_n_epochs, "train_time_interval": self.train_time_interval})

    def state_dict(self) -> dict[str, Any]:
        """Lightning's state of a ModelCheckpoint (scores as tensors, as Lightning's)."""
        return {
            "monitor": self.monitor, "best_model_score": _tensor(self.best_model_score),
            "best_model_path": self.best_model_path, "current_score": _tensor(self.current_score),
            "dirpath": self.dirpath, "best_k_models": {p: _tensor(v) for p, v in self.best_k_models.items()},
            "kth_best_model_path": self.kth_best_model_path, "kth_value": _tensor(self.kth_value),
            "last_model_path": self.last_model_path,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's: the bookkeeping when ``dirpath`` is the one saved (else only
        ``best_model_path``, with a warning)."""
        saved_dir = state_dict.get("dirpath", self.dirpath)
        if self.dirpath == saved_dir:
            self.best_model_score = _float(state_dict["best_model_score"])
            self.kth_best_model_path = state_dict.get("kth_best_model_path", self.kth_best_model_path)
            self.kth_value = _float(state_dict.get("kth_value", self.kth_value))
            self.best_k_models = {p: _float(v) for p, v in state_dict.get("best_k_models", self.best_k_models).items()}
            self.last_model_path = state_dict.get("last_model_path", self.last_model_path)
        else:
            warnings.warn(
                f"The dirpath has changed from {saved_dir!r} to {self.dirpath!r}, therefore `best_model_score`, "
                f"`kth_best_model_path`, `kth_value`, `last_model_path` and `best_k_models` won't be reloaded. "
                f"Only `best_model_path` will be reloaded.", stacklevel=2)
        self.best_model_path = state_dict["best_model_path"]

    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Lightning's: write ``best_k_models`` (path: score) as YAML to ``filepath``
        (default: ``best_k_models.yaml`` in ``dirpath``)."""
        import yaml

        if filepath is None:
            if not self.dirpath:
                raise ConfigurationError(
                    "ModelCheckpoint.to_yaml() without a filepath writes into dirpath, which is set when fit starts: "
                    "pass to_yaml('<file>.yaml') or call it after fit")
            filepath = os.path.join(self.dirpath, "best_k_models.yaml")
        with open(filepath, "w") as out:
            yaml.dump({path: float(score) for path, score in self.best_k_models.items()}, out)

    @hookimpl
    def on_exception(self, trainer, exception):
        """``save_on_exception``: a checkpoint of where ``fit`` failed, named by
        ``filename`` (not ranked), and ``last.ckpt``, as Lightning's."""
        # As Lightning: not in a fast_dev_run or the sanity check, nor where a checkpoint
        # of this step was saved (hookloop's own resume last.ckpt does not count)
        if (not self.save_on_exception or trainer.config.fast_dev_run or trainer.state.fn != "fit"
                or trainer.sanity_checking or self.dir is None or self._step_saved_for_user == trainer.global_step):
            return
        path = self._versioned(trainer, str(self.dir / self.format_name(trainer)), None)
        trainer.save_checkpoint(path)
        self._last_saved = self._position(trainer)
        for last in self._last_paths():
            self._copy(trainer, path, str(last))
        if trainer.is_global_zero:
            rank_zero_info(f"An {type(exception).__name__} was raised with message: {exception}, saved checkpoint "
                           f"to {path}")

    @hookimpl
    def on_save_checkpoint(self, checkpoint):
        # Lightning's place too, so code that reads a Lightning checkpoint reads this one
        checkpoint.setdefault("callbacks", {})[self.state_key] = self.state_dict()
        checkpoint["plugins"][self.hookloop_name] = {
            "dir": str(self.dir) if self.dir else None, "monitor": self.monitor, "mode": self.mode,
            "best_k_models": dict(self.best_k_models), "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score, "last_model_path": self.last_model_path,
            "latest": list(self.latest), "last_global_step_saved": self._last_global_step_saved,
            "current_score": _float(self.current_score), "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
        }

    @hookimpl
    def on_load_checkpoint(self, trainer, checkpoint):
        """Continue the bookkeeping of the run the checkpoint came from, when it kept its
        checkpoints where this one does and ranked them by the same metric."""
        # (set by hookloop.resume.run.restore: the file this run loaded)
        loaded = getattr(trainer.state, "loaded_ckpt_path", None)
        self._resumed_from = str(loaded) if loaded is not None else None
        state = checkpoint.get("plugins", {}).get(self.hookloop_name)  # checkpoint-2: a second one in callbacks=
        if state:
            # The run's position, whatever the directory: the step already saved stays saved.
            self._last_global_step_saved = state.get("last_global_step_saved")
        if not state or state["dir"] != (str(self.dir) if self.dir else None) or state["monitor"] != self.monitor:
            return
        self.best_k_models = {p: s for p, s in state["best_k_models"].items() if Path(p).exists()}
        self.best_model_path, self.best_model_score = state["best_model_path"], state["best_model_score"]
        self.last_model_path, self.latest = state["last_model_path"], list(state["latest"])
        self.current_score = _tensor(state.get("current_score"))
        self.kth_best_model_path = state.get("kth_best_model_path", "")
        self.kth_value = state.get("kth_value", self.kth_value)


def _tensor(value: float | None) -> Any:
    """A score as Lightning keeps it: a 0-d tensor (None stays None)."""
    import torch

    return None if value is None else torch.tensor(float(value))


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _weights_finite(trainer) -> bool:
    """Whether every floating-point parameter of the module is finite, on every rank
    (one small all-reduce with several processes: sharded strategies hold different
    parts). One device sync: the per-parameter checks are stacked first."""
    import torch

    checks = []
    for p in trainer.module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor: this rank's shard
        if local.is_floating_point() and local.numel():
            checks.append(torch.isfinite(local.detach()).all())
    ok = torch.stack(checks).all() if checks else torch.tensor(True)
    if trainer.world_size > 1:
        ok = trainer.reduce(ok.to(torch.float32), "min") > 0
    return bool(ok)


def _remove_files(paths: list[str]) -> None:
    for path in paths:
        target = Path(path)
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists():
            target.unlink()
        storage.unsync(target)  # a staged checkpoint's copy on the store goes too


def log_dirs(trainer) -> list:
    """The directories of the run's logs (the run directory, each logger's), none for a run
    without a logger (whose directory is the root itself)."""
    return [d for d in (trainer.state.run_dirs or []) if d is not None] if trainer.loggers else []


def _copy_and_commit(source: Any, target: Any, keep_previous: bool, step: int) -> None:
    atomic_copy(source, target, keep_previous=keep_previous)
    storage.sync_file(target, step)


class _Values(dict):
    """The values a filename template is formatted with: a name not among them is 0, as
    Lightning's, and remembered (``missing``) so the observer can say so."""

    def __init__(self, values: dict[str, Any]):
        super().__init__(values)
        self.missing: list[str] = []

    def __missing__(self, key: str) -> int:
        self.missing.append(key)
        return 0


class _Job:
    """One asynchronous save, run by the trainer's background writer: the snapshots'
    writes (atomic, fsync'd), then last.ckpt's copy and the removal of pushed-out files,
    in the order a synchronous save does them."""

    def __init__(self, writes: list, then: list, spare: list, commit: int | None = None):
        self.writes, self.then, self.spare, self.commit = writes, then, spare, commit

    def __call__(self) -> None:
        for item in self.writes:
            if callable(item):  # a strategy's own step (hookloop.defer): e.g. commit its directory
                item()
            else:
                snapshot, path, _ = item
                _write_checkpoint(snapshot, path)
                if self.commit is not None:
                    storage.sync_file(path, self.commit)  # a staged directory's: committed to its store
        # written: its storages are the next snapshot's (the writer waits for this job
        # before that snapshot is taken)
        self.spare[:] = [storage for item in self.writes if not callable(item) for storage in item[2]]
        self.writes = []
        for step in self.then:
            step()


class _SaveEverySteps:
    """``every_n_train_steps`` or ``train_time_interval``: registered only by runs that ask
    for it."""

    hookloop_role = "observer"

    def __init__(self, owner: ModelCheckpoint):
        self.owner = owner

    @hookimpl
    def on_train_start(self, trainer):
        self.owner._last_time_checked = time.monotonic()

    @hookimpl(trylast=True)
    def on_train_batch_end(self, trainer, batch_idx):
        n = self.owner.every_n_train_steps
        # Once per optimizer step: at the micro-batch that took it (the position moves).
        owner = self.owner
        if n is None:
            if self._time_is_up(trainer):
                owner.save(trainer, defer=True)
            return
        if trainer.global_step and trainer.global_step % n == 0 and (
                trainer.global_step != owner._last_global_step_saved):
            owner._last_global_step_saved = trainer.global_step
            if (owner.monitor is not None and not owner._saves_at_epoch_end(trainer)
                    and batch_idx + 1 == trainer.num_training_batches and self._validates_this_epoch(trainer)):
                # The epoch's last batch, with a validation due after it: rank by its fresh
                # metric (Lightning defers to on_validation_end here too).
                owner._deferred = True
                return
            owner.save(trainer, defer=True)

    def _time_is_up(self, trainer) -> bool:
        """``train_time_interval``: whether that much time passed since the last save by time
        (global rank 0's clock decides, for every rank, as Lightning)."""
        now, owner = time.monotonic(), self.owner
        last = owner._last_time_checked
        due = last is not None and now - last >= owner.train_time_interval.total_seconds()
        if trainer.world_size > 1:
            due = trainer.broadcast(due, 0)
        if due:
            owner._last_time_checked = now
        return due

    def _validates_this_epoch(self, trainer) -> bool:
        every = trainer.config.check_val_every_n_epoch
        return self.owner._validation_enabled(trainer) and (every is None or (trainer.current_epoch + 1) % every == 0)


# Types, not strings, in ModelCheckpoint's signature (as Lightning's): its CLI (jsonargparse)
# and code reading ``inspect.signature(ModelCheckpoint)`` parse arguments by them
# (``--save_last yes``, ``--save_last link``).
ModelCheckpoint.__init__.__annotations__.update(get_type_hints(ModelCheckpoint.__init__))
