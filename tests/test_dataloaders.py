"""The public loader helpers: ``DistributedSamplerWrapper``, ``distributed_sampler`` and
``rebuild_dataloader``, tested directly (one process; each rank's share is built here
for ranks 0 and 1 and compared with an index sequence worked out by hand)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, WeightedRandomSampler

import hookloop


class IndexData(Dataset):
    """Sample ``i`` is ``i``: a batch shows which indices a loader drew."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def shares(indices: list[int], world: int = 2) -> list[list[int]]:
    """Rank r's positions r, r + world, ... of ``indices`` padded by wrapping around,
    which is how ``DistributedSampler`` splits an epoch."""
    total = math.ceil(len(indices) / world) * world
    padded = (indices * math.ceil(total / len(indices)))[:total]
    return [padded[r:total:world] for r in range(world)]


# ---------------------------------------------------------------------------------------
# DistributedSamplerWrapper: the same draw on every rank, nobody's generator touched
# ---------------------------------------------------------------------------------------


WEIGHTS = torch.tensor([0.0, 1.0, 3.0, 0.5, 2.0, 0.0, 1.0, 4.0])


def weighted_reference(seed: int, num_samples: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(WEIGHTS, num_samples, replacement=True, generator=g).tolist()


def test_wrapper_leaves_the_users_generator_untouched():
    user = torch.Generator().manual_seed(1234)
    torch.rand(5, generator=user)  # somewhere in the middle of its stream
    before = user.get_state().clone()
    sampler = WeightedRandomSampler(WEIGHTS, 9, generator=user)
    wrapper = hookloop.DistributedSamplerWrapper(sampler, num_replicas=2, rank=0, seed=3)
    list(wrapper)
    assert sampler.generator is user
    assert torch.equal(user.get_state(), before)


class FailingSampler(Sampler):
    def __init__(self, generator):
        self.generator = generator

    def __len__(self):
        return 4

    def __iter__(self):
        torch.rand(1, generator=self.generator)
        raise RuntimeError("the user's sampler failed")


def test_wrapper_restores_the_users_generator_when_the_sampler_raises():
    user = torch.Generator().manual_seed(99)
    before = user.get_state().clone()
    sampler = FailingSampler(user)
    with pytest.raises(RuntimeError, match="the user's sampler failed"):
        list(hookloop.DistributedSamplerWrapper(sampler, num_replicas=2, rank=1, seed=0))
    assert sampler.generator is user
    assert torch.equal(user.get_state(), before)


class GlobalRandomSampler(Sampler):
    """A user's sampler with no ``generator`` attribute: it draws from torch's global one."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


def test_wrapper_of_a_sampler_on_the_global_generator_keeps_the_global_state():
    torch.manual_seed(2024)
    torch.rand(3)
    before = torch.get_rng_state().clone()
    wrappers = [hookloop.DistributedSamplerWrapper(GlobalRandomSampler(11), 2, r, seed=5) for r in (0, 1)]
    for w in wrappers:
        w.set_epoch(2)
    drawn = [list(w) for w in wrappers]
    assert torch.equal(torch.get_rng_state(), before)
    reference = torch.randperm(11, generator=torch.Generator().manual_seed(5 + 2)).tolist()
    assert drawn == shares(reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_wrapper_does_not_reseed_cuda_generators():
    torch.cuda.manual_seed_all(77)
    torch.rand(3, device="cuda")
    before = [s.clone() for s in torch.cuda.get_rng_state_all()]
    list(hookloop.DistributedSamplerWrapper(GlobalRandomSampler(10), 2, 0, seed=1))
    list(hookloop.DistributedSamplerWrapper(WeightedRandomSampler(WEIGHTS, 10), 2, 0, seed=1))
    after = torch.cuda.get_rng_state_all()
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_two_ranks_share_one_seeded_draw_of_a_weighted_sampler():
    user = torch.Generator().manual_seed(0)
    sampler = WeightedRandomSampler(WEIGHTS, 15, generator=user)
    wrappers = [hookloop.DistributedSamplerWrapper(sampler, num_replicas=2, rank=r, seed=7) for r in (0, 1)]
    by_epoch = []
    for epoch in (0, 1):
        for w in wrappers:
            w.set_epoch(epoch)
        drawn = [list(w) for w in wrappers]
        reference = weighted_reference(7 + epoch, 15)
        assert drawn == shares(reference)
        assert [len(d) for d in drawn] == [len(w) for w in wrappers] == [8, 8]
        # 15 draws split 8/7, the last rank padded with the first draw.
        assert sorted(drawn[0] + drawn[1][:7]) == sorted(reference)
        assert WEIGHTS[torch.tensor(drawn[0] + drawn[1])].min() > 0  # the weighting survived
        by_epoch.append(drawn)
    assert by_epoch[0] != by_epoch[1]  # set_epoch changes the draw


def test_weighted_sampler_without_a_generator_draws_as_seeded_by_hand():
    # What tests/test_ddp.py expects of a WeightedRandomSampler(generator=None) under ddp.
    wrappers = [hookloop.DistributedSamplerWrapper(WeightedRandomSampler(WEIGHTS, 16), 2, r) for r in (0, 1)]
    assert [list(w) for w in wrappers] == shares(weighted_reference(0, 16))


# ---------------------------------------------------------------------------------------
# distributed_sampler: shuffle exactly when the user's training loader shuffles
# ---------------------------------------------------------------------------------------


def permutation_shares(n: int, seed: int, epoch: int) -> list[list[int]]:
    return shares(torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist())


def test_training_loader_without_shuffle_is_shuffled_as_lightnings():
    # Lightning's training DistributedSampler shuffles an unshuffled loader too.
    loader = DataLoader(IndexData(11), batch_size=2, shuffle=False)
    samplers = [hookloop.distributed_sampler(loader, 2, r, training=True) for r in (0, 1)]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        assert [list(s) for s in samplers] == permutation_shares(11, seed=0, epoch=epoch)
    rebuilt = [hookloop.rebuild_dataloader(loader, s) for s in samplers]
    assert [torch.cat(list(r)).tolist() for r in rebuilt] == permutation_shares(11, seed=0, epoch=1)
    # overfit_batches keeps the order (Lightning: shuffle and not overfit_batches)
    ordered = DataLoader(IndexData(11), batch_size=2, sampler=hookloop.helpers.OrderedSampler(IndexData(11)))
    samplers = [hookloop.distributed_sampler(ordered, 2, r, training=True) for r in (0, 1)]
    assert [list(s) for s in samplers] == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 0]]


def test_shuffled_training_loader_gets_the_seeded_permutation_shares():
    loader = DataLoader(IndexData(11), batch_size=2, shuffle=True)
    samplers = [hookloop.distributed_sampler(loader, 2, r, training=True, seed=4) for r in (0, 1)]
    for epoch in (0, 1, 2):
        for s in samplers:
            s.set_epoch(epoch)
        assert [list(s) for s in samplers] == permutation_shares(11, seed=4, epoch=epoch)


def test_evaluation_loaders_are_never_shuffled():
    loader = DataLoader(IndexData(10), batch_size=2, shuffle=True)
    samplers = [hookloop.distributed_sampler(loader, 2, r, training=False) for r in (0, 1)]
    assert [list(s) for s in samplers] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


# ---------------------------------------------------------------------------------------
# rebuild_dataloader: the loader's own class and every argument it was built with
# ---------------------------------------------------------------------------------------


class TaggedLoader(DataLoader):
    """A subclass with an argument of its own and behaviour of its own."""

    def __init__(self, dataset, tag, **kwargs):
        super().__init__(dataset, **kwargs)
        self.tag = tag

    def __iter__(self):
        for batch in super().__iter__():
            yield self.tag, batch


def test_subclass_comes_back_as_itself_with_its_argument_and_behaviour():
    loader = TaggedLoader(IndexData(8), "train", batch_size=2, shuffle=False, drop_last=True)
    sampler = DistributedSampler(IndexData(8), num_replicas=2, rank=1, shuffle=False)
    rebuilt = hookloop.rebuild_dataloader(loader, sampler)
    assert type(rebuilt) is TaggedLoader
    assert rebuilt.tag == "train" and rebuilt.sampler is sampler and rebuilt.drop_last is True
    assert [(tag, batch.tolist()) for tag, batch in rebuilt] == [("train", [1, 3]), ("train", [5, 7])]


class KeywordOnlyLoader(DataLoader):
    """No **kwargs: only what its own signature names can be passed."""

    def __init__(self, dataset, batch_size, sampler=None, *, scale=1):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler)
        self.scale = scale


def test_subclass_without_kwargs_gets_its_own_parameters():
    loader = KeywordOnlyLoader(IndexData(6), 3, scale=10)
    rebuilt = hookloop.rebuild_dataloader(loader, DistributedSampler(IndexData(6), 2, 0, shuffle=False))
    assert type(rebuilt) is KeywordOnlyLoader
    assert (rebuilt.batch_size, rebuilt.scale) == (3, 10)
    assert [b.tolist() for b in rebuilt] == [[0, 2, 4]]


def collate_plus_100(items):
    return torch.tensor(items) + 100


def seed_worker(worker_id):
    torch.manual_seed(worker_id)


OPTIONS = ("dataset", "batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
           "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
           "persistent_workers", "pin_memory_device", "in_order")


def test_every_dataloader_argument_survives():
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(
        IndexData(12), batch_size=3, shuffle=True, num_workers=2, collate_fn=collate_plus_100,
        pin_memory=False, drop_last=True, timeout=30, worker_init_fn=seed_worker,
        multiprocessing_context="fork", generator=generator, prefetch_factor=3,
        persistent_workers=True, pin_memory_device="cpu", in_order=False,
    )
    sampler = DistributedSampler(IndexData(12), num_replicas=2, rank=0, shuffle=False)
    rebuilt = hookloop.rebuild_dataloader(loader, sampler)
    assert type(rebuilt) is DataLoader
    for name in OPTIONS:
        assert getattr(rebuilt, name) == getattr(loader, name), name
    assert rebuilt.generator is generator and rebuilt.collate_fn is collate_plus_100
    assert rebuilt.sampler is sampler
    # It still loads, with the user's collate_fn, in two worker processes.
    assert sorted(torch.cat(list(rebuilt)).tolist()) == [100, 102, 104, 106, 108, 110]


def test_loader_without_automatic_batching_keeps_batch_size_none():
    loader = DataLoader(IndexData(4), batch_size=None)
    rebuilt = hookloop.rebuild_dataloader(loader, DistributedSampler(IndexData(4), 2, 1, shuffle=False))
    assert rebuilt.batch_size is None and rebuilt.batch_sampler is None
    assert list(rebuilt) == [1, 3]


class Forgetful(DataLoader):
    """Takes ``scale`` but keeps it under another name: it cannot be rebuilt."""

    def __init__(self, dataset, scale, **kwargs):
        super().__init__(dataset, **kwargs)
        self._factor = scale


def test_subclass_with_an_unstored_required_argument_is_refused_with_advice():
    loader = Forgetful(IndexData(4), 2.0, batch_size=2)
    with pytest.raises(hookloop.ConfigurationError) as info:
        hookloop.rebuild_dataloader(loader, DistributedSampler(IndexData(4), 2, 0))
    message = str(info.value)
    assert "Forgetful" in message and "'scale'" in message
    assert "self.scale" in message and "use_distributed_sampler=False" in message


def test_custom_batch_sampler_is_still_refused():
    class Pairs(Sampler):
        def __len__(self):
            return 2

        def __iter__(self):
            return iter([[0, 1], [2, 3]])

    loader = DataLoader(IndexData(4), batch_sampler=Pairs())
    with pytest.raises(TypeError, match="custom batch_sampler"):
        hookloop.rebuild_dataloader(loader, DistributedSampler(IndexData(4), 2, 0))


# ---------------------------------------------------------------------------------------
# Evaluation under a padding sampler: a warning, with the count worked out by hand
# ---------------------------------------------------------------------------------------


class RankZeroOfTwo:
    """Gives this process rank 0's share of 2, as ddp does on rank 0 (one process here)."""

    hookloop_name = "rank_zero_of_two"

    def __init__(self, wrap_user_sampler: bool = False):
        self.wrap_user_sampler = wrap_user_sampler

    @hookloop.hookimpl
    def configure_sampler(self, trainer, dataloader, training):
        if self.wrap_user_sampler:
            return hookloop.DistributedSamplerWrapper(dataloader.sampler, 2, 0)
        return DistributedSampler(dataloader.dataset, num_replicas=2, rank=0, shuffle=training)


def padded_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "DistributedSampler repeats" in str(w.message)]


@pytest.mark.parametrize("wrap_user_sampler", [False, True])
def test_evaluation_that_counts_repeated_samples_says_so(tmp_path, recwarn, wrap_user_sampler):
    from conftest import TinyModule, tiny_data

    class Evaluated(TinyModule):
        def test_step(self, batch, batch_idx, dataloader_idx=0):
            return self.validation_step(batch, batch_idx)

    trainer = hookloop.Trainer(plugins=[RankZeroOfTwo(wrap_user_sampler)], enable_progress_bar=False,
                               default_root_dir=tmp_path, max_epochs=1)
    # 9 samples on 2 ranks: 5 each, 1 repeated (10 - 9).
    trainer.validate(TinyModule(), DataLoader(tiny_data(9), batch_size=4))
    assert padded_warnings(recwarn) == [
        "the validation loader has 9 samples for 2 processes: the DistributedSampler repeats 1 of them so that "
        "every rank gets 5, and validation metrics count those twice (as in Lightning). For exact metrics run "
        "validation on one process, or give the loader a multiple of 2 samples."]
    recwarn.clear()
    # An even split repeats nothing; of two test loaders only the uneven one (loader 1) is named.
    trainer.test(Evaluated(), [DataLoader(tiny_data(10), batch_size=4), DataLoader(tiny_data(7), batch_size=4)])
    assert [m.split(":")[0] for m in padded_warnings(recwarn)] == ["the test loader 1 has 7 samples for 2 processes"]
    recwarn.clear()
    # fit's validation loader too; the training loader is not evaluated.
    trainer = hookloop.Trainer(plugins=[RankZeroOfTwo(wrap_user_sampler)], enable_progress_bar=False,
                               default_root_dir=tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(TinyModule(), DataLoader(tiny_data(9), batch_size=4), DataLoader(tiny_data(11), batch_size=4))
    assert [m.split(":")[0] for m in padded_warnings(recwarn)] == ["the validation loader has 11 samples for 2 processes"]
