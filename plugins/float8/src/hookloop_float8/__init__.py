"""hookloop-float8: float8 training with torchao (``convert_to_float8_training``).

Every ``nn.Linear`` chosen (both dimensions multiples of 16, not excluded by ``skip``)
becomes torchao's ``Float8Linear``: its matmuls (forward, and the two of the backward)
run in float8 (e4m3 for inputs and weights, e5m2 for output gradients) with the
``recipe``'s scaling, the weights and the optimizer staying in their own precision.

* **Where it runs.** On CUDA GPUs with float8 tensor cores (compute capability 8.9 or
  newer: Ada, Hopper, Blackwell), where it is faster than bf16 (torchtitan: 8,532 against
  5,762 tokens/s per H100 on Llama-3.1-8B with FSDP + compile + float8). It is refused
  elsewhere with a :class:`hookloop.ConfigurationError` at ``setup``. On the CPU, torch
  2.13's ``torch._scaled_mm`` runs and torchao 0.18's ``Float8Linear`` trains, but each
  matmul converts its float8 operands back to float32 first: a 512-2048-512 MLP step
  (batch 256, one thread) took 0.153 s against 0.039 s in float32 (3.9x slower), with the
  loss of float8's precision (docs/decisions.md). A float8 run on the CPU would only be
  a slower, less precise float32 run.
* **torchao** is imported at ``setup``; missing, it is a
  :class:`hookloop.MissingDependencyError` naming ``pip install torchao``.
* **Order.** ``wrap_model`` returns ``None``: the layers are converted before a strategy
  that owns the lifecycle wraps the model (the core orders the transforms). It claims no
  mesh dimension (``hookloop_mesh_dims = ()``) and runs alone: beside any mesh plugin it is
  refused at construction, since no test checks those layouts yet
  (``hookloop_refuses_beside``; docs/configurations.md, "Every pair of mesh plugins").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hookloop

__all__ = ["Float8", "RECIPES", "MIN_CAPABILITY", "unsupported_reason"]

#: torchao's float8 recipes (``Float8LinearConfig.from_recipe_name``)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: the CUDA compute capability of float8 tensor cores (``torch._scaled_mm`` on CUDA)
MIN_CAPABILITY = (8, 9)
#: measured on this project's CPU machines (docs/decisions.md)
CPU_MEASUREMENT = ("on the CPU, torch._scaled_mm converts float8 back to float32 before each matmul: a 512-2048-512 "
                   "MLP step took 0.153 s against 0.039 s in float32 (3.9x slower), and less precise")


def _fail(message: str) -> hookloop.ConfigurationError:
    return hookloop.ConfigurationError(f"float8: {message}")


def unsupported_reason(device: torch.device) -> str | None:
    """Why float8 training does not run (usefully) on ``device``, or ``None``."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) >= MIN_CAPABILITY:
            return None
        return (f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}; "
                f"float8 matmuls (torch._scaled_mm) need float8 tensor cores, capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper: L4, L40, H100, H200)")
    return (f"float8 training runs on CUDA GPUs with float8 tensor cores (capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: L4, L40, H100, H200); this run's device is {device}: "
            f"{CPU_MEASUREMENT} (docs/decisions.md). Train in float32 or bf16-mixed here")


def import_torchao():
    """torchao's ``float8`` module, or a :class:`hookloop.MissingDependencyError`."""
    try:
        from torchao import float8
    except ImportError as error:
        raise hookloop.MissingDependencyError(
            f"float8: the float8 plugin needs torchao (convert_to_float8_training): pip install torchao "
            f"(or pip install hookloop-float8[torchao]); importing it failed: {error}") from None
    return float8


class Float8:
    """float8 training of the model's ``nn.Linear`` layers with torchao (CUDA, capability 8.9+).

    recipe: torchao's scaling recipe: "tensorwise" (default: one scale per tensor, the fastest), "rowwise" or "rowwise_with_gw_hp"
    skip: module names (fnmatch patterns, a list or one comma-separated string) left in high precision, e.g. "head,lm_head"
    """

    hookloop_name = "float8"
    hookloop_role = "extension"
    #: float8 changes the numerics and needs a GPU: chosen by name only
    hookloop_autoload = False
    hookloop_requires = ">=2,<3"
    #: it composes with the mesh plugins: it claims no mesh dimension
    hookloop_mesh_dims: tuple[str, ...] = ()
    #: refused at construction (hookloop.mesh.check_refusals): float8 is checked alone on
    #: one GPU (tests/gpu/test_float8_gpu.py); tp needs torchao's float8 tensor-parallel
    #: styles, and no test checks any other layout yet
    hookloop_refuses_beside = {
        d: f"float8 is checked alone on one GPU (tests/gpu/test_float8_gpu.py), and beside {what} no test "
           f"checks it yet{extra}: train float8 on one GPU, or {what} without float8"
        for d, what, extra in (
            ("tp", "tp", " (tp needs torchao's Float8ColwiseParallel/Float8RowwiseParallel styles)"),
            ("cp", "cp", ""), ("pp", "the pipeline", ""), ("dp_replicate", "ddp", ""), ("dp_shard", "fsdp", ""),
            ("compile", "compile", ""))}

    def __init__(self, recipe: str = "tensorwise", skip: list[str] | str | None = None):
        if recipe not in RECIPES:
            raise _fail(f"option recipe={recipe!r} must be one of {', '.join(map(repr, RECIPES))}")
        if isinstance(skip, str):
            skip = [s.strip() for s in skip.split(",") if s.strip()]
        if skip is not None and (not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) and s for s in skip)):
            raise _fail(f"option skip={skip!r} must be module names (fnmatch patterns)")
        self.recipe, self.skip = recipe, list(skip or [])
        #: the names of the layers the last wrap converted
        self.converted: list[str] = []
        self._float8: Any = None

    @hookloop.hookimpl
    def setup(self, trainer):
        """Refuse a device without float8 tensor cores, then import torchao."""
        reason = unsupported_reason(trainer.root_device)
        if reason is not None:
            raise _fail(reason)
        self._float8 = import_torchao()

    def chosen(self, name: str, module: nn.Module) -> bool:
        """Whether the layer ``name`` is converted: an ``nn.Linear`` whose dimensions are
        multiples of 16 (``torch._scaled_mm``'s requirement) that ``skip`` does not name."""
        import fnmatch

        return (isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
                and not any(fnmatch.fnmatchcase(name, p) for p in self.skip))

    @hookloop.hookimpl
    def wrap_model(self, trainer, model):
        """Convert the chosen layers of the user's module in place, before the strategy
        wraps it (returns ``None``)."""
        float8 = self._float8 or import_torchao()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        module = model.module
        self.converted = [n for n, m in module.named_modules() if self.chosen(n, m)]
        if not self.converted:
            raise _fail(f"no nn.Linear of {type(module).__name__} can run in float8 (both dimensions multiples "
                        f"of 16, not named in skip={self.skip!r})")
        float8.convert_to_float8_training(module, config=config, module_filter_fn=lambda m, fqn: self.chosen(fqn, m))
        if trainer.global_rank == 0:
            print(f"hookloop-float8: {len(self.converted)} layers in float8 ({self.recipe})", flush=True)
        return None
