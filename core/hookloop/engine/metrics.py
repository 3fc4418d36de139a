"""What ``self.log`` recorded during a run: :class:`Metrics`, held by the loop's state
(``trainer.state.metrics``), and the per-thread batch the step module runs.

Below the loop's state: it imports nothing of the loop, the session or the trainer; the
trainer it is given is read for ``root_device``, ``world_size``, ``reduce`` and the
batch being run (``trainer.state.current_batch``).
"""

from __future__ import annotations

import itertools
import sys
import threading
from typing import Any

import torch

from hookloop.contract.errors import ConfigurationError
from hookloop.helpers import batch_size_of


def _is_torchmetrics(value: Any, kind: str) -> bool:
    """Whether ``value`` is a ``torchmetrics.<kind>``; torchmetrics is optional, and a value
    can only be one once the user has imported it (hookloop never does)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, getattr(torchmetrics, kind))


def _torchmetrics_metric(name: str, value: Any) -> Any:
    """``value`` when a torchmetrics ``Metric``; else a TypeError saying what self.log takes."""
    if _is_torchmetrics(value, "Metric"):
        return value
    if _is_torchmetrics(value, "MetricCollection"):
        raise TypeError(
            f"self.log({name!r}, ...) got a torchmetrics MetricCollection: log it with "
            f"self.log_dict(collection), which logs each of its metrics under its own name"
        )
    raise TypeError(
        f"self.log({name!r}, ...) needs a number, a scalar tensor or a torchmetrics Metric, "
        f"got {type(value).__name__}"
    )


def _scalar(name: str, value: Any, what: str, device: torch.device) -> torch.Tensor | None:
    """A torchmetrics Metric's ``value`` (its forward() or compute() result) as a detached
    0-d tensor on ``device``; ``None`` stays ``None`` (nothing to log)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        tensor = isinstance(value, torch.Tensor)
        shape = f"a tensor of shape {tuple(value.shape)}" if tensor else type(value).__name__
        raise ConfigurationError(
            f"self.log({name!r}, metric): the metric's {what} must be a scalar tensor, got "
            f"{shape}; log a metric that returns one number (or log its values yourself, one name "
            "each)"
        )
    value = value.detach().reshape(())
    return value if value.device == device else value.to(device)


# ---------------------------------------------------------------------------------------
# Metrics: what self.log recorded
# ---------------------------------------------------------------------------------------

# The batch a DataParallel replica (or any forward through the step module) is running,
# per thread, so a replica's value is weighted by its own share of the batch.
_STEP_BATCH = threading.local()

# Which replica logged a step value: one number per thread, never reused (a finished
# thread's ``threading.get_ident()`` is given to the next thread started, so DataParallel's
# replica threads, one finishing before the next starts, would share an ident and the
# second value would replace the first instead of joining the mean).
_REPLICA = threading.local()
_REPLICA_IDS = itertools.count()


def _replica_id() -> int:
    rid = getattr(_REPLICA, "id", None)
    if rid is None:
        rid = _REPLICA.id = next(_REPLICA_IDS)
    return rid


class Metrics:
    """What ``self.log`` recorded during a run; reduced across ranks on request.

    Every tensor is kept on the run's root device (a value logged on another device, a
    DataParallel replica's, is moved there), so reductions never mix devices, and
    nothing is read back to the host per step: step values become floats when
    ``trainer.callback_metrics`` is read, epoch values once per epoch, in one transfer.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        #: where self.log is called from: "train", "validate", "test" or "predict"
        self.stage = "train"
        #: inside an epoch-level hook (on_*_epoch_start/end): log per epoch by default
        self.epoch_level = False
        #: "/dataloader_idx_N" while evaluating one of several loaders
        self.suffix = ""
        #: N while evaluating loader N of several (None otherwise)
        self.dataloader_idx: int | None = None
        #: epoch key -> the loader it was logged under (several evaluation loaders): that
        #: loader's result holds it, as Lightning's (even with add_dataloader_idx=False)
        self.loader_of: dict[str, int] = {}
        #: increases every training micro-batch: replica values of one step share it
        self.step_token = 0
        #: the step token when the training epoch's values were last computed: a forked
        #: name reports its epoch value from then until a newer step value arrives
        self.epoch_token = -1
        #: name -> [step token, {replica id: 0-d tensor}] (several threads under DataParallel)
        self.step_values: dict[str, list] = {}
        #: stage -> name -> [batch-weighted sum, samples, sync, op, plain sum, max, min]
        self.epoch_sums: dict[str, dict[str, list]] = {}
        self.callback_metrics: dict[str, float] = {}
        self.prog_bar: set[str] = set()
        self.not_for_logger: set[str] = set()
        #: names logged with both on_step and on_epoch: reported as name_step, name_epoch
        #: and name (the step value during the epoch, the epoch value after it); each
        #: name -> its (step key, epoch key): Lightning's ``x_step/dataloader_idx_0`` for
        #: ``x`` logged on one of several loaders
        self.forked: dict[str, tuple[str, str]] = {}
        #: a forked name's step or epoch key -> ("step" or "epoch", the name)
        self.fork_parts: dict[str, tuple[str, str]] = {}
        #: the training epoch's partial sums while an epoch stopped early ends (its
        #: metrics computed, its sums kept for a resume): what checkpoints save meanwhile
        self.kept_train_sums: dict[str, list] | None = None
        #: an evaluation batch's step values (self.log(on_step=True) in validation/test),
        #: handed to the loggers after the batch in a row of their own, as Lightning does
        self.eval_step_row: dict[str, torch.Tensor] = {}
        #: the latest value of each evaluation metric logged per step with prog_bar=True:
        #: shown in the progress bar (Lightning's), neither a result nor a callback metric
        self.eval_step_pbar: dict[str, torch.Tensor] = {}
        #: stage -> evaluation batches logged so far this run (those rows' ``step``)
        self.eval_logged_steps: dict[str, int] = {}
        #: stage -> name -> torchmetrics Metric logged per epoch: its compute() is the value
        self.epoch_metrics: dict[str, dict[str, Any]] = {}
        #: stage -> every torchmetrics Metric logged in it: reset() when the stage ends
        self.metric_objects: dict[str, dict[int, Any]] = {}
        self._lock = threading.Lock()

    # -- recording ----------------------------------------------------------------------

    def log(self, name, value, prog_bar, for_logger, on_step, on_epoch, op, sync_dist,
            add_dataloader_idx, batch_size):
        # DataParallel runs the step in one thread per replica: updates must not interleave.
        with self._lock:
            self._log(name, value, prog_bar, for_logger, on_step, on_epoch, op, sync_dist,
                      add_dataloader_idx, batch_size)

    def _log(self, name, value, prog_bar, for_logger, on_step, on_epoch, op, sync_dist,
             add_dataloader_idx, batch_size):
        if self.stage == "predict":
            raise ConfigurationError(
                f"self.log({name!r}, ...) in predict: prediction logs no metrics (as in "
                "Lightning); return the values from predict_step, or compute metrics in test_step"
            )
        device = self.trainer.root_device
        metric = None
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.numel() != 1:
                raise ConfigurationError(
                    f"self.log({name!r}, ...) needs a scalar, got a tensor of shape "
                    f"{tuple(value.shape)}: reduce it first (e.g. .mean()), or log each element "
                    "under its own name"
                )
            value = value.reshape(())
            if value.device != device:
                value = value.to(device, non_blocking=True)
        elif isinstance(value, (int, float, bool)) or hasattr(value, "__float__"):
            value = torch.tensor(float(value), device=device)
        else:
            # A torchmetrics Metric (Lightning's rules): its step value is its forward()
            # result for this batch (none after update() alone), its epoch value its
            # compute() at the epoch's end, then reset(); it syncs itself, so sync_dist and
            # reduce_fx do not apply
            metric = _torchmetrics_metric(name, value)
            value = _scalar(name, metric._forward_cache, "forward() result", device)
            sync_dist = False
        suffix = self.suffix if add_dataloader_idx else ""
        # Lightning's names: x/dataloader_idx_0, and x_step/dataloader_idx_0 when forked
        step_key, epoch_key = f"{name}_step{suffix}", f"{name}_epoch{suffix}"
        name = name + suffix
        training = self.stage == "train" and not self.epoch_level
        if on_step is None:
            on_step = training
        if on_epoch is None:
            on_epoch = not training
        forked = on_step and on_epoch
        if metric is not None:
            # reset at the stage's end
            self.metric_objects.setdefault(self.stage, {})[id(metric)] = metric
            if value is None:
                on_step = False  # nothing for this step (Lightning logs no step value)
                if not on_epoch:
                    return
        if self.stage != "train" and on_step:
            # Lightning: an evaluation metric logged per step goes to the loggers once per
            # batch (as name_step when it is also per epoch), and only its epoch value is a
            # result and a callback metric
            key = step_key if on_epoch else name
            self.eval_step_row[key] = self.trainer.reduce(value, op) if sync_dist else value
            if prog_bar and not self.trainer.sanity_checking:
                self.eval_step_pbar[key] = self.eval_step_row[key]
            if not for_logger:
                self.not_for_logger.add(key)
            if not on_epoch:
                return
            on_step = False
        names = (name, step_key, epoch_key) if forked else (name,)
        if forked:
            self.forked[name] = (step_key, epoch_key)
            self.fork_parts[step_key], self.fork_parts[epoch_key] = ("step", name), ("epoch", name)
        if prog_bar:
            self.prog_bar.update(names)
        if not for_logger:
            self.not_for_logger.update(names)
        if on_step:
            # The step value is reduced now; the epoch sums below take the LOCAL value and
            # are reduced once at the epoch's end (as Lightning): summing values already
            # reduced and reducing again would count every rank world_size times.
            step_value = self.trainer.reduce(value, op) if sync_dist else value
            key = step_key if forked else name
            slot = self.step_values.get(key)
            replica = _replica_id()
            if slot is None or slot[0] != self.step_token:
                self.step_values[key] = [self.step_token, {replica: step_value}]
            else:
                slot[1][replica] = step_value  # another replica of the same step
        if on_epoch and metric is not None:
            key = epoch_key if forked else name
            self.epoch_metrics.setdefault(self.stage, {})[key] = metric
            if self.dataloader_idx is not None:
                self.loader_of[key] = self.dataloader_idx
        elif on_epoch:
            if batch_size is None:
                batch = getattr(_STEP_BATCH, "batch", None)
                batch = self.trainer.state.current_batch if batch is None else batch
                batch_size = batch_size_of(batch)
            key = epoch_key if forked else name
            if self.dataloader_idx is not None:
                self.loader_of[key] = self.dataloader_idx
            # Lightning's _ResultMetric: accumulate in the logged dtype, float32 (the default
            # dtype) for anything but float32/float64, so epoch means are bit-equal to its.
            v = value
            if value.dtype not in (torch.float32, torch.float64):
                v = value.to(torch.get_default_dtype())
            sums = self.epoch_sums.setdefault(self.stage, {})
            entry = sums.get(key)
            if entry is None:
                sums[key] = [v * batch_size, batch_size, sync_dist, op, v, v, v]
            else:
                entry[0] = entry[0] + v * batch_size
                entry[1] += batch_size
                entry[4] = entry[4] + v
                entry[5] = torch.maximum(entry[5], v)
                entry[6] = torch.minimum(entry[6], v)

    # -- stages -------------------------------------------------------------------------

    def reset_run(self) -> None:
        """Forget the previous run's metrics (``callback_metrics``, step values, progress
        bar names) at the start of ``fit``/``validate``/``test``/``predict``, as Lightning's
        ``reset_metrics()``: after ``fit`` then ``test`` only the test's metrics are left.
        A new dict, so one a caller kept from the previous run keeps its values."""
        self.callback_metrics = {}
        self.step_values = {}
        self.eval_step_row, self.eval_step_pbar = {}, {}
        self.prog_bar, self.not_for_logger, self.forked, self.fork_parts = set(), set(), {}, {}

    def start(self, stage: str) -> None:
        """A new epoch of ``stage``: forget its epoch sums (and, for training, the step
        values of the previous epoch)."""
        self.stage = stage
        self.epoch_sums[stage] = {}
        self.epoch_metrics[stage] = {}
        self.loader_of = {}
        if stage == "train":
            self.step_values = {}

    def epoch_tensors(self, stage: str) -> dict[str, torch.Tensor]:
        """The epoch values of ``stage`` as 0-d tensors on the root device, reduced across
        ranks where ``sync_dist`` asked for it (a collective: every rank calls this)."""
        out: dict[str, torch.Tensor] = {}
        reduce = self.trainer.reduce
        sums = self.epoch_sums.get(stage, {})
        for name, (total, count, sync, op, plain_sum, vmax, vmin) in sums.items():
            if op == "mean":
                if sync:
                    # Lightning: the mean over ranks of the sums, divided by the mean over
                    # ranks of the sample counts (both in the sum's dtype, like its sync).
                    world = self.trainer.world_size
                    n = torch.tensor(count, dtype=total.dtype, device=total.device)
                    pair = reduce(torch.stack([total, n]), "sum")
                    total, count = pair[0] / world, pair[1] / world
                out[name] = total / count
            elif op == "sum":
                out[name] = reduce(plain_sum, "sum") if sync else plain_sum
            elif op == "max":
                out[name] = reduce(vmax, "max") if sync else vmax
            else:
                out[name] = reduce(vmin, "min") if sync else vmin
        device = self.trainer.root_device
        for name, metric in self.epoch_metrics.get(stage, {}).items():
            # compute() syncs across ranks itself
            value = _scalar(name, metric.compute(), "compute() result", device)
            if value is not None:
                out[name] = value
        return out

    def finish_epoch(self, stage: str, publish: bool = True) -> dict[str, float]:
        """Reduce ``stage``'s epoch metrics into floats (one device transfer), add them
        (and, for training, the latest step values) to ``callback_metrics`` unless
        ``publish`` is False (the sanity check), and forget the sums. Returns what was
        computed."""
        tensors = self.epoch_tensors(stage)
        self.epoch_sums[stage], self.epoch_metrics[stage] = {}, {}
        out: dict[str, float] = {}
        if tensors:
            values = torch.stack([t.to(torch.float64) for t in tensors.values()]).tolist()
            for name, value in zip(tensors, values, strict=True):
                out[name] = value
                part = self.fork_parts.get(name)
                if part is not None and part[0] == "epoch":
                    out[part[1]] = value
        if stage == "train":
            self.epoch_token = self.step_token
            out = {**self.latest_step_values(), **out}  # the epoch value wins for a forked name
        if publish:
            self.callback_metrics.update(out)
        return out

    def reset_metric_objects(self, stage: str) -> None:
        """``reset()`` every torchmetrics Metric logged in ``stage``: after its epoch's end
        hooks (``on_train_epoch_end``, ``on_validation_end``...), as Lightning."""
        for metric in self.metric_objects.pop(stage, {}).values():
            metric.reset()

    def latest_step_values(self) -> dict[str, float]:
        """The last value of every per-step metric (the mean over DataParallel replicas)."""
        if not self.step_values:
            return {}
        names, tensors, fresh = [], [], []
        for name, (token, per_thread) in self.step_values.items():
            values = list(per_thread.values())
            names.append(name)
            one = len(values) == 1
            tensors.append(values[0] if one else torch.stack([v.double() for v in values]).mean())
            fresh.append(token > self.epoch_token)
        floats = torch.stack([t.to(torch.float64) for t in tensors]).tolist()
        out = dict(zip(names, floats, strict=True))
        for name, is_fresh in zip(names, fresh, strict=True):
            part = self.fork_parts.get(name)
            if part is not None and part[0] == "step" and is_fresh:
                out[part[1]] = out[name]
        return out

    def read(self) -> dict[str, float]:
        """``callback_metrics`` with the latest step values folded in (reads the device)."""
        if self.step_values:
            self.callback_metrics.update(self.latest_step_values())
        return self.callback_metrics

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The training epoch's partial sums and the reported metrics, for a resume
        mid-epoch that reports the same epoch means as an uninterrupted run."""
        train = self.kept_train_sums
        if train is None:
            train = self.epoch_sums.get("train", {})
        sums = {name: [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in entry]
                for name, entry in train.items()}
        return {"train_sums": sums, "callback_metrics": dict(self.read())}

    def load_state_dict(self, state: dict) -> None:
        device = self.trainer.root_device
        self.epoch_sums["train"] = {
            name: [t.to(device) if isinstance(t, torch.Tensor) else t for t in entry]
            for name, entry in (state.get("train_sums") or {}).items()
        }
        self.callback_metrics.update(state.get("callback_metrics") or {})

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]  # locks do not pickle (spawned workers get the trainer)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
