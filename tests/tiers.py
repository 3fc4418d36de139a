"""The suite's tiers, its launch guard and its per-file report (imported by conftest.py).

Tiers are pytest markers (declared in pyproject.toml) chosen with ``--tier``:

    make check      --tier=check   every in-process test, and the launched jobs marked ``check``
                                   (one real 2-process job per strategy family): minutes
    make test       --tier=test    (the default, what CI runs) check + everything marked ``slow``
    make test-full  --tier=full    test + everything marked ``full`` (the long matrices)

A test outside the chosen tier is *deselected*, not skipped: the summary counts only what
ran. ``gpu`` tests run in every tier and skip, with the reason, where there is no CUDA.

A **launch** is a new Python interpreter or a launcher started by the test process
(``subprocess`` running ``python``, ``torchrun``, ``horovodrun``, ``mpirun``, ``hookloop``
or ``pip``, or a ``spawn``/``forkserver`` multiprocessing child): each pays for ``import
torch`` again. A fork (a DataLoader worker) is not one, nor is a small program a library
runs (``ldconfig``, a compiler). A test that launches without a ``slow``, ``full``
or ``check`` marker fails: that is what keeps ``make check`` quick. The launches and the
wall time of every test file are printed at the end of the run (and written as JSON
to ``$HOOKLOOP_TEST_REPORT`` when it is set).
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import subprocess
import sys
from collections import defaultdict

import pytest

TIERS = ("check", "test", "full")
LAUNCH_MARKERS = ("slow", "full", "check")

#: The tier this session runs; set by ``pytest_configure`` before any test module is
#: imported, so a module may read it at import time (:func:`at_least`).
TIER = "test"


def at_least(tier: str) -> bool:
    """Whether this session runs ``tier``'s tests: ``at_least("full")`` under ``make test-full``.
    For the few tests whose *parameters* grow with the tier (a wider model, more seeds)."""
    return TIERS.index(TIER) >= TIERS.index(tier)


def tier_of(item) -> str:
    """The cheapest tier that runs ``item``."""
    if item.get_closest_marker("full"):
        return "full"
    if item.get_closest_marker("check"):
        return "check"
    if item.get_closest_marker("slow"):
        return "test"
    return "check"


# -- counting launches ------------------------------------------------------------------

_current: list = [None]
_launches: dict = defaultdict(int)
_seconds: dict = defaultdict(float)


LAUNCHERS = ("python", "torchrun", "horovodrun", "mpirun", "hookloop", "pip", "deepspeed")


def _count() -> None:
    _launches[_current[0]] += 1


def _is_launch(args, executable) -> bool:
    program = executable or (args if isinstance(args, (str, bytes)) else args[0])
    program = os.fsdecode(program)
    if isinstance(args, (str, bytes)):  # a shell line: its first word
        program = program.split()[0] if program.split() else program
    return os.path.basename(program).startswith(LAUNCHERS) or program == sys.executable


_execute_child = subprocess.Popen._execute_child
_spawnv_passfds = multiprocessing.util.spawnv_passfds


def _counted_execute_child(self, args, executable, *rest, **kwargs):
    if _is_launch(args, executable):
        _count()
    return _execute_child(self, args, executable, *rest, **kwargs)


def _counted_spawnv_passfds(*args, **kwargs):
    _count()
    return _spawnv_passfds(*args, **kwargs)


# -- pytest hooks -----------------------------------------------------------------------


def pytest_addoption(parser):
    parser.addoption("--tier", choices=TIERS, default=os.environ.get("HOOKLOOP_TEST_TIER", "test"),
                     help="check: in-process tests and one launched job per strategy family; "
                          "test (default, CI): + every launched job marked slow; full: + the long "
                          "matrices marked full")


def pytest_configure(config):
    global TIER
    TIER = config.getoption("--tier")
    if TIER == "full":
        # The conformance kit (hookloop.testing) is public and reads its own knob for its
        # longer seed lists; the full tier turns it on for the processes it starts too.
        os.environ["HOOKLOOP_TEST_FULL"] = "1"
    subprocess.Popen._execute_child = _counted_execute_child
    multiprocessing.util.spawnv_passfds = _counted_spawnv_passfds


def pytest_unconfigure(config):
    subprocess.Popen._execute_child = _execute_child
    multiprocessing.util.spawnv_passfds = _spawnv_passfds


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        (keep if TIERS.index(tier_of(item)) <= TIERS.index(TIER) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    yield
    _current[0] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    launches = _launches.get(item.nodeid, 0)
    if call.when == "teardown":  # travels with the report (to the controller under xdist)
        report.user_properties = [*report.user_properties, ("hookloop_launches", launches)]
    if call.when != "call" or report.failed or not launches:
        return
    if not any(item.get_closest_marker(m) for m in LAUNCH_MARKERS):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started {launches} process(es) (a Python interpreter or a launcher) "
            "but is not marked slow, full or check: the quick tier must stay in-process. "
            "Call the code in-process (e.g. hookloop.tools.cli.main([...]) with capsys), share a job of "
            "tests/jobs.py, or mark the test (pytest.mark.slow) and say why in its docstring.")


def pytest_runtest_logreport(report):
    """Seconds (setup + call + teardown) and launches per test, from the reports: so the
    table is right in-process and under pytest-xdist (where the reports reach the controller)."""
    _seconds[report.nodeid] += report.duration
    for key, value in report.user_properties:
        if key == "hookloop_launches":
            _launches[report.nodeid] = value


def _by_file() -> dict:
    files: dict = defaultdict(lambda: {"tests": 0, "launches": 0, "seconds": 0.0})
    for nodeid, seconds in _seconds.items():
        row = files[nodeid.split("::")[0]]
        row["tests"] += 1
        row["seconds"] += seconds
        row["launches"] += _launches.get(nodeid, 0)
    return dict(files)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    files = _by_file()
    if not files:
        return
    write = terminalreporter.write_line
    terminalreporter.section(f"launches and wall time per test file (tier {TIER})")
    write(f"{'seconds':>8} {'launches':>8} {'tests':>6}  file")
    for name, row in sorted(files.items(), key=lambda kv: -kv[1]["seconds"]):
        write(f"{row['seconds']:8.1f} {row['launches']:8d} {row['tests']:6d}  {name}")
    write(f"{sum(r['seconds'] for r in files.values()):8.1f} {sum(r['launches'] for r in files.values()):8d} "
          f"{sum(r['tests'] for r in files.values()):6d}  total")
    target = os.environ.get("HOOKLOOP_TEST_REPORT")
    if target:
        with open(target, "w") as f:
            json.dump({"tier": TIER, "files": files,
                       "tests": {n: {"seconds": s, "launches": _launches.get(n, 0)} for n, s in _seconds.items()}},
                      f, indent=1)
