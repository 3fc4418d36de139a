"""``hookloop.DataModule``: Lightning's ``LightningDataModule``.

A DataModule keeps the data of a run in one place: ``prepare_data()`` downloads or
writes what every process will read, ``setup(stage)`` builds the datasets, and
``train_dataloader()`` / ``val_dataloader()`` / ``test_dataloader()`` /
``predict_dataloader()`` return the loaders. Pass it to ``trainer.fit(module,
datamodule=dm)`` (and to ``validate``/``test``/``predict``).

Inside each worker, after the process group exists:

* ``prepare_data()`` runs once per node, on local rank 0 (``prepare_data_per_node =
  False``: once in the whole job, on global rank 0), while the other ranks wait at a
  barrier, so they never read a half-written file;
* ``setup(stage)`` runs on every rank, ``stage`` being ``"fit"``, ``"validate"``,
  ``"test"`` or ``"predict"``;
* the loaders the stage needs are asked for, then sharded by the strategy like any
  loader;
* ``teardown(stage)`` runs at the end, also after an exception.

``state_dict()``/``load_state_dict()`` travel in checkpoints.
"""

from __future__ import annotations

from typing import Any

from hookloop.lightning.module import HyperparametersMixin


class DataModule(HyperparametersMixin):
    """Base class for data modules; override what you need (see the module docstring)."""

    #: ``prepare_data`` once per node (True) or once per job on global rank 0 (False)
    prepare_data_per_node: bool = True

    def __init__(self) -> None:
        self.trainer: Any = None

    def prepare_data(self) -> None:
        """Download or write data; runs on one process per node (or per job)."""

    def setup(self, stage: str) -> None:
        """Build datasets for ``stage``; runs on every process."""

    def teardown(self, stage: str) -> None:
        """Release what ``setup`` built; runs on every process."""

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no train_dataloader()")

    def val_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no val_dataloader()")

    def test_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no test_dataloader()")

    def predict_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no predict_dataloader()")

    def state_dict(self) -> dict:
        """State to keep in checkpoints (plain types and tensors)."""
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned."""


# Not the user's loaders: hookloop.session.provides tells them apart by this mark.
for _method in ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader"):
    getattr(DataModule, _method).hookloop_placeholder = True
