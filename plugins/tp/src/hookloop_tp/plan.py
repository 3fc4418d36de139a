"""The tensor-parallel plan: the module's own, or an automatic one.

A plan is what ``torch.distributed.tensor.parallel.parallelize_module`` takes: a dict
``{module name (fnmatch pattern allowed): ParallelStyle}``. :func:`module_plan` reads
the module's ``tensor_parallel_plan`` attribute; :func:`auto_plan` makes one:

* attention: in a module whose ``nn.Linear`` children include both a query/key/value
  projection and an output projection (names matched against ``colwise`` and
  ``rowwise``), the first are ``ColwiseParallel`` (each process computes its heads) and
  the output projection ``RowwiseParallel`` (its partial sums all-reduced);
* MLPs: two ``nn.Linear`` children registered one after the other, with only
  element-wise modules (activations, dropout) between them and the first's
  ``out_features`` equal to the second's ``in_features``: the first colwise, the second
  rowwise;
* everything else is replicated (every process holds it whole).

The automatic plan reads the registration order, not the ``forward``: a block whose
forward uses its layers otherwise needs a plan of its own.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

import hookloop

#: query/key/value projection names (fnmatch patterns) of the automatic plan
COLWISE = ("q_proj", "k_proj", "v_proj", "q", "k", "v", "query", "key", "value", "wq", "wk", "wv", "qkv",
           "in_proj", "c_attn")
#: output projection names of the automatic plan
ROWWISE = ("out_proj", "o_proj", "o", "wo", "out", "proj")

#: modules that act element by element: allowed between the two layers of an MLP pair
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softplus,
               nn.Dropout, nn.Identity, nn.Hardswish, nn.Hardtanh, nn.ReLU6, nn.SELU, nn.CELU)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def auto_plan(module: nn.Module, colwise: tuple[str, ...] = COLWISE, rowwise: tuple[str, ...] = ROWWISE) -> dict[str, Any]:
    """The automatic plan of ``module`` (see the module docstring); ``{}`` when nothing
    in it can be split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for prefix, parent in module.named_modules():
        children = list(parent.named_children())
        linears = [n for n, c in children if isinstance(c, nn.Linear)]
        cols = [n for n in linears if _matches(n, colwise)]
        rows = [n for n in linears if _matches(n, rowwise)]
        done: set[str] = set()
        if cols and rows:
            for name in cols:
                plan[_join(prefix, name)] = ColwiseParallel()
            for name in rows:
                plan[_join(prefix, name)] = RowwiseParallel()
            done = set(cols) | set(rows)
        pending: tuple[str, nn.Linear] | None = None
        for name, child in children:
            if isinstance(child, nn.Linear) and name not in done:
                if pending is not None and pending[1].out_features == child.in_features:
                    plan[_join(prefix, pending[0])] = ColwiseParallel()
                    plan[_join(prefix, name)] = RowwiseParallel()
                    pending = None
                else:
                    pending = (name, child)
            elif not isinstance(child, ELEMENTWISE):
                pending = None
    return plan


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def module_plan(module: nn.Module) -> dict[str, Any] | None:
    """The module's ``tensor_parallel_plan`` attribute (checked), or ``None``."""
    from torch.distributed.tensor.parallel import ParallelStyle

    plan = getattr(module, "tensor_parallel_plan", None)
    if plan is None:
        return None
    if not isinstance(plan, dict) or not plan:
        raise hookloop.ConfigurationError(
            f"{type(module).__name__}.tensor_parallel_plan must be a non-empty dict "
            f"{{module name: ParallelStyle}} (ColwiseParallel(), RowwiseParallel(), ...), not {plan!r}")
    names = {n for n, _ in module.named_modules()}
    for key, style in plan.items():
        if not isinstance(key, str) or not isinstance(style, ParallelStyle):
            raise hookloop.ConfigurationError(
                f"{type(module).__name__}.tensor_parallel_plan[{key!r}] = {style!r}: the keys are module "
                f"names and the values torch.distributed.tensor.parallel ParallelStyles")
        if not any(fnmatch.fnmatchcase(n, key) for n in names):
            close = sorted(n for n in names if n)[:8]
            raise hookloop.ConfigurationError(
                f"{type(module).__name__}.tensor_parallel_plan names {key!r}, which is no submodule of "
                f"the module (its submodules: {', '.join(close)}{', ...' if len(names) > 9 else ''})")
    return plan
