"""hookloop.testing's conformance suite on hookloop-fairscale's ddp_sharded: one launch of
the kit's worker through ``hookloop run --plugins ddp_sharded --devices 2``."""

from __future__ import annotations


import pytest
from hookloop.testing import StrategyConformance
from tiers import at_least  # noqa: E402


@pytest.mark.slow
class TestDDPShardedConformance(StrategyConformance):
    plugin = "ddp_sharded"
    wide = at_least("full")  # the several-bucket model: make test-full
