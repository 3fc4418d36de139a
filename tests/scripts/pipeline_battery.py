"""The pipeline checks in one multi-process run (starting processes is the expensive part).

Run by tests/test_pipeline.py as ``hookloop run --plugins pipeline --devices 2
pipeline_battery.py OUT CASES``. Every rank writes ``OUT/rank<R>.pt`` with what it
observed; the test compares it with a hand-written one-process loop (pipeline_models.reference).
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hookloop  # noqa: E402
from pipeline_models import BATCH, CLIP, Net, PlannedNet, data  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(240, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
CASES = sys.argv[2].split(",")
RANK = int(os.environ["RANK"])
STEPS = 3
torch.set_num_threads(1)
record: dict = {}


class Probe:
    """Records the loss the loop saw at each step, and saves a checkpoint when asked."""

    hookloop_name, hookloop_role = "probe", "observer"

    def __init__(self, save_at: int | None = None, path: Path | None = None):
        self.save_at, self.path = save_at, path
        self.losses: list[float] = []
        self.batches: list[torch.Tensor] = []
        self.layouts: dict = {}

    @hookloop.hookimpl
    def on_train_batch_start(self, trainer, batch, batch_idx):
        self.batches.append(batch[0].clone())

    @hookloop.hookimpl
    def on_before_optimizer_step(self, trainer, optimizer):
        self.layouts = {n: (tuple(map(str, p.placements)) if hasattr(p, "placements") else "plain")
                        for n, p in trainer.module.named_parameters()}

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer, outputs, loss, batch, batch_idx):
        self.losses.append(float(loss))
        if self.save_at is not None and trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.path)


def fit(module, steps: int, probe: Probe, options: dict, ckpt_path=None, accumulate: int = 1, **kwargs):
    trainer = hookloop.Trainer(max_steps=steps, plugins=[probe], plugin_options={"pipeline": options},
                               accumulate_grad_batches=accumulate, **kwargs,
                               enable_checkpointing=False, logger=False, enable_progress_bar=False,
                               num_sanity_val_steps=0, enable_model_summary=False)
    trainer.fit(module, DataLoader(data(), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer


def weights(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


for case in CASES:
    kind, _, rest = case.partition(":")
    if kind in ("parity", "tp"):  # parity:SCHEDULE:OPTIMIZER (tp: the module with a tp plan)
        schedule, optimizer = rest.split(":")
        probe = Probe()
        module = (PlannedNet if kind == "tp" else Net)(optimizer)
        fit(module, STEPS, probe, {"schedule": schedule, "microbatches": 4})
        record[case] = {"final": weights(module), "losses": probe.losses, "batches": probe.batches,
                        "layouts": probe.layouts}
    elif kind in ("clip", "tpclip"):  # clip:SCHEDULE:ALGORITHM, gradient_clip_val=CLIP (SGD)
        schedule, algorithm = rest.split(":")
        module = (PlannedNet if kind == "tpclip" else Net)("sgd")
        fit(module, STEPS, Probe(), {"schedule": schedule, "microbatches": 4}, gradient_clip_val=CLIP,
            gradient_clip_algorithm=algorithm)
        record[case] = {"final": weights(module)}
    elif kind == "accumulate":  # accumulate:SCHEDULE: 2 batches per optimizer step
        probe = Probe()
        module = Net("adam")
        fit(module, STEPS, probe, {"schedule": rest, "microbatches": 4}, accumulate=2)
        record[case] = {"final": weights(module), "losses": probe.losses, "batches": probe.batches}
    elif kind == "validate":  # validate:SCHEDULE: validation at the epoch's end, inside fit
        module = Net("sgd")
        trainer = hookloop.Trainer(max_epochs=1, plugins=[Probe()], plugin_options={"pipeline": {"schedule": rest}},
                                   enable_checkpointing=False, logger=False, enable_progress_bar=False,
                                   num_sanity_val_steps=0, enable_model_summary=False)
        train = torch.utils.data.Subset(data(), range(STEPS * BATCH))  # one epoch of STEPS batches
        trainer.fit(module, DataLoader(train, batch_size=BATCH), DataLoader(data(), batch_size=BATCH))
        record[case] = {"val_loss": float(trainer.callback_metrics["val_loss"])}
    elif kind == "whole":  # whole:SCHEDULE: 4 uninterrupted Adam steps (the resume's reference)
        probe = Probe()
        module = Net("adam")
        fit(module, 4, probe, {"schedule": rest, "microbatches": 4})
        record[case] = {"final": weights(module), "losses": probe.losses, "batches": probe.batches}
    elif kind in ("resume", "tpresume"):  # resume:SCHEDULE: save at step 2 under pp=2, resume to step 4
        schedule, cls = rest, (PlannedNet if kind == "tpresume" else Net)
        path = OUT / f"{kind}.ckpt"
        module = cls("adam", seed=0)
        fit(module, 2, Probe(save_at=2, path=path), {"schedule": schedule, "microbatches": 4})
        record[f"{kind}_files"] = sorted(p.name for p in OUT.iterdir())
        record[f"{kind}_is_dir"] = path.is_dir()
        resumed = cls("adam", seed=5)  # other initial weights: the checkpoint must replace them
        probe = Probe()
        fit(resumed, 4, probe, {"schedule": schedule, "microbatches": 4}, ckpt_path=path)
        record[case] = {"final": weights(resumed), "losses": probe.losses}

torch.save(record, OUT / f"rank{RANK}.pt")
