"""Runs of tests/test_safe_loading.py, one process of a world of one, one run after another.

``python safe_loading_worker.py RUNS.json``: RUNS.json is a list of runs, each a dict
``{"plugins": [...], "plugin_options": {...}, "root": DIR, "epochs": N, "ckpt_path": P,
"validate": bool, "out": FILE}``. Each run fits (or validates) the tiny classifier with
Adam, and writes to ``out`` either ``{"weights": state dict}`` (the module's weights
after the run) or ``{"error": type name, "message": str}`` when it raised.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import TinyClassifier, tiny_dataset


class AdamClassifier(TinyClassifier):
    """Adam: its state and the ZeRO optimizer's hold more than SGD's."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def run(spec: dict) -> dict:
    trainer = hookloop.Trainer(
        plugins=spec["plugins"], plugin_options=spec.get("plugin_options", {}), max_epochs=spec.get("epochs", 1),
        default_root_dir=spec["root"], num_sanity_val_steps=0, enable_progress_bar=False)
    module = AdamClassifier(seed=spec.get("seed", 0))
    loader = DataLoader(tiny_dataset(), batch_size=16)
    try:
        if spec.get("validate"):
            trainer.validate(module, loader, ckpt_path=spec["ckpt_path"])
        else:
            trainer.fit(module, loader, loader, ckpt_path=spec.get("ckpt_path"))
    except hookloop.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    weights = {}
    if not spec.get("validate"):  # after validate, ZeRO-3's parameters stay partitioned
        # After an fsdp run the module keeps its DTensor shards: in a world of one, the
        # local shard is the whole tensor.
        weights = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().float().clone()
                   for k, v in module.state_dict().items()}
    return {"weights": weights, "global_step": trainer.global_step}


if __name__ == "__main__":
    for spec in json.loads(open(sys.argv[1]).read()):
        torch.save(run(spec), spec["out"])
