"""``lr_monitor`` (opt-in): Lightning's LearningRateMonitor.

Logs the learning rate of every optimizer's parameter groups (and, on request, their
momentum and weight decay) through the loggers, with Lightning 2.6's names, steps and
public record (``lrs``, ``last_momentum_values``, ``last_weight_decay_values``):

* names: a scheduler's ``name`` from its config, else ``lr-<Optimizer>``; the j-th
  optimizer of a class (counted over those without a named scheduler) gets ``-<j>``; with
  several parameter groups ``/<group name>`` (``/pg<i>`` for an unnamed one); with one, its
  ``name`` when it has one. Momentum is ``<name>-momentum`` (SGD's ``momentum``, Adam's
  first beta, 0 for an optimizer without either, with a warning when training starts),
  weight decay ``<name>-weight_decay``.
* when: ``logging_interval="step"`` logs every optimizer before a batch, when the loggers
  take that batch's row (``log_every_n_steps``; also when training is stopping);
  ``"epoch"`` logs every optimizer when an epoch starts; ``None`` logs a scheduler's
  optimizer at its scheduler's ``interval`` and an optimizer without a scheduler at both.
  The row's step is the number of batches whose optimizers stepped so far, as Lightning's.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any

from hookloop.contract.errors import ConfigurationError
from hookloop.contract.hookspecs import hookimpl


class LearningRateMonitor:
    """Log learning rates (and momentum, weight decay), as Lightning's callback.

    logging_interval: "step", "epoch", or None (each scheduler's own interval; an
        optimizer without a scheduler at both)
    log_momentum: also log each group's momentum (SGD) or first beta (Adam) as
        ``<name>-momentum`` (0 for an optimizer without either)
    log_weight_decay: also log each group's weight decay as ``<name>-weight_decay``

    After a run ``lrs`` maps every name to the learning rates logged under it, and
    ``last_momentum_values`` / ``last_weight_decay_values`` hold the last values logged
    (``None`` when not logged), as Lightning's.
    """

    hookloop_name = "lr_monitor"
    hookloop_role = "observer"

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False):
        if logging_interval not in (None, "step", "epoch"):
            raise ConfigurationError(
                f"lr_monitor logging_interval={logging_interval!r} must be 'step', 'epoch' or None")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}

    # -- names (Lightning's) ------------------------------------------------------------

    def _names(self, trainer) -> list[tuple[Any, Any, list[str]]]:
        """``(optimizer, its scheduler config or None, its groups' names)``: first the
        scheduled optimizers in scheduler order, then the others in optimizer order."""
        out: list[tuple[Any, Any, list[str]]] = []
        seen: list = []
        seen_types: defaultdict[type, int] = defaultdict(int)
        for config in trainer.lr_scheduler_configs:
            optimizer = getattr(config.scheduler, "optimizer", None)
            if optimizer is None:
                continue  # not a torch scheduler: its optimizer is listed as one without
            base = config.name if config.name is not None else f"lr-{type(optimizer).__name__}"
            out.append((optimizer, config, self._group_names(optimizer, base, seen, seen_types, config.name)))
        for optimizer in trainer.optimizers:
            optimizer = getattr(optimizer, "optimizer", optimizer)  # a wrapper (DeepSpeed's, the loop's)
            if any(optimizer is s for s in seen):
                continue
            base = f"lr-{type(optimizer).__name__}"
            out.append((optimizer, None, self._group_names(optimizer, base, seen, seen_types, None)))
        return out

    @staticmethod
    def _group_names(optimizer, name: str, seen: list, seen_types: defaultdict, config_name: str | None) -> list[str]:
        seen.append(optimizer)
        kind = type(optimizer)
        if config_name is None:
            seen_types[kind] += 1
        groups = optimizer.param_groups
        names = [group.get("name", f"pg{i}") for i, group in enumerate(groups, start=1)]
        duplicates = {n for n in names if names.count(n) > 1}
        if duplicates:
            raise ConfigurationError(
                f"A single `Optimizer` cannot have multiple parameter groups with identical `name` values. "
                f"{name} has duplicated parameter group names {duplicates}: give each parameter group of "
                f"configure_optimizers a different 'name' (or none)")
        if kind in seen_types and seen_types[kind] > 1:
            name = f"{name}-{seen_types[kind] - 1}"
        if len(groups) > 1:
            return [f"{name}/{g}" for g in names]
        return [f"{name}/{groups[0]['name']}" if groups[0].get("name") else name]

    # -- hooks --------------------------------------------------------------------------

    @hookimpl
    def on_train_start(self, trainer):
        """Lightning's checks when training starts (no logger to write to, parameter groups
        of one optimizer sharing a ``name``; a warning when ``log_momentum`` finds an
        optimizer without momentum), then an empty record per name."""
        if not trainer.loggers:
            raise ConfigurationError(
                "Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger: it logs the "
                "learning rates through the loggers. Remove logger=False from Trainer(...) (or give a logger), "
                "or remove the LearningRateMonitor from callbacks")
        if self.log_momentum:
            configs = trainer.lr_scheduler_configs
            optimizers = ([getattr(c.scheduler, "optimizer", None) for c in configs] if configs
                          else [getattr(o, "optimizer", o) for o in trainer.optimizers])
            defaults = [getattr(o, "defaults", {}) for o in optimizers]
            if any("momentum" not in d for d in defaults) and any("betas" not in d for d in defaults):
                warnings.warn("You have set log_momentum=True, but some optimizers do not have momentum. "
                              "This will log a value 0 for the momentum.", RuntimeWarning, stacklevel=2)
        names = [name for _, _, group_names in self._names(trainer) for name in group_names]
        self.lrs = {name: [] for name in names}
        self.last_momentum_values = {f"{name}-momentum": None for name in names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}

    @hookimpl
    def on_train_batch_start(self, trainer):
        if self.logging_interval == "epoch":
            return
        stepped = _batches_that_stepped(trainer)
        if (stepped + 1) % trainer.config.log_every_n_steps == 0 or trainer.should_stop:
            self._log(trainer, "step" if self.logging_interval is None else "any", stepped)

    @hookimpl
    def on_train_epoch_start(self, trainer):
        if self.logging_interval != "step":
            self._log(trainer, "epoch" if self.logging_interval is None else "any", _batches_that_stepped(trainer))

    def _log(self, trainer, interval: str, step: int) -> None:
        stats = self.values(trainer, interval)
        if stats:
            trainer.log_metrics(stats, step=step)

    def values(self, trainer, interval: str = "any") -> dict[str, float]:
        """The values logged now (and recorded in ``lrs``...) for the optimizers due at
        ``interval`` ("step", "epoch" or "any"), by Lightning's names."""
        stats: dict[str, float] = {}
        for optimizer, config, names in self._names(trainer):
            for name in names:  # a group added since (fine-tuning): Lightning's renaming
                old = name.replace("/pg1", "")
                if "/pg1" in name and old in self.lrs:
                    self.lrs[name] = self.lrs.pop(old)
                else:
                    self.lrs.setdefault(name, [])
            if config is not None and interval not in (config.interval, "any"):
                continue
            use_betas = "betas" in getattr(optimizer, "defaults", {})
            for group, name in zip(optimizer.param_groups, names, strict=True):
                stats[name] = group["lr"]
                self.lrs[name].append(group["lr"])
                if self.log_momentum:
                    momentum = group["betas"][0] if use_betas else group.get("momentum", 0)
                    stats[f"{name}-momentum"] = self.last_momentum_values[f"{name}-momentum"] = momentum
                if self.log_weight_decay:
                    decay = group["weight_decay"]
                    stats[f"{name}-weight_decay"] = self.last_weight_decay_values[f"{name}-weight_decay"] = decay
        return stats


def _batches_that_stepped(trainer) -> int:
    """Lightning's ``_batches_that_stepped``, the step of the loggers' rows: the training
    batches whose optimizers stepped (an accumulation window counts once; under manual
    optimization every batch, whatever the number of ``opt.step()`` calls)."""
    if trainer.automatic_optimization:
        return trainer.global_step
    return trainer.state.total_batch_idx
