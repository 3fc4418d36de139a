"""Resume, on one process, the sharded checkpoint two processes wrote (DCP reshards).

Run by tests/test_fsdp.py as ``hookloop run --plugins fsdp --devices 1 fsdp_resume_one.py
OUT``, after tests/scripts/fsdp_battery.py wrote ``OUT/mid.ckpt`` on two processes with
batches of 8: here one process takes batches of 16, the two ranks' batches together,
so it continues exactly as the two-process run would have.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hookloop  # noqa: E402
from fsdp_models import Net, data  # noqa: E402

OUT = Path(sys.argv[1])
trainer = hookloop.Trainer(plugins=[hookloop.plugin("fsdp", auto_wrap_policy={"Block"})], max_epochs=2,
                           enable_checkpointing=False, num_sanity_val_steps=0)
module = Net(seed=123, optimizer="adam")
trainer.fit(module, DataLoader(data(), batch_size=16), ckpt_path=OUT / "mid.ckpt")
torch.save({"world_size": trainer.world_size, "global_step": trainer.global_step,
            "final": {k: v.detach().clone() for k, v in module.state_dict().items()}}, OUT / "resumed_1.pt")
