"""hookloop-ema: an exponential moving average of the weights, as a hookloop plugin.

Everything a plugin needs is here: a class with ``hookloop_name`` and ``hookloop_role``,
hook implementations marked with ``@hookloop.hookimpl`` that take only the arguments
they use, state saved into and restored from checkpoints, and an entry point in
``pyproject.toml``.
"""

from __future__ import annotations

import torch

import hookloop


class EMA:
    """Keep ``ema = decay * ema + (1 - decay) * w`` for every floating-point weight.

    Options:

    ``decay`` (0.9)
        how much of the average each optimizer step keeps, in (0, 1).
    ``apply_at_end`` (True)
        copy the averaged weights into the model when ``fit`` ends.
    """

    hookloop_name = "example_ema"  # its entry-point name (`ema` is hookloop-averaging's)
    hookloop_role = "extension"  # composes with any strategy and precision plugin
    hookloop_requires = ">=2,<3"  # the hookloop plugin contract versions it is written for

    def __init__(self, decay: float = 0.9, apply_at_end: bool = True):
        if not 0.0 < decay < 1.0:
            raise hookloop.ConfigurationError(f"ema decay={decay!r} must be in (0, 1)")
        self.decay = decay
        self.apply_at_end = apply_at_end
        self.shadow: dict[str, torch.Tensor] = {}
        self._last_step = 0

    @staticmethod
    def _weights(trainer) -> dict[str, torch.Tensor]:
        return {k: v for k, v in trainer.module.state_dict().items() if v.is_floating_point()}

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        # A resumed run already restored the shadow in on_load_checkpoint.
        if not self.shadow:
            self.shadow = {k: v.detach().clone() for k, v in self._weights(trainer).items()}
        self._last_step = trainer.global_step

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer):
        if trainer.global_step == self._last_step:
            return  # an accumulating micro-batch: the weights did not change
        self._last_step = trainer.global_step
        with torch.no_grad():
            for name, weight in self._weights(trainer).items():
                self.shadow[name].mul_(self.decay).add_(weight, alpha=1.0 - self.decay)

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        if self.apply_at_end:
            trainer.module.load_state_dict(self.shadow, strict=False)

    @hookloop.hookimpl
    def on_save_checkpoint(self, checkpoint):
        checkpoint["plugins"]["example_ema"] = {"decay": self.decay, "shadow": dict(self.shadow)}

    @hookloop.hookimpl
    def on_load_checkpoint(self, checkpoint):
        state = checkpoint["plugins"].get("example_ema")
        if state is not None:
            self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
