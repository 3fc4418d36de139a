"""The core is layered: every module of ``core/hookloop/`` imports only modules of its own
layer or below, and no import cycle exists (issue 20).

The imports are read from the source with ``ast``, nothing is imported: module-level
and function-local imports alike (a function-local import that hides a cycle is still a
cycle), ``import hookloop.x``, ``from hookloop.x import y``, ``from . import x``,
``from .x import y``, ``from .. import x`` and imports of the package root ``hookloop``
(the public facade, which nothing inside the core imports). Imports under
``if TYPE_CHECKING:`` count too.

:data:`LAYERS` is the order, bottom to top; docs/plugin-authors.md ("How the core is
layered") lists the same layers, and :func:`test_the_documented_layers_are_the_tested_ones`
keeps the two equal. A module that a layer names but that does not exist (yet) is
skipped; a module of the core that no layer names is an error.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "hookloop"
DOC = ROOT / "docs" / "plugin-authors.md"
PACKAGE = "hookloop"

#: The core's layers, bottom to top (module names relative to ``hookloop``; a name that
#: is a package stands for the package and every module in it). A module may import the
#: modules of its own layer and of the layers below.
LAYERS: list[list[str]] = [
    ["contract.errors", "_version", "contract.types", "distributed.ranks", "contract.versioning", "contract.hookspecs", "resume.rundir", "resume.storage", "contract.sourcescan", "distributed.failures"],
    ["resume.unpickling", "engine.settings", "distributed.elastic", "contract.pluginspec", "_moved", "contract.translators", "distributed.environment"],
    ["dispatch"],
    ["contract", "distributed", "resume", "engine", "lightning", "tools"],
    ["distributed.launch", "distributed.collectives"],
    ["distributed.faults", "resume.checkpoint"],
    ["lightning.loggers", "helpers", "distributed.strategy", "data", "resume.loader_state", "distributed.mesh", "resume.sharded_store"],
    ["engine.metrics"],
    ["engine.state"],
    ["engine.optim", "resume.dcp"],
    ["engine.defaults", "observers", "lightning.callbacks"],
    ["engine.step", "observers.ledger"],
    ["engine.loop"],
    ["resume.run"],
    ["engine.session"],
    ["lightning.module", "lightning.datamodule", "distributed.results"],
    ["distributed.launchers"],
    ["contract.registry"],
    ["contract.checks", "lightning.strategies", "engine.resolution"],
    ["engine.trainer", "lightning.tuner", "lightning.plugin", "lightning.views"],
    ["tools.cli", "lightning.cli", "tools.scaffold", "tools.plot", "__main__"],
    ["hookloop"],
    ["testing"],
]

#: Imports the layering allows although they go up, each with why. None: the last one
#: (``module -> loops``, which closed ``datamodule -> module -> loops -> datamodule``) went
#: with ``loops.py``'s split into step/loop/resume/session.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def module_name(path: Path, core: Path = CORE) -> str:
    parts = list(path.relative_to(core.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def core_modules(core: Path = CORE) -> dict[str, Path]:
    return {module_name(p, core): p for p in sorted(core.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """``(imported core module, line)`` for every import of a core module in ``path``."""
    is_package = path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: list[tuple[str, int]] = []

    def owner(dotted: str) -> str | None:
        # the module itself, or the nearest package above a name it defines
        parts = dotted.split(".")
        while parts:
            if ".".join(parts) in modules:
                return ".".join(parts)
            parts.pop()
        return None

    tree = ast.parse(path.read_text(), str(path))
    binds_root = False  # `import hookloop.x` binds the name `hookloop`: the package root
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    target = owner(alias.name)
                    if target:
                        found.append((target, node.lineno))
                    binds_root = binds_root or alias.asname is None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package[: len(package) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else owner(base)
                if target:
                    found.append((target, node.lineno))
    if binds_root:  # `hookloop.<name>` after `import hookloop.x`: a module, or the facade's name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == PACKAGE):
                found.append((owner(f"{PACKAGE}.{node.attr}") or PACKAGE, node.lineno))
    return [(t, line) for t, line in found if t != name]


def import_graph(core: Path = CORE) -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line}}`` over the core's modules."""
    modules = core_modules(core)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in imports_of(name, path, modules):
            edges.setdefault(target, line)
        graph[name] = edges
    return graph


def layer_of(name: str, layers: list[list[str]] = LAYERS) -> int | None:
    """The index of the layer holding ``name`` (a package's entry covers its modules)."""
    best = None
    for index, layer in enumerate(layers):
        for entry in layer:
            full = PACKAGE if entry == PACKAGE else f"{PACKAGE}.{entry}"
            if name == full or (full != PACKAGE and name.startswith(full + ".")):
                if best is None or len(full) > best[1]:
                    best = (index, len(full))
    return None if best is None else best[0]


def cycles(graph: dict[str, dict[str, int]], ignored: set[tuple[str, str]] = frozenset()) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one
    module (Tarjan), ignoring the ``ignored`` edges."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def edges(v: str) -> list[str]:
        return sorted(w for w in graph.get(v, {}) if (v, w) not in ignored and w in graph)

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges(v):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    found: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for component in components:
        members = set(component)
        for start in component:  # the shortest cycle through each member, each cycle once
            previous: dict[str, str | None] = {start: None}
            queue = [start]
            cycle = None
            while queue and cycle is None:
                v = queue.pop(0)
                for w in edges(v):
                    if w == start:
                        path = [v]
                        while previous[path[-1]] is not None:
                            path.append(previous[path[-1]])
                        cycle = list(reversed(path))
                        break
                    if w in members and w not in previous:
                        previous[w] = v
                        queue.append(w)
            first = cycle.index(min(cycle))
            key = tuple(cycle[first:] + cycle[:first])
            if key not in seen:
                seen.add(key)
                found.append(list(key) + [key[0]])
    return found


def upward_imports(graph: dict[str, dict[str, int]], layers: list[list[str]] = LAYERS,
                   ignored: set[tuple[str, str]] = frozenset()) -> list[str]:
    problems = []
    for name, edges in sorted(graph.items()):
        here = layer_of(name, layers)
        for target, line in sorted(edges.items()):
            there = layer_of(target, layers)
            if here is None or there is None or (name, target) in ignored:
                continue
            if there > here:
                problems.append(f"{name} (layer {here + 1}) imports {target} (layer {there + 1}), a higher "
                                f"layer, at {name.replace('.', '/')}.py:{line}")
    return problems


# ---------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------


def test_every_core_module_is_in_a_layer():
    unplaced = sorted(name for name in core_modules() if layer_of(name) is None)
    assert not unplaced, (f"core modules in no layer: {unplaced}; add each to LAYERS in tests/test_layers.py and "
                          f"to docs/plugin-authors.md ('How the core is layered')")
    entries = [entry for layer in LAYERS for entry in layer]
    assert len(entries) == len(set(entries)), "a module is named in two layers"


def test_the_core_has_no_import_cycle():
    found = cycles(import_graph(), KNOWN_EXCEPTIONS)
    assert not found, "import cycles in the core:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_module_imports_a_higher_layer():
    problems = upward_imports(import_graph(), ignored=KNOWN_EXCEPTIONS)
    assert not problems, "imports from a lower layer to a higher one:\n" + "\n".join(problems)


def test_the_known_exceptions_still_exist():
    """An exception that no longer occurs is removed from KNOWN_EXCEPTIONS (it would hide
    the next one)."""
    graph = import_graph()
    stale = [edge for edge in KNOWN_EXCEPTIONS if edge[0] in graph and edge[1] not in graph[edge[0]]]
    assert not stale, f"KNOWN_EXCEPTIONS lists imports that no longer exist: {stale}: remove them"


def test_nothing_in_the_core_imports_the_facade():
    graph = import_graph()
    importers = sorted(name for name, edges in graph.items() if PACKAGE in edges
                       and layer_of(name) < layer_of(PACKAGE))
    assert not importers, (f"{importers} import the package root `hookloop` (its __init__, the public facade, "
                           f"which imports the whole core): import the module that defines the name instead")


def documented_layers(text: str) -> list[list[str]]:
    """The numbered list of the section "How the core is layered": one layer per item,
    its modules in backticks before the colon."""
    section = re.search(r"^#+ [^\n]*How the core is layered\n(.*?)(?=^#+ |\Z)", text, re.S | re.M)
    assert section, f"{DOC} has no section 'How the core is layered'"
    layers = []
    for line in section.group(1).splitlines():
        item = re.match(r"^\d+\.\s+(.*)", line)
        if item:
            names = item.group(1).split(":", 1)[0]
            layers.append(re.findall(r"`([^`]+)`", names))
    return layers


def test_the_documented_layers_are_the_tested_ones():
    assert documented_layers(DOC.read_text()) == LAYERS, (
        "docs/plugin-authors.md ('How the core is layered') and LAYERS in tests/test_layers.py differ: "
        "change both")


# ---------------------------------------------------------------------------------------
# The reader itself, on a small package written here (each kind of import)
# ---------------------------------------------------------------------------------------


def test_the_reader_sees_every_kind_of_import(tmp_path):
    core = tmp_path / PACKAGE
    (core / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .b import thing\nVERSION = 1\n",
        "a.py": "def f():\n    from . import b\n",  # function-local
        "b.py": "from .c import name\n",
        "c.py": "import hookloop.d\n",
        "d.py": "from hookloop import e\n",
        "e.py": "from . import VERSION\n",  # a name of the package root: the facade
        "f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        "sub/__init__.py": "",
        "sub/g.py": "from .. import a\nfrom ..sub import h\nimport hookloop\n",
        "sub/h.py": "from hookloop.sub.g import x\n",
        "i.py": "import hookloop.e\nhookloop.e.f()\nhookloop.VERSION\n",  # the root's name, reached through hookloop.e
    }
    for rel, text in files.items():
        (core / rel).write_text(text)
    graph = import_graph(core)
    assert graph == {
        "hookloop": {"hookloop.b": 1},
        "hookloop.a": {"hookloop.b": 2},
        "hookloop.b": {"hookloop.c": 1},
        "hookloop.c": {"hookloop.d": 1},
        "hookloop.d": {"hookloop.e": 1},
        "hookloop.e": {"hookloop": 1},
        "hookloop.f": {"hookloop.a": 3},
        "hookloop.i": {"hookloop.e": 1, "hookloop": 3},
        "hookloop.sub": {},
        "hookloop.sub.g": {"hookloop.a": 1, "hookloop.sub.h": 2, "hookloop": 3},
        "hookloop.sub.h": {"hookloop.sub.g": 1},
    }
    found = cycles(graph)
    assert found == [
        ["hookloop", "hookloop.b", "hookloop.c", "hookloop.d", "hookloop.e", "hookloop"],
        ["hookloop.sub.g", "hookloop.sub.h", "hookloop.sub.g"],
    ]
    layers = [["e", "d"], ["c", "b", "a", "f", "i"], ["sub"], ["hookloop"]]
    assert upward_imports(graph, layers) == [
        "hookloop.e (layer 1) imports hookloop (layer 4), a higher layer, at hookloop/e.py:1",
        "hookloop.i (layer 2) imports hookloop (layer 4), a higher layer, at hookloop/i.py:3",
        "hookloop.sub.g (layer 3) imports hookloop (layer 4), a higher layer, at hookloop/sub/g.py:3",
    ]
    assert upward_imports(graph, [["e", "d", "sub"], ["c", "b", "a", "f", "i"], ["hookloop"]],
                          ignored={("hookloop.e", "hookloop")}) == [
        "hookloop.i (layer 2) imports hookloop (layer 3), a higher layer, at hookloop/i.py:3",
        "hookloop.sub.g (layer 1) imports hookloop (layer 3), a higher layer, at hookloop/sub/g.py:3",
        "hookloop.sub.g (layer 1) imports hookloop.a (layer 2), a higher layer, at hookloop/sub/g.py:1",
    ]


def test_the_doc_reader_reads_the_numbered_list():
    text = ("# Guide\n## 9. How the core is layered\nBottom first.\n\n1. `errors`, `types`: the bottom\n"
            "2. `dist`: process groups; see `faults`\n\n## 10. Next\n1. `not`: a layer\n")
    assert documented_layers(text) == [["errors", "types"], ["dist"]]


#: what the loop engine never imports (issue 34): Lightning compatibility, the tools and the
#: conformance kit sit above it and reach it through the contract (contract.translators)
ENGINE_NEVER_IMPORTS = ("lightning", "tools", "testing")


def engine_imports_above(graph: dict[str, dict[str, int]]) -> list[str]:
    """``engine/`` modules importing a package of :data:`ENGINE_NEVER_IMPORTS`, one line each."""
    engine = f"{PACKAGE}.engine"
    banned = tuple(f"{PACKAGE}.{name}" for name in ENGINE_NEVER_IMPORTS)
    return [f"{name} imports {target} at {name.replace('.', '/')}.py:{line}"
            for name, edges in sorted(graph.items())
            if name == engine or name.startswith(engine + ".")
            for target, line in sorted(edges.items())
            if any(target == b or target.startswith(b + ".") for b in banned)]


@pytest.mark.check
def test_the_engine_never_imports_lightning_tools_or_testing():
    found = engine_imports_above(import_graph())
    assert not found, ("engine/ imports what sits above it (Lightning compatibility translates "
                       "its arguments through hookloop.contract.translators instead):\n"
                       + "\n".join(found))
    # the check itself sees such an import (a check that found nothing would pass too)
    assert engine_imports_above({"hookloop.engine.x": {"hookloop.lightning.tuner": 3}}) == [
        "hookloop.engine.x imports hookloop.lightning.tuner at hookloop/engine/x.py:3"]
