"""hookloop-amp: automatic mixed precision as a hookloop precision plugin.

``precision="16-mixed"``: every forward runs under ``torch.autocast(dtype=float16)``,
the loss is scaled before backward by the loss scaler of the ``configure_grad_scaler``
hook (a ``torch.amp.GradScaler``, or a strategy's shard-aware one), gradients are
unscaled before clipping, a step whose gradients hold inf/nan is skipped and the scale
lowered (:class:`hookloop.GradScaling`).
``precision="bf16-mixed"``: bf16 autocast only (bf16 has fp32's range: no scaler).
``precision="32"``: nothing to do.

It composes with every strategy that leaves precision to it (the single-process
default, ``ddp``, ``dp``): it touches only the forward context, ``backward`` and
``optimizer_step``. A strategy that owns precision (``hookloop_owns={"precision"}``,
e.g. DeepSpeed) reads ``trainer.precision`` itself and this plugin steps aside, saying
so once.
"""

from __future__ import annotations

import math

import torch

import hookloop

MIXED = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class AMP:
    """Mixed precision: autocast around the forward, scaled backward for fp16.

    Options (``plugin_options={"amp": {...}}`` or ``hookloop.plugin("amp", ...)``):

    ``allow_cpu_fp16``
        fp16 mixed precision is meant for CUDA; on a CPU device it is an error that
        suggests ``bf16-mixed``. ``True`` runs fp16 autocast and a CPU ``GradScaler``
        anyway (slow; for tests and experiments of the scaler path).
    ``init_scale``, ``growth_interval``
        passed to ``torch.amp.GradScaler`` (defaults as in PyTorch).
    """

    hookloop_name = "amp"
    hookloop_role = "precision"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self, allow_cpu_fp16: bool = False, init_scale: float = 2.0**16, growth_interval: int = 2000):
        if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not (
                math.isfinite(init_scale) and init_scale > 0):
            raise hookloop.ConfigurationError(
                f"amp init_scale={init_scale!r} must be a finite number > 0 (the first loss scale of an fp16 run; "
                f"the default is 65536.0)")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise hookloop.ConfigurationError(
                f"amp growth_interval={growth_interval!r} must be an integer >= 1 (the steps without inf/NaN "
                f"gradients before the loss scale doubles; the default is 2000)")
        self.allow_cpu_fp16 = allow_cpu_fp16
        self.init_scale = init_scale
        self.growth_interval = growth_interval
        self.scaling: hookloop.GradScaling | None = None
        self.dtype: torch.dtype | None = None
        self.device_type: str | None = None
        self._told_handover = False

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler of an fp16 run (``None`` otherwise)."""
        return self.scaling.scaler if self.scaling is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because of inf/nan gradients, in this run."""
        return self.scaling.skipped_steps if self.scaling is not None else 0

    # -- setup ----------------------------------------------------------------------------

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        """Choose the autocast dtype for ``trainer.precision`` and build the scaler."""
        self.scaling, self.dtype, self.device_type = None, None, None
        self._trainer = trainer  # for backward's trainer.backward_kwargs
        precision = trainer.precision
        if precision == "32":
            return
        if trainer.strategy_owns("precision"):
            # The strategy applies it (e.g. DeepSpeed's fp16/bf16 engine); autocasting or
            # scaling here as well would apply it twice.
            if not self._told_handover and trainer.global_rank == 0:
                strategy = getattr(trainer.strategy, "hookloop_name", type(trainer.strategy).__name__)
                print(
                    f"hookloop-amp: precision={precision!r} is applied by the strategy "
                    f"{strategy!r}, which owns precision; amp leaves it to it",
                    flush=True,
                )
            self._told_handover = True
            return
        if precision not in MIXED:
            raise hookloop.ConfigurationError(
                f"precision={precision!r} is not mixed precision: hookloop-amp applies "
                f"'16-mixed' and 'bf16-mixed' (autocast, fp32 weights). Use one of those, "
                f"or a strategy that owns precision and supports {precision!r} (deepspeed)"
            )
        device = trainer.root_device
        dtype = MIXED[precision]
        if dtype is torch.float16 and device.type != "cuda" and not (device.type == "cpu" and self.allow_cpu_fp16):
            where = "this machine has no CUDA GPU" if not torch.cuda.is_available() else f"this run's device is {device}"
            raise hookloop.ConfigurationError(
                f"precision='16-mixed' (fp16 autocast with a GradScaler) needs a CUDA GPU, and "
                f"{where}: use precision='bf16-mixed' (--precision bf16-mixed), which runs on "
                f"CPU, or precision='32'"
            )
        if dtype is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise hookloop.ConfigurationError(
                f"precision='bf16-mixed' but {torch.cuda.get_device_name(device)} does not "
                f"support bfloat16 (it needs compute capability 8.0, Ampere, or newer): use "
                f"precision='16-mixed'"
            )
        self.dtype, self.device_type = dtype, device.type
        if dtype is torch.float16 and stage == "fit":
            # The strategy may give a shard-aware scaler (ddp_sharded); the default is
            # torch.amp.GradScaler(device.type, **options).
            options = {"init_scale": self.init_scale, "growth_interval": self.growth_interval}
            self.scaling = hookloop.GradScaling(
                trainer.hook.configure_grad_scaler(trainer=trainer, device=device, options=options))

    @hookloop.hookimpl
    def teardown(self):
        """Nothing to release; the scaler lives until the next ``setup``."""

    # -- the step -------------------------------------------------------------------------

    @hookloop.hookimpl
    def forward_context(self):
        """``torch.autocast`` with the run's dtype, on the root device's type."""
        if self.dtype is None:
            return None
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    @hookloop.hookimpl
    def backward(self, loss):
        """fp16: backward of the scaled loss (with ``trainer.backward_kwargs``, e.g.
        ``manual_backward``'s ``retain_graph``). bf16/32: defer to the strategy/default."""
        scaling = self.scaling
        if scaling is None:
            return None
        return scaling.backward(self._trainer, loss)

    @hookloop.hookimpl
    def optimizer_step(self, trainer, optimizer):
        """fp16: unscale, clip, step unless inf/nan, update the scale
        (:meth:`hookloop.GradScaling.step`).

        Returns ``False`` when the step was skipped. bf16/32: defer (``None``).
        """
        scaling = self.scaling
        if scaling is None:
            return None
        return scaling.step(trainer, optimizer)

    # -- checkpoints ----------------------------------------------------------------------

    @hookloop.hookimpl
    def on_save_checkpoint(self, trainer, checkpoint):
        """Store the scaler's state (scale, growth tracker) so a resume continues it."""
        if self.scaling is not None:
            checkpoint["plugins"]["amp"] = {
                "precision": trainer.precision,
                "scaler": self.scaler.state_dict(),
                "skipped_steps": self.skipped_steps,
            }

    @hookloop.hookimpl
    def on_load_checkpoint(self, checkpoint):
        """Restore the scaler's state when both the checkpoint and this run use one."""
        state = checkpoint.get("plugins", {}).get("amp")
        if state is None or self.scaling is None:
            return  # fp32/bf16 on one side: there is no scale to carry over
        self.scaling.load_state_dict(state["scaler"], state.get("skipped_steps", 0))
