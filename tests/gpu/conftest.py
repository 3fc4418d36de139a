"""Skip the ``gpu``-marked tests where they cannot run, with the reason (``-ra`` prints it).

``@pytest.mark.gpu`` needs one CUDA GPU, ``@pytest.mark.gpu(count=2)`` two. On a machine
with them, ``make test`` runs these tests with the rest; ``pytest -m gpu`` runs only them.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # Counted once, at collection: is_available and device_count start no CUDA context,
    # so no GPU looks busy to the auto-selection test because of this process.
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.kwargs.get("count", 1)
        if not cuda:
            reason = f"no CUDA GPU: torch {torch.__version__}, CUDA build {torch.version.cuda}"
        elif count < needed:
            reason = f"needs {needed} GPUs, this machine has {count}"
        else:
            continue
        # A skip marker, not pytest.skip() here: the report then points at the test.
        item.add_marker(pytest.mark.skip(reason=reason))
