"""hookloop-ray: the ``ray`` launcher, hookloop's workers as Ray actors.

``ray``
    a launcher (``hookloop_role = "launcher"``): it composes with any strategy
    (``plugins=["ddp", "ray"]``, ``hookloop run --plugins fsdp,ray script.py``). The
    workers are Ray actors in a placement group; each starts one worker process with the
    environment a worker needs (docs/environment.md). Two launch modes:
    ``Trainer(plugins=["ddp", "ray"]).fit(model)`` from a plain Python process (as Ray
    Train's ``TorchTrainer``), and ``hookloop run --plugins ddp,ray script.py`` (as
    torchrun). ``max_failures`` restarts every worker from the last checkpoint.

docs/how-to/ray.md says how to use it and what differs from Ray Train.
"""

from .launcher import Ray

__all__ = ["Ray"]
