"""tp checks itself: the split model against the whole one, on the first batch; the plan, printed.

"Never a silent wrong function": a plan that splits a layer the model's ``forward`` does
not use as the plan assumes (an attention that views its heads with the global head
count, a fused q/k/v projection split contiguously, a gated MLP whose gate is left
whole) trains another function without an error. So, on by default (``tp.verify``):

1. :class:`SelfCheck` keeps an unsharded copy of the module before it is split (the same
   weights: after rank 0's broadcast);
2. the first time the split module (or the outermost module holding split layers) is
   called, before that call runs, its forward and the copy's run on the same input under
   ``torch.no_grad()`` in eval mode (train mode restored after; the random number
   generators' states restored, so the run's numbers do not change), every submodule's
   output recorded by name; a submodule whose output has the same shape in both (split
   layers whose outputs are shards are skipped; a DTensor output is compared whole) and
   the final output must agree within the dtype's tolerance (:data:`TOLERANCES`);
3. the verdict is agreed by every process (one ``all_gather_object``): all of them raise
   the same :class:`hookloop.ConfigurationError`, naming the first module whose output
   differs (or where the split forward failed), the size of the difference, the likely
   cause read from the module's layers, and the fix;
4. the copy is freed.

Memory: one unsharded copy of the module (and the first batch's activations of both)
during the first step. :func:`describe_plan` writes the plan as a table (the line
printed on rank 0 at start, and ``hookloop plan``'s answer).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookloop

#: the tolerance of the check by the compared output's dtype: ``(atol, rtol)``; an output
#: passes when ``max |split - whole| <= atol + rtol * max |whole|`` (rtol scaled by the
#: output's size, so a large activation does not fail on rounding)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 3e-2),
    torch.float16: (1e-3, 1e-2),
}

#: names of fused query/key/value projections (one ``nn.Linear`` computing all three)
FUSED_QKV = ("qkv", "*qkv*", "c_attn", "in_proj", "W_pack", "query_key_value", "Wqkv")

_STYLE_NAMES = {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise", "SequenceParallel": "sequence_parallel",
                "PrepareModuleInput": "prepare_input", "PrepareModuleOutput": "prepare_output",
                "PrepareModuleInputOutput": "prepare_input_output"}


# -- the plan as a table ------------------------------------------------------------------


def style_name(style: Any) -> str:
    """``colwise``, ``rowwise``, ``sequence_parallel``, ... for a ``ParallelStyle`` (or a
    plan's string as it is); a non-default layout is added in brackets."""
    if isinstance(style, str):
        return style
    name = next((_STYLE_NAMES[c.__name__] for c in type(style).__mro__ if c.__name__ in _STYLE_NAMES),
                type(style).__name__)
    notes = []
    if name in ("colwise", "rowwise"):
        inputs, outputs = getattr(style, "input_layouts", None), getattr(style, "output_layouts", None)
        if name == "colwise" and inputs is not None and "Shard" in repr(inputs):
            notes.append(f"input {_placement(inputs)}")
        if name == "rowwise" and outputs is not None and "Shard" in repr(outputs):
            notes.append(f"output {_placement(outputs)}")
        if getattr(style, "use_local_output", True) is False:
            notes.append("output a DTensor")
    return f"{name} ({', '.join(notes)})" if notes else name


def _placement(layouts: Any) -> str:
    layouts = layouts if isinstance(layouts, (tuple, list)) else (layouts,)
    return ",".join(str(p) for p in layouts)


def expand_plan(module: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``{module name: style}`` for every submodule a plan's key (an fnmatch pattern per
    dotted part, as ``parallelize_module`` reads it) names; the root entry ``""`` kept."""
    names = [n for n, _ in module.named_modules()]
    out: dict[str, Any] = {}
    for key, style in plan.items():
        if key == "":
            out[""] = style
            continue
        parts = key.split(".")
        for name in names:
            atoms = name.split(".") if name else []
            if len(atoms) == len(parts) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(atoms, parts)):
                out[name] = style
    return out


def plan_of_parameters(module: nn.Module) -> dict[str, str]:
    """The plan read back from the module's parameters after it was split (for a module
    that parallelized itself in ``configure_tensor_parallel``): a leaf whose weight is a
    DTensor sharded on dimension 0 is ``colwise`` (``nn.Linear``), on dimension 1
    ``rowwise``; a replicated DTensor ``replicated``."""
    from torch.distributed.tensor import DTensor

    out: dict[str, str] = {}
    for name, sub in module.named_modules():
        weight = sub._parameters.get("weight") if hasattr(sub, "_parameters") else None
        if not isinstance(weight, DTensor):
            continue
        shards = [p.dim for p in weight.placements if p.is_shard()]
        if not shards:
            out[name] = "replicated"
        elif isinstance(sub, nn.Embedding):
            out[name] = "rowwise" if shards[0] == 0 else "colwise"
        else:
            out[name] = "colwise" if shards[0] == 0 else "rowwise"
    return out


def _pattern(name: str, modules: dict[str, nn.Module]) -> str:
    """``name`` with the index of a repeated block made ``*``: a child of a ``ModuleList``,
    or a child of a ``Sequential`` that has children itself (a block, not a layer)."""
    parts = name.split(".")
    out = []
    for i, part in enumerate(parts):
        parent = modules.get(".".join(parts[:i]))
        child = modules.get(".".join(parts[:i + 1]))
        block = isinstance(parent, nn.ModuleList) or (
            isinstance(parent, nn.Sequential) and child is not None and any(True for _ in child.children()))
        out.append("*" if part.isdigit() and block else part)
    return ".".join(out)


def _grouped(entries: list[tuple[str, str]], modules: dict[str, nn.Module]) -> list[tuple[str, str, int]]:
    """Entries of repeated blocks (``layers.0.attn.q``, ``layers.1.attn.q``, ...) as one
    (``layers.*.attn.q``) with a count, in the order of their first appearance."""
    groups: dict[tuple[str, str], int] = {}
    for name, label in entries:
        key = (_pattern(name, modules), label)
        groups[key] = groups.get(key, 0) + 1
    return [(name, label, count) for (name, label), count in groups.items()]


def _divisibility(sub: nn.Module, label: str, tp: int) -> str:
    if isinstance(sub, nn.Linear):
        dim = ("out_features", sub.out_features) if label.startswith("colwise") else ("in_features", sub.in_features)
    elif isinstance(sub, nn.Embedding):
        dim = (("embedding_dim", sub.embedding_dim) if label.startswith("colwise")
               else ("num_embeddings", sub.num_embeddings))
    else:
        return ""
    return f"  ! {dim[0]} {dim[1]} is not a multiple of tp={tp}" if dim[1] % tp else ""


def describe_plan(module: nn.Module, plan: dict[str, Any], source: str = "", tp: int | None = None) -> str:
    """The plan ``plan`` (``{name or pattern: ParallelStyle or str}``) of ``module`` as a
    compact table: one line per split module and its style, repeated blocks grouped
    (``layers.*.attn.q  colwise  (x12)``), then the leaf modules holding parameters that
    are left whole. ``source`` says where the plan came from; with ``tp`` (the tp size) a
    split dimension that is not a multiple of it is marked."""
    applied = expand_plan(module, plan)
    split = [(name or "(the module's input/output)", style_name(style)) for name, style in applied.items()]
    covered = tuple(n + "." for n in applied if n)
    whole = [name for name, sub in module.named_modules()
             if name and name not in applied and not name.startswith(covered)
             and not any(True for _ in sub.children()) and any(True for _ in sub.parameters(recurse=False))]
    modules = dict(module.named_modules())
    rows = _grouped(split, modules)
    width = max((len(n) for n, _, _ in rows), default=0)
    head = f"hookloop-tp: the plan ({source or 'given'}{f', tp={tp}' if tp else ''}) of {type(module).__name__}: "
    head += f"{len(applied)} module(s) split, {len(whole)} left whole"
    lines = [head]
    for name, label, count in rows:
        first = next((n for n in applied if n and _pattern(n, modules) == name), None)
        note = _divisibility(modules[first], label, tp) if tp and first is not None else ""
        lines.append(f"  {name.ljust(width)}  {label}{f'  (x{count})' if count > 1 else ''}{note}")
    if whole:
        lines.append("  left whole: " + ", ".join(f"{n} (x{c})" if c > 1 else n for n, _, c in
                                                  _grouped([(w, "") for w in whole], modules)))
    if not applied:
        lines.append("  nothing is split: every process computes the whole model")
    return "\n".join(lines)


# -- the check ----------------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a module's output (a tensor, a tuple/list/dict of
    them, a dataclass-like ``ModelOutput``), in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


#: the dtype a run's ``precision`` computes in (autocast, or fsdp's parameters): the check's
#: tolerance is the loosest of it and the compared outputs' dtypes
PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16,
                    "16-true": torch.float16}


def _tolerance(*dtypes: torch.dtype | None) -> tuple[float, float]:
    known = [TOLERANCES[d] for d in dtypes if d in TOLERANCES] or [TOLERANCES[torch.float32]]
    return max(t[0] for t in known), max(t[1] for t in known)


def _difference(split: Any, whole: Any, compute: torch.dtype | None = None) -> tuple[float, float] | None:
    """``(max |split - whole|, its bound)`` over the outputs' tensors whose shapes agree
    (``None`` when none do: a split layer's output is a shard); ``compute``: the dtype
    the run computes in, when lower than the outputs'."""
    worst: tuple[float, float] | None = None
    a, b = _tensors(split), _tensors(whole)
    if len(a) != len(b):
        return None
    for x, y in zip(a, b):
        x = _whole(x)
        if x.shape != y.shape:
            continue
        atol, rtol = _tolerance(x.dtype, y.dtype, compute)
        diff = float((x.detach().double() - y.detach().double()).abs().max()) if y.numel() else 0.0
        bound = atol + rtol * (float(y.detach().double().abs().max()) if y.numel() else 0.0)
        if diff != diff:  # NaN in one and not the other
            diff = float("inf") if bool(torch.isnan(x).any()) != bool(torch.isnan(y).any()) else 0.0
        if worst is None or diff - bound > worst[0] - worst[1]:
            worst = (diff, bound)
    return worst


class SelfCheck:
    """One run's check (see the module docstring): made before the module is split,
    :meth:`arm`\\ ed after. ``labels``: ``{module name: style}`` of the applied plan (for
    the diagnosis). The verdict is agreed over the world (every process of the run)."""

    def __init__(self, module: nn.Module, trainer: Any = None):
        self.compute = PRECISION_DTYPES.get(str(getattr(trainer, "precision", "32")))
        memo = {id(trainer): trainer} if trainer is not None else {}
        trainer_ref = module.__dict__.get("_hookloop_trainer")
        if trainer_ref is not None:
            memo[id(trainer_ref)] = trainer_ref
        try:
            self.whole = copy.deepcopy(module, memo)
        except Exception as exc:  # noqa: BLE001 - an attribute that cannot be copied: said with the fix
            raise hookloop.ConfigurationError(
                f"tp.verify: {type(module).__name__} could not be copied for tp's self-check (copy.deepcopy: "
                f"{type(exc).__name__}: {exc}): keep what cannot be copied off the module, or skip the check with "
                f"--plugin-option tp.verify=false") from exc
        self.whole.__dict__.pop("_hookloop_trainer", None)
        self.module = module
        self.labels: dict[str, str] = {}
        self.handles: list = []
        self.plan_hooks: set = set()

    # -- arming ---------------------------------------------------------------------------

    def arm(self, labels: dict[str, str], before: dict | None = None) -> None:
        """Hook the split module and each module above a split layer: the first of them
        called runs the check on its own input, before that call. ``before``: the
        module's hook keys before the split (``{submodule: {hook dict name: keys}}``): the
        hooks added since are the plan's, kept during the check."""
        self.labels = labels
        self.plan_hooks = {(id(m), attr, key) for m in self.module.modules() for attr in _HOOK_TABLES
                           for key in getattr(m, attr, {}) if key not in (before or {}).get(m, {}).get(attr, ())}
        split = [n for n in labels if n]
        names = {""} | {".".join(n.split(".")[:i]) for n in split for i in range(1, n.count(".") + 2)}
        for name, sub in self.module.named_modules():
            if name in names:
                self.handles.append(sub.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True,
                                                                  prepend=True))

    def disarm(self) -> None:
        """The hooks removed and the copy freed (after the check, or a run that ended before it)."""
        self._remove_hooks()
        self.whole = None

    def _remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pre_hook(self, name: str):
        def hook(sub, args, kwargs):
            self._remove_hooks()
            self.run(name, sub, args, kwargs)
            return None
        return hook

    # -- running --------------------------------------------------------------------------

    @torch._dynamo.disable
    def run(self, name: str, sub: nn.Module, args: tuple, kwargs: dict) -> None:
        """Compare ``sub``'s forward on ``args``/``kwargs`` with the copy's; agree the
        verdict with every process; raise it, or free the copy."""
        try:
            message = self._compare(name, sub, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the whole module failing on this input: said as is
            message = (f"{_AS_IS}tp.verify: the self-check could not run on the first batch ({type(exc).__name__}: "
                       f"{exc}); --plugin-option tp.verify=false skips it")
        self.whole = None  # the copy freed before anything else
        verdicts = [message]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            verdicts = [None] * dist.get_world_size()
            dist.all_gather_object(verdicts, message)
        failed = [(r, m) for r, m in enumerate(verdicts) if m]
        if failed and failed[0][1].startswith(_AS_IS):
            raise hookloop.ConfigurationError(failed[0][1][len(_AS_IS):])
        if failed:
            rank, text = failed[0]
            where = f" (seen on rank {rank}; every rank stops)" if len(failed) < len(verdicts) else ""
            raise hookloop.ConfigurationError(f"tp.verify: the tensor-parallel {type(self.module).__name__} does not "
                                              f"compute what the whole module computes{where}: {text}")

    def _refresh(self) -> None:
        """The copy's parameters and buffers set to the split module's, whole (a checkpoint
        restored after the split changed them; a DTensor gathered: a collective, in the
        same order on every process)."""
        split = dict(self.module.named_parameters())
        split.update(self.module.named_buffers())
        with torch.no_grad():
            for n, t in (*self.whole.named_parameters(), *self.whole.named_buffers()):
                if n in split:
                    t.copy_(_whole(split[n].detach()).to(t.dtype))

    def _compare(self, name: str, sub: nn.Module, args: tuple, kwargs: dict) -> str | None:
        """The check on this process: ``None``, or what differs and why."""
        self._refresh()
        whole = self.whole.get_submodule(name) if name else self.whole
        prefix = f"{name}." if name else ""
        rng = _rng_states()
        modes = [(m, m.training) for m in (*sub.modules(), *whole.modules())]
        try:
            with _plan_hooks_only((*sub.modules(), *whole.modules()), self.plan_hooks), torch.no_grad():
                for m, _ in modes:
                    m.eval()
                with _Recorder(whole, prefix) as reference:
                    expected = whole(*_as_dtype(args, whole), **_as_dtype(kwargs, whole))
                _set_rng_states(rng)
                with _Recorder(sub, prefix) as split:
                    try:
                        got = sub(*args, **kwargs)
                    except hookloop.ConfigurationError as exc:  # the plan's own check (sequence_parallel)
                        return _AS_IS + str(exc)
                    except Exception as exc:  # noqa: BLE001 - where it failed is the diagnosis
                        where = split.stack[-1] if split.stack else name
                        return (f"the split forward fails in {where or type(self.module).__name__!r}: "
                                f"{type(exc).__name__}: {exc}. {diagnose(self.module, where, self.labels)}")
        finally:
            for m, training in modes:
                m.training = training
            _set_rng_states(rng)
        seen: dict[str, int] = {}
        for mod_name in split.order:  # the first module to differ, in the order the outputs came
            i = seen[mod_name] = seen.get(mod_name, -1) + 1
            want = reference.outputs.get(mod_name, [])
            diff = _difference(split.outputs[mod_name][i], want[i], self.compute) if i < len(want) else None
            if diff is not None and not diff[0] <= diff[1]:
                what = repr(mod_name) if mod_name else type(self.module).__name__
                return (f"the output of {what} differs by {diff[0]:.3g} (tolerance {diff[1]:.3g}) on the first "
                        f"batch. {diagnose(self.module, mod_name, self.labels)}")
        diff = _difference(got, expected, self.compute)
        if diff is not None and not diff[0] <= diff[1]:
            return (f"the output of {type(self.module).__name__} differs by {diff[0]:.3g} (tolerance {diff[1]:.3g}) "
                    f"on the first batch. {diagnose(self.module, name, self.labels)}")
        return None


class _Recorder:
    """Every submodule's outputs by name (``prefix`` + its name), in the order they come,
    and the stack of the modules being run (the innermost last: where a failure is)."""

    def __init__(self, module: nn.Module, prefix: str):
        self.module, self.prefix = module, prefix
        self.outputs: dict[str, list] = {}
        self.order: list[str] = []
        self.stack: list[str] = []
        self.handles: list = []

    def __enter__(self) -> "_Recorder":
        for n, m in self.module.named_modules():
            self.handles.append(m.register_forward_pre_hook(self._enter(self.prefix + n if n else self.prefix[:-1])))
            self.handles.append(m.register_forward_hook(self._leave(self.prefix + n if n else self.prefix[:-1])))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _enter(self, name: str):
        def hook(_module, _args):
            self.stack.append(name)
        return hook

    def _leave(self, name: str):
        def hook(_module, _args, output):
            self.stack.pop()
            self.outputs.setdefault(name, []).append(output)
            self.order.append(name)
        return hook


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")
#: a verdict raised as it is (an error of the plan's own, already in the user's words)
_AS_IS = "\0"


def _as_dtype(value: Any, module: nn.Module) -> Any:
    """``value``'s floating-point tensors in the dtype of ``module``'s parameters (an input
    that a data-parallel wrapper already cast to its compute dtype, for the whole copy)."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple):
        return tuple(_as_dtype(v, module) for v in value)
    if isinstance(value, list):
        return [_as_dtype(v, module) for v in value]
    if isinstance(value, dict):
        return {k: _as_dtype(v, module) for k, v in value.items()}
    return value


def _origin(hook: Any) -> str:
    fn = getattr(hook, "func", hook)  # a functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    return getattr(fn, "__module__", None) or ""


@contextlib.contextmanager
def _plan_hooks_only(modules, plan_hooks: set):
    """During the check, the modules' forward hooks that the plan added (``plan_hooks``)
    or that torch's own machinery registered (FSDP's gathering) stay; the others (the
    user's, observers', other plugins') are held back, so that nothing but the check sees
    its forwards; all of them back after."""
    saved = []
    for m in modules:
        for attr in _HOOK_TABLES:
            table = getattr(m, attr, None)
            if not table:
                continue
            keep = {k: v for k, v in table.items()
                    if (id(m), attr, k) in plan_hooks or _origin(v).startswith("torch.")}
            if len(keep) != len(table):
                saved.append((table, list(table.items())))
                table.clear()
                table.update(keep)
    try:
        yield
    finally:
        for table, items in saved:
            table.clear()
            table.update(items)


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


# -- the diagnosis ------------------------------------------------------------------------


_FIX = ("Fix: give the module a tensor_parallel_plan (hookloop-tp README, \"The plan\") or change the automatic "
        "plan's names (--plugin-option tp.colwise=... / tp.rowwise=...); --plugin-option tp.verify=false skips "
        "this check (the run then trains what the split model computes).")


def diagnose(module: nn.Module, name: str, labels: dict[str, str]) -> str:
    """The likely cause of a difference first seen at ``name`` (or a failure there), read
    from the layers of the block around it and the plan applied to them, with the fix."""
    modules = dict(module.named_modules())
    block_name = name
    sub = modules.get(name)
    if sub is None or not any(isinstance(c, nn.Linear) for c in sub.children()):
        block_name = name.rpartition(".")[0] if "." in name else ""
    block = modules.get(block_name, module)
    prefix = f"{block_name}." if block_name else ""
    linears = [(n, c) for n, c in block.named_children() if isinstance(c, nn.Linear)]
    style = {n: labels.get(prefix + n, "") for n, _ in linears}
    cols = [(n, c) for n, c in linears if style[n].startswith("colwise")]
    rows = [(n, c) for n, c in linears if style[n].startswith("rowwise")]
    whole = [(n, c) for n, c in linears if not style[n]]
    where = repr(block_name) if block_name else type(module).__name__
    for n, c in cols:
        fused = any(fnmatch.fnmatchcase(n, p) for p in FUSED_QKV)
        if fused or any(c.out_features == 3 * r.in_features for _, r in rows):
            return (f"Likely cause: {prefix}{n} is a fused query/key/value projection (out_features "
                    f"{c.out_features} = 3 x {c.out_features // 3}) split contiguously: the first process gets all "
                    f"of q and part of k. Split q, k and v per head (separate projections, or a plan that splits "
                    f"the fused one per head), or leave the projections of {where} whole. " + _FIX)
    for g, gc in whole:
        for n, c in cols:
            if gc.in_features == c.in_features and gc.out_features == c.out_features and rows:
                return (f"Likely cause: a gated MLP in {where} whose gate {prefix}{g} is left whole while "
                        f"{prefix}{n} is split colwise and {prefix}{rows[0][0]} rowwise (an unpaired gate): "
                        f"split {prefix}{g} colwise too (gate and up colwise, down rowwise). " + _FIX)
    if cols and rows:
        heads = [a for a in ("num_heads", "n_head", "n_heads", "heads", "num_attention_heads", "nhead")
                 if isinstance(getattr(block, a, None), int)]
        named = f" (its {heads[0]} = {getattr(block, heads[0])})" if heads else ""
        return (f"Likely cause: an attention in {where} that views its heads with the global head count"
                f"{named}, e.g. view(b, t, H, -1): under tp each process holds H / tp of the heads; use "
                f"view(b, t, -1, head_dim) (or H // tp heads). Or its forward uses the split layers "
                f"otherwise than the plan assumes (their order, a reshape over the features). " + _FIX)
    return (f"Likely cause: the forward of {where} uses the split layers otherwise than the plan assumes "
            f"(another order, an operation mixing the features between a colwise and a rowwise layer, a "
            f"shape computed from the whole width). " + _FIX)

