"""``early_stopping`` (opt-in): Lightning's EarlyStopping.

Stops training when ``monitor`` stops improving for ``patience`` checks (by more than
``min_delta``), reaches ``stopping_threshold``, goes past ``divergence_threshold``, or
is not finite (``check_finite``). Values are compared as Lightning 2 compares them: in
the metric's float32, and the ``patience``-th check without improvement stops.
Checked at each training epoch's end when validation runs once at every epoch's end or
not at all, else after each validation (mid-epoch too, with ``val_check_interval``), as
in Lightning. Global rank 0 decides and
broadcasts, so every rank stops at the same optimizer step; the loop honours
``trainer.should_stop`` after every step as well as between epochs.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import torch

from hookloop.contract.errors import ConfigurationError
from hookloop.contract.hookspecs import hookimpl
from hookloop.distributed.ranks import rank_zero_info, rank_zero_warn


class EarlyStoppingReason(Enum):
    """Why an :class:`EarlyStopping` stopped training (Lightning's enum, its values)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping:
    """Stop training when a metric stops improving.

    monitor: the metric to watch ("val_loss")
    mode: "min" or "max": which direction is an improvement
    patience: checks without improvement before stopping (3)
    min_delta: the least change that counts as an improvement (0.0)
    check_finite: stop when the metric is nan or infinite (True)
    stopping_threshold: stop as soon as the metric is better than this (None)
    divergence_threshold: stop as soon as the metric is worse than this (None)
    check_on_train_epoch_end: check at the training epoch's end rather than after each
        validation (None: at epoch ends when validation runs once at every epoch's end
        or never, after each validation otherwise)
    verbose: print each improvement, and warn (instead of nothing) when ``strict=False``
        finds no ``monitor`` metric (False)
    strict: a check without the ``monitor`` metric is an error; ``False`` skips that check (True)
    log_rank_zero_only: (Lightning's) verbose messages only from global rank 0; they
        come from rank 0 only here in any case, since rank 0 decides
    """

    hookloop_name = "early_stopping"
    hookloop_role = "observer"
    # Which metric to watch is the user's choice: never loaded by HOOKLOOP_AUTOLOAD_PLUGINS.
    hookloop_autoload = False

    # Lightning 2.6's parameter order: EarlyStopping("val_loss", 0.01) is min_delta=0.01 in both.
    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: str = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = False):
        if mode not in ("min", "max"):
            raise ConfigurationError(
                f"EarlyStopping(mode={mode!r}): `mode` can be min, max, got {mode} ('min': lower {monitor} is "
                f"better, 'max': higher is better)")
        if not isinstance(patience, int) or patience < 0:
            raise ConfigurationError(f"early_stopping patience={patience!r} must be an integer >= 0")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not math.isfinite(min_delta):
            raise ConfigurationError(
                f"early_stopping min_delta={min_delta!r} must be a finite number (the least change of {monitor} "
                f"that counts as an improvement; 0.0 counts every change)")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, abs(min_delta)
        for name, threshold in (("stopping_threshold", stopping_threshold), ("divergence_threshold", divergence_threshold)):
            if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                          or not math.isfinite(threshold)):
                raise ConfigurationError(
                    f"early_stopping {name}={threshold!r} must be a finite number (a value of {monitor}) or None")
        self.check_finite, self.stopping_threshold = check_finite, stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.verbose, self.strict, self.log_rank_zero_only = verbose, strict, log_rank_zero_only
        self.wait_count = 0
        self.best_score: float | None = None
        self.stopped_epoch = 0  # Lightning's: 0 until it stops
        self.reason: str | None = None
        #: why it stopped, as Lightning's (NOT_STOPPED until it does)
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        #: Lightning's text of why it stopped (None until it does)
        self.stopping_reason_message: str | None = None
        self._lightning_message: str | None = None
        self._why: str | None = None  # hookloop's reason to stop, said when it stops

    def _on_epoch_end(self, trainer) -> bool:
        """Lightning's choice: at the training epoch's end when validation runs once at
        every epoch's end (so that epoch's training metrics exist), after each validation
        when it runs mid-epoch or every few epochs; at epoch ends without validation."""
        if self.check_on_train_epoch_end is not None:
            return self.check_on_train_epoch_end
        config = trainer.config
        if not trainer.val_dataloaders or config.limit_val_batches == 0:
            return True  # (Lightning: never, when check_val_every_n_epoch != 1)
        return config.check_val_every_n_epoch == 1 and config.val_check_interval == 1.0

    # pl_module: a Lightning subclass's override calls these through super() with
    # Lightning's arguments (pluggy passes only trainer)
    @hookimpl
    def on_validation_end(self, trainer, pl_module=None):
        if trainer.state == "fit" and not trainer.sanity_checking and not self._on_epoch_end(trainer):
            self._run_early_stopping_check(trainer)

    @hookimpl
    def on_train_epoch_end(self, trainer, pl_module=None):
        if self._on_epoch_end(trainer):
            self._run_early_stopping_check(trainer)

    def _run_early_stopping_check(self, trainer) -> None:
        """The check the hooks run (Lightning's name, so code that wraps or counts it
        finds it): :meth:`check`."""
        self.check(trainer)

    def _evaluate_stopping_criteria(self, current: torch.Tensor) -> tuple[bool, str | None]:
        """Whether to stop now, and Lightning's message why (Lightning's name and result);
        updates the patience count, and keeps hookloop's shorter reason in ``_why``.

        Lightning 2.6's rules and arithmetic: the metric as a float32 tensor (how it logs
        a value), a best score that starts at +-inf (a first nan or inf is a check
        without improvement, not a best score), improvement by more than ``min_delta``,
        and ``wait_count >= patience`` stops."""
        self._why = self._stop_reason(current)
        return self._why is not None, self._lightning_message if self._why is not None else None

    def _stop_reason(self, current: torch.Tensor) -> str | None:
        """hookloop's reason to stop now (Lightning's message in ``_lightning_message``), or None."""
        value = float(current)
        lower = self.mode == "min"
        better = torch.lt if lower else torch.gt
        order = "<" if lower else ">"
        previous = self.best_score if self.best_score is not None else (math.inf if lower else -math.inf)
        if self.check_finite and not torch.isfinite(current):
            self.stopping_reason = EarlyStoppingReason.NON_FINITE_METRIC
            self._lightning_message = (f"Monitored metric {self.monitor} = {current} is not finite. Previous best "
                                       f"value was {previous:.3f}. Signaling Trainer to stop.")
            return f"{self.monitor} = {value} is not finite"
        threshold = self.stopping_threshold
        if threshold is not None and better(current, threshold):
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            self._lightning_message = (f"Stopping threshold reached: {self.monitor} = {current} {order} {threshold}. "
                                       f"Signaling Trainer to stop.")
            return f"{self.monitor} = {value:.6g} reached the stopping threshold {threshold}"
        threshold = self.divergence_threshold
        if threshold is not None and better(-current, -threshold):
            self.stopping_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            self._lightning_message = (f"Divergence threshold reached: {self.monitor} = {current} {order} "
                                       f"{threshold}. Signaling Trainer to stop.")
            return f"{self.monitor} = {value:.6g} went past the divergence threshold {threshold}"
        best = self.best_score
        best = torch.tensor(best if best is not None else (math.inf if lower else -math.inf), dtype=torch.float32)
        if better(current + self.min_delta if lower else current - self.min_delta, best):
            if self.verbose:
                rank_zero_info(f"Metric {self.monitor} improved"
                                        + (f" by {abs(float(best) - float(current)):.3f} >= min_delta = {self.min_delta}"
                                           if torch.isfinite(best) else "") + f". New best score: {float(current):.3f}")
            self.best_score, self.wait_count = float(current), 0
            return None
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
            self._lightning_message = (f"Monitored metric {self.monitor} did not improve in the last "
                                       f"{self.wait_count} records. Best score: {previous:.3f}. Signaling Trainer to stop.")
            best_text = "none" if self.best_score is None else f"{self.best_score:.6g}"
            return (f"{self.monitor} did not improve by more than {self.min_delta} for {self.wait_count} checks "
                    f"(best {best_text})")
        return None

    def check(self, trainer) -> None:
        """Decide on rank 0 and tell every rank (a collective: every rank calls it)."""
        decision = None
        if trainer.is_global_zero:
            metrics = trainer.callback_metrics
            if self.monitor not in metrics and not self.strict:
                if self.verbose:
                    rank_zero_warn(f"EarlyStopping(monitor={self.monitor!r}, strict=False): no metric of "
                                            f"that name was logged (logged: {', '.join(sorted(metrics)) or 'none'})")
                decision = ("go", None)
            elif self.monitor not in metrics:
                decision = ("error", f"EarlyStopping(monitor={self.monitor!r}) but no metric of that name was logged "
                                     f"(logged: {', '.join(sorted(metrics)) or 'none'}): log it with "
                                     f"self.log({self.monitor!r}, ...) or monitor one of those")
            else:
                self._why = None
                stop, message = self._evaluate_stopping_criteria(
                    torch.tensor(float(metrics[self.monitor]), dtype=torch.float32))
                if stop:
                    self._lightning_message = message
                decision = ("stop", self._why or message or "its stopping criteria were met") if stop else ("go", None)
        decision, self.wait_count, self.best_score, self.stopping_reason, self._lightning_message = trainer.broadcast(
            (decision, self.wait_count, self.best_score, self.stopping_reason, self._lightning_message), 0)
        if decision[0] == "error":
            raise ConfigurationError(decision[1])
        if decision[0] == "stop":
            trainer.should_stop = True
            self.stopped_epoch, self.reason = trainer.current_epoch, decision[1]
            self.stopping_reason_message = self._lightning_message
            trainer.print(f"hookloop: early stopping at epoch {trainer.current_epoch}, step {trainer.global_step}: "
                          f"{decision[1]}", flush=True)

    @property
    def state_key(self) -> str:
        """Lightning's key of this callback's state in ``checkpoint["callbacks"]``."""
        return type(self).__qualname__ + repr({"monitor": self.monitor, "mode": self.mode})

    def state_dict(self) -> dict[str, Any]:
        """Lightning's state of an EarlyStopping (the best score as a tensor, +-inf before
        the first check, as Lightning's)."""
        best = self.best_score if self.best_score is not None else (math.inf if self.mode == "min" else -math.inf)
        return {
            "wait_count": self.wait_count, "stopped_epoch": self.stopped_epoch or 0,
            "best_score": torch.tensor(best, dtype=torch.float32), "patience": self.patience,
            "stopping_reason": self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = state_dict["wait_count"]
        self.stopped_epoch = state_dict["stopped_epoch"]
        best = float(state_dict["best_score"])
        self.best_score = best if math.isfinite(best) else None
        self.patience = state_dict["patience"]
        self.stopping_reason = EarlyStoppingReason(int(state_dict.get("stopping_reason", 0)))
        self.stopping_reason_message = state_dict.get("stopping_reason_message")

    @hookimpl
    def on_save_checkpoint(self, checkpoint):
        # Lightning's place too, so code that reads a Lightning checkpoint reads this one
        checkpoint.setdefault("callbacks", {})[self.state_key] = self.state_dict()
        # under its plugin name: a second EarlyStopping in callbacks= is early_stopping-2
        checkpoint["plugins"][self.hookloop_name] = {"wait_count": self.wait_count,
                                                     "best_score": self.best_score}

    @hookimpl
    def on_load_checkpoint(self, checkpoint):
        state = checkpoint.get("plugins", {}).get(self.hookloop_name)
        if state:
            self.wait_count, self.best_score = state["wait_count"], state["best_score"]
