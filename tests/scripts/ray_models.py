"""A module for tests/test_ray.py's in-process fits: the workers import it by name."""

from torch.utils.data import DataLoader

from hookloop.testing import TinyClassifier, tiny_dataset


class WorkerError(RuntimeError):
    """What the failing module raises: the caller must get this type back."""


class Failing(TinyClassifier):
    def __init__(self, seed: int = 0, fail: bool = True):
        super().__init__(seed=seed)
        self.fail = fail

    def training_step(self, batch, batch_idx):
        if self.fail and self.trainer.global_step == 1:
            raise WorkerError("failing on purpose at step 1")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return DataLoader(tiny_dataset(32), batch_size=8)
