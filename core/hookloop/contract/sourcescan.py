"""A plugin's declared role, read from its source without running any of it.

``hookloop plugins`` lists roles, but installing a plugin must run none of its code until
a run asks for it (plugins are imported by name only). So the listing reads the class an
entry point names with :mod:`ast`: ``hookloop_role = "strategy"`` in its body (or a tuple
assignment naming it), else in its base classes, following ``from .module import Name``
re-exports within the plugin's own files. Modules are located without importing them
or their parent packages (``find_spec`` for the top-level name, then ``PathFinder`` in
the package's folders).

Where the source does not say plainly (a role computed at run time, a class made by a
factory, a compiled module), the answer is ``None`` and ``hookloop plugins --load``
imports the plugin to ask it.
"""

from __future__ import annotations

import ast
import importlib.util
from importlib.machinery import PathFinder, SourceFileLoader
from pathlib import Path

_MAX_HOPS = 12  # re-exports and base classes followed before giving up


def declared_role(entry_point_value: str) -> str | None:
    """The ``hookloop_role`` that ``"module:Attr"`` (or ``"module"``) declares, or ``None``."""
    module, _, attr = entry_point_value.partition(":")
    module, attr = module.strip(), attr.split("[")[0].strip()
    if "." in attr:
        return None
    tree = _parse(module)
    if tree is None:
        return None
    if not attr:  # a module used as the plugin: its top level declares the role
        return _assigned_role(tree.body)
    return _class_role(module, tree, attr, _MAX_HOPS)


def declares(entry_point_value: str, attribute: str) -> bool:
    """Whether the class an entry point names assigns or defines ``attribute`` in its body
    or a base class's (the module's top level for a module plugin), read as
    :func:`declared_role` reads the role."""
    module, _, attr = entry_point_value.partition(":")
    module, attr = module.strip(), attr.split("[")[0].strip()
    tree = _parse(module) if "." not in attr else None
    if tree is None:
        return False

    def find(body: list[ast.stmt]) -> bool | None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attribute:
                return True
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [getattr(node, "target", None)])
            if any(isinstance(t, ast.Name) and t.id == attribute for t in targets):
                return True
        return None

    return bool(_class_role(module, tree, attr, _MAX_HOPS, find) if attr else find(tree.body))


def _class_role(module: str, tree: ast.Module, name: str, hops: int, find=None) -> str | None:
    find = find or _assigned_role  # what to look for in a class body (the role by default)
    if hops <= 0:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            role = find(node.body)
            if role is not None:
                return role
            for base in node.bases:  # inherited: bases named in this module or imported
                if isinstance(base, ast.Name):
                    role = _class_role(module, tree, base.id, hops - 1, find)
                    if role is not None:
                        return role
            return None
    for node in tree.body:  # re-exported: from .strategy import DDP (as ...)
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = _absolute(module, node, tree)
                    sub = _parse(source) if source else None
                    if source is None or sub is None:
                        return None
                    return _class_role(source, sub, alias.name, hops - 1, find)
    return None


def _assigned_role(body: list[ast.stmt]) -> str | None:
    targets: list[ast.expr]
    for node in body:
        if isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id == "hookloop_role":
                return _string(value)
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                for t, v in zip(target.elts, value.elts, strict=False):
                    if isinstance(t, ast.Name) and t.id == "hookloop_role":
                        return _string(v)
    return None


def _string(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _absolute(module: str, node: ast.ImportFrom, tree: ast.Module) -> str | None:
    if not node.level:
        return node.module
    # Relative to the package: ``module`` itself when it is a package's __init__.
    package = module if getattr(tree, "_is_package", False) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    if not package:
        return None
    return f"{package}.{node.module}" if node.module else package


def _parse(module: str) -> ast.Module | None:
    path = _source_path(module)
    if path is None:
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    tree._is_package = path.name == "__init__.py"  # type: ignore[attr-defined]
    return tree


def _source_path(module: str) -> Path | None:
    parts = module.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    # A top-level name is found without running code (sys.meta_path's finders include
    # editable installs' own); submodules are looked up in their package's folders only,
    # since find_spec("a.b") would import the package "a".
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    for part in parts[1:]:
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = PathFinder.find_spec(f"{spec.name}.{part}", spec.submodule_search_locations)
    if spec is None or not isinstance(spec.loader, SourceFileLoader) or not spec.origin:
        return None
    return Path(spec.origin)
