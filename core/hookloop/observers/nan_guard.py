"""``nan_guard`` (opt-in): a non-finite or spiking loss, agreed on by every rank, skips
the step's update or stops the run.

Named ``nan_guard``, not Lightning's ``detect_anomaly``: that name is Lightning's switch
for ``torch.autograd.set_detect_anomaly`` (finding the operation that made a NaN in the
backward, at a large cost per step), a different tool; this one guards the weights
against a bad step at the cost of one number read per step.

At every optimizer step (automatic optimization), before the optimizer steps, each rank
checks the loss of the step's accumulation window (and, with ``check_grad_norm``, the norm
of its gradients) for a non-finite value, or, with ``spike_factor``, a loss above
``spike_factor`` times the median of the last ``window`` good steps' losses (of this rank;
the check starts once ``window`` are known). The ranks agree on the verdict in the
all-reduce that the preemption agreement uses (:meth:`hookloop.distributed.faults.Preemption.agree_now`),
which then runs at every step and is blocking (see hookloop.faults; without the guard it
runs every ``stop_check_every_n_steps`` steps, asynchronously): a verdict is per step by
nature, and a decision one step late would apply the bad update on every rank. The guard
is opt-in: only the runs that enable it pay that wait and the read of the loss. So every
rank takes the same action at the same step:

``action="skip"``: the optimizer does not step on any rank (the update is dropped, as
    ``GradScaler`` drops an inf/nan step; ``global_step`` and the schedulers still count
    it, as Lightning counts a skipped AMP step); the step's loss is not added to the
    spike history. ``skipped_steps`` counts them (saved in checkpoints).
``action="stop"``: the update is dropped, ``nan_guard.ckpt`` is written to the run's
    checkpoint directory (every rank: the save is collective; it resumes at the batch
    that went bad), a message names the step, the rank(s) and the value, and fit stops
    after this batch on every rank (``trainer.should_stop``).
"""

from __future__ import annotations

import math
import statistics
import sys

import torch

from hookloop.contract.errors import ConfigurationError
from hookloop.distributed.faults import preemption_checkpoint_path
from hookloop.contract.hookspecs import hookimpl

#: the verdicts, as the numbers the ranks all-reduce (MAX: the worse wins)
GOOD, SPIKE, NON_FINITE = 0.0, 1.0, 2.0
_WHAT = {SPIKE: "a loss spike", NON_FINITE: "a non-finite value"}


class NanGuard:
    """Skip or stop on a non-finite or spiking loss, every rank alike.

    action: "skip" (drop the step's update on every rank) or "stop" (checkpoint and stop)
    spike_factor: a loss above this many times the median of the last ``window`` good
        losses is a spike (None: only non-finite values count)
    window: how many recent good losses the median is taken over
    check_grad_norm: also treat a non-finite gradient norm as bad (leave off under fp16
        AMP: its GradScaler skips those steps itself); each rank checks its own gradients
        (fsdp's shards, a pipeline's stages; under DeepSpeed's ZeRO they are in the engine,
        not checked: its overflow check skips such steps itself)
    """

    hookloop_name = "nan_guard"
    hookloop_role = "observer"

    def __init__(self, action: str = "skip", spike_factor: float | None = None, window: int = 20,
                 check_grad_norm: bool = False):
        if action not in ("skip", "stop"):
            raise ConfigurationError(f"nan_guard action={action!r}: the choices are 'skip' and 'stop'")
        if spike_factor is not None and not (isinstance(spike_factor, (int, float)) and spike_factor > 1):
            raise ConfigurationError(
                f"nan_guard spike_factor={spike_factor!r} must be a number > 1 (a loss above that many times the "
                f"recent median is a spike), or None to check for non-finite values only")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigurationError(f"nan_guard window={window!r} must be an int >= 1")
        self.action, self.spike_factor, self.window = action, spike_factor, window
        self.check_grad_norm = check_grad_norm
        self.history: list[float] = []
        self.skipped_steps = 0
        #: (global_step, verdict name, global rank, value) of every bad step seen
        self.events: list[tuple[int, str, int, float]] = []
        self._loss: torch.Tensor | None = None

    @hookimpl
    def on_fit_start(self, trainer):
        if not trainer.automatic_optimization:
            raise ConfigurationError(
                "nan_guard checks the loss before the loop's optimizer step: it needs automatic optimization "
                "(the module sets automatic_optimization = False)")

    @hookimpl
    def on_before_backward(self, trainer, loss):
        # The window's loss: the micro-batches' losses, each already divided by the window.
        loss = loss.detach()
        first = trainer.batch_idx % trainer.accumulate_grad_batches == 0 or self._loss is None
        self._loss = loss.clone() if first else self._loss + loss

    @hookimpl(tryfirst=True)
    def optimizer_step(self, trainer, optimizer):
        """Before any plugin steps: agree; a bad step returns False (not taken)."""
        loss, self._loss = self._loss, None
        if loss is None:
            return None  # not a step of the loop (no loss seen): nothing to judge
        value = float(loss)
        verdict = self._verdict(value, optimizer)
        preemption = trainer.state.preemption
        if trainer.world_size > 1 and preemption is not None:
            agreed, rank = preemption.agree_now(trainer, verdict)
        elif trainer.world_size > 1:  # outside fit's loop: a reduce of its own
            flags = trainer.reduce(torch.tensor([verdict, (trainer.global_rank + 1) if verdict else 0.0]), "max")
            agreed, rank = float(flags[0]), int(flags[1]) - 1
        else:
            agreed, rank = verdict, (0 if verdict else -1)
        if not agreed:
            self.history.append(value)
            del self.history[:-self.window]
            return None  # good on every rank: the next implementation steps
        what = _WHAT[agreed]
        step = trainer.global_step
        self.events.append((step, what, rank, value))
        if verdict:  # this rank saw it: say its own value (each rank that did)
            print(f"hookloop: nan_guard: global rank {trainer.global_rank}: {what} at global step {step}: "
                  f"loss {value!r}{self._median_text()}", file=sys.stderr, flush=True)
        if self.action == "skip":
            self.skipped_steps += 1
            trainer.print(f"hookloop: nan_guard: skipped the update of global step {step} on every rank "
                          f"({what} on global rank {rank})", flush=True)
            return False
        path = preemption_checkpoint_path(trainer).with_name("nan_guard.ckpt")
        trainer.save_checkpoint(path)
        trainer.should_stop = True
        seen = f"loss {value!r}" if rank == trainer.global_rank else "its value is in that rank's line"
        trainer.print(f"hookloop: nan_guard: stopping at global step {step}: {what} on global rank {rank} "
                      f"({seen}); its update was not applied on any rank; checkpoint written to {path} (it "
                      f"resumes at this step's batch)", flush=True)
        return False

    def _verdict(self, value: float, optimizer) -> float:
        if not math.isfinite(value):
            return NON_FINITE
        if self.check_grad_norm:
            # this rank's gradients only (a DTensor's local shard, a pipeline's own stages):
            # the agreement (MAX) makes one rank's non-finite value every rank's verdict
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            if grads and not torch.isfinite(torch.stack([g.detach().float().norm() for g in grads]).sum()):
                return NON_FINITE
        if self.spike_factor is not None and len(self.history) >= self.window:
            if value > self.spike_factor * statistics.median(self.history):
                return SPIKE
        return GOOD

    def _median_text(self) -> str:
        if self.spike_factor is None or len(self.history) < self.window:
            return ""
        return f" (median of the last {self.window} good steps: {statistics.median(self.history)!r})"

    @hookimpl
    def on_save_checkpoint(self, checkpoint):
        checkpoint["plugins"]["nan_guard"] = {"history": list(self.history), "skipped_steps": self.skipped_steps}

    @hookimpl
    def on_load_checkpoint(self, checkpoint):
        state = checkpoint.get("plugins", {}).get("nan_guard")
        if state:
            self.history = list(state["history"])[-self.window:]
            self.skipped_steps = int(state["skipped_steps"])

