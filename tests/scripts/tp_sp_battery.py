"""The sequence-parallel checks in one 2-process run.

Run by tests/test_tp_sp.py as ``hookloop run --plugins tp --devices 2 tp_sp_battery.py OUT``.
Each rank trains tp_sp_models.Transformer with ``tp`` ``sequence_parallel=True`` (SGD with
momentum, then Adam), then a module whose own plan asks for it, and writes ``OUT/rank<R>.pt``: the final weights, the last step's
gradients, the parameters' layouts and what every LayerNorm received (its local shape
and DTensor placements), recorded by forward hooks.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hookloop  # noqa: E402
from tp_sp_models import PlannedTransformer, Transformer, data  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(300, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
STEPS = 4
record: dict = {}


class Probe:
    """The last step's gradients and layouts; the inputs every LayerNorm saw."""

    hookloop_name, hookloop_role = "probe", "observer"

    def __init__(self):
        self.seen: dict = {"grads": {}, "layouts": {}, "norm_inputs": []}
        self._handles = []

    @hookloop.hookimpl
    def on_train_start(self, trainer):
        for name, m in trainer.module.named_modules():
            if isinstance(m, nn.LayerNorm):
                self._handles.append(m.register_forward_hook(self._record(name)))

    def _record(self, name):
        def hook(module, args, output):
            x = args[0]
            local = x.to_local() if hasattr(x, "to_local") else x
            self.seen["norm_inputs"].append(
                (name, tuple(local.shape), tuple(map(str, getattr(x, "placements", ()))) or "plain"))
        return hook

    @hookloop.hookimpl
    def on_before_optimizer_step(self, trainer, optimizer):
        module = trainer.module
        self.seen["grads"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                              for n, p in module.named_parameters()}
        self.seen["layouts"] = {n: (tuple(map(str, p.placements)) if hasattr(p, "placements") else "plain")
                                for n, p in module.named_parameters()}

    @hookloop.hookimpl
    def on_train_end(self, trainer):
        for h in self._handles:
            h.remove()


for optimizer in ("sgd", "adam"):
    probe = Probe()
    module = Transformer(optimizer=optimizer)
    trainer = hookloop.Trainer(max_steps=STEPS, plugins=[probe, hookloop.plugin("tp", sequence_parallel=True)],
                               enable_checkpointing=False, logger=False, enable_progress_bar=False,
                               num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data(), batch_size=4))
    record[optimizer] = {"final": {k: v.detach().clone() for k, v in module.state_dict().items()}, **probe.seen}
    # after fit: plain parameters again, the plan's hooks (the root's split and gather) gone
    record[optimizer]["after_fit"] = {n: type(p).__name__ for n, p in module.named_parameters()}
    with torch.no_grad():
        record[optimizer]["after_fit_output"] = module(data().tensors[0][:2])

# The module's own plan asks for sequence parallelism: the automatic one, made in __init__.
probe = Probe()
module = PlannedTransformer(optimizer="sgd")
trainer = hookloop.Trainer(max_steps=STEPS, plugins=[probe, "tp"], enable_checkpointing=False, logger=False,
                           enable_progress_bar=False, num_sanity_val_steps=0)
trainer.fit(module, DataLoader(data(), batch_size=4))
record["planned"] = {"final": {k: v.detach().clone() for k, v in module.state_dict().items()}, **probe.seen}

# A sequence of 5 does not split over 2 processes: refused before the first collective.
x, y = data().tensors
try:
    hookloop.Trainer(max_steps=1, plugins=[hookloop.plugin("tp", sequence_parallel=True)], enable_checkpointing=False,
                     logger=False, enable_progress_bar=False, num_sanity_val_steps=0).fit(
        Transformer(), DataLoader(torch.utils.data.TensorDataset(x[:, :5], y[:, :5]), batch_size=4))
    record["uneven"] = None
except hookloop.ConfigurationError as error:
    record["uneven"] = str(error)

torch.save(record, OUT / f"rank{RANK}.pt")
