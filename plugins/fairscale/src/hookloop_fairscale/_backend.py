"""The one place that knows how fairscale is found, and what to say when it is not."""

from __future__ import annotations

import importlib.util

import hookloop

#: The exact release this distribution is built and tested against.
FAIRSCALE_REQUIREMENT = "fairscale==0.4.13"


def require_fairscale(plugin: str) -> None:
    """Raise ``MissingDependencyError`` naming the package when fairscale is not installed.

    Checked when the plugin object is created (``Trainer(...)``), before any process
    starts, without importing fairscale (plugins import their backend in their hooks).
    """
    try:
        found = importlib.util.find_spec("fairscale") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if not found:
        raise hookloop.MissingDependencyError(
            f"the {plugin!r} plugin runs on fairscale, which is not installed: "
            f"pip install '{FAIRSCALE_REQUIREMENT}' (or pip install hookloop-fairscale, which "
            f"depends on it; install torch first so pip keeps your torch build)"
        )
