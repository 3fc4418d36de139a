"""One worker of tests/test_cluster_environments.py's real runs.

``cluster_env_train.py OUT [DEVICES]`` trains the tiny model as ``ddp`` under whichever
launcher started it (``hookloop run --plugins ddp --devices 2``, ``mpirun -np 2``, or a
plain ``python`` with the environment the Kubeflow operator or LSF's jsrun sets) and
writes ``OUT/rank<R>.pt``: the weights, the ranks the Trainer saw and the source the
strategy detected. Each rank starts from other weights (seed 10 + rank): DDP must
broadcast rank 0's, so equal results are not an accident of equal starts.
"""

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402
from hookloop.distributed.environment import ClusterEnvironment  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    kwargs = {"devices": int(sys.argv[2])} if len(sys.argv) > 2 else {}
    rank = ClusterEnvironment.detect().global_rank
    module = TinyModule(seed=10 + rank)
    trainer = hookloop.Trainer(plugins=["ddp"], max_epochs=2, enable_checkpointing=False,
                               logger=False, **kwargs)
    trainer.fit(module, DataLoader(tiny_data(96), batch_size=8, shuffle=True))
    torch.save(
        {
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "source": trainer.strategy.cluster.source,
            "pid": os.getpid(),
        },
        out / f"rank{trainer.global_rank}.pt",
    )
