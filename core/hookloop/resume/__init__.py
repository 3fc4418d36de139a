"""Nothing a user trained is lost: checkpoints and resuming.

``checkpoint`` (atomic writes, safe loads, RNG state), ``unpickling`` (checkpoints never
run code), ``dcp`` (torch.distributed.checkpoint directories), ``loader_state`` (where
the training loader stands), ``rundir`` (one run directory per run) and ``run`` (what
a checkpoint of the run holds, and how a run resumes).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # hookloop.resume was a module (now hookloop.resume.run) until 0.10: its names,
    # deprecated for one minor contract version (hookloop/_moved.py)
    from hookloop._moved import forward

    return forward("resume", name)
