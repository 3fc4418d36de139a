"""Defects found in review of the loop (issue 9, item 6); each test failed before its fix.

Multi-process ones (``hookloop run`` of a script asking for ddp) are in
tests/test_lightning_ddp.py; the DeepSpeed, Horovod, SLURM, sampler and loader ones
beside their plugins' tests.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

import hookloop
from conftest import TinyModule, max_abs_diff, state_of, tiny_data


# -- 6.1: every metric tensor on one device -----------------------------------------------


def test_sync_dist_mean_keeps_every_tensor_on_the_run_device():
    """The mean's sample count was a CPU tensor stacked with the value's device tensor:
    on CUDA, self.log(..., sync_dist=True) crashed at the first validation end. The
    meta device stands in for an accelerator here: any host tensor mixed in fails."""
    trainer = hookloop.Trainer()
    trainer.root_device = torch.device("meta")
    metrics = trainer.state.metrics
    metrics.start("validate")
    metrics.stage = "validate"
    trainer.state.current_batch = torch.zeros(4, 2, device="meta")
    for op in ("mean", "sum", "max", "min"):
        metrics.log(f"v_{op}", torch.ones((), device="meta"), False, True, None, None, op, True, True, None)
    metrics.log("from_host", 3.0, False, True, None, None, "mean", True, True, 2)
    tensors = metrics.epoch_tensors("validate")
    assert set(tensors) == {"v_mean", "v_sum", "v_max", "v_min", "from_host"}
    assert {t.device.type for t in tensors.values()} == {"meta"}


# -- 6.2: validation must not reset the training epoch's metrics ---------------------------


class LogsEpochMean(TinyModule):
    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.log("x0_mean", x[:, 0].mean(), on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


def test_training_epoch_metrics_survive_validation():
    data = tiny_data(64)
    trainer = hookloop.Trainer(max_epochs=1, enable_checkpointing=False)
    trainer.fit(LogsEpochMean(), DataLoader(data, batch_size=8), DataLoader(tiny_data(16, seed=3), batch_size=8))
    assert trainer.callback_metrics["x0_mean"] == pytest.approx(data.tensors[0][:, 0].mean().item(), abs=1e-6)


def test_epoch_end_metrics_carry_only_this_epochs_validation():
    class Seen:
        hookloop_role = "observer"

        def __init__(self):
            self.keys = []

        @hookloop.hookimpl
        def on_train_epoch_end(self, metrics):
            self.keys.append(sorted(k for k in metrics if k.startswith("val")))

    seen = Seen()
    trainer = hookloop.Trainer(max_epochs=4, check_val_every_n_epoch=2, enable_checkpointing=False, plugins=[seen])
    trainer.fit(TinyModule(), DataLoader(tiny_data(16), batch_size=8), DataLoader(tiny_data(8), batch_size=8))
    assert seen.keys == [[], ["val_acc", "val_loss"], [], ["val_acc", "val_loss"]]


# -- 6.4: an unsized loader's last accumulation window steps ---------------------------------


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(zip(*self.data.tensors))


def test_unsized_loader_steps_its_last_partial_window_and_leaks_no_gradient():
    data = tiny_data(80)  # 10 batches of 8; windows of 3: 3 + 3 + 3 + 1
    torch.manual_seed(0)
    ours = TinyModule()
    trainer = hookloop.Trainer(max_epochs=2, accumulate_grad_batches=3, enable_checkpointing=False)
    trainer.fit(ours, DataLoader(Stream(data), batch_size=8))
    torch.manual_seed(0)
    reference = TinyModule()
    optimizer = reference.configure_optimizers()
    for _ in range(2):
        for i, (x, y) in enumerate(DataLoader(data, batch_size=8)):
            if i % 3 == 0:  # zeroed at each window's start, as Lightning (the last window: 1 batch)
                optimizer.zero_grad(set_to_none=True)
            (nn.functional.cross_entropy(reference(x), y) / 3).backward()
            if (i + 1) % 3 == 0 or i == 9:
                optimizer.step()
    assert trainer.global_step == 2 * 4
    # what is left after fit is the last (one-batch) window's gradient, nothing of an earlier one
    assert max_abs_diff({n: p.grad for n, p in ours.named_parameters()},
                        {n: p.grad for n, p in reference.named_parameters()}) == 0.0
    assert max_abs_diff(state_of(ours), state_of(reference)) == 0.0


# -- 6.5: a loader with a batch_sampler ------------------------------------------------------


def test_batch_sampler_loader_prints_the_effective_batch_size(capsys):
    loader = DataLoader(tiny_data(32), batch_sampler=BatchSampler(SequentialSampler(range(32)), 4, drop_last=False))
    trainer = hookloop.Trainer(max_epochs=1, accumulate_grad_batches=2, enable_checkpointing=False)
    trainer.fit(TinyModule(), loader)
    assert trainer.global_step == 4
    assert "effective batch size 8 = 4 per device x 1 processes x 2 accumulated batches" in capsys.readouterr().out
    uneven = DataLoader(tiny_data(32), batch_sampler=[list(range(0, 5)), list(range(5, 32))])
    hookloop.Trainer(max_epochs=1, accumulate_grad_batches=2, enable_checkpointing=False).fit(TinyModule(), uneven)
    assert "effective batch size = (batch_sampler's batches) x 1 processes x 2" in capsys.readouterr().out


# -- 6.11: values logged by DataParallel replicas -----------------------------------------------


class ThreadReplicas(nn.Module):
    """What nn.DataParallel does with a batch, on the CPU: split it with torch.chunk, run
    one replica per thread, gather the outputs. (The real one needs GPUs; the GPU test
    in tests/gpu/test_gpu_metrics.py runs it.)"""

    def __init__(self, module: nn.Module, replicas: int):
        super().__init__()
        self.module, self.replicas = module, replicas

    one_after_another = False  # each replica's thread ends before the next starts

    def forward(self, kind, batch, batch_idx, dataloader_idx=None):
        x, y = batch
        parts = list(zip(x.chunk(self.replicas), y.chunk(self.replicas)))
        outputs = [None] * len(parts)

        def run(i):
            outputs[i] = self.module(kind, parts[i], batch_idx)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(parts))]
        for t in threads:
            t.start()
            if self.one_after_another:
                t.join()
                time.sleep(0.005)  # the thread's exit completes: the next thread gets its ident
        for t in threads:
            t.join()
        return torch.stack(outputs).mean() if kind == "train" else None


class CpuDataParallel:
    hookloop_name = "cpu_dp"
    hookloop_role = "strategy"

    def __init__(self, one_after_another: bool = False):
        self.one_after_another = one_after_another

    @hookloop.hookimpl
    def wrap_model(self, trainer, model):
        replicas = ThreadReplicas(model.to(trainer.root_device), replicas=2)
        replicas.one_after_another = self.one_after_another
        return replicas


class LogsPerReplica(TinyModule):
    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.log("x0_step", x[:, 0].mean())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.log("x0_val", x[:, 0].mean())


@pytest.mark.parametrize("one_after_another", [False, True])
def test_replica_logs_average_per_step_and_weigh_by_their_own_share(tmp_path, one_after_another):
    """``one_after_another``: a replica's thread ends before the next one starts, so the
    second gets the first's ``threading.get_ident()`` (CPython reuses it): the replicas'
    values were keyed by it, and the second replaced the first (a flaky failure when the
    threads happened to run so, every time here)."""
    train, val = tiny_data(15), tiny_data(15, seed=4)  # batches of 5 split 3 + 2
    trainer = hookloop.Trainer(max_epochs=1, plugins=[CpuDataParallel(one_after_another)], enable_checkpointing=False,
                               default_root_dir=tmp_path)
    trainer.fit(LogsPerReplica(), DataLoader(train, batch_size=5), DataLoader(val, batch_size=5))
    last = train.tensors[0][10:, 0]
    per_replica = [part.mean() for part in last.chunk(2)]
    assert trainer.callback_metrics["x0_step"] == pytest.approx(torch.stack(per_replica).mean().item(), abs=1e-6)
    # the whole validation set's mean, whatever the replicas' shares
    assert trainer.callback_metrics["x0_val"] == pytest.approx(val.tensors[0][:, 0].mean().item(), abs=1e-6)
