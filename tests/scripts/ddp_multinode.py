"""One "node" of the two-node test in tests/test_ddp_multinode.py.

``ddp_multinode.py OUT`` runs under ``hookloop run --plugins STRATEGY --nodes 2 ...`` (the
CLI path); ``ddp_multinode.py OUT --relaunch NODE_RANK HOST:PORT STRATEGY`` is started
with plain ``python`` and names everything in code, so ``Trainer.fit`` re-launches the
script through the same elastic agent (the in-code path). STRATEGY is ``ddp`` or
``ddp2`` (one process per node either way here). Each worker writes ``OUT/rank<R>.pt``.
"""

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    kwargs = {}
    if "--relaunch" in sys.argv:
        node_rank, endpoint, strategy = sys.argv[3], sys.argv[4], sys.argv[5]
        kwargs = dict(plugins=[strategy], devices=1, nodes=2, node_rank=int(node_rank), rdzv_endpoint=endpoint)
    rank = int(os.environ.get("RANK", 0))  # unset in the process that re-launches

    class WithStepEnd(TinyModule):
        """Lightning calls training_step_end whatever the strategy (ddp2: the node's
        gathered outputs); it returns the loss unchanged here."""

        step_ends = 0

        def training_step_end(self, outputs):
            self.step_ends += 1
            return outputs

    module = WithStepEnd(seed=10 + rank)  # different on each rank: DDP must broadcast rank 0's
    trainer = hookloop.Trainer(max_epochs=2, enable_checkpointing=False, **kwargs)
    trainer.fit(module, DataLoader(tiny_data(96), batch_size=8, shuffle=True))
    torch.save(
        {
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "relaunched": "--relaunch" in sys.argv,
            "strategy": type(trainer.strategy).__name__,
            "step_ends": module.step_ends,
        },
        out / f"rank{trainer.global_rank}.pt",
    )
