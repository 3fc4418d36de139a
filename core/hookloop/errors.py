"""Errors hookloop raises for bad input. Each names what was wrong and how to fix it."""

from __future__ import annotations


class HookloopError(Exception):
    """Base class of every error hookloop raises on purpose."""


class ConfigurationError(HookloopError, ValueError):
    """An argument, or a combination of arguments or plugins, that cannot work."""


class PluginNotFoundError(HookloopError, LookupError):
    """A plugin name that no installed distribution registers."""


class PluginConflictError(ConfigurationError):
    """Two plugins that cannot run together, e.g. two strategies."""


class PluginValidationError(HookloopError, TypeError):
    """A plugin whose hook implementations do not match the hook contract."""


class MissingDependencyError(HookloopError, ImportError):
    """A plugin whose third-party dependencies are not installed."""


class CheckpointError(HookloopError, RuntimeError):
    """A checkpoint that does not exist, is corrupt, or belongs to another model."""


class CollectiveTimeoutError(HookloopError, RuntimeError):
    """A collective (all_reduce, broadcast, barrier...) that timed out or lost a peer: a
    rank stopped making progress. Names the collective and the suspected rank(s)."""
