"""hookloop.testing's conformance suite on hookloop-fairscale's ddp_sharded: one launch of
the kit's worker through ``hookloop run --plugins ddp_sharded --devices 2``."""

from __future__ import annotations

import os

from hookloop.testing import StrategyConformance


class TestDDPShardedConformance(StrategyConformance):
    plugin = "ddp_sharded"
    wide = os.environ.get("HOOKLOOP_TEST_FULL") == "1"  # the several-bucket model: make test-full
