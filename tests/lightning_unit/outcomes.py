"""The pytest plugin of one run (``-p tests.lightning_unit.outcomes``): each test's outcome.

Loaded before Lightning's conftest. Under ``LIGHTNING_UNIT_FRAMEWORK=lightning`` it makes
``lightning`` the installed pytorch-lightning 2.6.6 for the whole session (aliases.py).
Every test id gets ``passed``/``failed``/``error``/``skipped`` (an xfail that failed counts
as ``skipped``, as pytest reports it, and an unexpected pass as ``failed``: Lightning
runs with ``xfail_strict``) and the first line of what went wrong; a file that fails to
collect is recorded under ``collection_errors``. The JSON goes to ``$LIGHTNING_UNIT_OUT``.
A test that runs past ``$LIGHTNING_UNIT_TEST_TIMEOUT`` seconds is interrupted (SIGALRM)
and fails with a ``TimeoutError``.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

if os.environ.get("LIGHTNING_UNIT_FRAMEWORK") == "lightning":
    from tests.lightning_unit import aliases

    aliases.install()

RESULTS: dict = {"tests": {}, "collection_errors": {}}
TIMEOUT = int(os.environ.get("LIGHTNING_UNIT_TEST_TIMEOUT", "180"))


def first_line(report) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2]).splitlines()[0][:300] if str(longrepr[2]).strip() else ""
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def pytest_runtest_logreport(report) -> None:
    entry = RESULTS["tests"].setdefault(report.nodeid, {"outcome": None, "message": ""})
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "skipped" if report.skipped else "failed"
            entry.update(outcome=outcome, message=("xfail: " + report.wasxfail)[:300] if report.skipped
                         else "unexpectedly passed (xfail_strict)")
        else:
            entry.update(outcome=report.outcome, message=first_line(report) if not report.passed else "")
    elif report.failed and entry["outcome"] in (None, "passed"):  # setup or teardown
        entry.update(outcome="error", message=f"{report.when}: {first_line(report)}")
    elif report.skipped and report.when == "setup":
        entry.update(outcome="skipped", message=first_line(report))


def pytest_make_parametrize_id(config, val, argname):
    # a placeholder for a name hookloop lacks gets the id Lightning's object gets (an enum
    # member's str, a class's name), so that the test ids of the two runs are the same
    from tests.lightning_scripts.rewrite import Missing

    if isinstance(val, Missing):
        return object.__getattribute__(val, "_path")
    return None


def pytest_collectreport(report) -> None:
    if report.failed:  # the error's own line ("E   ImportError: ..."), not pytest's preamble
        lines = [line[1:].strip() for line in str(report.longrepr).splitlines() if line.startswith("E ")]
        RESULTS["collection_errors"][report.nodeid] = (lines[-1] if lines else first_line(report))[:300]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    def interrupt(signum, frame):
        raise TimeoutError(f"the test ran past {TIMEOUT} s (LIGHTNING_UNIT_TEST_TIMEOUT)")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(TIMEOUT)
    try:
        return (yield)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def pytest_sessionfinish(session) -> None:
    out = os.environ.get("LIGHTNING_UNIT_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(RESULTS, f, indent=1, sort_keys=True)
