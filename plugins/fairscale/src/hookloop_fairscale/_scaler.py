"""fairscale's ShardedGradScaler, made to run on the CPU as well as on CUDA.

Imported only for ``precision="16-mixed"`` runs (it imports fairscale).
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from fairscale.optim.grad_scaler import OptState, _refresh_per_optimizer_state
from fairscale.optim.grad_scaler import ShardedGradScaler as FairscaleShardedGradScaler


class ShardedGradScaler(FairscaleShardedGradScaler):
    """The shard-aware loss scaler: whether any rank found inf/nan is decided by all.

    Under ddp_sharded each rank unscales and checks the gradients of its own partition;
    a plain ``GradScaler`` would let one rank skip its step while another steps (and
    OSS's parameter broadcast would then wait forever, or the weights drift apart).
    fairscale's ``ShardedGradScaler`` all-reduces the inf flag; this subclass keeps it on
    where fairscale turns it off without CUDA, and fixes two CPU paths of 0.4.13 (the
    flag was reduced on a CUDA copy and never copied back; the scale's CPU update stored
    the growth tracker as a Python int, which ``state_dict()`` cannot read).
    """

    def __init__(self, device_type: str, init_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, process_group=None):
        group = process_group if process_group is not None else dist.group.WORLD
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "CUDA is not available. Disabling." on the CPU
            super().__init__(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                             growth_interval=growth_interval, enabled=True, process_group=group)
        if not self._enabled:
            # Without CUDA torch's base initialiser (through torch.cuda.amp) left the scale
            # unset: initialise it for the CPU, then put fairscale's per-optimizer state back.
            torch.amp.GradScaler.__init__(self, device_type, init_scale=init_scale, growth_factor=growth_factor,
                                          backoff_factor=backoff_factor, growth_interval=growth_interval)
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            self.group = group

    def unscale_(self, optimizer) -> None:  # type: ignore[override]
        """Unscale this rank's gradients, then agree with every rank on inf/nan."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((1,), 0.0, dtype=torch.float32, device=self._scale.device)
        found = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        # One flag per rank, reduced once: a rank whose partition has no gradient on some
        # device still takes part in the same collective as the others.
        combined = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        for flag in found.values():
            combined += flag.to(combined.device)
        dist.all_reduce(combined, group=self.group)
        state["found_inf_per_device"] = {combined.device: combined}
        state["stage"] = OptState.UNSCALED

    def _amp_update_scale_cpu_(self, found_inf: torch.Tensor) -> None:  # type: ignore[override]
        torch._amp_update_scale_(self._scale, self._growth_tracker, found_inf,
                                 self._growth_factor, self._backoff_factor, self._growth_interval)
