"""Argument translators: how a compatibility layer takes the ``Trainer`` arguments the
engine does not know, without the engine importing it.

The engine (``hookloop.engine``) knows ``plugins=`` and the settings of
:class:`hookloop.TrainerConfig`. Lightning's names for plugins (``callbacks=``,
``strategy=``, ``logger=`` objects) and the ``hookloop tune`` entry belong to
``hookloop.lightning``, which sits above the engine. The facade (``import hookloop``)
registers that layer's translator here (:func:`register`); the settings resolution
(:func:`hookloop.engine.resolution.resolve_settings`) hands it the arguments it owns.

A translator is blockable by its name, as a built-in plugin is: ``plugins=["no:lightning"]``
(``-p no:lightning``, ``HOOKLOOP_PLUGINS=no:lightning``) turns it off, and then an argument
or environment variable it owns is refused at start with a :class:`ConfigurationError`
naming it (docs/lightning.md, "Turning compatibility off"; docs/decisions.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from hookloop.contract.errors import ConfigurationError


@dataclass(frozen=True)
class Translation:
    """What a translator made of the arguments: the plain ``arguments`` for the engine
    (those it owns taken out, ``plugins`` holding what they stood for, in order), the
    ``adapter`` plugin standing for several given objects (``trainer.callbacks`` lists
    them in its place; ``None`` without one) and the built-in observers the translation
    replaces (``logger=`` objects replace the default ``csv``)."""

    arguments: Mapping[str, Any]
    adapter: Any = None
    replaces_builtin: frozenset[str] = field(default_factory=frozenset)


class ArgumentTranslator(Protocol):
    """A compatibility layer's entry into the settings resolution and into ``fit``."""

    #: the built-in plugin name that blocks it (``no:NAME``)
    name: str
    #: the environment variables it alone reads (refused while it is blocked)
    variables: tuple[str, ...]

    def owns(self, argument: str, value: Any) -> bool:
        """Whether ``Trainer(argument=value)`` is this layer's to translate."""
        ...

    def translate(self, arguments: Mapping[str, Any]) -> Translation:
        """The engine's arguments for ``arguments`` (every argument given in code)."""
        ...

    def before_fit(self, trainer: Any, model: Any, train_dataloaders: Any, datamodule: Any) -> None:
        """Called by ``fit`` after its checks, before anything starts (``hookloop tune``)."""
        ...


_REGISTERED: dict[str, ArgumentTranslator] = {}


def register(translator: ArgumentTranslator) -> None:
    """Add (or replace, by name) a translator; the facade registers ``lightning``'s."""
    _REGISTERED[translator.name] = translator


def registered() -> tuple[ArgumentTranslator, ...]:
    """The translators in the order they were registered."""
    return tuple(_REGISTERED.values())


#: Read-only attributes of the Trainer that a compatibility layer provides over the run's
#: plugins (Lightning's ``trainer.early_stopping_callbacks``, ``trainer.lightning_module``):
#: name -> function of the trainer. The engine's ``Trainer.__getattr__`` looks a name up
#: here only when it has no such attribute itself.
_VIEWS: dict[str, Any] = {}


def register_view(name: str, view: Any) -> None:
    """Provide ``trainer.<name>`` as ``view(trainer)`` (the facade registers Lightning's)."""
    _VIEWS[name] = view


def view(name: str) -> Any:
    """The function behind ``trainer.<name>``, or ``None``."""
    return _VIEWS.get(name)


def blocked_error(translator: str, what: str, blocked_by: str) -> ConfigurationError:
    """The error for an argument (or variable) ``what`` of a blocked compatibility layer."""
    return ConfigurationError(
        f"{what} is {translator.capitalize()} compatibility, which is blocked ({blocked_by}): "
        f"remove "
        f"no:{translator} to use it, or give the engine's own setting instead (plugins=[...] for "
        f"plugin objects and strategy plugins; logger=True/False)"
    )


def unknown_error(what: str) -> ConfigurationError:
    """The error for a compatibility argument that no registered translator takes."""
    return ConfigurationError(
        f"{what} needs a compatibility layer, and none is registered (import hookloop, whose "
        f"facade registers Lightning's): give plugins=[...] instead"
    )


def as_list(value: Any) -> list:
    """An argument given as one object, a list or a tuple (or ``None``), as a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]
