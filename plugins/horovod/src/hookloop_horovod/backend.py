"""Importing Horovod, lazily, and saying how to build it when it is not usable.

Horovod is imported only when a run needs it (``hookloop plugins`` imports this plugin
to show its role and must not pay for, or fail on, Horovod). Three things can be wrong:
Horovod is not installed (``pip install horovod`` does not compile against torch >= 2.1,
so it has to be built), it was built without its PyTorch extension, or without Gloo
(the only controller that runs without MPI, and the one hookloop launches with).
"""

from __future__ import annotations

import importlib.util
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import ModuleType

import hookloop

HOROVOD_VERSION = "0.28.1"

BUILD_HINT = (
    "Build it from source with PyTorch and Gloo (horovod 0.28.1 as published does not "
    "compile against torch >= 2.1): `PYTHON=.venv/bin/python plugins/horovod/build_horovod.sh` "
    "from the hookloop checkout (about 6 minutes the first time, then cached), or "
    "`make install`. See plugins/horovod/BUILD.md."
)


def import_horovod() -> ModuleType:
    """Return ``horovod.torch``, or raise :class:`hookloop.MissingDependencyError`.

    Not cached: the check is a dictionary lookup once the module is imported, and a
    process that builds Horovod after a failed attempt gets the new answer.
    """
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        # Also an extension built against another torch ("undefined symbol ...").
        raise hookloop.MissingDependencyError(
            f"the horovod plugin needs Horovod with its PyTorch extension, and "
            f"`import horovod.torch` failed: {exc}. {BUILD_HINT}"
        ) from exc
    gloo_built = getattr(hvd, "gloo_built", None)
    if gloo_built is None or not gloo_built():
        raise hookloop.MissingDependencyError(
            f"the installed Horovod ({_version()}) was built without Gloo, which the horovod "
            f"plugin launches with (`horovodrun --gloo`). Rebuild it with "
            f"HOROVOD_WITH_GLOO=1: {BUILD_HINT} (HOOKLOOP_FORCE_REBUILD=1 replaces the "
            f"installed build)."
        )
    return hvd


def build_status() -> str | None:
    """``None`` when Horovod's compiled PyTorch extension is installed, else the command
    that builds it (the plugin's ``hookloop_build_status``, shown by ``hookloop plugins``).
    Looks for the file without importing Horovod; an extension built against another torch
    is still caught at launch by :func:`import_horovod`."""
    spec = importlib.util.find_spec("horovod")  # the top-level package: imports nothing
    folders = (spec.submodule_search_locations or []) if spec else []
    if any(next(Path(f, "torch").glob(f"mpi_lib_v2{s}"), None) for f in folders for s in EXTENSION_SUFFIXES):
        return None
    return "run 'make backends' (or plugins/horovod/build_horovod.sh)"


def check_launcher() -> None:
    """Fail before any worker starts if the workers could not use Horovod."""
    import_horovod()
    try:
        import horovod.runner.launch  # noqa: F401  (horovodrun's entry point)
    except ImportError as exc:
        raise hookloop.MissingDependencyError(
            f"Horovod's launcher (horovod.runner, i.e. horovodrun) cannot be imported: "
            f"{exc}. Install its requirements (cloudpickle, psutil, pyyaml) or {BUILD_HINT}"
        ) from exc


def _version() -> str:
    try:
        import horovod

        return f"horovod {horovod.__version__}"
    except ImportError:
        return "horovod"


def under_horovod_launcher() -> bool:
    """True in a process that horovodrun (or mpirun) started, whoever started horovodrun."""
    return "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ
