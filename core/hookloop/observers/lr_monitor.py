"""``lr_monitor`` (opt-in): Lightning's LearningRateMonitor.

Logs the learning rate of every optimizer's parameter groups (and their momentum),
per step (every ``log_every_n_steps`` optimizer steps) or per epoch, as metrics named
``lr-<Optimizer>`` (``lr-<Optimizer>/pg<i>`` with several groups, ``lr-<Optimizer>-<j>``
for the j-th optimizer of a class) that the loggers write.
"""

from __future__ import annotations

from hookloop.contract.errors import ConfigurationError
from hookloop.contract.hookspecs import hookimpl


class LearningRateMonitor:
    """Log learning rates (and momentum).

    logging_interval: "step", "epoch", or None (each optimizer's scheduler's interval;
        "epoch" without a scheduler)
    log_momentum: also log each group's momentum (SGD) or first beta (Adam) as momentum-<...>
    """

    hookloop_name = "lr_monitor"
    hookloop_role = "observer"

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False):
        if logging_interval not in (None, "step", "epoch"):
            raise ConfigurationError(
                f"lr_monitor logging_interval={logging_interval!r} must be 'step', 'epoch' or None")
        self.logging_interval, self.log_momentum = logging_interval, log_momentum
        self._logged_step = -1

    def _interval(self, trainer) -> str:
        if self.logging_interval:
            return self.logging_interval
        intervals = {c.interval for c in trainer.lr_scheduler_configs}
        return "step" if intervals == {"step"} else "epoch"

    @staticmethod
    def _names(trainer):
        """``(optimizer, its name)`` for each optimizer: ``lr-<Optimizer>``, then
        ``lr-<Optimizer>-<j>`` for the j-th of a class (Lightning's)."""
        counts: dict[str, int] = {}
        for optimizer in trainer.optimizers:
            base = type(getattr(optimizer, "optimizer", optimizer)).__name__
            index = counts[base] = counts.get(base, -1) + 1
            yield optimizer, (f"lr-{base}" if index == 0 else f"lr-{base}-{index}")

    @staticmethod
    def _group_key(name: str, groups: list, g: int) -> str:
        """Lightning's suffix: the group's ``name`` (``"pg<i>"`` when it has none) with
        several groups; with one, its ``name`` when it has one."""
        if len(groups) > 1:
            return f"{name}/{groups[g].get('name', f'pg{g + 1}')}"
        return f"{name}/{groups[g]['name']}" if groups[g].get("name") else name

    @hookimpl
    def on_train_start(self, trainer):
        """Lightning's refusals, when training starts: no logger to write to, and
        parameter groups of one optimizer that share a ``name`` (their values would
        overwrite each other)."""
        if not trainer.loggers:
            raise ConfigurationError(
                "Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger: it logs the "
                "learning rates through the loggers. Remove logger=False from Trainer(...) (or give a logger), "
                "or remove the LearningRateMonitor from callbacks")
        for optimizer, name in self._names(trainer):
            names = [group.get("name", f"pg{i}") for i, group in enumerate(optimizer.param_groups, start=1)]
            duplicates = {n for n in names if names.count(n) > 1}
            if duplicates:
                raise ConfigurationError(
                    f"A single `Optimizer` cannot have multiple parameter groups with identical `name` values. "
                    f"{name} has duplicated parameter group names {duplicates}: give each parameter group of "
                    f"configure_optimizers a different 'name' (or none)")

    def values(self, trainer) -> dict[str, float]:
        """Every group's learning rate (and momentum), by Lightning's names."""
        out: dict[str, float] = {}
        for optimizer, name in self._names(trainer):
            groups = optimizer.param_groups
            for g, group in enumerate(groups):
                key = self._group_key(name, groups, g)
                out[key] = float(group["lr"])
                if self.log_momentum:
                    momentum = group.get("momentum", (group.get("betas") or (None,))[0])
                    if momentum is not None:
                        out[key.replace("lr-", "momentum-", 1)] = float(momentum)
        return out

    @hookimpl
    def on_train_epoch_start(self, trainer):
        if self._interval(trainer) == "epoch":
            trainer.log_metrics(self.values(trainer))

    @hookimpl
    def on_train_batch_end(self, trainer):
        step = trainer.global_step
        if self._interval(trainer) == "step" and step != self._logged_step and step % trainer.config.log_every_n_steps == 0:
            self._logged_step = step
            trainer.log_metrics(self.values(trainer))
