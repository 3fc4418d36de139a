"""hookloop.testing's strategy conformance suite on the fsdp strategy (2 processes, gloo).

``state_dict_type="full"`` (the default): the checkpoint is hookloop's single file and
``module.state_dict()`` gathers full tensors, so the suite reads the weights as it reads
ddp's. The sharded format is checked against references in tests/test_fsdp.py.
"""


import pytest
from hookloop.testing import StrategyConformance
from tiers import at_least  # noqa: E402


@pytest.mark.slow
class TestFSDPConformance(StrategyConformance):
    plugin = "fsdp"
    wide = at_least("full")  # the several-bucket model: make test-full
    checkpoint = "file"
    options = {"auto_wrap_policy": ["Linear"]}  # two units under the root: the common layout
