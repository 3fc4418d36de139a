"""hookloop.distributed.reaper: ``as_launcher(reap=True)`` ends what its launch started.

Real processes: a launcher (tests/scripts/reaper_launcher.py) starts, inside
``hookloop.as_launcher(reap=...)``, a daemon that imports no hookloop and escapes its
parent (double fork, a session of its own: what a local Ray cluster's agents are). The
daemon outlives a SIGKILLed launcher without the reaper, and is gone within seconds with
it; after a normal end of the block it is gone when the block returns. Each test starts
two short Python processes (about a second): marked slow, as every launching test is
(tests/tiers.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "tests" / "scripts" / "reaper_launcher.py"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the reaper reads /proc")]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


def start(*args: str) -> tuple[subprocess.Popen, int]:
    launcher = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, text=True)
    daemon = int(launcher.stdout.readline())
    assert alive(daemon)
    return launcher, daemon


def test_a_daemon_outlives_a_sigkilled_launcher_without_the_reaper():
    launcher, daemon = start("--no-reap")
    try:
        launcher.kill()
        launcher.wait()
        assert not gone_within(daemon, 1.0)  # what the reaper is for
    finally:
        os.kill(daemon, signal.SIGKILL)


def test_the_reaper_ends_a_daemon_of_a_sigkilled_launcher():
    launcher, daemon = start()
    try:
        launcher.kill()
        launcher.wait()
        assert gone_within(daemon, 5.0)
    finally:
        if alive(daemon):
            os.kill(daemon, signal.SIGKILL)


def test_the_reaper_ends_a_daemon_when_the_block_ends_and_then_exits():
    launcher, daemon = start("--leave")
    try:
        assert launcher.stdout.readline().strip() == "left"  # printed after the with block
        assert not alive(daemon)  # already gone when as_launcher returned
        assert launcher.wait(timeout=30) == 0
    finally:
        if alive(daemon):
            os.kill(daemon, signal.SIGKILL)
