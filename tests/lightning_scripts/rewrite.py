"""Mechanical import rewriting: one Lightning source, two frameworks, imports changed only.

``rewrite(source, "lightning")`` points Lightning's imports at the installed reference
(``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` -> ``lightning_fabric``;
the ``lightning`` package itself is not installed). ``rewrite(source, "hookloop")`` points
them at hookloop through `NAMES`, the porting table of docs/lightning.md as data. A name
the table lacks is imported from ``hookloop`` under its own name, so a name hookloop lacks
fails loudly (``ImportError: cannot import name 'X' from 'hookloop'``).

In both, ``lightning.pytorch.demos`` becomes ``lightning_demos``: the vendored copy of
Lightning's demos, itself rewritten for the same framework, so both run the same code.

``rewrite(source, "hookloop", missing="placeholder")`` (Lightning's unit tests, tests/lightning_unit)
binds a name hookloop lacks to a `Missing` placeholder instead, so that the failure is the
test's that uses it, not the whole file's: any use of the placeholder (call, attribute,
subclassing, ``pytest.raises``) fails naming the Lightning name.

Only import statements change; each rewritten statement stays on its lines (a multi-line
import becomes one line plus blank lines), so tracebacks point at the original lines.
``import lightning as L`` / ``import lightning.pytorch as pl`` under hookloop become
``L = namespace("lightning")``: a module-like object that resolves ``L.Trainer``,
``L.pytorch.callbacks.EarlyStopping``... through the same table, lazily, so a script
fails on the first name hookloop lacks, where it uses it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types

# Lightning name -> "module:attribute" in hookloop. Lightning re-exports its public names
# from several modules (``lightning.pytorch.callbacks.early_stopping.EarlyStopping`` is
# ``lightning.pytorch.callbacks.EarlyStopping``), so the key is the name alone.
NAMES = {
    "LightningModule": "hookloop:Module",
    "LightningDataModule": "hookloop:DataModule",
    "Trainer": "hookloop:Trainer",
    "seed_everything": "hookloop:seed_everything",
    "Callback": "hookloop:Callback",
    "ModelCheckpoint": "hookloop:ModelCheckpoint",
    "EarlyStopping": "hookloop:EarlyStopping",
    "LearningRateMonitor": "hookloop:LearningRateMonitor",
    "BaseFinetuning": "hookloop:BaseFinetuning",
    "BackboneFinetuning": "hookloop:BackboneFinetuning",
    "BasePredictionWriter": "hookloop:BasePredictionWriter",
    "GradientAccumulationScheduler": "hookloop:GradientAccumulationScheduler",
    "TQDMProgressBar": "hookloop:TQDMProgressBar",
    "RichProgressBar": "hookloop:RichProgressBar",
    "ModelSummary": "hookloop:ModelSummary",
    "Timer": "hookloop:Timer",
    "CSVLogger": "hookloop:CSVLogger",
    "TensorBoardLogger": "hookloop_tensorboard:TensorBoardLogger",
    "MLFlowLogger": "hookloop_mlflow:MLFlowLogger",
    "LightningCLI": "hookloop:LightningCLI",
    "rank_zero_only": "hookloop.distributed.ranks:rank_zero_only",
    "rank_zero_info": "hookloop.distributed.ranks:rank_zero_info",
    "rank_zero_warn": "hookloop.distributed.ranks:rank_zero_warn",
    "rank_zero_debug": "hookloop.distributed.ranks:rank_zero_debug",
    "LightningOptimizer": "hookloop.engine.optim:LoopOptimizer",
    "LRSchedulerConfig": "hookloop:SchedulerConfig",
    # what Lightning's Tuner.lr_find returns (its class name is private; hookloop's is public)
    "_LRFinder": "hookloop:LRFinder",
    "STEP_OUTPUT": "hookloop.contract.types:STEP_OUTPUT",
    "OptimizerLRScheduler": "hookloop.contract.types:OptimizerLRScheduler",
    "TRAIN_DATALOADERS": "hookloop.contract.types:TRAIN_DATALOADERS",
    "EVAL_DATALOADERS": "hookloop.contract.types:EVAL_DATALOADERS",
    "MisconfigurationException": "hookloop.contract.errors:MisconfigurationException",
    "PossibleUserWarning": "hookloop.contract.errors:PossibleUserWarning",
    "DDPStrategy": "hookloop.lightning.strategies:DDPStrategy",
    "FSDPStrategy": "hookloop.lightning.strategies:FSDPStrategy",
    "DeepSpeedStrategy": "hookloop.lightning.strategies:DeepSpeedStrategy",
    "StochasticWeightAveraging": "hookloop_averaging:SWA",
    "EMAWeightAveraging": "hookloop_averaging:EMA",
}

# Facts about the environment that Lightning exposes as private constants (is torchvision
# importable, is this Windows): not Lightning behaviour, so they are computed here for
# both frameworks rather than counted as names hookloop lacks.
FACTS = {
    "_TORCHVISION_AVAILABLE": lambda: importlib.util.find_spec("torchvision") is not None,
    "_RICH_AVAILABLE": lambda: importlib.util.find_spec("rich") is not None,
    "_IS_WINDOWS": lambda: sys.platform == "win32",
}


def _fact(name: str):
    """``_X_AVAILABLE`` / ``_X_GREATER_EQUAL_1_2`` (Lightning's checks of an installed package):
    computed here, like `FACTS`; None for any other name."""
    import re

    if name in FACTS:
        return FACTS[name]
    found = re.fullmatch(r"_([A-Z0-9]+)_(AVAILABLE|GREATER_EQUAL_(\d+(?:_\d+)*))", name)
    if not found:
        return None
    package = found.group(1).lower()
    if found.group(2) == "AVAILABLE":
        return lambda: importlib.util.find_spec(package) is not None

    def at_least() -> bool:
        from importlib.metadata import PackageNotFoundError, version

        from packaging.version import Version

        try:
            return Version(version(package)).release >= tuple(int(x) for x in found.group(3).split("_"))
        except PackageNotFoundError:
            return False

    return at_least


# Lightning's subpackages: ``from lightning.pytorch import callbacks`` binds a namespace.
SUBPACKAGES = {"pytorch", "callbacks", "loggers", "utilities", "cli", "core", "trainer", "strategies",
               "profilers", "tuner", "loops", "plugins", "accelerators", "types", "imports", "model_helpers",
               "exceptions", "states", "module", "optimizer", "early_stopping", "model_checkpoint",
               "finetuning", "progress", "csv_logs", "tensorboard", "mlflow"}

FRAMEWORKS = ("lightning", "hookloop")


def _is_lightning(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")


def _demos(module: str) -> str | None:
    """``lightning.pytorch.demos.x`` -> ``lightning_demos.x``; None if not the demos."""
    for prefix in ("lightning.pytorch.demos", "pytorch_lightning.demos"):
        if module == prefix or module.startswith(prefix + "."):
            return "lightning_demos" + module[len(prefix):]
    return None


def reference_module(module: str) -> str:
    """The installed pytorch-lightning 2.6.6 module for a Lightning module name."""
    demos = _demos(module)
    if demos:
        return demos
    for old, new in (("lightning.pytorch", "pytorch_lightning"), ("lightning.fabric", "lightning_fabric"),
                     ("lightning", "pytorch_lightning")):
        if module == old or module.startswith(old + "."):
            return new + module[len(old):]
    return module


def target(name: str) -> tuple[str, str] | None:
    """hookloop's (module, attribute) for a Lightning name; None for an environment fact."""
    if _fact(name):
        return None
    return tuple(NAMES.get(name, f"hookloop:{name}").split(":"))  # type: ignore[return-value]


def resolve(name: str, lightning_module: str = "lightning.pytorch"):
    """The hookloop object for a Lightning name (what a rewritten import binds)."""
    if _fact(name):
        return _fact(name)()
    if name == "demos":
        return importlib.import_module("lightning_demos")
    if name in SUBPACKAGES and name not in NAMES:
        return namespace(f"{lightning_module}.{name}")
    module, attr = target(name)
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"hookloop has no equivalent of Lightning's {lightning_module}.{name} "
            f"(looked for {module}.{attr}): {exc}") from None


class namespace(types.ModuleType):  # noqa: N801 - used like a module
    """``import lightning as L`` under hookloop: ``L.X`` resolves through `NAMES`."""

    def __init__(self, lightning_module: str):
        super().__init__(lightning_module)
        self._lightning_module = lightning_module

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return resolve(name, self._lightning_module)
        except ImportError as exc:
            raise AttributeError(str(exc)) from None


class Missing:
    """A Lightning name hookloop lacks, bound where its import was; any use raises ImportError.

    Its class is named ``hookloop_lacks_<Name>``, so that even an error that only names the
    type (``pytest.raises``: "expected exception must be a BaseException type, not ...")
    says which name is missing."""

    def __init__(self, qualname: str, reason: str, path: str = ""):
        object.__setattr__(self, "_qualname", qualname)
        object.__setattr__(self, "_reason", reason)
        # the name as Lightning's object prints it (``EarlyStoppingReason.PATIENCE_EXHAUSTED``):
        # a parametrized test's id (tests/lightning_unit/outcomes.py)
        object.__setattr__(self, "_path", path or qualname.rsplit(".", 1)[-1])

    def _fail(self, *args, **kwargs):
        raise ImportError(self._reason)

    __call__ = __iter__ = __enter__ = _fail

    def __getattr__(self, name: str):
        # an attribute of what is missing is missing too (``Reason.PATIENCE`` in a decorator
        # at import time): the test that uses it fails, not the collection of the file
        if name.startswith("__"):
            raise AttributeError(name)
        return type(self)(f"{self._qualname}.{name}", self._reason, f"{self._path}.{name}")

    def __mro_entries__(self, bases):
        self._fail()

    def __repr__(self) -> str:
        return f"<hookloop lacks {self._qualname}>"


def resolve_or_missing(name: str, lightning_module: str):
    """`resolve`, or a `Missing` placeholder for a name hookloop lacks."""
    try:
        return resolve(name, lightning_module)
    except ImportError as exc:
        return type(f"hookloop_lacks_{name}", (Missing,), {})(f"{lightning_module}.{name}", str(exc))


def _hookloop_import(node: ast.AST, missing: str = "raise") -> str:
    if isinstance(node, ast.Import):
        parts = []
        for alias in node.names:
            if not _is_lightning(alias.name):
                parts.append(f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else ""))
                continue
            demos = _demos(alias.name)
            if demos:
                parts.append(f"import {demos}" + (f" as {alias.asname}" if alias.asname else ""))
                continue
            bound = alias.asname or alias.name.split(".")[0]
            full = alias.name if alias.asname else alias.name.split(".")[0]
            parts.append(f"{bound} = __import__('tests.lightning_scripts.rewrite', fromlist=['namespace'])"
                         f".namespace({full!r})")
        return "; ".join(parts)
    assert isinstance(node, ast.ImportFrom)
    demos = _demos(node.module)
    if demos:
        return f"from {demos} import " + ", ".join(
            a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
    parts = []
    for alias in node.names:
        bound = alias.asname or alias.name
        if alias.name == "*":
            raise ValueError(f"'from {node.module} import *' cannot be rewritten name by name")
        tgt = target(alias.name)
        if missing == "placeholder":
            parts.append(f"{bound} = __import__('tests.lightning_scripts.rewrite', fromlist=['resolve_or_missing'])"
                         f".resolve_or_missing({alias.name!r}, {node.module!r})")
        elif tgt is None or alias.name == "demos" or (alias.name in SUBPACKAGES and alias.name not in NAMES):
            parts.append(f"{bound} = __import__('tests.lightning_scripts.rewrite', fromlist=['resolve'])"
                         f".resolve({alias.name!r}, {node.module!r})")
        else:
            module, attr = tgt
            parts.append(f"from {module} import {attr}" + (f" as {bound}" if bound != attr else ""))
    return "; ".join(parts)


def _reference_import(node: ast.AST) -> str:
    if isinstance(node, ast.Import):
        parts = []
        for alias in node.names:
            name = reference_module(alias.name) if _is_lightning(alias.name) else alias.name
            if alias.asname:
                parts.append(f"import {name} as {alias.asname}")
            elif name != alias.name and "." not in alias.name:
                parts.append(f"import {name} as {alias.name}")
            elif name != alias.name and alias.name.split(".")[0] == "lightning":
                # ``import lightning.fabric``: binds ``lightning``, whose ``.pytorch``/``.fabric`` are used
                parts.append("lightning = __import__('tests.lightning_scripts.rewrite', "
                             "fromlist=['reference_package']).reference_package()")
            elif name != alias.name:
                raise ValueError(f"'import {alias.name}' without 'as' cannot be rewritten")
            else:
                parts.append(f"import {name}")
        return "; ".join(parts)
    names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
    return f"from {reference_module(node.module)} import {names}"


def reference_package() -> types.ModuleType:
    """What ``import lightning.pytorch`` binds, for the installed reference: a module whose
    ``pytorch`` and ``fabric`` are pytorch-lightning's and lightning-fabric's packages."""
    package = types.ModuleType("lightning")
    package.pytorch = importlib.import_module("pytorch_lightning")
    package.fabric = importlib.import_module("lightning_fabric")
    return package


def lightning_imports(source: str) -> list[ast.AST]:
    nodes = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_lightning(node.module):
            nodes.append(node)
        elif isinstance(node, ast.Import) and any(_is_lightning(a.name) for a in node.names):
            nodes.append(node)
    return nodes


def rewrite(source: str, framework: str, missing: str = "raise") -> str:
    """``source`` with its Lightning imports pointed at ``framework``; nothing else changes.
    ``missing="placeholder"``: a name hookloop lacks binds a `Missing` (hookloop only)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, not {framework!r}")
    if missing not in ("raise", "placeholder"):
        raise ValueError(f"missing must be 'raise' or 'placeholder', not {missing!r}")
    if framework == "hookloop":
        def make(node):
            return _hookloop_import(node, missing)
    else:
        make = _reference_import
    lines = source.splitlines(keepends=True)
    for node in sorted(lightning_imports(source), key=lambda n: n.lineno, reverse=True):
        first, last = node.lineno - 1, node.end_lineno - 1
        indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
        tail = lines[last][node.end_col_offset:].rstrip("\n")  # e.g. a trailing comment
        new = indent + make(node) + tail + "\n"
        lines[first:last + 1] = [new] + ["\n"] * (last - first)
    return "".join(lines)


def missing_names(source: str) -> list[str]:
    """The Lightning names a source imports, and the ``Trainer(...)`` keywords it passes,
    that hookloop lacks (for the table: all of them, not only the first that fails)."""
    import inspect

    import hookloop

    accepted = inspect.signature(hookloop.Trainer).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Trainer":
            out += [f"Trainer({k.arg}=)" for k in node.keywords
                    if k.arg and not takes_any and k.arg not in accepted and f"Trainer({k.arg}=)" not in out]
    for node in lightning_imports(source):
        if isinstance(node, ast.ImportFrom) and not _demos(node.module):
            for alias in node.names:
                try:
                    resolve(alias.name, node.module)
                except ImportError:
                    out.append(f"{node.module}.{alias.name}")
    return out
