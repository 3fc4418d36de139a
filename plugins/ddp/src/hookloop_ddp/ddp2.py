"""The ``ddp2`` strategy: DataParallel inside each node, DistributedDataParallel across nodes.

Lightning 1.x's DDP2 (the seed's "DP in a machine, DDP across machines"): one process per
node; in it, ``nn.DataParallel`` splits each batch over the node's GPUs (so
``training_step_end`` sees the node's whole batch, e.g. for a softmax or NCE loss over
every part), and DDP all-reduces the gradients between the nodes. Each node draws its own
share of the data: the effective batch size is ``batch_size x nodes``.

Built from the two plugins' public pieces rather than copies: :class:`hookloop_ddp.DDP`
with its extension points (one process per node, the node's first GPU as the root device,
``configure_ddp`` wrapping DataParallel), and hookloop-dp's ``replicate_over_gpus`` /
``average_replica_losses``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import hookloop
from hookloop.distributed.launchers import Torchrun

from .environment import ClusterEnvironment
from .strategy import DDP

try:
    import hookloop_dp
except ImportError as exc:  # pragma: no cover - the message is the point
    raise hookloop.MissingDependencyError(
        "the ddp2 strategy runs DataParallel inside each node, from hookloop-dp, which is not "
        "installed: pip install hookloop-dp"
    ) from exc


class DDP2(DDP):
    """DataParallel over a node's GPUs, DDP across nodes (``plugins=["ddp2"]``).

    ``devices`` names the GPUs of each node (a count, ``-1`` or a list), ``nodes`` the
    machines; one process starts per node. Every :class:`DDP` option applies to the
    cross-node DDP.
    """

    hookloop_name = "ddp2"
    #: one process per node, not a mesh dimension (ddp's claim not inherited)
    hookloop_composes = False

    def __init__(self, **ddp_options):
        super().__init__(**ddp_options)
        self.gpu_ids: list[int] = []

    #: torchrun with one process per node, whatever ``devices`` says; on one node that
    #: process is the calling one (the core's ``torchrun`` launcher, ``processes_per_node=1``)
    hookloop_launcher = Torchrun(processes_per_node=1)

    def check_process_count(self, trainer, cluster: ClusterEnvironment) -> None:
        if cluster.local_world_size != 1:
            raise hookloop.ConfigurationError(
                f"ddp2 runs one process per node (DataParallel uses the node's GPUs from it), but "
                f"{cluster.source} started {cluster.local_world_size} on this node: launch with "
                f"`hookloop run --plugins ddp2 --devices N --nodes M ...` (or torchrun "
                f"--nproc-per-node 1)"
            )

    def root_device(self, trainer, cluster: ClusterEnvironment) -> torch.device:
        """The node's first GPU (DataParallel's output device), or the CPU."""
        self.gpu_ids = hookloop_dp.device_ids(trainer.config)
        return torch.device("cuda", self.gpu_ids[0]) if self.gpu_ids else torch.device("cpu")

    def configure_ddp(self, trainer, model: nn.Module) -> nn.Module:
        """DDP around DataParallel around the step module: DataParallel accumulates the
        replicas' gradients into the root GPU's parameters, whose hooks DDP all-reduces."""
        inner = hookloop_dp.replicate_over_gpus(trainer, model, self.gpu_ids)
        # One device (the root GPU) holds every parameter: no device_ids, the batch is
        # already there and DataParallel scatters it.
        return self.configure_ddp_module(trainer, inner, device_ids=None)

    @hookloop.hookimpl
    def training_step_end(self, trainer, outputs):
        """Average the node's gathered per-replica losses (as dp does)."""
        return hookloop_dp.average_replica_losses(trainer, outputs)
