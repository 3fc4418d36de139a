"""hookloop-dp: ``torch.nn.DataParallel`` as a hookloop strategy.

One process; each batch is split across the listed GPUs, one thread per GPU runs a
replica of the model, and the outputs are gathered on the first GPU. The user's
``training_step_end(outputs)`` receives the gathered outputs (the loop calls it) and
returns the loss; without one, gathered per-replica losses are averaged.

Mixed precision composes: autocast state is per thread, and DataParallel's replica
threads would not inherit the dtype of the loop's ``torch.autocast`` (PyTorch re-enables
autocast there with its default dtype only), so the forward contexts of the run
(``forward_context`` hook: hookloop-amp's autocast) are entered again inside every
replica thread.

On a machine without CUDA, DataParallel has no GPU to split over: the run is an ordinary
single-device CPU run, and the plugin says so once.

Public pieces, which ``ddp2`` (hookloop-ddp: DataParallel inside a node, DDP across
nodes) builds on: :func:`device_ids`, :func:`replicate_over_gpus`,
:func:`average_replica_losses`, :class:`ReplicaContexts`, :func:`mean_of_replicas`.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import torch
from torch import nn

import hookloop
from hookloop.distributed.launchers import InProcess


class ReplicaContexts(nn.Module):
    """Runs ``module`` inside fresh copies of ``contexts``, in whatever thread calls it.

    DataParallel calls each replica's forward from its own thread; thread-local state
    such as ``torch.autocast`` set in the calling thread does not reach it. Copies,
    because a context manager object keeps its entry state on itself and replicas run
    concurrently.
    """

    def __init__(self, module: nn.Module, contexts: list, unsqueeze_scalars: bool = False):
        super().__init__()
        self.module = module
        self.contexts = list(contexts)
        #: return 0-d tensors as shape (1,), so DataParallel gathers them into one entry
        #: per replica without warning at every step (as Lightning's DP does)
        self.unsqueeze_scalars = unsqueeze_scalars

    def forward(self, *args, **kwargs):
        if not self.contexts:
            out = self.module(*args, **kwargs)
        else:
            with contextlib.ExitStack() as stack:
                for context in self.contexts:
                    stack.enter_context(_fresh(context))
                out = self.module(*args, **kwargs)
        return _unsqueeze_scalars(out) if self.unsqueeze_scalars else out


def _unsqueeze_scalars(out):
    if isinstance(out, torch.Tensor):
        return out.unsqueeze(0) if out.ndim == 0 else out
    if isinstance(out, dict):
        return type(out)((k, _unsqueeze_scalars(v)) for k, v in out.items())
    if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
        return type(out)(_unsqueeze_scalars(v) for v in out)
    return out


def _fresh(context):
    try:
        return copy.copy(context)
    except Exception:  # not copyable: re-entrant by the hook's contract
        return context


class DP:
    """DataParallel strategy (``plugins=["dp"]``, ``devices=N`` GPUs of one machine).

    ``devices``: a count ``N`` (GPUs ``0..N-1``), ``-1``/``"auto"`` (all) or a list of
    GPU indices; with hookloop-gpus, the GPUs it chose.
    """

    hookloop_name = "dp"
    #: DataParallel in one process: no device mesh, no mesh plugin beside it
    hookloop_composes = False
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for

    def __init__(self):
        self.device_ids: list[int] = []
        self._told: set[str] = set()

    # -- launching: one process whatever ``devices`` says -----------------------------------

    @property
    def hookloop_launcher(self) -> InProcess:
        """The core's ``in_process`` launcher: DataParallel's devices are threads, not
        processes, so ``devices=N`` must not re-launch N processes."""
        return InProcess(check=_check_one_node, label="dp")

    # -- environment ----------------------------------------------------------------------

    @hookloop.hookimpl
    def setup_environment(self, trainer):
        """A world of one; the root device is the first listed GPU (or the CPU)."""
        self.device_ids = device_ids(trainer.config)
        trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank = 1, 0, 0, 0
        trainer.root_device = torch.device("cuda", self.device_ids[0]) if self.device_ids else torch.device("cpu")
        return True

    @hookloop.hookimpl
    def setup(self, trainer):
        """Say once how this run is parallel, and that DDP is faster."""
        if not self.device_ids:
            self._tell(
                "cpu",
                "hookloop-dp: no CUDA GPU for DataParallel (CPU-only machine or "
                "accelerator='cpu'): running single-device on the CPU, the batch is not split",
            )
        else:
            self._tell("gpus", f"hookloop-dp: DataParallel over GPUs {self.device_ids} (one process, one thread per GPU)")
        self._tell(
            "ddp",
            "hookloop-dp: note: DistributedDataParallel (--plugins ddp, pip install "
            "hookloop-ddp) is faster than DataParallel, usually several times, and is "
            "what PyTorch recommends",
        )

    def _tell(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            print(message, flush=True)

    # -- model ------------------------------------------------------------------------------

    @hookloop.hookimpl
    def wrap_model(self, trainer, model):
        """``DataParallel`` around the step module (:func:`replicate_over_gpus`)."""
        return replicate_over_gpus(trainer, model, self.device_ids)

    @hookloop.hookimpl
    def teardown(self, trainer):
        """Hand back the unwrapped step module (DataParallel and the replica contexts
        belong to the run)."""
        model = trainer.model
        while isinstance(model, (nn.DataParallel, ReplicaContexts)):
            model = model.module
        trainer.model = model

    @hookloop.hookimpl
    def training_step_end(self, trainer, outputs):
        """Average gathered per-replica losses (:func:`average_replica_losses`)."""
        return average_replica_losses(trainer, outputs)


def replicate_over_gpus(trainer, model: nn.Module, gpu_ids: list[int]) -> nn.Module:
    """``model`` on the first of ``gpu_ids``, in ``nn.DataParallel`` over all of them,
    with the run's forward contexts (autocast) re-entered inside each replica (see
    :class:`ReplicaContexts`). Without GPUs: ``model`` on the root device, unsplit."""
    contexts = [c for c in trainer.hook.forward_context(trainer=trainer) if c is not None]
    inner = ReplicaContexts(model, contexts, unsqueeze_scalars=bool(gpu_ids)).to(trainer.root_device)
    if not gpu_ids:
        return inner  # on the CPU there is nothing to split over
    return nn.DataParallel(inner, device_ids=gpu_ids, output_device=gpu_ids[0])


def average_replica_losses(trainer, outputs):
    """The ``training_step_end`` of DataParallel runs: the gathered per-replica losses
    averaged, unless the user's module reduces them itself in its own
    ``training_step_end`` (which the loop already called); ``None`` to keep ``outputs``."""
    if callable(getattr(trainer.module, "training_step_end", None)):
        return None
    return mean_of_replicas(outputs)


def mean_of_replicas(outputs):
    """``outputs`` with a gathered loss vector (one entry per replica) averaged.

    Each replica's scalar loss comes back as shape (1,), and DataParallel concatenates
    them into one entry per replica; a dict output is gathered entry by entry. Returns
    ``None`` when there is nothing to average.
    """
    if isinstance(outputs, torch.Tensor):
        return outputs.mean() if outputs.ndim == 1 else None
    if isinstance(outputs, dict) and isinstance(outputs.get("loss"), torch.Tensor) and outputs["loss"].ndim == 1:
        return {**outputs, "loss": outputs["loss"].mean()}
    return None


def _check_one_node(config) -> None:
    if config.nodes > 1:
        raise hookloop.ConfigurationError(
            f"dp (DataParallel) runs on one machine, and nodes={config.nodes}: use the ddp "
            f"strategy for several machines (--plugins ddp, pip install hookloop-ddp)"
        )


def device_ids(config) -> list[int]:
    """The CUDA devices ``config.devices`` names on this machine; ``[]`` without CUDA."""
    if config.accelerator == "cpu" or not torch.cuda.is_available():
        if config.accelerator in ("cuda", "gpu"):
            raise hookloop.ConfigurationError(
                f"accelerator={config.accelerator!r} with dp, but torch {torch.__version__} "
                f"sees no CUDA GPU: run on the CPU with accelerator='cpu'"
            )
        return []
    available = torch.cuda.device_count()
    devices = config.devices
    if isinstance(devices, (list, tuple)):
        ids = list(devices)
    elif isinstance(devices, str) and "," in devices:
        ids = [int(d) for d in devices.split(",") if d.strip()]
    elif devices in (-1, "-1", "auto"):
        ids = list(range(available))
    else:
        ids = list(range(config.num_processes()))
    missing = [i for i in ids if i >= available]
    if missing:
        raise hookloop.ConfigurationError(
            f"devices={devices!r} names GPU {', '.join(map(str, missing))}, but torch sees "
            f"{available} GPU(s) (indices 0..{available - 1}): use devices<={available}"
        )
    return ids
