"""The launcher conformance kit (hookloop.testing.LauncherConformance) on the core's
launchers, and on launchers that break the contract (the kit must fail them).

Every check runs real jobs: 2 worker processes (gloo), a restart, a SIGKILL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import install_fake_distribution
from hookloop.testing import LauncherConformance

pytestmark = pytest.mark.slow  # each class starts ~6 jobs of 2 processes (~60 s)


class TestSpawnLauncher(LauncherConformance):
    """spawn: workers started from inside fit; both modes (script: hookloop run --launcher spawn)."""

    launcher = "spawn"


class TestTorchrunLauncher(LauncherConformance):
    """torchrun re-runs the script: script mode only (its caller does not get results back)."""

    launcher = "torchrun"
    modes = ("script",)


# -- the kit fails launchers that break the contract --------------------------------------------

BROKEN = textwrap.dedent('''
    import os
    import subprocess
    import sys

    import hookloop
    from hookloop.distributed.launchers import Spawn


    class NoSeed(Spawn):
        """Does not pass the caller's seed on: the workers' samplers shuffle with another."""

        hookloop_name = "noseed"

        @hookloop.hookimpl
        def spawn(self, trainer, function):
            seed = os.environ.pop("PL_GLOBAL_SEED", None)
            try:
                return super().spawn(trainer, function)
            finally:
                if seed is not None:
                    os.environ["PL_GLOBAL_SEED"] = seed


    class Leaky(Spawn):
        """Starts a daemon of its own (no hookloop in it) and never reaps it."""

        hookloop_name = "leaky"

        @hookloop.hookimpl
        def spawn(self, trainer, function):
            with hookloop.as_launcher():
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
            return super().spawn(trainer, function)
''')

SUITES = textwrap.dedent('''
    from hookloop.testing import LauncherConformance


    class TestNoSeed(LauncherConformance):
        launcher = "noseed"
        modes = ("function",)


    class TestLeaky(LauncherConformance):
        launcher = "leaky"
        modes = ("function",)
        reap_timeout = 3.0
''')


def test_the_kit_fails_launchers_that_break_the_contract(site, tmp_path):
    """Two broken launchers, one job each and three checks (~30 s): the seed not passed
    on fails the identity and the reference checks; an unreaped daemon fails the orphan
    check; each passes the other checks."""
    install_fake_distribution(site, "hookloop-badlaunch", {"noseed": "hl_badlaunch:NoSeed", "leaky": "hl_badlaunch:Leaky"},
                              {"hl_badlaunch": BROKEN})
    (tmp_path / "test_broken_launchers.py").write_text(SUITES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_") and k != "PL_GLOBAL_SEED"}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "-k",
                           "identity or reference or outlives_the_launch", "test_broken_launchers.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    failed = {line.split(" ")[1] for line in proc.stdout.splitlines() if line.startswith("FAILED")}
    assert proc.returncode == 1, proc.stdout
    assert failed == {
        "test_broken_launchers.py::TestNoSeed::test_every_worker_gets_the_jobs_identity_and_environment[function]",
        "test_broken_launchers.py::TestNoSeed::test_the_weights_agree_with_the_one_process_reference[function]",
        "test_broken_launchers.py::TestLeaky::test_no_process_outlives_the_launch[function]",
    }, proc.stdout


# -- docs/plugin-authors.md's Ray launcher in 100 lines ---------------------------------------------

def tiny_ray_source() -> str:
    """The ``tiny_ray`` code block of docs/plugin-authors.md, as written there."""
    from conftest import REPO

    text = (REPO / "docs" / "plugin-authors.md").read_text()
    start = text.index('```python\n"""tiny_ray: a Ray launcher') + len("```python\n")
    return text[start:text.index("```", start)]


TINY_RAY_SUITE = textwrap.dedent('''
    from hookloop.testing import LauncherConformance


    class TestTinyRay(LauncherConformance):
        launcher = "tiny_ray"
        modes = ("function",)
''')


def test_the_documented_ray_launcher_passes_the_kit(site, tmp_path):
    """The docs' third-party Ray launcher, installed as a plugin, under the whole kit (~30 s:
    a local Ray cluster per job)."""
    source = tiny_ray_source()
    assert 80 <= len(source.splitlines()) <= 120, "the example is about 100 lines"
    install_fake_distribution(site, "tiny-ray", {"tiny_ray": "tiny_ray:TinyRay"}, {"tiny_ray": source})
    (tmp_path / "test_tiny_ray.py").write_text(TINY_RAY_SUITE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_") and k != "PL_GLOBAL_SEED"}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", "test_tiny_ray.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "7 passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout
