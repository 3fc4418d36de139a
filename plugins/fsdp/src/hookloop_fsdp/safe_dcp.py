"""Reading ``torch.distributed.checkpoint`` directories without running their code: moved
to the core (:mod:`hookloop.dcp`, shared with tp); these names stay for older imports."""

from hookloop.resume.dcp import SafeFileSystemReader  # noqa: F401
from hookloop.resume.dcp import dcp_to_torch_save as to_torch_save  # noqa: F401
from hookloop.resume.dcp import safe_dcp_load as load  # noqa: F401
