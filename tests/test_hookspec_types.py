"""The hook contract is typed (issue 34, item 4).

Every hook spec annotates every argument and its return, and the annotations resolve;
the protocols the specs use for ``trainer`` and ``config`` (``hookloop.contract.hookspecs``,
section 0) are checked against what a real run passes: a plugin wrapping every hook
checks each argument and each result against the spec's annotations.
"""

from __future__ import annotations

import ast
import collections.abc
import contextlib
import inspect
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pluggy
import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, TinyModule, tiny_data
from hookloop.contract import hookspecs


def specs() -> dict[str, Any]:
    """Every hook spec of the contract, by name."""
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if inspect.isfunction(fn) and hasattr(fn, "hookloop_spec")
    }


def decorated_in_source() -> set[str]:
    """The functions the spec module's source marks ``@hookspec`` (read, not imported)."""
    path = Path(inspect.getsourcefile(hookspecs.setup) or "")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                target = deco.func if isinstance(deco, ast.Call) else deco
                if isinstance(target, ast.Name) and target.id == "hookspec":
                    found.add(node.name)
    return found


# -- every spec typed ------------------------------------------------------------------


def test_every_hook_spec_annotates_every_argument_and_its_return() -> None:
    found = specs()
    pm = pluggy.PluginManager("hookloop")
    pm.add_hookspecs(hookspecs)
    registered = {name for name in vars(pm.hook) if not name.startswith("_")}
    # the count is the specs', three ways: the source, the module, pluggy's registry
    assert set(found) == decorated_in_source() == registered
    typed = []
    for name, fn in found.items():
        signature = inspect.signature(fn)
        bare = [p for p in signature.parameters.values() if p.annotation is inspect.Parameter.empty]
        assert not bare, f"hook spec {name}: no annotation on {', '.join(p.name for p in bare)}"
        assert signature.return_annotation is not inspect.Signature.empty, (
            f"{name}: no return annotation"
        )
        hints = typing.get_type_hints(fn)  # every annotation resolves
        assert set(hints) == {*signature.parameters, "return"}, name
        typed.append(name)
    assert len(typed) == len(found) == len(registered) > 60


def admits_none(hint: Any) -> bool:
    return hint is Any or hint is type(None) or type(None) in typing.get_args(hint)


def test_the_docstrings_agree_with_the_annotations() -> None:
    """firstresult: the return admits None and the docstring says where it stops; a hook
    that returns nothing documents no return; every ``:param x:`` is an argument."""
    for name, fn in specs().items():
        hints = typing.get_type_hints(fn)
        doc = inspect.getdoc(fn) or ""
        assert doc, f"hook spec {name} has no docstring"
        if fn.hookloop_spec.get("firstresult"):
            assert admits_none(hints["return"]), (
                f"{name} is firstresult: its return must admit None"
            )
            assert "Stops at first non-None result" in doc, name
        elif hints["return"] is type(None):
            assert ":returns:" not in doc, (
                f"{name} returns None, but its docstring documents a value"
            )
        for param in re.findall(r":param (\w+):", doc):
            assert param in hints, f"{name}'s docstring documents {param!r}, which it does not take"


# -- the annotations against a real run -------------------------------------------------


def conforms(value: Any, hint: Any, depth: int = 0) -> str | None:
    """Why ``value`` does not fit ``hint`` (``None`` when it does): classes, unions,
    literals, containers (their items too) and the contract's protocols (each member)."""
    if hint is Any or isinstance(hint, typing.TypeVar):
        return None
    if hint is None or hint is type(None):
        return None if value is None else f"{type(value).__name__} is not None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        reasons = [conforms(value, a, depth) for a in args]
        return None if None in reasons else " and ".join(r for r in reasons if r)
    if origin is typing.Literal:
        return None if value in args else f"{value!r} is none of {args}"
    if getattr(hint, "_is_protocol", False):
        return protocol_problem(value, hint, depth)
    if origin is collections.abc.Callable:
        return None if callable(value) else f"{type(value).__name__} is not callable"
    cls = origin or hint
    if cls is float and isinstance(value, int):
        return None  # the numeric tower: an int is a float to a type checker
    if not isinstance(value, cls):
        return f"{type(value).__name__} is not a {getattr(cls, '__name__', cls)}"
    if isinstance(value, collections.abc.Mapping) and len(args) == 2:
        for key, item in value.items():
            why = conforms(key, args[0], depth) or conforms(item, args[1], depth)
            if why:
                return f"[{key!r}]: {why}"
    elif isinstance(value, (list, tuple)) and len(args) == 1:
        for i, item in enumerate(value):
            why = conforms(item, args[0], depth)
            if why:
                return f"[{i}]: {why}"
    return None


def protocol_problem(value: Any, protocol: type, depth: int) -> str | None:
    attributes = typing.get_type_hints(protocol)
    for name, member in vars(protocol).items():
        if name.startswith("_"):
            continue
        if not hasattr(value, name):
            return f"{type(value).__name__} has no {name!r} ({protocol.__name__})"
        if isinstance(member, property) and depth < 2:
            why = conforms(
                getattr(value, name), typing.get_type_hints(member.fget)["return"], depth + 1
            )
            if why:
                return f"{protocol.__name__}.{name}: {why}"
        elif inspect.isfunction(member) and not callable(getattr(value, name)):
            return f"{protocol.__name__}.{name} is not callable"
    for name, hint in attributes.items():
        if not hasattr(value, name):
            return f"{type(value).__name__} has no {name!r} ({protocol.__name__})"
        why = conforms(getattr(value, name), hint, depth + 1)
        if why:
            return f"{protocol.__name__}.{name}: {why}"
    return None


#: trainer-reading hooks after which every TrainerLike property has its run value
TRAINER_CHECKED_IN = (
    "on_fit_start",
    "on_train_batch_end",
    "on_validation_end",
    "on_save_checkpoint",
    "on_test_end",
    "on_predict_end",
)


def make_checker(problems: list[str], seen: set[str]) -> Any:
    """A plugin wrapping every hook: each argument and each result against the spec."""
    hints = {name: typing.get_type_hints(fn) for name, fn in specs().items()}

    def check(name: str, arguments: dict[str, Any], result: Any) -> None:
        seen.add(name)
        for arg, value in arguments.items():
            if arg == "trainer" and name not in TRAINER_CHECKED_IN:
                continue
            why = conforms(value, hints[name][arg])
            if why:
                problems.append(f"{name}({arg}=...): {why}")
        firstresult = specs()[name].hookloop_spec.get("firstresult")
        for item in [result] if firstresult else result:
            why = conforms(item, hints[name]["return"])
            if why:
                problems.append(f"{name} returned {why}")

    namespace: dict[str, Any] = {"hookloop_name": "type_checker", "hookloop_role": "observer"}
    for name, fn in specs().items():
        args = list(inspect.signature(fn).parameters)
        source = (
            f"def {name}(self, {', '.join(args)}):\n"
            f"    result = yield\n"
            f"    check({name!r}, {{{', '.join(f'{a!r}: {a}' for a in args)}}}, result)\n"
            f"    return result\n"
        )
        scope: dict[str, Any] = {"check": check}
        exec(source, scope)  # a wrapper with the spec's argument names, as pluggy reads them
        namespace[name] = hookloop.hookimpl(wrapper=True)(scope[name])
    return type("TypeChecker", (), namespace)()


class Model(TinyModule):
    """Builds in configure_model (model_init_context), reduces, waits and broadcasts (the
    collectives), and tests and predicts too."""

    def configure_model(self) -> None:
        pass

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        # as a strategy's code calls them (trainer.barrier/broadcast skip them in a world of 1)
        hook = self.trainer.hook
        hook.barrier(trainer=self.trainer, name="epoch end")
        assert hook.broadcast(trainer=self.trainer, obj=[self.current_epoch], src=0) == [
            self.current_epoch
        ]

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


#: Hooks this in-process run on the CPU cannot reach, and why.
NOT_REACHED = {
    "launch_command": "a launcher: devices > 1 or hookloop run",
    "on_device_mesh": "a plugin claiming a mesh dimension",
    "describe_model": "hookloop plan only",
    "configure_grad_scaler": "precision 16-mixed, through hookloop-amp",
    "on_exception": "a run that raises",
}


def test_every_argument_and_result_of_a_real_run_fits_the_specs(tmp_path: Path) -> None:
    problems: list[str] = []
    seen: set[str] = set()
    checker = make_checker(problems, seen)
    loaders = (DataLoader(tiny_data(16), batch_size=8), DataLoader(tiny_data(8), batch_size=8))
    settings: dict[str, Any] = dict(
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        default_root_dir=str(tmp_path),
    )
    trainer = hookloop.Trainer(plugins=[checker], max_epochs=1, **settings)
    trainer.fit(Model(), *loaders)
    resumed = hookloop.Trainer(plugins=[checker], max_epochs=2, **settings)
    resumed.fit(Model(), *loaders, ckpt_path="last")
    resumed.validate(Model(), loaders[1])
    resumed.test(Model(), loaders[1])
    resumed.predict(Model(), loaders[1])
    assert not problems, "\n".join(sorted(set(problems)))
    assert set(specs()) - seen <= set(NOT_REACHED), sorted(set(specs()) - seen - set(NOT_REACHED))
    assert len(seen) >= len(specs()) - len(NOT_REACHED)


def test_the_checker_catches_a_value_that_does_not_fit() -> None:
    """The conformance check above can fail: a wrong type, a missing protocol member."""
    assert conforms(3, str) is not None
    assert conforms({"loss": "x"}, typing.Mapping[str, float]) is not None
    assert conforms(None, int | None) is None
    assert (
        conforms("sum", hookspecs.ReduceOp) is None
        and conforms("avg", hookspecs.ReduceOp) is not None
    )
    assert "has no 'accelerator'" in (
        conforms(types.SimpleNamespace(devices=1), hookspecs.ConfigLike) or ""
    )
    assert conforms(contextlib.nullcontext(), contextlib.AbstractContextManager[Any]) is None
    assert conforms(torch.amp.GradScaler("cpu"), hookspecs.GradScalerLike) is None


# -- docs/plugin-authors.md, "Type-checking a plugin", run as written ---------------------


@pytest.mark.slow  # launches mypy (about 10 s: it reads torch's annotations)
def test_the_documented_plugin_type_checks_and_mypy_finds_a_misspelt_attribute(
    tmp_path: Path,
) -> None:
    """hookloop's annotations reach a plugin's type checker (py.typed): the guide's
    example passes mypy, and the misspelling the guide quotes is found, as quoted."""
    text = (REPO / "docs" / "plugin-authors.md").read_text()
    section = text[text.index("### Type-checking a plugin") :]
    example = re.search(r"```python\n(.*?)```", section, re.S)
    assert example, "docs/plugin-authors.md's type-checking section has no python block"
    misuse = "\n\ndef steps(trainer: TrainerLike) -> int:\n    return trainer.global_stpe\n"
    (tmp_path / "as_written.py").write_text(example.group(1))
    (tmp_path / "misspelt.py").write_text(example.group(1) + misuse)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "as_written.py", "misspelt.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("misspelt.py:"), proc.stdout + proc.stderr
    quoted = '"TrainerLike" has no attribute "global_stpe"; maybe "global_step"?'
    assert quoted in errors[0] and quoted in " ".join(section.split())
