"""hookloop.testing's conformance suite on hookloop-fairscale's ddp_sharded: one launch of
the kit's worker through ``hookloop run --plugins ddp_sharded --devices 2``."""

from __future__ import annotations

from hookloop.testing import StrategyConformance


class TestDDPShardedConformance(StrategyConformance):
    plugin = "ddp_sharded"
