"""Lightning's ``TrainerFn`` and ``RunningStage``: names for the strings hookloop's
``trainer.state.fn`` and ``trainer.state.stage`` already hold.

Both are ``str`` enums comparing equal to their value whatever its case, as Lightning's
(``trainer.state.fn == TrainerFn.FITTING`` is ``"fit" == "fit"``), so code written against
Lightning's states reads hookloop's. hookloop's state keeps plain strings: the enums are
for the code that names them.
"""

from __future__ import annotations

from enum import Enum


class _StrEnum(str, Enum):
    """A ``str`` enum equal to its value in any case (Lightning's ``LightningEnum``)."""

    def __eq__(self, other: object) -> bool:
        other = other.value if isinstance(other, Enum) else str(other)
        return self.value.lower() == other.lower()

    def __hash__(self) -> int:
        return hash(self.value.lower())

    def __str__(self) -> str:
        return self.value


class TrainerFn(_StrEnum):
    """What the trainer is running: ``trainer.state.fn`` (Lightning's ``TrainerFn``)."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(_StrEnum):
    """Where in that run it is: ``trainer.state.stage`` (Lightning's ``RunningStage``)."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)

    @property
    def dataloader_prefix(self) -> str:
        """The word a stage's loaders are named by (``val_dataloaders``...)."""
        return "val" if self in (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING) else self.value


__all__ = ["RunningStage", "TrainerFn"]
