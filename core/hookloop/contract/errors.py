"""Errors hookloop raises for bad input. Each names what was wrong and how to fix it."""

from __future__ import annotations


class HookloopError(Exception):
    """Base class of every error hookloop raises on purpose."""

    #: Whether the error follows from the configuration alone (the arguments, plugins and
    #: installed packages, the same on every rank), so every rank of a job raises it alike.
    #: Under the user's own ``torchrun``, global rank 0 alone prints the traceback of such
    #: an error; the other ranks print one line (README "When a worker fails").
    same_on_every_rank = False


class ConfigurationError(HookloopError, ValueError):
    """An argument, or a combination of arguments or plugins, that cannot work."""

    same_on_every_rank = True


#: Lightning's name for the error of a setting that cannot work
#: (``lightning.pytorch.utilities.exceptions.MisconfigurationException``): the same class, so
#: ``except MisconfigurationException`` / ``pytest.raises(MisconfigurationException)`` in
#: ported code catch hookloop's refusals where Lightning's would raise
MisconfigurationException = ConfigurationError


class PossibleUserWarning(UserWarning):
    """A warning that may be a false positive (Lightning's
    ``lightning.pytorch.utilities.warnings.PossibleUserWarning``): filter it out when the
    setting it names is what you meant."""


class HookSignatureError(ConfigurationError, RuntimeError):
    """A module method whose arguments cannot take what the loop passes it (Lightning
    raises a ``RuntimeError`` for these: code that catches one catches this)."""


class AutomaticOptimizationError(ConfigurationError, RuntimeError):
    """What automatic optimization cannot do: several optimizers, a ``training_step`` taking
    ``optimizer_idx`` (Lightning raises a ``RuntimeError`` for these: code that catches one
    catches this). Manual optimization can."""


class MissingAttributeError(ConfigurationError, AttributeError):
    """An attribute of the user's module that a feature needs and cannot find (the
    learning rate ``lr_find`` sets; Lightning raises an ``AttributeError`` for these:
    code that catches one catches this)."""


class PluginNotFoundError(HookloopError, LookupError):
    """A plugin name that no installed distribution registers."""

    same_on_every_rank = True


class PluginConflictError(ConfigurationError):
    """Two plugins that cannot run together, e.g. two strategies."""


class PluginValidationError(HookloopError, TypeError):
    """A plugin whose hook implementations do not match the hook contract."""

    same_on_every_rank = True


class MissingDependencyError(HookloopError, ImportError):
    """A plugin whose third-party dependencies are not installed."""

    same_on_every_rank = True


class CheckpointError(HookloopError, RuntimeError):
    """A checkpoint that does not exist, is corrupt, or belongs to another model."""


class CollectiveTimeoutError(HookloopError, RuntimeError):
    """A collective (all_reduce, broadcast, barrier...) that timed out or lost a peer: a
    rank stopped making progress. Names the collective and the suspected rank(s)."""


def mark_same_on_every_rank(exc: BaseException) -> BaseException:
    """Mark ``exc`` (any exception, e.g. a third-party library's refusal of a setting) as
    raised alike by every rank, as :attr:`HookloopError.same_on_every_rank` does for a
    class; returns it, for ``raise mark_same_on_every_rank(exc)``."""
    exc.same_on_every_rank = True  # type: ignore[attr-defined]
    return exc


def same_on_every_rank(exc: BaseException) -> bool:
    """Whether ``exc`` is marked as raised alike by every rank (its class or the instance:
    :func:`mark_same_on_every_rank`)."""
    return getattr(exc, "same_on_every_rank", False) is True
