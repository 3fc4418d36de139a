"""hookloop-compile: ``torch.compile`` as a plugin, for the whole model or per block.

* **In place.** Each module chosen is compiled with ``nn.Module.compile`` (its
  ``__call__`` goes through ``torch.compile``), never wrapped in an ``OptimizedModule``:
  the module tree, ``trainer.model``, ``trainer.module`` and every state dict keep the
  original parameter names (no ``_orig_mod.`` prefix), so a checkpoint of a compiled run
  loads into an uncompiled one and back. ``teardown`` takes the compilation off again: the
  module a script gets back after ``fit`` is the one it gave.
* **Where it sits among the model transforms** (torchtitan's order: pipeline split, tp,
  compile, then data-parallel wrapping). The core calls the mesh plugins' ``wrap_model`` in
  that order whatever order the run lists them in (``hookloop.distributed.mesh.registration_order``:
  ``--plugins tp,compile`` and ``compile,tp`` alike), and a strategy that owns the
  lifecycle alone (deepspeed, horovod) after compile too; ``wrap_model`` returns ``None``
  so the strategy still wraps. Compiling is lazy: Dynamo traces a module at its first
  call, in the first training step, so it traces the module as every ``wrap_model`` left
  it (tp's DTensor parameters, fsdp's hooks). Per block, each block is marked before
  ``fully_shard`` makes it a unit, as torchtitan does. Beside the pipeline it is refused
  at construction (no test checks it).
* **Under ddp** the compiled module is the user's module inside the step module that
  ``DistributedDataParallel`` wraps; Dynamo traces it while DDP's forward runs, so its
  DDPOptimizer splits the graph at DDP's bucket boundaries and the all-reduce overlaps
  the backward as without compile.
* **Report.** At the end of the first training epoch of each ``fit``, global rank 0
  prints the graphs compiled, the graph breaks (first few reasons) and the recompiles
  (first few reasons) since the model was wrapped, and writes them to
  ``trainer.log_dir / "compile.json"``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import hookloop

from . import report as _report

__all__ = ["Compile", "REPORT_FILE", "compile_in_place"]

#: The report's file name in the run directory (``trainer.log_dir``).
REPORT_FILE = "compile.json"
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _fail(message: str) -> hookloop.ConfigurationError:
    return hookloop.ConfigurationError(f"compile: {message}")


def compile_in_place(module, kwargs: dict[str, Any]) -> None:
    """Route ``module``'s calls through ``torch.compile(**kwargs)``, keeping the module.

    ``nn.Module.compile()`` compiles ``_call_impl``, torch's own code, in which Dynamo
    starts no frame: it catches the first frame below it, the module's ``forward``, and
    runs the module's hooks (fsdp's, tp's) outside the graph. A module whose ``forward``
    is torch's own (``nn.TransformerEncoderLayer``, ``nn.Sequential``) has no such frame,
    and would run eagerly: for those, as ``torch.compile(module)`` does, the call goes
    through a small frame of Dynamo's (``wrap_inline``) that it traces into."""
    import types

    import torch

    try:
        from torch._dynamo import external_utils, trace_rules
    except ImportError:  # pragma: no cover - another torch: the plain in-place compile
        module.compile(**kwargs)
        return
    forward = module.forward
    if isinstance(forward, types.MethodType) and trace_rules.check(forward):
        module._compiled_call_impl = torch.compile(external_utils.wrap_inline(module._call_impl), **kwargs)
    else:
        module.compile(**kwargs)


def _ever_compiled(module) -> bool:
    """Whether Dynamo holds a compiled graph for ``module``'s ``forward`` (from this run or
    an earlier one in this process: a second fit of the same class compiles nothing new)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - another torch: assume it was
        return True
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    return code is None or bool(_debug_get_cache_entry_list(code))


class Compile:
    """Compiles the model with ``torch.compile``: the whole model or each block.

    mode: torch.compile's mode: None, "default", "reduce-overhead", "max-autotune" or "max-autotune-no-cudagraphs" (not with options)
    backend: torch.compile's backend, a name from torch._dynamo.list_backends() or a callable (default "inductor"; "aot_eager" is exact and compiles fast)
    fullgraph: True: a graph break is an error instead of a fallback to Python (default False)
    dynamic: torch.compile's dynamic: None (detect dynamic shapes on a recompile), True or False
    blocks: None (default): compile the LightningModule's forward (what training_step calls as self(x)); else a list of module class names (or one comma-separated string), each instance of them compiled in place, torchtitan style (a block inside a chosen block is not compiled again)
    options: a dict passed to torch.compile as options (the backend's settings; not with mode)
    """

    hookloop_name = "compile"
    hookloop_role = "extension"
    #: compiling is a choice with a cost (tens of seconds per model), never made by autoload
    hookloop_autoload = False
    hookloop_requires = ">=2,<3"
    #: it composes with any mesh plugin: it claims no mesh dimension
    hookloop_mesh_dims: tuple[str, ...] = ()
    #: refused at construction (hookloop.mesh.check_refusals): the pipeline runs stage
    #: modules cut out of the user's module, which a whole-model compile never calls
    hookloop_refuses_beside = {
        "pp": "the pipeline runs stages cut out of the module, and no test checks torch.compile on them yet: "
              "run the pipeline without compile, or compile without the pipeline"}

    def __init__(self, mode: str | None = None, backend: str | Callable = "inductor", fullgraph: bool = False,
                 dynamic: bool | None = None, blocks: list[str] | str | None = None,
                 options: dict[str, Any] | None = None):
        if mode not in MODES:
            raise _fail(f"option mode={mode!r} is not one of {', '.join(map(repr, MODES))}")
        if not (isinstance(backend, str) and backend) and not callable(backend):
            raise _fail(f"option backend={backend!r} must be a backend name (torch._dynamo.list_backends()) or a callable")
        if not isinstance(fullgraph, bool):
            raise _fail(f"option fullgraph={fullgraph!r} must be True or False")
        if dynamic not in (None, True, False):
            raise _fail(f"option dynamic={dynamic!r} must be None, True or False")
        if options is not None and not isinstance(options, dict):
            raise _fail(f"option options={options!r} must be a dict of the backend's settings")
        if mode is not None and options:
            raise _fail(f"options mode={mode!r} and options={options!r} cannot both be given "
                        "(torch.compile takes one or the other): put the mode's settings in options")
        if isinstance(blocks, str):
            blocks = [b.strip() for b in blocks.split(",") if b.strip()]
        if blocks is not None:
            if not isinstance(blocks, (list, tuple)) or not blocks or not all(isinstance(b, str) and b for b in blocks):
                raise _fail(f"option blocks={blocks!r} must be None or a non-empty list of module class names, "
                            "e.g. blocks=['TransformerBlock']")
            blocks = list(blocks)
        self.mode, self.backend, self.fullgraph, self.dynamic = mode, backend, fullgraph, dynamic
        self.blocks, self.options = blocks, options
        #: the names of the modules the last wrap compiled, in the user's module (its
        #: class name for the module itself)
        self.compiled: list[str] = []
        #: the report of the first training epoch of the last fit (also in compile.json)
        self.report: dict[str, Any] | None = None
        self._restore: list[tuple[Any, Any]] = []
        self._baseline: dict[str, Any] | None = None

    # -- choosing and compiling ---------------------------------------------------------

    def targets(self, module) -> dict[str, Any]:
        """The modules to compile in ``module`` (the user's), by qualified name: ``{"":
        module}`` for the whole model, else every instance of a class in ``blocks``
        (matched by class name or ``module.qualname``) that is not inside another."""
        if self.blocks is None:
            return {"": module}
        wanted = set(self.blocks)
        found: dict[str, Any] = {}
        matched: set[str] = set()
        for name, sub in module.named_modules():
            cls = type(sub)
            hits = wanted & {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
            if not hits:
                continue
            matched |= hits
            if any(name.startswith(outer + ".") or outer == "" for outer in found):
                continue  # inside a block already chosen: compiled as part of it
            found[name] = sub
        missing = [b for b in self.blocks if b not in matched]
        if missing:
            classes = sorted({type(m).__name__ for m in module.modules()})
            raise _fail(f"option blocks={self.blocks!r}: no module of class {', '.join(map(repr, missing))} in "
                        f"{type(module).__name__}; its module classes are: {', '.join(classes)}")
        return found

    def compile_kwargs(self) -> dict[str, Any]:
        """The arguments given to ``torch.compile`` for each module."""
        return {"mode": self.mode, "backend": self.backend, "fullgraph": self.fullgraph,
                "dynamic": self.dynamic, "options": self.options}

    @hookloop.hookimpl
    def wrap_model(self, trainer, model):
        """Compile the chosen modules of the user's module in place, then let the
        strategy wrap (returns ``None``)."""
        self._undo()
        targets = self.targets(model.module)
        self._baseline = _report.snapshot()
        self.report = None
        kwargs = self.compile_kwargs()
        for name, target in targets.items():
            self._restore.append((target, target.__dict__.get("_compiled_call_impl")))
            try:
                compile_in_place(target, kwargs)
            except Exception as error:  # torch's InvalidBackend, a bad options key
                self._undo()
                raise _fail(f"torch.compile({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) failed: "
                            f"{type(error).__name__}: {error}") from error
        self.compiled = [name or type(target).__name__ for name, target in targets.items()]
        return None

    def _undo(self) -> None:
        for target, previous in reversed(self._restore):
            target._compiled_call_impl = previous
        self._restore = []

    # -- the report ---------------------------------------------------------------------

    @hookloop.hookimpl
    def on_train_epoch_start(self, trainer):
        if self._baseline is None:  # a fit after a test in the same Trainer: wrapped again
            self._baseline = _report.snapshot()

    @hookloop.hookimpl
    def on_train_epoch_end(self, trainer, epoch):
        """Once per fit, at the end of its first training epoch: global rank 0 prints
        the report and writes it to ``trainer.log_dir / "compile.json"``."""
        if self.report is not None or self._baseline is None:
            return
        found = _report.since(self._baseline)
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", repr(self.backend))
        self.report = {"epoch": epoch, "backend": backend, "mode": self.mode, "fullgraph": self.fullgraph,
                       "dynamic": self.dynamic, "blocks": self.blocks, "compiled": list(self.compiled), **found}
        if not trainer.is_global_zero:
            return
        print(_report.describe(self.report), file=sys.stderr, flush=True)
        if self.report["graphs"] == 0 and self.blocks is None and not _ever_compiled(trainer.module):
            hookloop.rank_zero_warn(
                f"compile: nothing was compiled in the first training epoch: the training step never called "
                f"{type(trainer.module).__name__} itself (self(x)); name the modules to compile with "
                f"blocks=[...] (their class names)")
        path = trainer.log_dir / REPORT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        hookloop.atomic_write_text(path, json.dumps(self.report, indent=2) + "\n")

    @hookloop.hookimpl
    def teardown(self, trainer):
        """Take the compilation off again: the user's module is given back as it came."""
        self._undo()
        self._baseline = None
