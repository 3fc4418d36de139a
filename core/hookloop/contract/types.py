"""Type aliases that Lightning code annotates its hooks with
(``lightning.pytorch.utilities.types``).

Annotations only: a ported module's ``-> STEP_OUTPUT`` needs the name to exist, nothing more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

#: what ``training_step``/``validation_step``... return: a loss tensor, a dict with
#: ``"loss"``, or None
STEP_OUTPUT = Tensor | Mapping[str, Any] | None
#: any iterable or collection of iterables
TRAIN_DATALOADERS = Any
EVAL_DATALOADERS = Any
#: what ``configure_optimizers`` returns (hookloop.optim reads every form Lightning accepts)
OptimizerLRScheduler = (
    Optimizer | Sequence[Optimizer] | tuple | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None
)

__all__ = ["EVAL_DATALOADERS", "OptimizerLRScheduler", "STEP_OUTPUT", "TRAIN_DATALOADERS"]
