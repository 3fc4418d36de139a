"""``activation_checkpointing``: recompute named modules' activations in the backward pass.

An extension (not a strategy): it composes with any strategy (the single-process
default, ddp, ddp_sharded, pipe, ...). Before the strategy wraps the model, every
submodule of a class you name is wrapped with ``fairscale.nn.checkpoint_wrapper``: its
forward keeps only its inputs, and the activations inside it are recomputed when the
backward pass reaches it (less memory, one more forward of those modules). With
``offload_to_cpu`` the inputs it keeps are moved to the CPU as well. The wrapping is
undone at the end of the run.

DeepSpeed's own activation checkpointing (``partition_activations``,
``cpu_checkpointing``) applies to the ``deepspeed.checkpointing.checkpoint`` calls in your
model; FSDP's policy wraps module classes the same way as this plugin, with torch's
checkpoint. This one needs no change to the model and works with every strategy.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any

import torch
from torch import nn

import hookloop

from ._backend import require_fairscale


class ActivationCheckpointing:
    """Activation checkpointing of the module classes you name (``fairscale.nn.checkpoint_wrapper``).

    Options (constructor arguments, or ``plugin_options={"activation_checkpointing": {...}}``,
    ``--plugin-option activation_checkpointing.modules='["Block"]'``):

    ``modules``
        the classes to checkpoint: class objects, or names (``"Block"``, or qualified
        ``"mypackage.model.Block"``). A module of a named class inside another one that is
        checkpointed is not wrapped again. Default: none (the plugin does nothing, so that
        autoloading it changes nothing).
    ``offload_to_cpu``
        keep the checkpointed modules' inputs on the CPU until the backward pass (fairscale's
        option; for GPU memory).
    """

    hookloop_name = "activation_checkpointing"
    hookloop_role = "extension"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self, modules: list[Any] | tuple[Any, ...] = (), offload_to_cpu: bool = False):
        require_fairscale(self.hookloop_name)
        self.modules = modules
        self.offload_to_cpu = offload_to_cpu
        self._wrapped: list[tuple[nn.Module, Any]] = []  # (module, its previous instance forward)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "modules":
            if isinstance(value, (str, type)):
                value = [value]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, (str, type)) for v in value):
                raise hookloop.ConfigurationError(
                    f"activation_checkpointing option modules={value!r} must be a list of module "
                    f"classes or class names, e.g. ['Block'] or [mymodel.Block]")
            value = list(value)
        elif name == "offload_to_cpu" and not isinstance(value, bool):
            raise hookloop.ConfigurationError(f"activation_checkpointing option offload_to_cpu={value!r} must be True or False")
        object.__setattr__(self, name, value)

    def _matches(self, module: nn.Module) -> bool:
        cls = type(module)
        names = {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
        return any(m is cls if isinstance(m, type) else m in names for m in self.modules)

    @hookloop.hookimpl(wrapper=True)
    def wrap_model(self, trainer, model):
        """Wrap the named modules of the user's module, then let the strategy wrap the model.

        Without ``modules`` it does nothing: an extension loaded by
        ``HOOKLOOP_AUTOLOAD_PLUGINS`` must not change a run that did not ask for it."""
        if self.modules:
            self.apply(model.module)
        return (yield)

    def apply(self, root: nn.Module) -> list[str]:
        """Wrap every outermost submodule of ``root`` of a named class; their names."""
        from fairscale.nn import checkpoint_wrapper

        if not self.modules:
            raise hookloop.ConfigurationError(
                "activation_checkpointing has no modules to checkpoint: name their classes, e.g. "
                "hookloop.plugin('activation_checkpointing', modules=['Block']) or "
                "--plugin-option activation_checkpointing.modules='[\"Block\"]'")
        chosen: list[tuple[str, nn.Module]] = []
        for name, module in root.named_modules():
            if module is root or not self._matches(module):
                continue
            if any(name.startswith(outer + ".") for outer, _ in chosen):
                continue  # inside a module that is checkpointed already
            chosen.append((name, module))
        if not chosen:
            classes = sorted({type(m).__name__ for m in root.modules() if m is not root})
            wanted = [m.__name__ if isinstance(m, type) else m for m in self.modules]
            close = [c for w in wanted for c in difflib.get_close_matches(w.rsplit(".", 1)[-1], classes, n=1)]
            raise hookloop.ConfigurationError(
                f"activation_checkpointing modules={wanted} matches no submodule of "
                f"{type(root).__name__}; its module classes: {', '.join(classes)}"
                + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""))
        for _, module in chosen:
            self._wrapped.append((module, module.__dict__.get("forward")))
            checkpoint_wrapper(module, offload_to_cpu=self.offload_to_cpu)
            checkpointed = module.forward
            # WORKAROUND (fairscale 0.4.13, pinned): its recomputation restores CUDA's
            # autocast only, so under CPU autocast (bf16-mixed on the CPU) the recomputed
            # layers ran in fp32 on bf16 inputs and failed. Its wrapper is
            # partial(_checkpointed_forward, original_forward, weakref(module), offload);
            # the original forward is replaced by one that recomputes under the autocast
            # state the forward ran with.
            module.forward = functools.partial(checkpointed.func, _UnderForwardAutocast(checkpointed.args[0]),
                                               *checkpointed.args[1:])
        return [name for name, _ in chosen]

    @hookloop.hookimpl
    def teardown(self):
        """Give the wrapped modules their own forward back."""
        wrapped, self._wrapped = self._wrapped, []
        for module, previous in reversed(wrapped):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous


class _UnderForwardAutocast:
    """A module's forward that, when fairscale recomputes it in the backward pass, runs
    under the CPU autocast state its forward ran with (fairscale restores CUDA's itself)."""

    def __init__(self, forward):
        self.forward = forward
        self.state: tuple[bool, torch.dtype] = (False, torch.bfloat16)

    def __call__(self, module, *args, **kwargs):
        from fairscale.nn.checkpoint import is_recomputing

        if not is_recomputing():
            self.state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            return self.forward(module, *args, **kwargs)
        enabled, dtype = self.state
        with torch.autocast("cpu", dtype=dtype, enabled=enabled):
            return self.forward(module, *args, **kwargs)
