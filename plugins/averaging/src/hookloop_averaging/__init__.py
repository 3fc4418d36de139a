"""hookloop-averaging: averages of the weights kept beside training (issue 22, item 6).

* ``ema``: an exponential moving average after optimizer steps, as Lightning 2.6's
  ``EMAWeightAveraging`` (``AveragedModel`` with ``get_ema_avg_fn``): the first update
  copies the weights, each later one is ``avg = decay * avg + (1 - decay) * w``.
* ``swa``: stochastic weight averaging as Lightning 2.6's ``StochasticWeightAveraging``
  (``torch.optim.swa_utils``): an equal average of the weights taken at the start of each
  epoch from ``swa_epoch_start`` on, ``SWALR`` in place of the module's schedulers, and
  ``torch.optim.swa_utils.update_bn`` over the train loader at the end of fit.

Both validate on the averaged weights (swapped in for validation, swapped back for
training), copy the average into the model when ``fit`` ends, and keep their state (the
averaged tensors, the number averaged, the SWA scheduler) in checkpoints, so a resumed run
ends bit-identical to an uninterrupted one. The averages are elementwise, so under a
sharded strategy (fsdp: DTensor parameters) each rank averages its own local shards, which
equals averaging the full tensors; the shards' state then goes in each rank's
``rank_state`` rather than rank 0's checkpoint. Under DeepSpeed ZeRO-3 (partitioned
parameters, ``p.data`` empty between uses) the weights are read and written inside
``deepspeed.zero.GatheredParameters`` and the average is kept whole on every rank.
Pipeline strategies (fairscale's ``ddp_sequential``, hookloop's ``pipeline``) are refused:
each rank steps only its stage's parameters (docs/errors.md S17, S18).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import hookloop
from hookloop.distributed.ranks import rank_zero_info, rank_zero_warn

__all__ = ["EMA", "SWA"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local shard (a view: writes reach the parameter)."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).detach()


def _is_sharded(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "to_local") and hasattr(tensor, "placements")


@contextlib.contextmanager
def _whole(module: torch.nn.Module, modify: bool):
    """Inside: every DeepSpeed ZeRO-3 parameter of ``module`` whole in ``p.data`` (ZeRO-3
    partitions it and empties ``p.data`` between uses: averaging that would average
    nothing). ``modify``: what rank 0 wrote is broadcast and partitioned again on exit
    (every rank writes the same). Every rank must enter it (a collective); nothing to do
    without ZeRO-3 parameters."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
        yield


#: strategies whose ranks each train only their pipeline stage's layers (refused)
_STAGED = ("ddp_sequential", "pipeline")


def _torch_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` that ``optimizer`` is or wraps: DeepSpeed's ZeRO
    optimizers are not torch optimizers (SWALR refuses them) and hold the user's in
    ``.optimizer``, sharing its param groups."""
    while not isinstance(optimizer, torch.optim.Optimizer) and getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    return optimizer


def _checked_avg_fn(plugin: str, avg_fn: Any) -> Any:
    if avg_fn is not None and not callable(avg_fn):
        raise hookloop.ConfigurationError(
            f"{plugin} avg_fn={avg_fn!r} must be a function (average, weights, num_averaged) -> new average, "
            f"as torch.optim.swa_utils.AveragedModel's, or None")
    return avg_fn


class _Averaging:
    """What EMA and SWA share: the averaged tensors, the validation swap, the copy at the
    end of fit, and checkpoint state."""

    hookloop_role = "extension"
    hookloop_requires = ">=2,<3"
    hookloop_autoload = False  # it changes the weights: enabled by name only
    hookloop_name = ""
    _with_buffers = True  # EMA keeps the buffers (averaged or copied); SWA the parameters only

    def _reset(self) -> None:
        self.average: dict[str, torch.Tensor] | None = None  # name -> averaged local tensor
        self.n_averaged = 0
        self._loaded: dict | None = None
        self._sharded = False
        self._swapped = False
        self._fitting = False

    # -- strategies -----------------------------------------------------------------------

    @hookloop.hookimpl(tryfirst=True)
    def setup_environment(self, trainer):
        """Refuse, before the strategy starts, a strategy whose ranks each train only
        some of the layers: pipeline stages (fairscale's ``ddp_sequential``, hookloop's
        own ``pipeline``, whose ranks keep the whole module but step only their stages'
        parameters, the others' stale between its broadcasts)."""
        staged = [getattr(p, "hookloop_name", "") for p in trainer.plugins
                  if getattr(p, "hookloop_name", "") in _STAGED]
        if staged:
            raise hookloop.ConfigurationError(
                f"{self.hookloop_name} with {staged[0]!r} is not supported: each rank trains only its pipeline "
                f"stage's layers, so the average a rank keeps would hold the other stages' stale layers, and "
                f"the checkpoint (rank 0's) the first stage's average only. Use {self.hookloop_name} with ddp, "
                f"ddp_sharded, fsdp or deepspeed (ZeRO 0-3)")
        return None

    # -- the tensors --------------------------------------------------------------------

    def _current(self, trainer) -> dict[str, torch.Tensor]:
        """The model's tensors this plugin keeps an average of (local shards), by name."""
        module = trainer.module
        named = dict(module.named_parameters())
        if self._with_buffers:
            named.update(module.named_buffers())
        self._sharded = any(_is_sharded(t) for t in named.values())
        return {name: _local(t) for name, t in named.items()}

    def _start(self, trainer) -> None:
        """Allocate the average (a copy of the weights now, as ``AveragedModel``'s deepcopy)
        or restore it from the checkpoint that ``fit`` resumed from."""
        self._fitting = True
        with _whole(trainer.module, modify=False):
            self.average = {n: t.clone() for n, t in self._current(trainer).items()}
        state, self._loaded = self._loaded, None
        current = self.average
        if state is None:
            self._fresh_state()
            return
        saved = state["average"]
        if set(saved) != set(current):
            missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
            raise hookloop.CheckpointError(
                f"{self.hookloop_name}: the checkpoint's averaged weights do not match the model "
                f"(missing: {missing[:5]}, unexpected: {extra[:5]}); resume with the model it was "
                f"trained with, or without --plugins {self.hookloop_name}"
            )
        with torch.no_grad():
            for name, tensor in self.average.items():
                if saved[name].shape != tensor.shape:
                    raise hookloop.CheckpointError(
                        f"{self.hookloop_name}: the checkpoint's average of {name!r} has shape "
                        f"{tuple(saved[name].shape)}, this run's (local) {name!r} {tuple(tensor.shape)}: "
                        f"a sharded average resumes on the same number of processes"
                    )
                tensor.copy_(saved[name])
        self.n_averaged = int(state["n_averaged"])
        self._restore_state(state)

    def _update(self, trainer) -> None:
        """One update of the average with the model's weights now (``AveragedModel``'s
        ``update_parameters``: the first copies)."""
        with torch.no_grad(), _whole(trainer.module, modify=False):
            current = self._current(trainer)
            for name, avg in self.average.items():
                cur = current[name]
                if self.n_averaged == 0 or not self._is_averaged(name):
                    avg.copy_(cur)
                elif self.avg_fn is not None:  # Lightning's avg_fn: (average, current, num_averaged)
                    count = torch.tensor(self.n_averaged, dtype=torch.long, device=avg.device)
                    avg.copy_(self.avg_fn(avg, cur, count))
                else:
                    self._average_one(avg, cur)
        self.n_averaged += 1

    def _is_averaged(self, name: str) -> bool:
        return True

    def _swap(self, trainer) -> None:
        with torch.no_grad(), _whole(trainer.module, modify=True):
            current = self._current(trainer)
            for name, avg in self.average.items():
                tmp = avg.clone()
                avg.copy_(current[name])
                current[name].copy_(tmp)
        self._swapped = not self._swapped

    def _copy_to_model(self, trainer, names=None) -> None:
        with torch.no_grad(), _whole(trainer.module, modify=True):
            current = self._current(trainer)
            for name, avg in self.average.items():
                if names is None or name in names:
                    current[name].copy_(avg)

    # -- Lightning's callback hooks ---------------------------------------------------------
    # A Lightning subclass (``class MyEMA(EMA)``) overrides Lightning's hooks and calls
    # super() with Lightning's arguments: the hook implementations below take them too
    # (with defaults, which pluggy never passes), and setup/teardown exist to be called so.

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Lightning's ``WeightAveraging.setup``: nothing to do here (the average starts
        at ``on_fit_start``); a subclass's override is called when fit, validate, test or
        predict begins, before the module's ``setup``, as in Lightning."""

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """Lightning's ``teardown``: nothing to do here; a subclass's override is called."""

    # -- validation on the average ------------------------------------------------------

    @hookloop.hookimpl(tryfirst=True)
    def on_validation_start(self, trainer, pl_module=None):
        if self.validate_on_average and self._fitting and self.average is not None and self.n_averaged:
            self._swap(trainer)

    @hookloop.hookimpl(tryfirst=True)
    def on_validation_end(self, trainer, pl_module=None):
        # first of all implementations: a checkpoint written here has the trained weights
        if self._swapped:
            self._swap(trainer)

    @hookloop.hookimpl
    def on_exception(self, trainer, pl_module=None, exception=None):
        if self._swapped and self.average is not None:
            self._swap(trainer)

    # -- checkpoints --------------------------------------------------------------------

    def _state(self) -> dict:
        return {"n_averaged": self.n_averaged, "average": dict(self.average or {}), **self._extra_state()}

    @hookloop.hookimpl
    def on_save_checkpoint(self, checkpoint):
        if self.average is not None and not self._sharded:
            checkpoint["plugins"][self.hookloop_name] = self._state()

    @hookloop.hookimpl
    def on_save_rank_checkpoint(self, rank_state):
        if self.average is not None and self._sharded:
            rank_state[self.hookloop_name] = self._state()

    @hookloop.hookimpl
    def on_load_checkpoint(self, checkpoint):
        state = checkpoint.get("plugins", {}).get(self.hookloop_name)
        if state is not None:
            self._loaded = state

    @hookloop.hookimpl
    def on_load_rank_checkpoint(self, rank_state, rank_states):
        if rank_state is None:
            if any(isinstance(s, dict) and self.hookloop_name in s for s in rank_states or ()):
                raise hookloop.CheckpointError(
                    f"{self.hookloop_name}: the checkpoint's averaged weights are sharded over "
                    f"{len(rank_states)} processes; resume on {len(rank_states)} processes"
                )
            return
        state = rank_state.get(self.hookloop_name)
        if state is not None:
            self._loaded = state


class EMA(_Averaging):
    """An exponential moving average of the weights, as Lightning's ``EMAWeightAveraging``.

    Updated after an optimizer step whose index ``i = global_step - 1`` satisfies
    ``i >= update_starting_at_step`` and ``i % update_every_n_steps == 0``; the first
    update copies the weights, each later one is ``avg = decay * avg + (1 - decay) * w``
    (torch's ``get_ema_avg_fn``). Validation runs on the average (once one exists), and
    the average is copied into the model when ``fit`` ends.

    decay: the share of the average each update keeps, in [0, 1] (default 0.999)
    update_every_n_steps: update after every N-th optimizer step (default 1)
    update_starting_at_step: the first optimizer step index that updates (the warm-up; default 0)
    use_buffers: True: average the buffers too (Lightning's default); False: copy the model's buffers at each update
    validate_on_average: validate on the averaged weights (default True)
    apply_at_end: copy the average into the model when fit ends (default True)
    avg_fn: Lightning's WeightAveraging(avg_fn=...): new_average = avg_fn(average, weights, num_averaged) in place of the decay formula (default None)
    """

    hookloop_name = "ema"

    def __init__(self, decay: float = 0.999, update_every_n_steps: int = 1, update_starting_at_step: int = 0,
                 use_buffers: bool = True, validate_on_average: bool = True, apply_at_end: bool = True,
                 avg_fn: Any = None):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise hookloop.ConfigurationError(f"ema decay={decay!r} must be a number in [0, 1]")
        for name, value, low in (("update_every_n_steps", update_every_n_steps, 1),
                                 ("update_starting_at_step", update_starting_at_step, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise hookloop.ConfigurationError(f"ema {name}={value!r} must be an integer >= {low}")
        self.decay = float(decay)
        self.avg_fn = _checked_avg_fn("ema", avg_fn)
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.use_buffers = bool(use_buffers)
        self.validate_on_average = bool(validate_on_average)
        self.apply_at_end = bool(apply_at_end)
        self._reset()

    def _fresh_state(self) -> None:
        self.n_averaged, self.latest_update_step = 0, 0

    def _restore_state(self, state: dict) -> None:
        self.latest_update_step = int(state["latest_update_step"])

    def _extra_state(self) -> dict:
        return {"latest_update_step": self.latest_update_step}

    def _is_averaged(self, name: str) -> bool:
        return self.use_buffers or name in self._params

    def _average_one(self, avg: torch.Tensor, cur: torch.Tensor) -> None:
        avg.copy_(self.decay * avg + (1 - self.decay) * cur)  # torch's get_ema_avg_fn, then copy_

    @hookloop.hookimpl
    def on_fit_start(self, trainer, pl_module=None):
        self._start(trainer)
        self._params = set(dict(trainer.module.named_parameters()))

    @hookloop.hookimpl(tryfirst=True)
    def on_train_batch_end(self, trainer, pl_module=None, outputs=None, batch=None, batch_idx=None):
        step = trainer.global_step
        if step <= self.latest_update_step:
            return  # no optimizer step since the last update (accumulation), or already done
        index = step - 1
        if index >= self.update_starting_at_step and index % self.update_every_n_steps == 0:
            self._update(trainer)
            self.latest_update_step = step

    @hookloop.hookimpl
    def on_fit_end(self, trainer, pl_module=None):
        self._fitting = False
        if self.apply_at_end and self.average is not None and self.n_averaged:
            self._copy_to_model(trainer)


class _Frozen:
    """A module's LR scheduler held still while SWALR drives the optimizer (Lightning swaps
    it out); its state is saved and restored as before, so checkpoints keep their shape."""

    def __init__(self, scheduler):
        self.held = scheduler

    def step(self, *args, **kwargs):
        return None

    def __getattr__(self, name):
        return getattr(self.__dict__["held"], name)


class SWA(_Averaging):
    """Stochastic weight averaging, as Lightning's ``StochasticWeightAveraging``
    (``torch.optim.swa_utils``).

    From epoch ``swa_start`` (0-based: ``swa_epoch_start - 1`` for an int,
    ``max(int(swa_epoch_start * max_epochs) - 1, 0)`` for a float in [0, 1]) the
    parameters are averaged equally at the start of every epoch (so the average holds the
    weights at the end of epochs ``swa_start - 1`` .. ``max_epochs - 2``, as Lightning's),
    and ``SWALR(swa_lrs, annealing_epochs, annealing_strategy)`` steps at each epoch's end
    in place of the module's schedulers (held still). When ``fit`` ends the average is
    copied into the parameters and, if the model has BatchNorm layers, their statistics are
    recomputed with ``torch.optim.swa_utils.update_bn`` over the train loader as given to
    ``fit`` (``trainer.train_dataloader``: under ddp/fsdp every rank passes over all of it,
    unsharded, so the ranks end with the same statistics). One optimizer only.

    swa_lrs: the SWA learning rate, one float or one per parameter group (default None: the optimizer's rates when SWA starts)
    swa_epoch_start: the epoch SWA starts: an int >= 1 (1-based, as Lightning) or a fraction of max_epochs in [0, 1] (default 0.8)
    annealing_epochs: epochs SWALR anneals over (default 10)
    annealing_strategy: "cos" or "linear" (default "cos")
    update_bn: recompute BatchNorm statistics on the averaged weights at the end of fit (default True)
    validate_on_average: validate on the averaged weights (default True; Lightning's SWA validates the trained ones)
    apply_at_end: copy the average into the model when fit ends (default True)
    avg_fn: Lightning's avg_fn: new_average = avg_fn(average, weights, num_averaged) in place of the equal average (default None)
    """

    hookloop_name = "swa"
    _with_buffers = False

    def __init__(self, swa_lrs: Any = None, swa_epoch_start: Any = 0.8, annealing_epochs: int = 10,
                 annealing_strategy: str = "cos", update_bn: bool = True, validate_on_average: bool = True,
                 apply_at_end: bool = True, avg_fn: Any = None):
        if isinstance(swa_epoch_start, bool) or not isinstance(swa_epoch_start, (int, float)) or (
                isinstance(swa_epoch_start, int) and swa_epoch_start < 1) or (
                isinstance(swa_epoch_start, float) and not 0.0 <= swa_epoch_start <= 1.0):
            raise hookloop.ConfigurationError(
                f"swa swa_epoch_start={swa_epoch_start!r} should be a >0 integer or a float between 0 and 1 "
                f"(Lightning's words): an int >= 1 is the 1-based epoch, a float in [0, 1] a fraction of max_epochs")
        lrs = swa_lrs if isinstance(swa_lrs, (list, tuple)) else [swa_lrs]
        if swa_lrs is not None and not all(isinstance(lr, float) and lr > 0 for lr in lrs):
            # Lightning's rule: floats only (an int learning rate is refused there too)
            raise hookloop.ConfigurationError(
                f"swa swa_lrs={swa_lrs!r} should be a positive float, or a list of positive floats (one per "
                f"parameter group), e.g. swa_lrs=1e-2")
        if isinstance(annealing_epochs, bool) or not isinstance(annealing_epochs, int) or annealing_epochs < 0:
            raise hookloop.ConfigurationError(f"swa annealing_epochs={annealing_epochs!r} must be an integer >= 0")
        if annealing_strategy not in ("cos", "linear"):
            raise hookloop.ConfigurationError(
                f"swa annealing_strategy={annealing_strategy!r} must be 'cos' or 'linear'")
        self.swa_lrs = swa_lrs
        self.avg_fn = _checked_avg_fn("swa", avg_fn)
        self.swa_epoch_start = swa_epoch_start
        self.annealing_epochs = annealing_epochs
        self.annealing_strategy = annealing_strategy
        self.update_bn = bool(update_bn)
        self.validate_on_average = bool(validate_on_average)
        self.apply_at_end = bool(apply_at_end)
        self._reset()
        self.scheduler = None

    def _fresh_state(self) -> None:
        self.n_averaged, self.latest_update_epoch, self._scheduler_state = 0, -1, None

    def _restore_state(self, state: dict) -> None:
        self.latest_update_epoch = int(state["latest_update_epoch"])
        self._scheduler_state = state["scheduler_state"]

    def _extra_state(self) -> dict:
        return {"latest_update_epoch": self.latest_update_epoch,
                "scheduler_state": None if self.scheduler is None else self.scheduler.state_dict()}

    def _average_one(self, avg: torch.Tensor, cur: torch.Tensor) -> None:
        # Lightning's StochasticWeightAveraging.avg_fn (torch's get_swa_avg_fn)
        avg.copy_(avg + (cur - avg) / (self.n_averaged + 1))

    @hookloop.hookimpl
    def on_fit_start(self, trainer, pl_module=None):
        if len(trainer.optimizers) != 1:
            raise hookloop.ConfigurationError(
                f"swa works with one optimizer; configure_optimizers returned {len(trainer.optimizers)}")
        max_epochs = trainer.max_epochs
        unbounded = max_epochs is None or max_epochs < 0
        if isinstance(self.swa_epoch_start, float):
            if unbounded:
                raise hookloop.ConfigurationError(
                    "swa swa_epoch_start as a fraction needs max_epochs; give it as an int epoch instead")
            start = int(max_epochs * self.swa_epoch_start)
        else:
            start = self.swa_epoch_start
        self.swa_start = max(start - 1, 0)
        self.swa_end = float("inf") if unbounded else max_epochs - 1
        self._max_epochs = max_epochs
        self._held = []
        self._start(trainer)
        if self._scheduler_state is not None:
            self._make_scheduler(trainer, resumed=True)

    def _make_scheduler(self, trainer, resumed: bool) -> None:
        from torch.optim.swa_utils import SWALR

        optimizer = _torch_optimizer(trainer.optimizers[0])
        groups = optimizer.param_groups
        lrs = self.swa_lrs if isinstance(self.swa_lrs, (list, tuple)) else [self.swa_lrs] * len(groups)
        if len(lrs) != len(groups):
            raise hookloop.ConfigurationError(
                f"swa swa_lrs has {len(lrs)} rates for an optimizer of {len(groups)} parameter groups")
        lrs = [group["lr"] if lr is None else float(lr) for lr, group in zip(lrs, groups)]
        restored = [group["lr"] for group in groups]  # a resume: the optimizer's own, restored
        for lr, group in zip(lrs, groups):
            group["initial_lr"] = lr
        self.scheduler = SWALR(optimizer, swa_lr=lrs, anneal_epochs=self.annealing_epochs,
                               anneal_strategy=self.annealing_strategy,
                               last_epoch=self._max_epochs if self.annealing_strategy == "cos" else -1)
        # the loop's step function may hold the optimizer's step from before SWALR wrapped
        # it: say the optimizer has stepped (it has), or torch warns "step() before optimizer.step()"
        optimizer._opt_called = True
        if resumed:
            self.scheduler.load_state_dict(self._scheduler_state)
            for lr, group in zip(restored, groups):
                group["lr"] = lr  # SWALR's constructor stepped them; its recurrence reads them
        self._scheduler_state = None
        for config in trainer.lr_scheduler_configs:  # hold the module's schedulers still
            if getattr(config.scheduler, "optimizer", None) is optimizer and not isinstance(config.scheduler, _Frozen):
                if not resumed:  # Lightning's warning and info line, at the same moment
                    if config.interval != "epoch" or config.frequency != 1:
                        rank_zero_warn(f"SWA is currently only supported every epoch. Found {config.scheduler.__class__.__name__} "
                                       f"stepping every {config.frequency} {config.interval}(s): SWALR steps at each "
                                       f"epoch's end while SWA averages", category=UserWarning)
                    rank_zero_info(f"Swapping scheduler `{config.scheduler.__class__.__name__}` for `SWALR`")
                self._held.append((config, config.scheduler))
                config.scheduler = _Frozen(config.scheduler)

    @hookloop.hookimpl(wrapper=True)
    def on_train_epoch_start(self, trainer, pl_module=None):
        # a wrapper: before every other implementation, the module's hook included (Lightning
        # calls a callback's on_train_epoch_start before the module's, which may read SWALR's
        # initial_lr/swa_lr in the optimizer's param groups)
        epoch = trainer.current_epoch
        if self.swa_start <= epoch <= self.swa_end:
            if self.scheduler is None:
                self._make_scheduler(trainer, resumed=False)
            if epoch > self.latest_update_epoch:
                self._update(trainer)
                self.latest_update_epoch = epoch
        return (yield)

    @hookloop.hookimpl(tryfirst=True)
    def on_train_epoch_end(self, trainer, pl_module=None):
        # an epoch that ran to its end (not one stopped inside by max_steps): Lightning's
        # epoch-interval SWALR step; before the checkpoint observer saves at this event
        if self.scheduler is not None and trainer.state.loop_stage == "epoch_end":
            self.scheduler.step()

    @hookloop.hookimpl
    def on_fit_end(self, trainer, pl_module=None):
        self._fitting = False
        for config, scheduler in self._held:
            config.scheduler = scheduler
        self._held = []
        if not (self.apply_at_end and self.average is not None and self.n_averaged):
            return
        self._copy_to_model(trainer)
        bn = [m for m in trainer.module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if self.update_bn and bn and trainer.train_dataloader is not None:
            from torch.optim.swa_utils import update_bn

            update_bn(trainer.train_dataloader, trainer.module, device=trainer.root_device)
