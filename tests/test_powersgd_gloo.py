"""``hookloop-ddp``'s ``comm_hook="powersgd"`` on gloo with several gradient buckets
(issue 22, item 8).

torch's ``powerSGD_hook`` chains its all-reduces in future callbacks that each start an
all-reduce and block on it; gloo runs those callbacks on its 2 worker threads, so two
buckets in flight blocked both threads and the job hung, past any timeout (the blocked
all-reduces never started). The plugin now finishes each bucket inside the hook on
backends other than NCCL. A real 2-process gloo job: 2 KB buckets (every weight matrix
in its own), with and without ``find_unused_parameters=True`` and an unused layer; the
weights after 12 steps must equal a hand-written torch DDP + PowerSGD loop's.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import REPO, finish_job, start_hookloop_run

SCRIPT = REPO / "tests" / "scripts" / "powersgd_gloo_job.py"


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_powersgd_with_several_buckets_on_gloo_matches_a_hand_written_loop(tmp_path):
    proc = start_hookloop_run(["--plugins", "ddp", "--devices", "2", "--accelerator", "cpu", SCRIPT, tmp_path], cwd=tmp_path)
    finish_job(proc, timeout=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for record in ranks:
        assert record["buckets"] >= 2 and record["buckets_spare"] >= 2  # really several buckets
        assert record["hookloop_iter"] == record["hookloop_spare_iter"] == 12  # PowerSGD ran every step
        assert max_abs_diff(record["hookloop"], record["raw"]) <= 1e-6
        assert max_abs_diff(record["hookloop_spare"], record["raw_spare"]) <= 1e-6
        # the unused layer never moved, and PowerSGD did compress (not a plain all-reduce)
        assert record["hookloop_spare"]["spare.weight"].equal(ranks[0]["hookloop_spare"]["spare.weight"])
    assert max_abs_diff(ranks[0]["hookloop"], ranks[1]["hookloop"]) == 0.0


@pytest.mark.full  # a 2-process job that waits out a timeout
def test_a_rank_that_stops_while_the_other_is_in_the_powersgd_hook_fails_it_at_the_timeout(tmp_path):
    proc = start_hookloop_run(["--plugins", "ddp", "--devices", "2", "--accelerator", "cpu", SCRIPT, tmp_path, "stall"],
                              cwd=tmp_path)
    _, stderr = finish_job(proc, timeout=240, succeed=False)
    assert ("hookloop: rank 0 of powersgd_gloo_job.py failed first (host " in stderr
            and "CollectiveTimeoutError: global rank 0: the all_reduce of the gradients in backward" in stderr
            and "failed after global step 4 (process-group timeout 5 s)" in stderr), stderr
