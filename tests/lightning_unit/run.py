"""Run one vendored Lightning test file under one framework; each test's outcome as JSON.

    python -m tests.lightning_unit.run FRAMEWORK FILE [FILE ...]   (FILE relative to tests_pytorch)

`prepare` writes a work directory laid out as Lightning's ``tests/``: ``tests_pytorch/``
(the vendored files), ``pkgs/lightning_demos/`` and a ``pytest.ini`` with Lightning's own
pytest settings (pyproject.toml at the vendored commit: strict markers and xfails,
FutureWarning as an error). Under ``lightning`` the files are used as written, ``lightning``
being the installed pytorch-lightning 2.6.6 (aliases.py). Under ``hookloop`` their imports
are rewritten by tests/lightning_scripts/rewrite.py, a name hookloop lacks binding a
placeholder that fails the test using it; Lightning's harness (HARNESS: the conftest's
fixtures, RunIf's conditions) stays Lightning's, its imports pointed at pytorch-lightning
2.6.6; ``lightning`` itself is not importable (a test that patches Lightning's internals
by name, ``mock.patch("lightning.pytorch...")``, fails).

`run_files` runs pytest in a new process in that directory (the cwd of Lightning's CI:
a test that writes into the cwd leaves artifacts, which Lightning's conftest fails) and
returns {test id: {"outcome", "message"}}: collection errors and a crashed or timed-out
process become ``error`` entries of the tests the reference run found, never a crash of
the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.lightning_scripts.rewrite import rewrite

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENDOR = HERE / "vendor" / "tests_pytorch"
DEMOS = REPO / "tests" / "lightning_scripts" / "vendor" / "lightning_demos"
FRAMEWORKS = ("lightning", "hookloop")
HARNESS = ("__init__.py", "conftest.py", "helpers/runif.py")

PYTEST_INI = """\
# Lightning's pytest settings (its pyproject.toml), as far as they decide outcomes
[pytest]
addopts = --strict-markers --disable-pytest-warnings -p no:cacheprovider
markers =
    cloud: Run the cloud tests for example
    flaky: pytest-rerunfailures' marker (Lightning's CI has the plugin; here a test runs once)
filterwarnings =
    error::FutureWarning
    ignore::FutureWarning:onnxscript
    ignore:You are using `torch.load` with `weights_only=False`.*:FutureWarning
    ignore::FutureWarning:torch.distributed.algorithms.ddp_comm_hooks
    ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated.*:FutureWarning
xfail_strict = true
"""

# hookloop's conftest.py: Lightning's (lightning_conftest.py, its imports pointed at the
# installed pytorch-lightning 2.6.6: the fixtures are the tests' harness, not what they test).
HOOKLOOP_CONFTEST = """\
# Lightning's conftest, imports pointed at pytorch-lightning 2.6.6 (see tests/lightning_unit/run.py)
import pytest

from tests_pytorch import lightning_conftest
from tests_pytorch.lightning_conftest import *  # noqa: F403


def pytest_collection_modifyitems(items, config):
    # Lightning's marks every test `filterwarnings("error::lightning.fabric...")`, a name
    # resolved when the test runs, which names no installed module: the same class by its
    # installed name
    lightning_conftest.pytest_collection_modifyitems(items, config)
    for item in items:
        item.own_markers[:] = [
            pytest.mark.filterwarnings(m.args[0].replace("lightning.fabric.", "lightning_fabric.")).mark
            if m.name == "filterwarnings" and m.args and "lightning.fabric." in m.args[0] else m
            for m in item.own_markers]
"""


def prepare(framework: str, workdir: Path) -> None:
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, not {framework!r}")
    if workdir.exists():
        shutil.rmtree(workdir)
    for src in sorted(VENDOR.rglob("*.py")):
        rel = src.relative_to(VENDOR).as_posix()
        out = workdir / "tests_pytorch" / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        text = src.read_text()
        if framework == "hookloop":
            text = rewrite(text, "lightning") if rel in HARNESS else rewrite(text, "hookloop", missing="placeholder")
        if framework == "hookloop" and rel == "conftest.py":
            (workdir / "tests_pytorch" / "lightning_conftest.py").write_text(text)
            text = HOOKLOOP_CONFTEST
        out.write_text(text)
    if framework == "hookloop":
        pkg = workdir / "pkgs" / "lightning_demos"
        pkg.mkdir(parents=True)
        for src in DEMOS.glob("*.py"):
            (pkg / src.name).write_text(rewrite(src.read_text(), "hookloop"))
    (workdir / "pytest.ini").write_text(PYTEST_INI)


def environment(framework: str, workdir: Path, out: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(workdir), str(workdir / "pkgs"), str(REPO)])
    env.update(LIGHTNING_UNIT_FRAMEWORK=framework, LIGHTNING_UNIT_OUT=str(out), OMP_NUM_THREADS="1",
               PL_DISABLE_FORK="1", PYTHONDONTWRITEBYTECODE="1")
    for key in [k for k in env if k.startswith(("PL_", "HOOKLOOP_")) and k != "PL_DISABLE_FORK"]:
        del env[key]
    return env


def run_files(framework: str, files: list[str], workdir: Path, timeout: float = 3600) -> dict:
    """{file: {test id: {"outcome", "message"}}} of one pytest process over ``files``
    (a fresh ``prepare``d ``workdir``). A file that did not collect has the single id
    ``FILE::<collection>``; a process that died leaves ``FILE::<run>``."""
    prepare(framework, workdir)
    out = workdir / "outcomes.json"
    cmd = [sys.executable, "-m", "pytest", "-q", "--continue-on-collection-errors", "-p", "tests.lightning_unit.outcomes", "-c",
           str(workdir / "pytest.ini"), "--rootdir", str(workdir), *[f"tests_pytorch/{f}" for f in files]]
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=environment(framework, workdir, out), capture_output=True,
                              text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        died = None if out.is_file() else f"pytest exited {proc.returncode} without results: {tail[0][:200]}"
    except subprocess.TimeoutExpired:
        died = f"the run of the files passed {timeout:.0f} s"
    raw = json.loads(out.read_text()) if out.is_file() else {"tests": {}, "collection_errors": {}}
    results: dict = {f: {} for f in files}
    for nodeid, entry in raw["tests"].items():
        path, _, test = nodeid.partition("::")
        results.setdefault(path.removeprefix("tests_pytorch/"), {})[test] = entry
    for nodeid, message in raw["collection_errors"].items():
        path = nodeid.split("::")[0].removeprefix("tests_pytorch/")
        results.setdefault(path, {})["<collection>"] = {"outcome": "error", "message": message}
    if died:
        for f in files:
            results[f]["<run>"] = {"outcome": "error", "message": died}
    return results


def main(argv: list[str]) -> None:
    framework, *files = argv
    with tempfile.TemporaryDirectory(prefix=f"lightning-unit-{framework}-") as tmp:
        results = run_files(framework, files, Path(tmp) / "work")
    json.dump(results, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main(sys.argv[1:])
