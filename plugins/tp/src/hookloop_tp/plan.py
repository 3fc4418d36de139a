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

With ``sequence_parallel=True`` (Megatron's sequence parallelism, torchtitan's Llama
plan) the activations between the split blocks are sharded on the sequence dimension
(dimension 1) instead of replicated:

* the module's first input is split on dimension 1 when it enters the module and its
  output gathered again when it leaves (the plan's root entry ``""``), so the loss sees
  every position;
* the colwise layers take ``input_layouts=Shard(1)`` (an all-gather of the sequence
  before the split matmul) and the rowwise ones return ``output_layouts=Shard(1)`` (a
  reduce-scatter instead of the all-reduce);
* every other module that holds parameters (LayerNorm, RMSNorm, a head) and every
  ``nn.Dropout`` is ``SequenceParallel``: its parameters replicated DTensors (their
  gradients summed over the tp processes), its computation on the local positions.

So everything outside the split blocks must work position by position (norms,
per-token heads, element-wise ops, residual additions): a module mixing positions
elsewhere (a positional embedding added to a slice, a pooling over the sequence) needs a
plan of its own. The sequence length must be a multiple of the tp size.

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

#: modules without parameters that the sequence-parallel plan still shards (their
#: randomness is then DTensor's, the same on every process for the same position)
SEQUENCE_PARALLEL_STATELESS = (nn.Dropout,)

#: modules that act element by element: allowed between the two layers of an MLP pair
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softplus,
               nn.Dropout, nn.Identity, nn.Hardswish, nn.Hardtanh, nn.ReLU6, nn.SELU, nn.CELU)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def auto_plan(module: nn.Module, colwise: tuple[str, ...] = COLWISE, rowwise: tuple[str, ...] = ROWWISE,
              sequence_parallel: bool = False) -> dict[str, Any]:
    """The automatic plan of ``module`` (see the module docstring); ``{}`` when nothing
    in it can be split. ``sequence_parallel``: the activations between the split blocks
    sharded on the sequence dimension (:func:`sequence_parallel_plan`)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    attention: list[str] = []
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
            attention.append(prefix)
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
    if sequence_parallel and plan:
        plan = sequence_parallel_plan(module, plan, attention)
    return plan


def sequence_parallel_plan(module: nn.Module, plan: dict[str, Any], attention: list[str] = ()) -> dict[str, Any]:
    """``plan`` (colwise/rowwise styles by module name) made sequence parallel: the
    colwise layers take their input sharded on dimension 1 and the rowwise ones return it
    so; every other module holding parameters and every dropout is ``SequenceParallel``;
    the root entry ``""`` splits the module's first input on dimension 1 and gathers its
    output (see the module docstring). The modules named in ``attention`` (those whose
    projections the plan splits) get their first input gathered on entry instead, as
    torchtitan's ``PrepareModuleInput``, so their ``forward`` sees the whole sequence
    (an attention reads its length from its input)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel)

    class SplitSequence(PrepareModuleInputOutput):
        """The root's entry: first a check that the sequence splits evenly (DTensor's
        ``from_local`` in the layers below assumes equal shards), then the split."""

        def _apply(self, root: nn.Module, device_mesh: Any) -> nn.Module:
            size = device_mesh.size()

            def check(_module, args):
                x = args[0] if args else None
                if not hasattr(x, "shape") or x.dim() < 2 or x.shape[1] % size:
                    raise hookloop.ConfigurationError(
                        f"tp option sequence_parallel: {type(root).__name__}'s first input must be a tensor "
                        f"(batch, sequence, ...) whose sequence length is a multiple of the tp size {size}; "
                        f"it is {tuple(x.shape) if hasattr(x, 'shape') else type(x).__name__}")

            root.register_forward_pre_hook(check)
            return super()._apply(root, device_mesh)

    out: dict[str, Any] = {"": SplitSequence(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True)}
    if "" in attention:
        raise hookloop.ConfigurationError(
            f"tp option sequence_parallel: {type(module).__name__}'s attention projections are its own children; "
            f"the automatic sequence-parallel plan splits the sequence where the module is entered and gathers it "
            f"where an attention submodule is, so the attention must be a submodule (or give "
            f"{type(module).__name__} a tensor_parallel_plan)")
    gathered = tuple(a + "." for a in attention if a)
    for a in attention:
        if a:
            out[a] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
    for name, style in plan.items():
        if isinstance(style, ColwiseParallel) and name.startswith(gathered):
            out[name] = ColwiseParallel()
        elif isinstance(style, ColwiseParallel):
            out[name] = ColwiseParallel(input_layouts=Shard(1))
        elif isinstance(style, RowwiseParallel):
            out[name] = RowwiseParallel(output_layouts=Shard(1))
        else:
            out[name] = style
    split = tuple(n + "." for n in plan) + gathered
    for name, sub in module.named_modules():
        if not name or name in plan or name.startswith(split):
            continue
        own = any(True for _ in sub.parameters(recurse=False))
        if (own or isinstance(sub, SEQUENCE_PARALLEL_STATELESS)) and not any(True for _ in sub.children()):
            out[name] = SequenceParallel(use_local_output=True)
        elif own:
            raise hookloop.ConfigurationError(
                f"tp option sequence_parallel: {type(sub).__name__} {name!r} holds parameters of its own and "
                f"submodules; the automatic sequence-parallel plan shards only leaf modules: give "
                f"{type(module).__name__} a tensor_parallel_plan")
    return out


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
