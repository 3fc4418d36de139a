"""Loader state across a mid-epoch resume (issue 19, item 3): the resumed run yields exactly
the batches of the uninterrupted run, with persistent workers and with what the workers
draw; done batches are skipped by index (never read); a loader with
state_dict()/load_state_dict() is restored from its state; a plain iterable dataset warns.

Each test compares a run stopped mid-epoch (max_steps) and resumed from its last.ckpt in a
fresh trainer, with fresh loaders and another global seed in between, against one
uninterrupted run: the batches each step saw, and the final weights.
"""

from __future__ import annotations

import multiprocessing
import sys
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import hookloop

N, BATCH = 40, 4  # 10 batches per epoch
EPOCHS, STOP = 3, 13  # stopped at epoch 1, batch 3


class AugmentedData(Dataset):
    """Sample i is (i, a random augmentation drawn in __getitem__ from torch's generator);
    it counts its reads (in this process: num_workers=0)."""

    def __init__(self, n: int = N):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return torch.tensor(i), torch.rand(1)


class Recorder(hookloop.Module):
    """A linear fit of the augmentation; records every batch it trains on."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Linear(1, 1)
        self.seen: list[tuple[list[int], list[float]]] = []

    def training_step(self, batch, batch_idx):
        index, aug = batch
        self.seen.append((index.tolist(), aug.flatten().tolist()))
        return ((self.net(aug).flatten() - index.float() / N) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, module, loader, val_loader=None, ckpt_path=None, **kw):
    trainer = hookloop.Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, **kw)
    trainer.fit(module, loader, val_loader, ckpt_path=ckpt_path)
    return trainer


def stopped_and_resumed(tmp_path, make_loader, epochs=EPOCHS, stop=STOP):
    """(uninterrupted module, resumed module, resumed loader, first trainer)."""
    torch.manual_seed(11)
    straight = Recorder()
    fit(tmp_path / "a", straight, make_loader(), max_epochs=epochs)
    torch.manual_seed(11)
    first = Recorder()
    t1 = fit(tmp_path / "b", first, make_loader(), max_steps=stop)
    assert first.seen == straight.seen[:stop]
    torch.manual_seed(999)  # whatever the RNG does in between must not matter
    resumed, loader = Recorder(seed=3), make_loader()
    last = tmp_path / "b" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    fit(tmp_path / "b", resumed, loader, ckpt_path=last, max_epochs=epochs)
    return straight, resumed, loader, t1


def assert_same_run(straight, resumed, stop=STOP):
    assert len(resumed.seen) == len(straight.seen) - stop
    for step, (a, b) in enumerate(zip(straight.seen[stop:], resumed.seen), stop):
        assert a == b, f"step {step}: uninterrupted {a}, resumed {b}"
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "not-persistent"])
def test_a_mid_epoch_resume_with_workers_yields_the_uninterrupted_batches(tmp_path, persistent):
    # Two workers that draw an augmentation per sample; with persistent workers the resumed
    # loader used to draw a base seed the uninterrupted run never drew, so its sampler got
    # another seed and the rest of the epoch another permutation.
    def make_loader():
        return DataLoader(AugmentedData(), batch_size=BATCH, shuffle=True, num_workers=2,
                          persistent_workers=persistent, multiprocessing_context="fork")

    straight, resumed, _, trainer = stopped_and_resumed(tmp_path, make_loader)
    assert_same_run(straight, resumed)
    # the workers ended with each fit, although the trainer keeps the loader it iterated
    assert trainer.state.fit_train_loader is not None and not multiprocessing.active_children()


@pytest.mark.parametrize("stop", [10, 20], ids=["end-of-epoch-0", "end-of-epoch-1"])
def test_a_resume_at_an_epoch_boundary_with_persistent_workers_yields_the_uninterrupted_batches(tmp_path, stop):
    # Stopped after an epoch's last batch: the resumed process starts its workers at the
    # next epoch, where the uninterrupted run's persistent workers drew no base seed; the
    # resumed run used to draw one from the global generator, so the next epoch's shuffle
    # was another (found by hookloop.testing.ResumeConformance).
    def make_loader():
        return DataLoader(AugmentedData(), batch_size=BATCH, shuffle=True, num_workers=2,
                          persistent_workers=True, multiprocessing_context="fork")

    straight, resumed, _, _ = stopped_and_resumed(tmp_path, make_loader, stop=stop)
    assert_same_run(straight, resumed, stop=stop)


class Validated(Recorder):
    """Records what each validation batch drew in the workers (a random augmentation)."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.val_seen: list[list[float]] = []

    def validation_step(self, batch, batch_idx):
        self.val_seen.append(batch[1].flatten().tolist())


def test_validation_with_persistent_workers_draws_the_same_after_a_resume(tmp_path):
    # Validation's persistent workers were started anew by the resumed process and seeded
    # from another base seed: a random augmentation in validation differed (val_loss off by
    # 0.012 in hookloop.testing.ResumeConformance) while the weights were bit-identical.
    def loaders():
        def one(shuffle):
            return DataLoader(AugmentedData(), batch_size=BATCH, shuffle=shuffle, num_workers=2,
                              persistent_workers=True, multiprocessing_context="fork")
        return one(True), one(False)

    torch.manual_seed(11)
    straight = Validated()
    fit(tmp_path / "a", straight, *loaders(), max_epochs=EPOCHS, num_sanity_val_steps=0)
    torch.manual_seed(11)
    first = Validated()
    fit(tmp_path / "b", first, *loaders(), max_steps=10, num_sanity_val_steps=0)
    torch.manual_seed(999)
    resumed = Validated(seed=3)
    last = tmp_path / "b" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    fit(tmp_path / "b", resumed, *loaders(), ckpt_path=last, max_epochs=EPOCHS, num_sanity_val_steps=0)
    per_epoch = N // BATCH
    assert len(straight.val_seen) == EPOCHS * per_epoch
    assert resumed.val_seen[-(EPOCHS - 1) * per_epoch:] == straight.val_seen[per_epoch:]
    assert not multiprocessing.active_children()


def test_done_batches_are_skipped_by_index_and_never_read(tmp_path):
    def make_loader():
        return DataLoader(AugmentedData(), batch_size=BATCH, shuffle=True)

    straight, resumed, loader, _ = stopped_and_resumed(tmp_path, make_loader)
    assert_same_run(straight, resumed)
    # the 7 remaining batches of epoch 1 and the 10 of epoch 2; not the 3 done ones
    assert loader.dataset.reads == (EPOCHS * N // BATCH - STOP) * BATCH == 68


def test_a_loaders_own_generator_resumes_where_it_stood(tmp_path):
    # the loader's generator (not torch's global one) draws the shuffle of every epoch: the
    # epochs after the resumed one must continue from where it stood at the checkpoint
    def make_loader():
        return DataLoader(AugmentedData(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5))

    straight, resumed, _, _ = stopped_and_resumed(tmp_path, make_loader)
    assert_same_run(straight, resumed)


class Stream(IterableDataset):
    """An endless stream cut into epochs of ``N`` samples: the epoch after the first
    continues where it stopped, so reading it again from a fresh stream gives other
    samples. Sample i is (i, a noise drawn from i)."""

    def __init__(self):
        self.next, self.end = 0, None

    def __iter__(self):
        if self.end is None or self.next >= self.end:
            self.end = self.next + N
        while self.next < self.end:
            i = self.next
            self.next += 1
            yield torch.tensor(i), torch.rand(1, generator=torch.Generator().manual_seed(i))


class StatefulLoader(DataLoader):
    """A loader with torchdata's StatefulDataLoader contract over the stream."""

    def state_dict(self):
        return {"next": self.dataset.next, "end": self.dataset.end}

    def load_state_dict(self, state):
        self.dataset.next, self.dataset.end = state["next"], state["end"]


def test_a_stateful_loader_is_restored_from_its_state(tmp_path):
    def make_loader():
        return StatefulLoader(Stream(), batch_size=BATCH)

    straight, resumed, loader, _ = stopped_and_resumed(tmp_path, make_loader)
    assert_same_run(straight, resumed)
    last = tmp_path / "b" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    # saved after step 13 (samples 48-51), before the loop read the next batch ahead
    assert hookloop.safe_load(last)["loader_per_rank"] == [{"state_dict": {"next": 52, "end": 80}}]
    assert loader.dataset.next == EPOCHS * N


def test_a_plain_iterable_dataset_warns_once_that_it_cannot_resume_exactly(tmp_path):
    def make_loader():
        return DataLoader(Stream(), batch_size=BATCH)

    with pytest.warns(UserWarning, match=r"resuming mid-epoch \(batch 3\) with an IterableDataset that has no "
                                         r"state_dict\(\)/load_state_dict\(\).*cannot resume exactly") as caught:
        straight, resumed, _, _ = stopped_and_resumed(tmp_path, make_loader)
    assert sum("resuming mid-epoch" in str(w.message) for w in caught) == 1
    # it read the done batches again from a fresh stream: samples 0-11 discarded, 12-15 trained
    assert resumed.seen[0][0] == [12, 13, 14, 15] != straight.seen[STOP][0] == [52, 53, 54, 55]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(tmp_path / "c", Recorder(), make_loader(), max_epochs=1)  # no resume: no warning


@pytest.mark.full  # three 2-process jobs (~2 min on 2 cores)
def test_under_ddp_each_rank_resumes_its_shard_with_its_workers_draws(tmp_path):
    # DistributedSampler (seed + epoch) draws nothing; what the persistent workers draw
    # used to start again from a new base seed at the resume.
    import json

    from conftest import REPO, finish_job, start_hookloop_run

    script = REPO / "tests" / "scripts" / "resume_loader_job.py"

    def start(out, *args):
        out.mkdir()
        return start_hookloop_run(["--plugins", "ddp", "--devices", 2, script, out, *args], out)

    straight, stopped = start(tmp_path / "a", "--epochs", 2), start(tmp_path / "b", "--epochs", 2, "--steps", 7)
    finish_job(straight, 180), finish_job(stopped, 180)
    last = tmp_path / "b" / "root" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    finish_job(start(tmp_path / "c", "--epochs", 2, "--ckpt", last), 180)
    for rank in (0, 1):
        a = json.loads((tmp_path / "a" / f"seen_{rank}.json").read_text())
        b = json.loads((tmp_path / "b" / f"seen_{rank}.json").read_text())
        c = json.loads((tmp_path / "c" / f"seen_{rank}.json").read_text())
        assert len(a["seen"]) == 10 and b["seen"] == a["seen"][:7]  # 5 batches per rank and epoch
        assert c["seen"] == a["seen"][7:], f"rank {rank}"
        assert c["weights"] == a["weights"]


# -- torchdata's StatefulDataLoader (issue 37) ----------------------------------------------


class GeneratorAugmented(Dataset):
    """Sample i is (i, an augmentation drawn from a generator the dataset holds and saves):
    what a StatefulDataLoader gives back to each worker (docs/how-to/streaming-data.md)."""

    def __init__(self, n: int = N):
        self.n, self.generator = n, None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.generator is None:
            info = torch.utils.data.get_worker_info()
            self.generator = torch.Generator().manual_seed(info.seed if info else 0)
        return torch.tensor(i), torch.rand(1, generator=self.generator)

    def state_dict(self):
        return {"generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state):
        if state["generator"] is not None:
            self.generator = torch.Generator()
            self.generator.set_state(state["generator"])


def _plain_loader():
    return DataLoader(GeneratorAugmented(), batch_size=BATCH, shuffle=True, num_workers=2,
                      persistent_workers=True, multiprocessing_context="fork")


def test_stateful_dataloader_true_runs_as_a_hand_built_StatefulDataLoader(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(11)
    by_hand = Recorder()
    fit(tmp_path / "a", by_hand, StatefulDataLoader(GeneratorAugmented(), batch_size=BATCH, shuffle=True, num_workers=2,
                                                    persistent_workers=True, multiprocessing_context="fork"),
        max_epochs=2)
    torch.manual_seed(11)
    built = Recorder()
    loader = _plain_loader()
    trainer = fit(tmp_path / "b", built, loader, max_epochs=2, stateful_dataloader=True)
    assert type(trainer.state.fit_train_loader).__name__ == "StatefulDataLoader"
    assert type(loader) is DataLoader  # the user's loader is not changed
    assert len(built.seen) == 2 * N // BATCH
    assert built.seen == by_hand.seen
    for (name, a), b in zip(by_hand.state_dict().items(), built.state_dict().values()):
        assert torch.equal(a, b), name


def test_stateful_dataloader_true_resumes_mid_epoch_exactly(tmp_path):
    torch.manual_seed(11)
    straight = Recorder()
    trainer = fit(tmp_path / "a", straight, _plain_loader(), max_epochs=EPOCHS, stateful_dataloader=True)
    # the persistent workers of the loader hookloop built ended with fit
    assert trainer.state.fit_train_loader is not None and trainer.state.fit_train_loader._iterator is None
    torch.manual_seed(11)
    first = Recorder()
    fit(tmp_path / "b", first, _plain_loader(), max_steps=STOP, stateful_dataloader=True)
    torch.manual_seed(999)
    resumed = Recorder(seed=3)
    last = tmp_path / "b" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    fit(tmp_path / "b", resumed, _plain_loader(), ckpt_path=last, max_epochs=EPOCHS, stateful_dataloader=True)
    assert_same_run(straight, resumed)


class _SaveAtEpochEnd(hookloop.Callback):
    """Writes a checkpoint in ``on_train_epoch_end`` of epoch 0: the loader's iterator is
    exhausted then (torchdata's state says ``_iterator_finished``)."""

    def __init__(self, path):
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def test_a_stateful_dataloader_resumed_from_an_epochs_end_reads_no_extra_epoch(tmp_path):
    # A StatefulDataLoader state taken after its iterator was exhausted starts the next
    # epoch at its next iter(); hookloop used to read that iter() away as the epoch's
    # "empty rest": a whole extra epoch, the workers' generators one epoch ahead (the
    # full tier's save/accumulation kill points under ddp/fsdp, issue 37)
    torch.manual_seed(11)
    straight = Recorder()
    saved = tmp_path / "epoch0.ckpt"
    fit(tmp_path / "a", straight, _plain_loader(), max_epochs=EPOCHS, stateful_dataloader=True,
        callbacks=[_SaveAtEpochEnd(saved)])
    assert hookloop.safe_load(saved)["loader_per_rank"][0]["state_dict"]["_iterator_finished"] is True
    torch.manual_seed(999)
    resumed = Recorder(seed=3)
    fit(tmp_path / "b", resumed, _plain_loader(), ckpt_path=saved, max_epochs=EPOCHS, stateful_dataloader=True)
    assert_same_run(straight, resumed, stop=N // BATCH)


def test_stateful_dataloader_true_without_torchdata_names_pip_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)  # import fails as if not installed
    with pytest.raises(hookloop.ConfigurationError, match="pip install torchdata"):
        fit(tmp_path, Recorder(), _plain_loader(), max_epochs=1, stateful_dataloader=True)


def _docs_example(name: str) -> dict:
    """Run the code block of docs/how-to/streaming-data.md that defines ``name``."""
    import re
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "how-to" / "streaming-data.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if f"class {name}(" in b)
    namespace: dict = {}
    exec(compile(block, "docs/how-to/streaming-data.md", "exec"), namespace)
    return namespace


class StreamRecorder(Recorder):
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((x.flatten().tolist(), y.tolist()))
        return ((self.net(x / N).flatten() - y.float()) ** 2).mean()


def test_the_docs_stateful_iterable_dataset_resumes_exactly(tmp_path):
    docs = _docs_example("CountingStream")
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make_loader():
        return StatefulDataLoader(docs["CountingStream"](N), batch_size=BATCH, num_workers=2,
                                  persistent_workers=True, multiprocessing_context="fork")

    assert isinstance(docs["loader"], StatefulDataLoader)  # the page's own loader line ran
    torch.manual_seed(11)
    straight = StreamRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "a", straight, make_loader(), max_epochs=EPOCHS)
        torch.manual_seed(11)
        fit(tmp_path / "b", StreamRecorder(), make_loader(), max_steps=STOP)
        resumed = StreamRecorder(seed=3)
        last = tmp_path / "b" / "logs" / "version_0" / "checkpoints" / "last.ckpt"
        fit(tmp_path / "b", resumed, make_loader(), ckpt_path=last, max_epochs=EPOCHS)
    # a stateful stream resumes from its state, without the read-again warning
    assert not [w for w in caught if "resuming mid-epoch" in str(w.message)]
    assert sorted(i for x, _ in straight.seen[:N // BATCH] for i in x) == list(range(N))  # every sample once an epoch
    assert_same_run(straight, resumed)


class _BatchesFrom(torch.utils.data.Sampler):
    """Batches of BATCH consecutive indices, from batch ``start`` on."""

    def __init__(self):
        self.start = 0

    def __len__(self):
        return N // BATCH

    def __iter__(self):
        for b in range(self.start, N // BATCH):
            yield list(range(b * BATCH, (b + 1) * BATCH))


class GeneratorLoader(DataLoader):
    """As LitData's StreamingDataLoader: ``__iter__`` is a generator function (nothing of it
    runs at ``iter()``), ``DataLoader.__iter__`` inside draws the base seed from the global
    generator at the first ``next()``, and ``state_dict``/``load_state_dict`` resume it."""

    def __init__(self):
        super().__init__(AugmentedData(), batch_sampler=_BatchesFrom())
        self.done, self.restore = 0, False

    def __iter__(self):
        start, self.restore = (self.done if self.restore else 0), False
        self.done = self.batch_sampler.start = start
        for batch in super().__iter__():
            self.done += 1
            yield batch

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done, self.restore = state["done"], True


def test_a_stateful_loader_whose_iter_is_a_generator_resumes_with_the_uninterrupted_draws(tmp_path):
    """The base seed a lazily started loader draws comes from the epoch's RNG state after a
    resume too, not from the checkpoint's (which shifted every later draw: LitData)."""
    straight, resumed, _, _ = stopped_and_resumed(tmp_path, GeneratorLoader)
    assert_same_run(straight, resumed)


def _litdata_collate(samples):
    return (torch.tensor([int(s["index"]) for s in samples]),
            torch.tensor([[float(s["x"][0])] for s in samples]))


@pytest.mark.full  # ~30 s (litdata.optimize); the full tier's LitData certificates too
def test_litdata_resumed_at_an_epochs_end_trains_the_next_epoch_not_the_one_after(tmp_path):
    """LitData, given a state taken after the epoch's last batch, starts the next epoch at
    its next iter() (torchdata yields the empty rest first): hookloop must not read it as
    an empty rest, which lost the whole next epoch. Check tier: litdata.optimize starts a
    process to write the directory."""
    pytest.importorskip("litdata")
    from litdata import StreamingDataLoader, StreamingDataset

    from hookloop.testing.streaming import write_litdata

    directory = write_litdata(tmp_path / "lit", N)

    def make_loader():
        return StreamingDataLoader(StreamingDataset(input_dir=directory, shuffle=True, seed=7, drop_last=True),
                                   batch_size=BATCH, collate_fn=_litdata_collate)

    straight, resumed, _, _ = stopped_and_resumed(tmp_path, make_loader, stop=N // BATCH)
    assert_same_run(straight, resumed, stop=N // BATCH)
