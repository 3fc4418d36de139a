"""self.log on GPUs: metrics reduced on the device, read back from trainer.callback_metrics.

Written against the documented behaviour of ``hookloop.Module.log``: a validation value
is averaged over the validation set weighted by batch size, an ``on_epoch`` training
value over the epoch; ``sync_dist=True`` reduces across ranks with ``reduce_op``. Under
DataParallel every replica logs for its own chunk of the batch: a validation mean over
the chunks weighted by their sizes, a per-step value averaged over the replicas.

The references are computed on the CPU with hand-written loops. The batch sizes leave
uneven last batches (and, under DataParallel, uneven chunks), where a plain mean of
per-batch values would differ from the batch-weighted one.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

import hookloop
from conftest import REPO, max_abs_diff, run_python

from .gpu_check_model import MetricsNet, data

SCRIPTS = REPO / "tests" / "scripts"


def reference_fit(module, epochs, steps_of_epoch):
    """Plain SGD on the CPU; returns the batch-weighted mean loss of the last epoch.

    ``steps_of_epoch(epoch)`` gives each step's batches, one per rank: the step follows
    the mean of their mean losses, whose gradient is what DDP's all-reduce averages.
    """
    optimizer = module.configure_optimizers()
    for epoch in range(epochs):
        total, count = 0.0, 0
        for batches in steps_of_epoch(epoch):
            losses = [F.cross_entropy(module(x), y) for x, y in batches]
            torch.stack(losses).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for loss, (x, _) in zip(losses, batches):
                total, count = total + float(loss.detach()) * len(x), count + len(x)
    return total / count


def validation_reference(module, dataset):
    """(accuracy, largest |x|) over the whole validation set, on the CPU."""
    x, y = dataset.tensors
    with torch.no_grad():
        accuracy = (module(x).argmax(-1) == y).double().mean()
    return float(accuracy), float(x.abs().max())


def on_cpu(module):
    """A CPU copy of a trained ``MetricsNet`` (its lock cannot be deep-copied)."""
    reference = MetricsNet()
    reference.load_state_dict({k: v.cpu() for k, v in module.state_dict().items()})
    return reference


# -- one process on cuda:0 ----------------------------------------------------------------


@pytest.mark.gpu
def test_one_gpu_fit_and_validate_report_the_batch_weighted_means():
    train, val = data(88, seed=1), data(50, seed=2)
    train_loader = DataLoader(train, batch_size=24)  # 24, 24, 24, 16
    val_loader = DataLoader(val, batch_size=16)  # 16, 16, 16, 2
    module = MetricsNet()
    trainer = hookloop.Trainer(accelerator="cuda", max_epochs=2, enable_checkpointing=False)
    trainer.fit(module, train_loader, val_loader)
    fit_metrics = dict(trainer.callback_metrics)
    trainer.validate(module, val_loader)
    # validate() is becoming a list of dicts, one per dataloader: read callback_metrics.
    validate_metrics = dict(trainer.callback_metrics)
    assert trainer.root_device == torch.device("cuda", 0)
    assert {device for device, *_ in module.seen} == {"cuda:0"}

    reference = MetricsNet()
    train_loss = reference_fit(reference, 2, lambda epoch: [[batch] for batch in train_loader])
    assert max_abs_diff(on_cpu(module).state_dict(), reference.state_dict()) < 1e-5
    val_acc, val_max = validation_reference(reference, val)
    last_x = train.tensors[0][72:]
    assert fit_metrics["train_loss"] == pytest.approx(train_loss, abs=1e-5)
    assert fit_metrics["x0_mean"] == pytest.approx(float(last_x[:, 0].mean()), abs=1e-6)
    for metrics in (fit_metrics, validate_metrics):
        assert metrics["val_acc"] == pytest.approx(val_acc, abs=1e-6)
        assert metrics["val_max"] == val_max  # a max is exact


# -- ddp: 2 processes, NCCL ---------------------------------------------------------------


@pytest.mark.gpu(count=2)
def test_ddp_on_two_gpus_reduces_metrics_across_ranks(tmp_path):
    epochs, batch, val_batch, n_train, n_val = 2, 16, 8, 80, 50
    run_python(
        [sys.executable, "-m", "hookloop", "run", "--plugins", "ddp", "--devices", "2", str(SCRIPTS / "gpu_ddp_metrics.py"),
         str(tmp_path), *map(str, (epochs, batch, val_batch, n_train, n_val))],
        cwd=tmp_path,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    # Rank r trains on DistributedSampler(shuffle=True, seed=0)'s share: 40 samples in
    # batches of 16, 16, 8; and validates on samples r, r + 2, ...: 25, in 8, 8, 8, 1.
    train = data(n_train, seed=1)
    x_all, y_all = train.tensors
    samplers = [DistributedSampler(train, num_replicas=2, rank=r, shuffle=True, seed=0) for r in (0, 1)]

    def shares(epoch):
        orders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            orders.append(torch.tensor(list(sampler)))
        return [[(x_all[order[i : i + batch]], y_all[order[i : i + batch]]) for order in orders]
                for i in range(0, len(orders[0]), batch)]

    reference = MetricsNet()
    train_loss = reference_fit(reference, epochs, shares)
    val_acc, val_max = validation_reference(reference, data(n_val, seed=2))
    last_batches = shares(epochs - 1)[-1]
    for r, record in enumerate(ranks):
        assert (record["backend"], record["root_device"], record["world_size"]) == ("nccl", f"cuda:{r}", 2)
        assert max_abs_diff(record["weights"], reference.state_dict()) < 1e-5
        fit_metrics, validate_metrics = record["fit_metrics"], record["validate_metrics"]
        # sync_dist=True: every rank reports the mean over both ranks' samples.
        assert fit_metrics["train_loss"] == pytest.approx(train_loss, abs=1e-5)
        # Not synced: each rank keeps the value of its own last batch.
        assert fit_metrics["x0_mean"] == pytest.approx(float(last_batches[r][0][:, 0].mean()), abs=1e-6)
        for metrics in (fit_metrics, validate_metrics):
            assert metrics["val_acc"] == pytest.approx(val_acc, abs=1e-6)
            assert metrics["val_max"] == val_max


# -- DataParallel over every GPU ----------------------------------------------------------


@pytest.mark.gpu(count=2)
def test_dp_validation_mean_is_weighted_by_each_replicas_chunk():
    n = torch.cuda.device_count()
    batch = 4 * n - 1  # DataParallel splits it as torch.chunk does: n - 1 chunks of 4, one of 3
    val = data(3 * batch + 5, seed=2)  # and a last batch of 5, split over fewer replicas when n > 2
    module = MetricsNet()
    trainer = hookloop.Trainer(plugins=["dp"], devices=n, enable_checkpointing=False)
    trainer.validate(module, DataLoader(val, batch_size=batch))
    val_acc, val_max = validation_reference(on_cpu(module), val)
    assert trainer.callback_metrics["val_acc"] == pytest.approx(val_acc, abs=1e-6)
    assert trainer.callback_metrics["val_max"] == val_max


@pytest.mark.gpu(count=2)
def test_dp_step_metric_is_the_mean_over_replicas():
    n = torch.cuda.device_count()
    batch = 4 * n - 1
    train = data(2 * batch, seed=1)  # two steps
    module = MetricsNet()
    trainer = hookloop.Trainer(plugins=["dp"], devices=n, max_epochs=1, enable_checkpointing=False)
    trainer.fit(module, DataLoader(train, batch_size=batch))
    assert sorted({device for device, *_ in module.seen}) == [f"cuda:{i}" for i in range(n)]
    # Each replica logged the mean of its own chunk of the last batch; the reported value
    # is their plain mean, which differs from the whole batch's mean: the chunks are uneven.
    chunks = torch.chunk(train.tensors[0][batch:], n)
    expected = sum(float(chunk[:, 0].mean()) for chunk in chunks) / len(chunks)
    assert trainer.callback_metrics["x0_mean"] == pytest.approx(expected, abs=1e-6)
