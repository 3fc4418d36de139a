"""Outside models under tp's plans, in the "tp" job (tests/jobs.py; tests/test_tp_plan.py):
a nanoGPT-shaped model under the automatic plan (its fused attention left whole, its MLPs
split); a Hugging Face LlamaForCausalLM under its own plan (``plan="hf"``) and under the
automatic one (``plan="infer"``); a Qwen3ForCausalLM by default (its plan refused, the
automatic one instead: the attention with q_norm/k_norm whole); a Phi3ForCausalLM under
its plan (fused projections, gathered outputs): each trained 4 steps. Every rank writes
``OUT/rank<R>.pt``: the weights after the steps, each step's loss and the parameters'
layouts; the test compares them with tp_plan_models.reference (one process)."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hookloop  # noqa: E402
from tp_plan_models import BATCH, CASES, LM, STEPS, tokens  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(300, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])


class Probe:
    """Each step's loss, and the parameters' layouts at the first step."""

    hookloop_name, hookloop_role = "probe", "observer"

    def __init__(self):
        self.seen: dict = {"losses": [], "layouts": {}}

    @hookloop.hookimpl
    def on_before_optimizer_step(self, trainer, optimizer):
        if not self.seen["layouts"]:
            self.seen["layouts"] = {n: (tuple(map(str, p.placements)) if hasattr(p, "placements") else "plain")
                                    for n, p in trainer.module.named_parameters()}

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer, outputs, loss, batch, batch_idx):
        self.seen["losses"].append(float(loss))


record: dict = {}
for kind, plan in CASES:
    try:
        module, probe = LM(kind), Probe()
    except ImportError as exc:  # transformers missing fails these cases only, not the tp job's other scripts
        record[(kind, plan)] = {"missing": f"{exc} (a test dependency: make install, or pip install '.[test]')"}
        continue
    trainer = hookloop.Trainer(max_steps=STEPS, plugins=[probe, hookloop.plugin("tp", plan=plan)],
                               enable_checkpointing=False, logger=False, enable_progress_bar=False,
                               num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(tokens(), batch_size=BATCH))
    record[(kind, plan)] = {"final": {k: v.detach().clone() for k, v in module.state_dict().items()}, **probe.seen}

import torch  # noqa: E402

torch.save(record, OUT / f"rank{RANK}.pt")
faulthandler.cancel_dump_traceback_later()
