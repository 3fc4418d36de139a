"""hookloop-dp: DataParallel strategy. CPU machine: single-device run, AMP in replica threads."""

from __future__ import annotations

import sys
import textwrap
import threading

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, TinyModule, max_abs_diff, reference_loop, run_python, state_of, tiny_data
from test_amp import AutocastProbe, autocast_reference

HOOKLOOP = [sys.executable, "-m", "hookloop"]
needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@needs_cpu_only
def test_dp_on_cpu_trains_like_the_reference_loop_in_this_process(capsys):
    loader = DataLoader(tiny_data(), batch_size=16, shuffle=False)
    module = TinyModule()
    # devices=2 would be two processes for ddp; DataParallel runs them as threads of
    # this process, so nothing is re-launched (a relaunch from pytest would fail).
    trainer = hookloop.Trainer(plugins=["dp"], devices=2, max_epochs=2, enable_checkpointing=False)
    trainer.fit(module, loader, DataLoader(tiny_data(32, seed=4), batch_size=16))
    (metrics,) = trainer.validate(module, DataLoader(tiny_data(32, seed=4), batch_size=16))
    reference = TinyModule()
    reference_loop(reference, loader, epochs=2)
    assert max_abs_diff(state_of(module), state_of(reference)) < 1e-6
    assert trainer.world_size == 1 and trainer.root_device == torch.device("cpu")
    assert "val_acc" in metrics
    out = capsys.readouterr().out
    assert out.count("running single-device on the CPU") == 1
    assert out.count("DistributedDataParallel (--plugins ddp") == 1


@needs_cpu_only
def test_dp_with_bf16_runs_every_forward_under_autocast():
    loader = DataLoader(tiny_data(), batch_size=16)
    module = AutocastProbe()
    trainer = hookloop.Trainer(plugins=["dp", "amp"], devices=2, precision="bf16-mixed", max_epochs=2,
                               enable_checkpointing=False)
    trainer.fit(module, loader, DataLoader(tiny_data(32, seed=4), batch_size=16))
    reference = TinyModule()
    autocast_reference(reference, loader, epochs=2, dtype=torch.bfloat16)
    assert max_abs_diff(state_of(module), state_of(reference)) < 1e-6
    assert {kind for kind, *_ in module.seen} == {"train", "val"}
    assert all(on and dt == torch.bfloat16 and out == torch.bfloat16 for _, on, dt, out in module.seen)


def test_replica_forward_runs_under_autocast_in_its_own_thread():
    """DataParallel runs each replica's forward in a new thread, where the loop's autocast
    (thread-local) is not in force; the dp wrapper enters the run's contexts there."""
    from hookloop_dp import ReplicaContexts

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)
            self.seen = []

        def forward(self, kind, batch, batch_idx):
            out = self.linear(batch)
            self.seen.append((threading.current_thread().name, torch.is_autocast_enabled("cpu"), out.dtype))
            return out.float().sum()

    step = Step()
    wrapped = ReplicaContexts(step, [torch.autocast("cpu", dtype=torch.bfloat16)])
    x = torch.randn(3, 4)

    def in_threads(model, n=2):
        # What torch.nn.parallel.parallel_apply does with the replicas, minus the GPUs.
        threads = [threading.Thread(target=model, args=("train", x, 0), name=f"replica-{i}") for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    with torch.autocast("cpu", dtype=torch.bfloat16):  # the loop's own context, main thread
        in_threads(step)
        bare = list(step.seen)
        step.seen.clear()
        in_threads(wrapped)
    assert [s[1:] for s in bare] == [(False, torch.float32)] * 2  # why the wrapper exists
    assert sorted(s[0] for s in step.seen) == ["replica-0", "replica-1"]
    assert [s[1:] for s in step.seen] == [(True, torch.bfloat16)] * 2
    assert not torch.is_autocast_enabled("cpu")  # nothing leaked into this thread


def test_gathered_replica_losses_are_averaged_unless_the_module_reduces_them():
    from hookloop_dp import ReplicaContexts, mean_of_replicas

    class Step(torch.nn.Module):
        def forward(self, kind, batch, batch_idx):
            return {"loss": batch.sum(), "parts": (batch.mean(), batch)}

    # Each replica returns its scalar loss as shape (1,); DataParallel's gather
    # concatenates the replicas' outputs along dim 0 (torch.cat, as on the GPUs).
    replica = ReplicaContexts(Step(), [], unsqueeze_scalars=True)
    chunks = [torch.tensor([[0.5]]), torch.tensor([[1.5]]), torch.tensor([[4.0]])]
    outs = [replica("train", c, 0) for c in chunks]
    assert outs[0]["loss"].shape == (1,) and outs[0]["parts"][0].shape == (1,) and outs[0]["parts"][1].shape == (1, 1)
    gathered = torch.cat([o["loss"] for o in outs])
    assert torch.equal(mean_of_replicas(gathered), torch.tensor(2.0))
    out = mean_of_replicas({"loss": gathered, "logits": torch.ones(6, 3)})
    assert torch.equal(out["loss"], torch.tensor(2.0)) and out["logits"].shape == (6, 3)
    assert mean_of_replicas(torch.tensor(3.0)) is None  # one device: already a scalar


class StepEnd(TinyModule):
    """Lightning's DP pattern: training_step returns pieces, training_step_end the loss."""

    def __init__(self):
        super().__init__()
        self.step_end_inputs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"logits": self(x), "y": y}

    def training_step_end(self, outputs):
        self.step_end_inputs.append(sorted(outputs))
        return F.cross_entropy(outputs["logits"], outputs["y"])


def test_training_step_end_receives_the_outputs_and_returns_the_loss():
    loader = DataLoader(tiny_data(), batch_size=16)
    module = StepEnd()
    hookloop.Trainer(plugins=["dp"], max_epochs=1, enable_checkpointing=False).fit(module, loader)
    reference = TinyModule()
    reference_loop(reference, loader, epochs=1)
    assert module.step_end_inputs == [["logits", "y"]] * len(loader)
    assert max_abs_diff(state_of(module), state_of(reference)) < 1e-6


def test_dp_refuses_several_nodes():
    trainer = hookloop.Trainer(plugins=["dp"], nodes=2, node_rank=0, rdzv_endpoint="localhost:29400",
                               enable_checkpointing=False)
    with pytest.raises(hookloop.ConfigurationError, match="one machine.*ddp"):
        trainer.fit(TinyModule(), DataLoader(tiny_data(), batch_size=16))


@pytest.mark.check
@needs_cpu_only
def test_hookloop_run_with_dp_starts_one_process(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(
        """
        import os, sys, hookloop
        sys.path.insert(0, sys.argv[1])
        from conftest import TinyModule, tiny_data
        from torch.utils.data import DataLoader
        trainer = hookloop.Trainer(max_steps=2, enable_checkpointing=False)
        trainer.fit(TinyModule(), DataLoader(tiny_data(32), batch_size=16))
        print("RUN", os.getpid(), "LOCAL_RANK" in os.environ, trainer.world_size, trainer.config.devices)
        """
    ))
    out = run_python(HOOKLOOP + ["run", "--plugins", "dp", "--devices", "2", "train.py", str(REPO / "tests")], cwd=tmp_path)
    runs = [line.split() for line in out.stdout.splitlines() if line.startswith("RUN")]
    assert len(runs) == 1  # not one per device
    assert runs[0][2:] == ["False", "1", "2"]  # no torchrun, a world of one
