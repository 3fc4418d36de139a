"""Data defects of issue 17 §2: the distributed sampler's seed, the order of gathered
predictions, DataModules by duck type.

Multi-process checks run on 2 real processes (gloo, CPU) through
``hookloop.testing.run_processes``; each compares with a reference computed here:
``DistributedSampler``'s own order, or a single-process prediction.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import hookloop
from hookloop.testing import run_processes

WORLD = 2


class Numbers(Dataset):
    """Sample ``i`` is ``(tensor([i.]), i)``: a prediction says which sample it was."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i


class Records(hookloop.Module):
    """Records the sample indices each epoch trains on; predicts ``3 * x + 1`` and the index."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def on_train_epoch_start(self):
        self.seen.append([])

    def training_step(self, batch, batch_idx):
        x, index = batch
        self.seen[-1] += index.tolist()
        return self.layer(x).sum()

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, index = batch
        return {"y": 3 * x + 1, "index": index}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(root: str, **kwargs) -> hookloop.Trainer:
    kwargs.setdefault("plugins", ["ddp"])
    return hookloop.Trainer(accelerator="cpu", enable_checkpointing=False, num_sanity_val_steps=0,
                            default_root_dir=root, **kwargs)


# ---------------------------------------------------------------------------------------
# 8. The DistributedSampler's seed is the one seed_everything set
# ---------------------------------------------------------------------------------------


def _train_orders(seeds: list, epochs: int, n: int, plugin: str = "ddp") -> dict:
    """Rank's training order per epoch, for each seed of ``seeds`` (one fit each)."""
    orders = {}
    for seed in seeds:
        hookloop.seed_everything(seed)
        module = Records()
        with tempfile.TemporaryDirectory() as root:
            _trainer(root, max_epochs=epochs, plugins=[plugin]).fit(module, DataLoader(Numbers(n), batch_size=3, shuffle=True))
        orders[seed] = module.seen
    return orders


@pytest.mark.slow
def test_ddp_sampler_uses_the_seed_of_seed_everything():
    n, epochs, seeds = 14, 2, [1, 2]
    ranks = run_processes(_train_orders, nprocs=WORLD, args=(seeds, epochs, n), timeout=240)
    for rank, orders in enumerate(ranks):
        for seed in seeds:
            for epoch in range(epochs):
                # What Lightning builds: DistributedSampler(seed=int(PL_GLOBAL_SEED)).
                expected = DistributedSampler(Numbers(n), num_replicas=WORLD, rank=rank, shuffle=True, seed=seed)
                expected.set_epoch(epoch)
                assert orders[seed][epoch] == list(expected), (rank, seed, epoch)
        assert orders[1] != orders[2]


@pytest.mark.slow
def test_deepspeed_sampler_uses_the_seed_of_seed_everything():
    """deepspeed (like horovod) gets its sampler from the same core helper as ddp."""
    n, seed = 14, 3
    ranks = run_processes(_train_orders, nprocs=WORLD, args=([seed], 1, n, "deepspeed"), timeout=300)
    for rank, orders in enumerate(ranks):
        expected = DistributedSampler(Numbers(n), num_replicas=WORLD, rank=rank, shuffle=True, seed=seed)
        expected.set_epoch(0)
        assert orders[seed][0] == list(expected), rank


def test_seed_everything_records_the_seed_for_the_samplers(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored (to unset) after the test
    monkeypatch.delenv("PL_GLOBAL_SEED")
    loader = DataLoader(Numbers(10), batch_size=2, shuffle=True)
    assert hookloop.distributed_sampler(loader, 2, 0, training=True).seed == 0  # nothing set: 0, as Lightning
    hookloop.seed_everything(7)
    assert os.environ["PL_GLOBAL_SEED"] == "7"
    for sampler in (hookloop.distributed_sampler(loader, 2, 1, training=True),
                    hookloop.distributed_sampler(DataLoader(Numbers(10), sampler=[3, 1, 2]), 2, 1, training=True)):
        assert sampler.seed == 7
    # An explicit seed (ddp's sampler_seed option) still wins.
    assert hookloop.distributed_sampler(loader, 2, 0, training=True, seed=3).seed == 3


# ---------------------------------------------------------------------------------------
# 9. Predictions come back in dataset order whatever DistributedSampler the loader has
# ---------------------------------------------------------------------------------------

PREDICT_N, PREDICT_BATCH = 11, 3  # 11 samples: a padding sampler repeats one
SAMPLERS = {  # the loader's own DistributedSampler's arguments
    "shuffled": dict(shuffle=True, seed=5),
    "unshuffled": dict(shuffle=False),
    "shuffled_drop_last": dict(shuffle=True, seed=5, drop_last=True),
    "unshuffled_drop_last": dict(shuffle=False, drop_last=True),
}


class OwnShare(torch.utils.data.Sampler):
    """A sampler hookloop knows nothing of, that gives each rank a share of its own."""

    def __init__(self, indices: list):
        self.indices = indices

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _predict_with_user_samplers() -> dict:
    import warnings

    rank = int(os.environ["RANK"])
    results = {}
    for name, kwargs in SAMPLERS.items():
        sampler = DistributedSampler(Numbers(PREDICT_N), num_replicas=WORLD, rank=rank, **kwargs)
        loader = DataLoader(Numbers(PREDICT_N), batch_size=PREDICT_BATCH, sampler=sampler)
        with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[name] = (_trainer(root).predict(Records(), loader), [str(w.message) for w in caught])
    # A sampler of unknown kind, left alone (use_distributed_sampler=False): rank 0
    # predicts 4, 0, 2 and rank 1 predicts 1, 3.
    loader = DataLoader(Numbers(5), batch_size=2, sampler=OwnShare([[4, 0, 2], [1, 3]][rank]))
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["unknown"] = (_trainer(root, use_distributed_sampler=False).predict(Records(), loader),
                              [str(w.message) for w in caught])
    return results


def _single_process_predictions(indices: list, batch: int) -> list:
    """predict_step on the samples ``indices``, in batches of ``batch``: one process's loop."""
    module = Records()
    data = torch.utils.data.Subset(Numbers(PREDICT_N), indices)
    with torch.no_grad():
        return [module.predict_step(b, i) for i, b in enumerate(DataLoader(data, batch_size=batch))]


def _flat(predictions: list) -> tuple[list, list]:
    return ([float(v) for p in predictions for v in p["y"].flatten()],
            [int(i) for p in predictions for i in p["index"]])


@pytest.fixture(scope="module")
def predicted():
    return run_processes(_predict_with_user_samplers, nprocs=WORLD, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shuffled", "unshuffled"])
def test_predictions_with_a_users_distributed_sampler_come_back_in_dataset_order(predicted, name):
    expected = _single_process_predictions(list(range(PREDICT_N)), PREDICT_BATCH)
    for rank, results in enumerate(predicted):
        predictions, _ = results[name]
        assert [len(p["index"]) for p in predictions] == [3, 3, 3, 2]  # batched as one process batches
        assert _flat(predictions) == _flat(expected), (rank, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shuffled_drop_last", "unshuffled_drop_last"])
def test_drop_last_sampler_predictions_are_its_samples_once_in_dataset_order_with_a_warning(predicted, name):
    kwargs = SAMPLERS[name]
    kept = sorted(i for r in range(WORLD) for i in DistributedSampler(Numbers(PREDICT_N), num_replicas=WORLD, rank=r, **kwargs))
    assert len(kept) == 10  # the sampler drops one of the 11 samples
    expected = _single_process_predictions(kept, PREDICT_BATCH)
    for rank, results in enumerate(predicted):
        predictions, caught = results[name]
        assert _flat(predictions) == _flat(expected), (rank, name)
        dropped = [m for m in caught if "drop_last=True" in m]
        assert len(dropped) == (1 if rank == 0 else 0), caught  # global rank 0 says so, once
        if rank == 0:
            assert "1 of its 11 samples" in dropped[0]


@pytest.mark.slow
def test_predictions_of_an_unknown_sampler_come_in_rank_order_with_a_warning(predicted):
    for rank, results in enumerate(predicted):
        predictions, caught = results["unknown"]
        assert [p["index"].tolist() for p in predictions] == [[4, 0], [2], [1, 3]]  # rank 0's batches, then rank 1's
        unknown = [m for m in caught if "OwnShare" in m]
        assert len(unknown) == (1 if rank == 0 else 0), caught


# ---------------------------------------------------------------------------------------
# 10. A DataModule by duck type: any object with *_dataloader() methods
# ---------------------------------------------------------------------------------------


class LoadersOnly:
    """Not a hookloop.DataModule: no prepare_data, setup, teardown or state_dict."""

    def train_dataloader(self):
        from conftest import tiny_data

        return DataLoader(tiny_data(64), batch_size=16)


class SomeHooks:
    """setup, teardown and state_dict, but no prepare_data or load_state_dict."""

    def __init__(self):
        self.calls: list = []

    def setup(self, stage):
        from conftest import tiny_data

        self.calls.append(("setup", stage))
        self.data = tiny_data(64)

    def teardown(self, stage):
        self.calls.append(("teardown", stage))

    def state_dict(self):
        return {"kept": 3}

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16)

    def predict_dataloader(self):
        return DataLoader(self.data.tensors[0], batch_size=16)


@pytest.mark.parametrize("positional", [False, True])
def test_fit_accepts_a_datamodule_by_duck_type(tmp_path, positional):
    from conftest import TinyModule, max_abs_diff, reference_loop, state_of, tiny_data

    torch.manual_seed(4)
    module = TinyModule()
    trainer = hookloop.Trainer(max_epochs=2, default_root_dir=str(tmp_path), enable_checkpointing=False)
    if positional:
        trainer.fit(module, LoadersOnly())
    else:
        trainer.fit(module, datamodule=LoadersOnly())
    torch.manual_seed(4)
    reference = TinyModule()
    reference_loop(reference, DataLoader(tiny_data(64), batch_size=16), epochs=2)
    assert max_abs_diff(state_of(module), state_of(reference)) == 0.0


def test_a_duck_typed_datamodules_own_hooks_are_called(tmp_path):
    from conftest import TinyModule

    dm = SomeHooks()
    module = TinyModule()
    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_checkpointing=False)
    trainer.fit(module, datamodule=dm)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert torch.load(tmp_path / "run.ckpt", weights_only=True)["datamodule"] == {"kept": 3}
    trainer.fit(TinyModule(), datamodule=dm, ckpt_path=tmp_path / "run.ckpt")  # no load_state_dict: skipped
    predictions = trainer.predict(module, datamodule=dm)
    with torch.no_grad():
        assert torch.allclose(torch.cat(predictions), module(dm.data.tensors[0]), atol=1e-6)
    assert dm.calls == [("setup", "fit"), ("teardown", "fit")] * 2 + [("setup", "predict"), ("teardown", "predict")]
