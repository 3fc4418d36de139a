"""Where a worker learns its place in the job: torchrun's, LSF's, MPI's, Kubeflow's or
SLURM's variables, or none.

The detection is the core's (:mod:`hookloop.distributed.environment`), so that
``hookloop env`` and other strategies read the same answer; its names stay importable
from here.
"""

from hookloop.distributed.environment import (
    EXTERNAL_SOURCES,
    SOURCES,
    ClusterEnvironment,
    expand_hostlist,
    first_host,
    launched_externally,
)

__all__ = ["EXTERNAL_SOURCES", "SOURCES", "ClusterEnvironment", "expand_hostlist", "first_host",
           "launched_externally"]
