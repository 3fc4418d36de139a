"""hookloop-ddp: DistributedDataParallel strategies for hookloop.

``ddp``
    one process per device, started by ``hookloop run --plugins ddp --devices N`` (PyTorch's
    elastic agent, several nodes with ``--nodes``), plain ``torchrun``, or SLURM.
``ddp_spawn``
    the same training, with the processes started by ``fit`` itself (notebooks, scripts
    a launcher cannot re-run); the caller's module holds the trained weights afterwards.

Subclass :class:`DDP` to change how the process group is initialised
(:meth:`DDP.init_process_group`) or how the model is wrapped (:meth:`DDP.configure_ddp`),
and pass an instance: ``Trainer(plugins=[MyDDP()])``.
"""

from .environment import ClusterEnvironment
from .spawn import DDPSpawn
from .strategy import DDP, check_backend

__all__ = ["DDP", "DDPSpawn", "ClusterEnvironment", "check_backend"]
