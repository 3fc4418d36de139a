"""The tensor-parallel plan: the module's own, a Hugging Face model's, or an automatic one.

A plan is what ``torch.distributed.tensor.parallel.parallelize_module`` takes: a dict
``{module name: ParallelStyle}``. Here a plan may also name its styles by strings
(:data:`STYLES`: ``"colwise"``, ``"rowwise"``, ``"sequence_parallel"``, ``"replicate"``,
and Hugging Face's ``"colwise_gather_output"``/``"rowwise_split_input"``, formerly
``"colwise_rep"``/``"rowwise_rep"``) and its keys may hold fnmatch
wildcards matched one level of the name at a time, as torch does (``"layers.*.attn.q"``);
:func:`expand_plan` turns it into concrete names and torch's styles, every key checked.
:func:`module_plan` reads the module's ``tensor_parallel_plan``, :func:`hf_plan` the
``config.base_model_tp_plan`` a ``transformers`` model carries, and :func:`auto_plan`
makes one; :func:`resolve` picks one (the ``plan`` option) and says why.

The automatic plan, module by module (each module's ``nn.Linear`` children):

* attention: a module whose linears include query/key/value projections (names matched
  against ``colwise``) and an output projection (``rowwise``): with *separate* q, k and v
  projections (each ``out_features`` at most the output projection's ``in_features``)
  they are ``ColwiseParallel`` (each process computes its heads) and the output
  projection ``RowwiseParallel`` (its partial sums all-reduced). A *fused* projection
  (``qkv``, ``c_attn``, ``in_proj``, ``Wqkv``: one linear computing q, k and v, or one
  wider than the output) is never split: split contiguously it would hand a process all
  of q and part of k. The attention is then left whole (replicated: exact, only less
  parallel) and the plan's notes say so. So is an attention holding other modules with
  parameters (Qwen3's ``q_norm``/``k_norm`` on the heads: on split heads their gradients
  would be partial), and projections named like q/k/v without an output projection
  (never paired as an MLP);
* gated MLPs (Llama, Mistral, Qwen, torchtitan): three linears ``gate``, ``up`` (both
  E -> F) and ``down`` (F -> E) under the names of :data:`GATED` (``gate_proj``/``up_proj``/
  ``down_proj``, ``w1``/``w3``/``w2``, ...): gate and up colwise, down rowwise. Three
  linears of those shapes under other names are left whole, with a note (which two are
  gated cannot be told from the shapes);
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

The automatic plan reads the registration order and the names, not the ``forward``: a
block whose forward uses its layers otherwise needs a plan of its own.
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import dataclass, field
from typing import Any

from torch import nn

import hookloop

#: query/key/value projection names (fnmatch patterns) of the automatic plan; the fused ones
#: (:data:`FUSED`) mark an attention the automatic plan leaves whole
COLWISE = ("q_proj", "k_proj", "v_proj", "q", "k", "v", "query", "key", "value", "wq", "wk", "wv", "qkv",
           "in_proj", "c_attn", "Wqkv", "qkv_proj", "query_key_value", "kv", "kv_proj", "wkv")
#: output projection names of the automatic plan
ROWWISE = ("out_proj", "o_proj", "o", "wo", "out", "proj", "c_proj")
#: projections that compute q, k and v (or k and v) at once: never split contiguously
FUSED = ("qkv", "in_proj", "c_attn", "Wqkv", "qkv_proj", "query_key_value", "*qkv*", "kv", "kv_proj", "wkv")
#: gated MLPs' (gate, up, down) names: gate and up E -> F, down F -> E
GATED = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("gate", "up", "down"),
         ("wi_0", "wi_1", "wo"), ("fc_gate", "fc_up", "fc_down"))

#: modules without parameters that the sequence-parallel plan still shards (their
#: randomness is then DTensor's, the same on every process for the same position)
SEQUENCE_PARALLEL_STATELESS = (nn.Dropout,)

#: modules that act element by element: allowed between the two layers of an MLP pair
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softplus,
               nn.Dropout, nn.Identity, nn.Hardswish, nn.Hardtanh, nn.ReLU6, nn.SELU, nn.CELU)

#: containers whose children are not one block's layers (no gated-shape guess among them)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _styles() -> dict[str, Any]:
    """The plan strings and the torch styles they stand for (``None``: left whole)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            # local outputs, as the automatic sequence-parallel plan's and Hugging Face's
            "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
            "replicate": None,
            # Hugging Face's: colwise with its output gathered, rowwise of a replicated input
            "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
            "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate())}


#: Hugging Face styles refused (besides ``local*`` and ``packed*``): no torch style does what they do
_HF_REFUSED = ("gather", "isolated", "embedding_rowwise", "embedding_colwise", "replicated_with_grad_allreduce",
               "all_reduce", "ep_router", "grouped_gemm", "mla_kv_a_proj", "moe_tp_experts", "moe_identity_expert")

#: the strings a plan may use for its styles (:func:`expand_plan`)
STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate", "colwise_rep", "colwise_gather_output",
          "rowwise_rep", "rowwise_split_input")


@dataclass
class Plan:
    """A plan picked for a run (:func:`resolve`): ``styles`` by concrete module name (what
    ``parallelize_module`` gets; empty for a ``configure_tensor_parallel`` hook or when
    nothing splits), ``source`` (``"configure_tensor_parallel"``, ``"option"``,
    ``"tensor_parallel_plan"``, ``"hf"`` or ``"automatic"``) and ``notes``: what the
    automatic plan left whole, and why."""

    styles: dict[str, Any]
    source: str
    notes: list[str] = field(default_factory=list)


def auto_plan(module: nn.Module, colwise: tuple[str, ...] = COLWISE, rowwise: tuple[str, ...] = ROWWISE,
              sequence_parallel: bool = False, notes: list[str] | None = None) -> dict[str, Any]:
    """The automatic plan of ``module`` (see the module docstring); ``{}`` when nothing
    in it can be split. ``sequence_parallel``: the activations between the split blocks
    sharded on the sequence dimension (:func:`sequence_parallel_plan`). ``notes``: a list
    that receives one line per block left whole (a fused q/k/v projection, a gated MLP
    under unknown names), for the plan's printout."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    notes = [] if notes is None else notes
    plan: dict[str, Any] = {}
    attention: list[str] = []
    whole: list[tuple[str, str]] = []  # attentions left whole, and why
    for prefix, parent in module.named_modules():
        children = list(parent.named_children())
        linears = {n: c for n, c in children if isinstance(c, nn.Linear)}
        where = f"{type(parent).__name__} {prefix!r}" if prefix else type(parent).__name__
        done: set[str] = set()
        cols = [n for n in linears if _matches(n, colwise)]
        if cols:  # an attention: its projections are never paired as an MLP
            rows = [n for n in linears if _matches(n, rowwise) and n not in cols]
            done = set(cols) | set(rows)
            if _attention(where, parent, linears, cols, rows, notes):
                plan.update({_join(prefix, n): ColwiseParallel() for n in cols})
                plan.update({_join(prefix, n): RowwiseParallel() for n in rows})
                attention.append(prefix)
            else:
                whole.append((where, notes[-1]))
        if not isinstance(parent, _CONTAINERS):
            done |= _gated(prefix, where, {n: c for n, c in linears.items() if n not in done}, plan, notes)
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
    if sequence_parallel and whole:
        # around a whole attention the sequence-parallel plan would hand it this process's positions only
        raise hookloop.ConfigurationError(
            f"tp option sequence_parallel: the automatic plan leaves {', '.join(w for w, _ in whole)} whole "
            f"({whole[0][1]}), and the sequence-parallel plan would then compute that attention on "
            f"each process's share of the sequence only; drop sequence_parallel, or give "
            f"{type(module).__name__} a tensor_parallel_plan")
    if sequence_parallel and plan:
        plan = sequence_parallel_plan(module, plan, attention)
    return plan


def _attention(where: str, parent: nn.Module, linears: dict[str, nn.Linear], cols: list[str], rows: list[str],
               notes: list[str]) -> bool:
    """Whether the attention's projections ``cols`` (q/k/v) and ``rows`` (output) can be
    split; else a note saying why it is left whole."""
    if not rows:
        notes.append(f"{where}: left whole: {', '.join(cols)} look like query/key/value projections but no "
                     f"output projection is named among its linears ({', '.join(linears)}); name it with the "
                     f"tp option rowwise, or give the model a tensor_parallel_plan")
        return False
    width = min(linears[r].in_features for r in rows)
    fused = [n for n in cols if _matches(n, FUSED) or linears[n].out_features > width]
    if fused or len(cols) == 1:
        name = (fused or cols)[0]
        layer = linears[name]
        why = "is fused" if fused else "is its only query/key/value projection (fused, or the others elsewhere)"
        notes.append(f"{where}: attention left whole (every process computes it): its projection {name!r} "
                     f"({layer.in_features} -> {layer.out_features}) {why}, and split contiguously it would "
                     f"hand a process all of q and part of k. To split it: separate q/k/v projections, or a "
                     f"tensor_parallel_plan")
        return False
    # a norm on the heads (Qwen3's q_norm/k_norm) would see this process's heads only: its
    # gradient partial, a replicated parameter drifting apart on every process
    held = [n for n, c in parent.named_children()
            if not isinstance(c, nn.Linear) and any(True for _ in c.parameters())]
    if held:
        notes.append(f"{where}: attention left whole (every process computes it): {', '.join(held)} "
                     f"{'holds' if len(held) == 1 else 'hold'} parameters beside its projections, and on split "
                     f"heads each process would compute their gradient from its own heads only. To split it: a "
                     f"tensor_parallel_plan")
        return False
    return True


def _gated(prefix: str, where: str, linears: dict[str, nn.Linear], plan: dict[str, Any], notes: list[str]) -> set:
    """A gated MLP among ``linears`` (gate and up colwise, down rowwise) into ``plan``;
    the names it took (split, or left whole under unknown names)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def gated(gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> bool:
        return ((gate.in_features, gate.out_features) == (up.in_features, up.out_features)
                == (down.out_features, down.in_features))

    for names in GATED:
        if all(n in linears for n in names) and gated(*(linears[n] for n in names)):
            gate, up, down = names
            plan[_join(prefix, gate)] = ColwiseParallel()
            plan[_join(prefix, up)] = ColwiseParallel()
            plan[_join(prefix, down)] = RowwiseParallel()
            return set(names)
    shapes = [(a, b, c) for a, b, c in itertools.permutations(linears, 3)
              if a < b and gated(linears[a], linears[b], linears[c])]
    if not shapes:
        return set()
    taken = {n for triple in shapes for n in triple}
    a, b, c = shapes[0]
    notes.append(f"{where}: left whole: {a!r} and {b!r} have the same shape and {c!r} the reverse, as a gated MLP's "
                 f"gate, up and down, but the names are none the automatic plan knows "
                 f"({', '.join('/'.join(g) for g in GATED)}); give the model a tensor_parallel_plan "
                 f"(gate and up \"colwise\", down \"rowwise\")")
    return taken


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


def _expand_key(module: nn.Module, key: str) -> list[str]:
    """The submodule names ``key`` matches, one level of the name at a time (as
    ``parallelize_module`` matches its keys: ``layers.*.q`` never reaches ``a.layers.0.q``)."""
    if key == "":
        return [""]
    found = [("", module)]
    for atom in key.split("."):
        found = [(_join(path, name), child) for path, parent in found for name, child in parent.named_children()
                 if fnmatch.fnmatchcase(name, atom)]
    return [path for path, _ in found]


def to_style(value: Any, where: str) -> Any:
    """A plan's value as torch's ``ParallelStyle``: one already, or a string of :data:`STYLES`
    (``None`` for ``"replicate"``: the module stays whole). ``where`` names the entry in
    the error."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if isinstance(value, ParallelStyle):
        return value
    known = _styles()
    if isinstance(value, str) and value in known:
        make = known[value]
        return None if make is None else make()
    hf = isinstance(value, str) and (value.startswith(("local", "packed")) or value in _HF_REFUSED)
    hint = (f" ({value!r} is a Hugging Face style that no torch ParallelStyle follows exactly: give torch's styles "
            f"in a tensor_parallel_plan, or leave the layer whole)") if hf else ""
    raise hookloop.ConfigurationError(
        f"{where} = {value!r}: a plan's values are torch.distributed.tensor.parallel ParallelStyles "
        f"(ColwiseParallel(), RowwiseParallel(), ...) or one of the strings {', '.join(map(repr, STYLES))}{hint}")


def expand_plan(module: nn.Module, plan: Any, owner: str) -> dict[str, Any]:
    """``plan`` (keys with wildcards, values styles or strings) as concrete submodule names
    and torch's styles, in the plan's order; ``"replicate"`` entries dropped. ``owner``
    names the plan in the errors (``"Net.tensor_parallel_plan"``, ``"tp option plan"``):
    a key that is no submodule, a bad value, or two keys naming one module are refused."""
    if not isinstance(plan, dict) or not plan:
        raise hookloop.ConfigurationError(
            f"{owner} must be a non-empty dict {{module name: style}} (a ParallelStyle such as ColwiseParallel(), "
            f"or one of the strings {', '.join(map(repr, STYLES))}), not {plan!r}")
    out: dict[str, Any] = {}
    by: dict[str, str] = {}
    for key, value in plan.items():
        if not isinstance(key, str):
            raise hookloop.ConfigurationError(f"{owner}: the key {key!r} must be a module name (a string)")
        style = to_style(value, f"{owner}[{key!r}]")
        names = _expand_key(module, key)
        if not names:
            known = sorted(n for n, _ in module.named_modules() if n)
            raise hookloop.ConfigurationError(
                f"{owner} names {key!r}, which is no submodule of {type(module).__name__} (wildcards match one "
                f"level of the name; its submodules: {', '.join(known[:8])}{', ...' if len(known) > 8 else ''})")
        for name in names:
            if name in by:
                raise hookloop.ConfigurationError(
                    f"{owner}: {key!r} and {by[name]!r} both name the module {name!r}; give it one style")
            by[name] = key
            if style is not None:
                out[name] = style
    return out


def module_plan(module: nn.Module) -> dict[str, Any] | None:
    """The module's ``tensor_parallel_plan`` attribute (checked and expanded:
    :func:`expand_plan`), or ``None``."""
    plan = getattr(module, "tensor_parallel_plan", None)
    if plan is None:
        return None
    return expand_plan(module, plan, f"{type(module).__name__}.tensor_parallel_plan")


def hf_plan(module: nn.Module) -> dict[str, Any] | None:
    """The plan of the Hugging Face models inside ``module`` (the module itself or any
    submodule): each one's ``config.base_model_tp_plan``, whose keys are relative to its
    base model (``model.model`` of a ``LlamaForCausalLM``, found by ``base_model_prefix``),
    expanded and translated (:func:`expand_plan`); ``None`` when none carries one. The
    head-level ``_tp_plan`` (``lm_head``) is not used: the head stays whole."""
    entries: dict[str, Any] = {}
    for name, sub in module.named_modules():
        tp_plan = getattr(getattr(sub, "config", None), "base_model_tp_plan", None)
        # a model (PreTrainedModel: it has a base_model_prefix), not its layers (which hold the config too)
        if not isinstance(tp_plan, dict) or not tp_plan or not hasattr(type(sub), "base_model_prefix"):
            continue
        prefix = type(sub).base_model_prefix or ""
        base = _join(name, prefix) if isinstance(getattr(sub, prefix, None) if prefix else None, nn.Module) else name
        for key, value in tp_plan.items():
            entries.setdefault(_join(base, key), value)
    if not entries:
        return None
    return expand_plan(module, entries, f"{type(module).__name__}'s Hugging Face config.base_model_tp_plan")


#: the ``plan`` option's named values (else a dict: the plan itself)
PLAN_CHOICES = ("auto", "hf", "infer")


def check_plan_option(value: Any) -> None:
    """The tp option ``plan``: ``"auto"``, ``"hf"``, ``"infer"`` or a non-empty dict."""
    if isinstance(value, str) and value in PLAN_CHOICES:
        return
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        for key, style in value.items():
            to_style(style, f"tp option plan[{key!r}]")
        return
    raise hookloop.ConfigurationError(
        f"tp option plan={value!r} must be 'auto' (the module's own plan, else its Hugging Face plan, else the "
        f"automatic one), 'hf' (the Hugging Face model's config.base_model_tp_plan), 'infer' (the automatic plan) "
        f"or a dict {{module name: style}} (JSON on the command line: "
        f"--plugin-option 'tp.plan={{\"mlp.fc1\": \"colwise\", \"mlp.fc2\": \"rowwise\"}}')")


def resolve(module: nn.Module, option: Any = "auto", colwise: tuple[str, ...] = COLWISE,
            rowwise: tuple[str, ...] = ROWWISE, sequence_parallel: bool = False) -> Plan:
    """The run's plan for ``module`` under the tp option ``plan`` (``option``):

    * a dict: that plan (strings and wildcards allowed);
    * ``"hf"``: the Hugging Face model's (:func:`hf_plan`; refused when there is none);
    * ``"infer"``: the automatic plan (:func:`auto_plan`), whatever the module carries;
    * ``"auto"`` (the default): the module's ``configure_tensor_parallel`` hook (the
      ``Plan`` is then empty and the caller calls the hook), else its
      ``tensor_parallel_plan``, else its Hugging Face plan, else the automatic plan (also
      when the Hugging Face plan uses a style torch has no exact equivalent of: a note
      says so).

    ``sequence_parallel`` applies to the automatic plan only."""
    name = type(module).__name__
    if isinstance(option, dict):
        return Plan(expand_plan(module, option, "tp option plan"), "option")
    if option == "auto" and callable(getattr(module, "configure_tensor_parallel", None)):
        return Plan({}, "configure_tensor_parallel")
    if option == "auto":
        own = module_plan(module)
        if own is not None:
            return Plan(own, "tensor_parallel_plan")
    notes: list[str] = []
    if option in ("auto", "hf"):
        try:
            hf = hf_plan(module)
        except hookloop.ConfigurationError as refused:
            if option == "hf":
                raise
            hf = None  # by default a Hugging Face plan torch cannot follow exactly gives way to the automatic one
            notes.append(f"{refused}; the automatic plan instead")
        if hf is None and option == "hf":
            raise hookloop.ConfigurationError(
                f"tp option plan='hf': {name} holds no Hugging Face model with a config.base_model_tp_plan; "
                f"drop the option for the automatic plan, or give {name} a tensor_parallel_plan")
        if hf is not None and sequence_parallel:
            raise hookloop.ConfigurationError(
                f"tp option sequence_parallel applies to the automatic plan, and {name} carries a Hugging Face "
                f"plan: add --plugin-option tp.plan=infer for the automatic sequence-parallel plan, or drop "
                f"sequence_parallel")
        if hf is not None:
            return Plan(hf, "hf")
    styles = auto_plan(module, colwise, rowwise, sequence_parallel=sequence_parallel, notes=notes)
    return Plan(styles, "automatic", notes)


def check_sizes(module: nn.Module, styles: dict[str, Any], size: int) -> None:
    """Refuse, at start, a split whose local shards ``size`` processes cannot share
    evenly where the model's own code sees them: a colwise ``nn.Linear`` handing its
    caller a local slice of its output (``use_local_output``, the output sharded) whose
    ``out_features`` are not a multiple of ``size`` (rowwise: taking a sharded input, its
    ``in_features``), or, in an attention that declares its ``head_dim``, such a
    projection's heads (grouped-query attention's key/value heads too) not a multiple of
    ``size``. A gathered output, or one left a DTensor (a ``loss_parallel`` head over a
    vocabulary of 50257), may be uneven."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    modules = dict(module.named_modules())
    for name, style in styles.items():
        layer = modules.get(name)
        if not isinstance(layer, nn.Linear) or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        colwise = isinstance(style, ColwiseParallel)
        if colwise:
            local = style.use_local_output and any(isinstance(layout, Shard) for layout in style.output_layouts)
        else:
            local = any(isinstance(layout, Shard) for layout in style.input_layouts)
        if not local:
            continue
        features = layer.out_features if colwise else layer.in_features
        head_dim = getattr(modules.get(name.rpartition(".")[0]), "head_dim", None)
        if colwise and isinstance(head_dim, int) and head_dim > 0 and features % head_dim == 0:
            heads = features // head_dim
            if heads % size:
                raise hookloop.ConfigurationError(
                    f"tp: {name!r} computes {heads} heads of {head_dim} features, which {size} tp processes cannot "
                    f"share evenly (grouped-query attention's key/value heads included): use a tp size that "
                    f"divides {heads}, or leave this attention whole in a tensor_parallel_plan")
        if features % size:
            raise hookloop.ConfigurationError(
                f"tp: {name!r} is split {'colwise' if colwise else 'rowwise'} on its {features} "
                f"{'output' if colwise else 'input'} features, which {size} tp processes cannot share evenly: "
                f"use a tp size that divides {features}, or leave {name!r} whole in a tensor_parallel_plan")
