"""A ddp job whose module raises in ``configure_optimizers`` (tests/test_failure_report.py).

``failing_job.py ROOT WHICH [--devices N]``: ``WHICH`` is ``all`` (every rank raises the
same ValueError) or ``one`` (global rank 1 only). With ``--devices`` the script asks for
its processes in code (``Trainer(devices=N, plugins=["ddp"])``, run as ``python
failing_job.py``: the Trainer re-launches it); without, ``hookloop run`` decides.
"""

from __future__ import annotations

import argparse
import os

from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import TinyClassifier, tiny_dataset

MESSAGE = "optimizer offload refuses SGD: use torch.optim.Adam"


class Refusing(TinyClassifier):
    which = "all"

    def configure_optimizers(self):
        if self.which == "all" or os.environ.get("RANK") == "1":
            raise ValueError(MESSAGE)
        return super().configure_optimizers()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("which", choices=["all", "one"])
    parser.add_argument("--devices", type=int, default=None)
    args = parser.parse_args()
    Refusing.which = args.which
    code = {"devices": args.devices, "plugins": ["ddp"], "accelerator": "cpu"} if args.devices else {}
    trainer = hookloop.Trainer(max_steps=2, default_root_dir=args.root, enable_progress_bar=False, **code)
    trainer.fit(Refusing(), DataLoader(tiny_dataset(), batch_size=4))
