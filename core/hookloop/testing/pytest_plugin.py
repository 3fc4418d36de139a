"""hookloop's pytest plugin (entry point ``pytest11``): the ``hookloop_processes``
fixture. Importing it imports nothing heavy; it does nothing unless a test asks for it."""

from __future__ import annotations

import pytest


@pytest.fixture
def hookloop_processes():
    """``run(function, nprocs=2, args=(), timeout=120, env=None) -> [result of each rank]``:
    ``function(*args)`` on real processes with a torchrun-like environment (see
    :func:`hookloop.testing.run_processes`)."""
    from hookloop.testing.processes import run_processes

    return run_processes
