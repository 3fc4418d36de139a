"""``timer`` (opt-in): Lightning's Timer callback.

Tracks the time spent in training, validation and testing, and stops ``fit`` once the
training time reaches ``duration``: checked at fit start (a resumed run whose time is
already up trains nothing), then after every training batch (``interval="step"``) or at
every epoch's end (``interval="epoch"``), as Lightning 2.6 does. Rank 0's clock decides
for every rank. The elapsed training time is saved in checkpoints and resumed.

With several processes, the per-step check adds no collective: rank 0's verdict is its
vote in the preemption agreement (:meth:`hookloop.distributed.faults.Preemption.agree_stop`), which
runs every ``stop_check_every_n_steps`` optimizer steps without waiting (its all-reduce
read at the next agreement), so every rank stops at the same step, K to 2K optimizer
steps after the one where rank 0's time came (K = 16 by default; 1: the step after; with
``accumulate_grad_batches`` > 1 at the end of a window, its update applied). Lightning
broadcasts rank 0's verdict at every batch; hookloop's later stop is the price of a step
with no collective (docs/decisions.md). One process checks after every batch, as
Lightning.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from typing import Any

from hookloop.contract.errors import ConfigurationError
from hookloop.contract.hookspecs import hookimpl
from hookloop.distributed.ranks import rank_zero_info

#: Lightning's RunningStage values: the stages whose times are kept
STAGES = ("train", "sanity_check", "validate", "test", "predict")


def parse_duration(duration: Any, what: str = "Timer(duration=...)") -> float | None:
    """``"DD:HH:MM:SS"``, a ``timedelta`` or a dict of ``timedelta`` arguments, in seconds;
    ``what`` names the argument in the error (``Trainer(max_time=...)``)."""
    what = what.replace("...", "{!r}")
    given = duration
    if duration is None:
        return None
    if isinstance(duration, str):
        match = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", duration.strip())
        if not match:
            raise ConfigurationError(
                f"{what.format(duration)} is not a valid duration. Expected a string in the format DD:HH:MM:SS "
                f"(e.g. '00:12:00:00' for 12 hours), a datetime.timedelta or a dict such as {{'hours': 12}}")
        days, hours, minutes, seconds = (int(g) for g in match.groups())
        try:
            duration = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        except OverflowError as exc:
            raise _not_finite(what, duration, exc) from None
    elif isinstance(duration, dict):
        try:
            duration = timedelta(**duration)
        except TypeError as exc:
            raise ConfigurationError(
                f"{what.format(duration)}: {exc}; the keys are datetime.timedelta's (weeks, days, hours, "
                f"minutes, seconds, milliseconds, microseconds)") from None
        except (ValueError, OverflowError) as exc:  # NaN, infinity, more than 999999999 days
            raise _not_finite(what, duration, exc) from None
    if not isinstance(duration, timedelta):
        raise ConfigurationError(
            f"{what.format(duration)} must be a string DD:HH:MM:SS, a datetime.timedelta, a dict of "
            f"timedelta arguments, or None")
    if duration.total_seconds() < 0:
        raise ConfigurationError(
            f"{what.format(given)} is a negative time ({duration}): give a time >= 0, as a string DD:HH:MM:SS "
            f"(e.g. '00:12:00:00' for 12 hours), a datetime.timedelta or a dict such as {{'hours': 12}}; None "
            f"for no limit")
    return duration.total_seconds()


def _not_finite(what: str, duration: Any, exc: Exception) -> ConfigurationError:
    return ConfigurationError(
        f"{what.format(duration)} is not a valid duration ({exc}): give a finite time of at most "
        f"999999999 days, as a string DD:HH:MM:SS (e.g. '00:12:00:00' for 12 hours), a datetime.timedelta "
        f"or a dict such as {{'hours': 12}}; None for no limit")


class Timer:
    """Stop training after ``duration``; report the time spent per stage.

    duration: "DD:HH:MM:SS", a ``datetime.timedelta`` or a dict (``{"hours": 12}``); None:
        only measure
    interval: "step" (check after every training batch) or "epoch" (at every epoch's end)
    verbose: say on rank 0 when the time is up
    """

    hookloop_name = "timer"
    hookloop_role = "observer"

    def __init__(self, duration: Any = None, interval: str = "step", verbose: bool = True):
        if interval not in ("step", "epoch"):
            raise ConfigurationError(
                f"Unsupported parameter value `Timer(interval={interval})`. Possible choices are: step, epoch")
        self._duration = parse_duration(duration)
        self._interval = interval
        self._verbose = verbose
        self._start_time: dict[str, float | None] = dict.fromkeys(STAGES)
        self._end_time: dict[str, float | None] = dict.fromkeys(STAGES)
        self._offset = 0.0
        self._per_step: Any = None
        #: set by ``Trainer(max_time=...)`` given beside this Timer: said at setup
        self._max_time_ignored = False

    # -- Lightning's queries ----------------------------------------------------------------

    def start_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last started (``time.monotonic()`` seconds), or None."""
        return self._start_time[_stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last ended (``time.monotonic()`` seconds), or None."""
        return self._end_time[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage`` (training: with the time resumed from a checkpoint)."""
        stage = _stage(stage)
        start, end = self._start_time[stage], self._end_time[stage]
        offset = self._offset if stage == "train" else 0
        if start is None:
            return offset
        return (time.monotonic() if end is None else end) - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of ``duration`` (None without one)."""
        if self._duration is None:
            return None
        return self._duration - self.time_elapsed(stage)

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset = state_dict.get("time_elapsed", {}).get("train", 0)

    # -- the run ----------------------------------------------------------------------------

    @hookimpl
    def setup(self, trainer):
        if self._max_time_ignored:
            _announce(trainer, "Ignoring `Trainer(max_time=...)`, callbacks list already contains a Timer.")
        # Only a step-interval timer with a duration pays a call per batch.
        if self._duration is not None and self._interval == "step" and self._per_step is None:
            self._per_step = _StepCheck(self)
            trainer.plugin_manager.register(self._per_step, name="timer.step_check")

    @hookimpl
    def teardown(self, trainer):
        per_step, self._per_step = self._per_step, None
        if per_step is not None:
            trainer.plugin_manager.unregister(per_step)

    @hookimpl
    def on_fit_start(self, trainer):
        # After a checkpoint's state is restored: a run whose time is up trains nothing.
        if self._duration is not None:
            self._check(trainer)

    @hookimpl
    def on_train_start(self):
        self._start_time["train"] = time.monotonic()

    @hookimpl
    def on_train_end(self):
        self._end_time["train"] = time.monotonic()

    @hookimpl
    def on_train_epoch_end(self, trainer):
        if self._interval == "epoch" and self._duration is not None:
            self._check(trainer)

    # The sanity check is a validation here as in Lightning: its time is "validate"'s until
    # the first validation of the fit (Lightning keeps no "sanity_check" time)
    @hookimpl
    def on_validation_start(self):
        self._start_time["validate"] = time.monotonic()

    @hookimpl
    def on_validation_end(self):
        self._end_time["validate"] = time.monotonic()

    @hookimpl
    def on_test_start(self):
        self._start_time["test"] = time.monotonic()

    @hookimpl
    def on_test_end(self):
        self._end_time["test"] = time.monotonic()

    @hookimpl
    def on_predict_start(self):
        self._start_time["predict"] = time.monotonic()

    @hookimpl
    def on_predict_end(self):
        self._end_time["predict"] = time.monotonic()

    @hookimpl
    def on_save_checkpoint(self, checkpoint):
        checkpoint["plugins"]["timer"] = self.state_dict()

    @hookimpl
    def on_load_checkpoint(self, checkpoint):
        state = checkpoint.get("plugins", {}).get("timer")
        if state:
            self.load_state_dict(state)

    def _check(self, trainer) -> None:
        stop = self.time_elapsed() >= self._duration
        self._stop(trainer, trainer.broadcast(stop, 0))  # rank 0's clock decides for every rank

    def _stop(self, trainer, stop: bool) -> None:
        trainer.should_stop = trainer.should_stop or stop
        if stop and self._verbose:
            elapsed = timedelta(seconds=int(self.time_elapsed("train")))
            _announce(trainer, f"Time limit reached. Elapsed time is {elapsed}. Signaling Trainer to stop.")


def _announce(trainer, message: str) -> None:
    """Lightning's info line, said once on rank 0: logged (as Lightning logs it) where
    logging shows ``hookloop``'s info lines, printed where it would show nothing (Lightning's
    own logger prints its info lines by default; hookloop's leaves logging to the user)."""
    if logging.getLogger("hookloop").isEnabledFor(logging.INFO) and logging.getLogger("hookloop").hasHandlers():
        if trainer.global_rank == 0:
            rank_zero_info(message)
    else:
        trainer.print(message, flush=True)


class _StepCheck:
    """The per-batch half of :class:`Timer`: registered only for ``interval="step"`` with
    a duration."""

    hookloop_role = "observer"

    def __init__(self, timer: Timer):
        self.timer = timer

    def stop_vote(self, trainer) -> bool:
        """Rank 0's clock, in the preemption agreement's all-reduce (hookloop.faults)."""
        return trainer.global_rank == 0 and self.timer.time_elapsed() >= self.timer._duration

    @hookimpl
    def on_train_batch_end(self, trainer):
        preemption = trainer.state.preemption
        if trainer.world_size == 1 or preemption is None:
            self.timer._check(trainer)  # one process: no collective; outside fit's loop: a broadcast
        elif trainer.is_last_batch or trainer.batch_idx % trainer.accumulate_grad_batches == 0:
            # an optimizer-step boundary (batch_idx is the next batch's here): the vote
            # agreed there (False between the agreement boundaries: nothing is done)
            self.timer._stop(trainer, preemption.agree_stop(trainer))


def _stage(stage: Any) -> str:
    stage = getattr(stage, "value", stage)
    if stage not in STAGES:
        raise ConfigurationError(f"Timer: unknown stage {stage!r}; the stages are {', '.join(STAGES)}")
    return stage
