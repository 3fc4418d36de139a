"""hookloop.testing.ResumeConformance for every in-tree strategy (issue 19, item 1).

Each class runs one job twice per seed: uninterrupted, and SIGKILLed in successive
attempts inside a step, a checkpoint save, a validation and an accumulation window
(dropout, persistent loader workers, per-rank seeds, accumulation, clipping, a
scheduler); the restarted job must end bit-identical. ``HOOKLOOP_TEST_FULL=1`` runs
four seeds per strategy instead of one.

``make test`` runs one process, ddp (torch's elastic agent restarts it, a single file)
and horovod's refusal; ``make test-full`` (``HOOKLOOP_TEST_FULL=1``) adds ddp_spawn,
ddp_sharded, fsdp (full and sharded), ZeRO stages 1-3, dp and ddp2 (40-110 s each on 2
cores: together 10 minutes of ``make test``). A sharded directory's kill-and-resume stays
in ``make test`` through tests/test_sharded_atomic.py's DCP test.

* ``ddp_spawn`` and ``dp`` launch without torch's elastic agent (``ddp_spawn`` spawns
  from inside ``fit``, ``dp`` is one plain process), so nothing restarts their workers:
  the kit re-runs the whole job with ``fit(ckpt_path="last")`` after each kill, as a
  user would (``restarts = "rerun"``).
* ``ddp2`` is one process per node (DataParallel inside it): on one CPU machine, one process.
* ``horovod`` refuses ``--max-restarts`` (horovodrun does not restart workers):
  the class asserts that refusal.
"""

import os

import pytest

from hookloop.testing import ResumeConformance

FULL = pytest.mark.full  # the rest of the strategy matrix


@pytest.mark.slow
class TestSingleProcess(ResumeConformance):
    plugin = ""
    world_size = 1


@pytest.mark.slow
class TestDDP(ResumeConformance):
    plugin = "ddp"


@FULL
class TestDDPSpawn(ResumeConformance):
    plugin = "ddp_spawn"
    restarts = "rerun"


@FULL
class TestDDPSharded(ResumeConformance):
    plugin = "ddp_sharded"


@FULL
class TestFSDP(ResumeConformance):
    plugin = "fsdp"  # state_dict_type="full" (the default): hookloop's single file, written by rank 0


@FULL
class TestFSDPSharded(ResumeConformance):
    plugin = "fsdp"
    options = {"state_dict_type": "sharded"}  # a torch.distributed.checkpoint directory, a shard per rank
    checkpoint = "directory"


@FULL
class TestDeepSpeedStage1(ResumeConformance):
    plugin = "deepspeed_stage_1"
    checkpoint = "directory"


@FULL
class TestDeepSpeedStage2(ResumeConformance):
    plugin = "deepspeed_stage_2"
    checkpoint = "directory"


@FULL
class TestDeepSpeedStage3(ResumeConformance):
    plugin = "deepspeed_stage_3"
    checkpoint = "directory"


@FULL
class TestDP(ResumeConformance):
    plugin = "dp"
    world_size = 1
    restarts = "rerun"


@FULL
class TestDDP2(ResumeConformance):
    plugin = "ddp2"
    world_size = 1


@pytest.mark.slow
class TestHorovod(ResumeConformance):
    plugin = "horovod"
    refuses_restarts = "horovod cannot restart failed workers"
