"""Processes, process groups and the device mesh.

``collectives`` (process groups and the collectives strategies share), ``strategy`` (the
pieces of strategies built on ``torch.distributed``, and samplers), ``launch`` (workers
through PyTorch's elastic agent), ``mesh`` (one device mesh per run), ``faults``
(preemption and hung collectives), ``failures`` (a worker's failure, reported once) and
``ranks`` (rank-zero helpers and the launcher's identity).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # hookloop.distributed was a module (now hookloop.distributed.strategy) until 0.10: its
    # names, deprecated for one minor contract version (hookloop/_moved.py)
    from hookloop._moved import forward

    return forward("distributed", name)
