"""Train two steps on a GPU that hookloop-gpus auto-selects; write where the run went.

    hookloop run tests/scripts/gpu_auto_select.py OUT.json

Run by tests/gpu/test_gpu.py. A fresh process, because the choice is published as
CUDA_VISIBLE_DEVICES, which CUDA reads only when it starts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import hookloop  # noqa: E402
from gpu_check_model import Net, data  # noqa: E402

trainer = hookloop.Trainer(plugins=["gpus"], plugin_options={"gpus": {"auto_select_gpus": True}},
                           devices=1, max_steps=2, enable_checkpointing=False)
module = Net()
trainer.fit(module, DataLoader(data(64), batch_size=32))
gpus = next(p for p in trainer.plugins if p.hookloop_name == "gpus")
Path(sys.argv[1]).write_text(json.dumps({
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "selected": gpus.selected,
    "root_device": str(trainer.root_device),
    "device_count": torch.cuda.device_count(),
    # The UUID names the physical GPU whatever the numbering: the test compares it with NVML's.
    "uuid": str(torch.cuda.get_device_properties(0).uuid),
    "batch_devices": sorted({device for device, *_ in module.seen}),
    "weight_device": str(module.net[0].weight.device),
}))
