"""Type aliases that Lightning code annotates its hooks with (``lightning.pytorch.utilities.types``).

Annotations only: a ported module's ``-> STEP_OUTPUT`` needs the name to exist, nothing more.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

from torch import Tensor
from torch.optim import Optimizer

#: what ``training_step``/``validation_step``... return: a loss tensor, a dict with ``"loss"``, or None
STEP_OUTPUT = Optional[Union[Tensor, Mapping[str, Any]]]
#: any iterable or collection of iterables
TRAIN_DATALOADERS = Any
EVAL_DATALOADERS = Any
#: what ``configure_optimizers`` returns (hookloop.optim reads every form Lightning accepts)
OptimizerLRScheduler = Optional[Union[Optimizer, Sequence[Optimizer], tuple, Mapping[str, Any], Sequence[Mapping[str, Any]]]]

__all__ = ["EVAL_DATALOADERS", "OptimizerLRScheduler", "STEP_OUTPUT", "TRAIN_DATALOADERS"]
