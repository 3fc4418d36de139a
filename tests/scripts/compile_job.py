"""A 2-process run of the compile plugin beside a data-parallel strategy.

Run by tests/test_compile.py as ``hookloop run --plugins STRATEGY,compile --devices 2
compile_job.py OUT``: trains compile_models.Net for 2 epochs on 8 samples per rank and
step, and writes ``OUT/rank<R>.pt``: the full weights, the parameter names and what
was compiled during the run, and the plugin's report.
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
from compile_models import Net, data  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(400, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
record: dict = {}


def full(module) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
            for k, v in module.state_dict().items()}


class Probe:
    hookloop_name, hookloop_role = "probe", "observer"

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        record["model_type"] = type(trainer.model).__name__
        record["compiled_during_fit"] = sorted(n for n, m in trainer.module.named_modules()
                                               if m.__dict__.get("_compiled_call_impl") is not None)

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        record["final"] = full(trainer.module)


trainer = hookloop.Trainer(max_epochs=2, default_root_dir=OUT, callbacks=[Probe()], enable_progress_bar=False,
                           enable_model_summary=False, enable_checkpointing=False, logger=False)
module = Net()
trainer.fit(module, DataLoader(data(), batch_size=8))
compile_plugin = next(p for p in trainer.plugins if type(p).__name__ == "Compile")
record["report"] = compile_plugin.report
record["compiled_after_fit"] = sorted(n for n, m in module.named_modules()
                                      if m.__dict__.get("_compiled_call_impl") is not None)
record["log_dir"] = str(trainer.log_dir)
torch.save(record, OUT / f"rank{os.environ['RANK']}.pt")
