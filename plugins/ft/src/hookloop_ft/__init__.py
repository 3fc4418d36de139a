"""hookloop-ft: in-place recovery with torchft.

``ft``
    each replica group is an ordinary hookloop run (one process, or several with
    ``--devices N`` that all-reduce within the group first); the groups find each
    other through torchft's Lighthouse, average their gradients every step through
    torchft's ``Manager``, and step only when the Manager says the step is healthy. A
    group that dies leaves the others training; its replacement joins the next quorum
    and copies the weights and optimizer state from a live peer.

``ft`` with ``fsdp`` (HSDP)
    fsdp shards the model over each group's processes; ft averages the shards' gradients
    over the groups (FSDP2's all-reduce hook) and a replacement group copies each shard
    from the process of equal rank in a live group.

docs/how-to/torchft.md says how to start a Lighthouse and the groups, and what is exact.
"""

from .strategy import FT, LIGHTHOUSE_ENV

__all__ = ["FT", "LIGHTHOUSE_ENV"]
