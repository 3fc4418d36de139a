"""hookloop-cp on CUDA: ring attention (torch's ``context_parallel``) under hookloop.

Marked ``gpu`` and skipped, with the reason, without CUDA (tests/gpu/conftest.py); torch
2.13 has ring attention for the CUDA SDPA kernels only, so this is where context
parallelism itself is tested (tests/test_cp.py tests the CPU refusal and the plugin's
data path without attention).

1. One GPU: ``--plugins ddp,cp --devices 1 --mesh cp=1``: the CUDA SDPA kernel under
   ``context_parallel`` (a ring of one), the plugin's sharding and averaging, equal to a
   hand-written loop on the same GPU.
2. Two GPUs (NCCL): ``--mesh cp=2``: each rank holds half of every sequence, keys and
   values go around the ring; equal to the one-process loop within 1e-5 (fp32: the
   memory-efficient kernel), both ranks loading the same batches.
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO, run_python

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from cp_models import SEQ, data, reference  # noqa: E402

SCRIPTS = REPO / "tests" / "scripts"
STEPS = 4


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _run(tmp_path, cp: int) -> list[dict]:
    run_python([sys.executable, "-m", "hookloop", "run", "--plugins", "ddp,cp", "--accelerator", "gpu",
                "--devices", str(cp), "--mesh", f"cp={cp}", str(SCRIPTS / "cp_train.py"), str(tmp_path)],
               cwd=tmp_path, timeout=600)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(cp)]


@pytest.mark.gpu
def test_cp_of_one_on_a_gpu_equals_the_hand_written_loop(tmp_path):
    (record,) = _run(tmp_path, 1)
    assert record["device"] == "cuda:0" and record["mesh"] == (("dp_replicate", "cp"), (1, 1))
    assert record["local"] == [((4, SEQ, 8), (4, SEQ))] * STEPS
    assert max_diff(record["final"], reference(STEPS, device="cuda")) <= 1e-5


@pytest.mark.gpu(count=2)
def test_cp_on_two_gpus_equals_one_process(tmp_path):
    ranks = _run(tmp_path, 2)
    expected = reference(STEPS, device="cuda")
    y = data().tensors[1]
    for r, record in enumerate(ranks):
        assert record["device"] == f"cuda:{r}" and record["mesh"] == (("dp_replicate", "cp"), (1, 2))
        assert record["local"] == [((4, SEQ // 2, 8), (4, SEQ // 2))] * STEPS
        assert [b.tolist() for b in record["batches"]] == [y[4 * i:4 * (i + 1)].tolist() for i in range(STEPS)]
        assert max_diff(record["final"], expected) <= 1e-5
    assert max_diff(ranks[0]["final"], ranks[1]["final"]) == 0.0
