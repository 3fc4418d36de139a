"""hookloop-cp on the CPU machines: what runs here and what is refused.

torch 2.13 has ring attention for the CUDA SDPA kernels only, so context parallelism
itself is tested on a GPU (tests/gpu/test_cp_gpu.py). Here:

* the refusal: ``hookloop run --plugins ddp,cp --devices 2 --mesh cp=2`` on the CPU stops
  at setup on every rank with the reason and where it runs; the same in this process;
* that the refusal is true: SDPA inside torch's ``context_parallel`` on the CPU raises
  torch's ``NotImplementedError`` for the CPU kernel (1 gloo process), and the op is not
  in the table the plugin reads;
* the plugin's data path without attention, on 2 gloo processes (``ddp,cp`` with
  ``--mesh cp=2``): a position-wise model (tp_models-like, no SDPA) with the batch sharded
  on the sequence by torch's ``context_parallel`` and the gradients averaged over the cp
  group equals the same model trained by a hand-written loop in one process, and both cp
  ranks load the same batches. The device refusal is skipped there by a subclass
  (cp_train.py ``cpu-data-path``): what runs is the plugin's own code and torch's.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, run_python

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from cp_models import SEQ, CausalNet, PositionNet, data, reference  # noqa: E402

SCRIPTS = REPO / "tests" / "scripts"
STEPS = 4
REASON = ("handles the CUDA SDPA kernels only (_scaled_dot_product_cudnn_attention, _scaled_dot_product_efficient_attention, "
          "_scaled_dot_product_flash_attention); on the CPU, SDPA runs aten._scaled_dot_product_flash_attention_for_cpu, "
          "which has no context-parallel rule. Context parallelism runs on CUDA GPUs (NCCL)")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.slow
def test_cp_on_two_cpu_processes_is_refused_at_setup_on_every_rank(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hookloop", "run", "--plugins", "ddp,cp", "--devices", "2",
                           "--mesh", "cp=2", str(SCRIPTS / "cp_train.py"), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    # Reported once (docs/how-to/failures.md): the first rank's message, the other's noted.
    assert proc.stderr.count(f"ConfigurationError: cp: torch {torch.__version__}'s ring attention") == 1
    assert re.search(r"hookloop: rank [01] raised the same error", proc.stderr), proc.stderr
    assert REASON in proc.stderr
    assert not list(tmp_path.glob("rank*.pt"))  # no step ran


def test_cp_is_refused_on_the_cpu_in_this_process_before_any_step(tmp_path):
    steps = []

    class Count:
        hookloop_name, hookloop_role = "count", "observer"

        @hookloop.hookimpl
        def on_train_batch_start(self, trainer, batch, batch_idx):
            steps.append(batch_idx)

    trainer = hookloop.Trainer(plugins=["ddp", "cp", Count()], mesh={"cp": 1}, max_steps=1, logger=False,
                               enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(hookloop.ConfigurationError, match="^cp: torch .*'s ring attention") as info:
        trainer.fit(CausalNet(), DataLoader(data(), batch_size=4))
    assert REASON in str(info.value) and steps == []


@pytest.mark.slow
def test_the_refusal_is_torchs_own_limit_on_the_cpu(tmp_path):
    import hookloop_cp

    ops = {str(op) for op in hookloop_cp._ring_attention_ops()}
    assert "aten._scaled_dot_product_efficient_attention.default" in ops
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in ops
    assert hookloop_cp.unsupported_reason(torch.device("cuda", 0)) is None
    assert "CUDA GPUs" in hookloop_cp.unsupported_reason(torch.device("mps"))
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.nn import functional as F\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor.experimental import context_parallel\n"
        "dist.init_process_group('gloo')\n"
        "mesh = init_device_mesh('cpu', (1,), mesh_dim_names=('cp',))\n"
        "x = torch.randn(2, 8, 4)\n"
        "try:\n"
        "    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):\n"
        "        q = x.view(2, 1, 8, 4)\n"
        "        F.scaled_dot_product_attention(q, q, q, is_causal=True)\n"
        "    print('RAN')\n"
        "except NotImplementedError as error:\n"
        "    print('REFUSED', error)\n"
        "dist.destroy_process_group()\n")
    out = run_python([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(probe)],
                     cwd=tmp_path, timeout=120).stdout
    assert "REFUSED Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy" in out


@pytest.mark.slow
def test_the_data_path_on_two_cpu_processes_equals_one_process_without_attention(tmp_path):
    run_python([sys.executable, "-m", "hookloop", "run", "--plugins", "ddp,cp", "--devices", "2", "--mesh", "cp=2",
                str(SCRIPTS / "cp_train.py"), str(tmp_path), "cpu-data-path"], cwd=tmp_path, timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    expected = reference(STEPS, model_class=PositionNet)
    x, y = data().tensors
    for record in ranks:
        assert record["mesh"] == (("dp_replicate", "cp"), (1, 2))
        # each rank computed half of every sequence ...
        assert record["local"] == [((4, SEQ // 2, 8), (4, SEQ // 2))] * STEPS
        # ... of the same batches, in the user's order (cp is no data-parallel dimension)
        assert [b.tolist() for b in record["batches"]] == [y[4 * i:4 * (i + 1)].tolist() for i in range(STEPS)]
        # gradients averaged over the cp group: the one-process run
        assert max_diff(record["final"], expected) <= 1e-5
    assert max_diff(ranks[0]["final"], ranks[1]["final"]) == 0.0


def test_bad_options_are_refused():
    from hookloop_cp import CP

    with pytest.raises(hookloop.ConfigurationError, match="seq_dim=0 must be an integer >= 1"):
        CP(seq_dim=0)
    with pytest.raises(hookloop.ConfigurationError, match="rotate_method='ring'"):
        CP(rotate_method="ring")
    with pytest.raises(hookloop.ConfigurationError, match="'freqs:x' is not NAME or NAME:DIM"):
        CP(buffers="freqs:x")
    assert CP(buffers="rope.freqs, pos:1").buffers == [("rope.freqs", 0), ("pos", 1)]
    assert CP.hookloop_mesh_dims == ("cp",) and CP.hookloop_requires == ">=2,<3"
