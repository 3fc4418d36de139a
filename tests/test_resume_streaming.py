"""hookloop.testing.ResumeConformance with stateful and streaming training loaders
(issue 37, item 1): torchdata's StatefulDataLoader (built by hand, and by
``Trainer(stateful_dataloader=True)`` from a plain DataLoader), a Hugging Face ``datasets``
IterableDataset streamed from local parquet files and split with ``split_dataset_by_node``,
and LitData's StreamingDataset over a local "remote" directory; each under ddp and fsdp,
world size 2, ``num_workers=2`` (persistent), SIGKILLed mid-epoch and resumed by torch's
elastic agent, must end bit-identical (weights, optimizer state, schedulers, metrics.csv)
to the uninterrupted run. What each loader restores: docs/how-to/streaming-data.md.

``make test`` runs one certificate per loader library (the step kill, the mid-epoch one):
StatefulDataLoader under ddp, Hugging Face streaming under fsdp; LitData in the full tier
(CI time).
The ``full`` tier runs each loader under ddp and fsdp at every kill point (seed 2 only:
the seeds move the kill points within their categories; 8 jobs of 60-120 s on 2 cores).
"""

import os
from pathlib import Path

import pytest
import torch

import hookloop
from hookloop.testing import ResumeConformance
from hookloop.testing.processes import run_processes

FULL = pytest.mark.full

class _StepKill(ResumeConformance):
    kinds = ("step",)  # the kill mid-epoch, where the loader's own state is what resumes
    full_seeds = (2,)

@pytest.mark.slow
class TestStatefulDDP(_StepKill):
    plugin = "ddp"
    loader = "stateful"

@pytest.mark.slow
class TestHFStreamingFSDP(_StepKill):
    plugin = "fsdp"
    loader = "hf_streaming"
    # datasets 5.2 with persistent workers: the epochs after a mid-epoch resume are cut
    # to what was left of the resumed one (huggingface/datasets#7447): not exact
    persistent_workers = False

@pytest.mark.full  # CI time: LitData is certified in the full tier (here and TestAllLitdata*)
class TestLitDataDDP(_StepKill):
    # LitData's StreamingDataLoader.__iter__ is a generator function: the torch iterator
    # inside draws its base seed at the first next(), which after a resume came after the
    # checkpoint's RNG state was back and shifted dropout; hookloop draws it from the
    # epoch's RNG state (hookloop.resume.loader_state.started)
    plugin = "ddp"
    loader = "litdata"

# -- the full matrix: every loader x {ddp, fsdp}, every kill point -------------------------
# The StatefulDataLoader kinds pass at every kill point, the save and accumulation ones
# (resumes from a checkpoint written at an epoch's end, the loader's iterator exhausted)
# included: tests/test_resume_loader.py guards that resume on one process.

def _full(plugin: str, loader: str) -> type:
    return FULL(type(f"TestAll{loader.title().replace('_', '')}{plugin.upper()}", (ResumeConformance,),
                     {"plugin": plugin, "loader": loader, "__module__": __name__, "full_seeds": (2,),
                      "persistent_workers": loader != "hf_streaming"}))

for _plugin in ("ddp", "fsdp"):
    for _loader in ("stateful", "stateful_trainer", "hf_streaming", "litdata"):
        _cls = _full(_plugin, _loader)
        globals()[_cls.__name__] = _cls


@FULL
class TestWorkerGeneratorIsNotRestored(_StepKill):
    """The documented limit: augmentation drawn from a StatefulDataLoader worker's global
    generator (torch.randn in __getitem__) is not restored by torchdata, so the resumed
    run differs; the certificate's comparison catches it."""

    plugin = "ddp"
    loader = "stateful_worker_rng"

    def test_final_weights_are_bit_identical(self, runs):
        with pytest.raises(AssertionError, match="weights differ from the uninterrupted run's"):
            super().test_final_weights_are_bit_identical(runs)

    def test_optimizer_and_scheduler_states_are_bit_identical(self, runs):
        with pytest.raises(AssertionError, match="differ"):
            super().test_optimizer_and_scheduler_states_are_bit_identical(runs)

    def test_logged_metrics_are_identical(self, runs):
        with pytest.raises(AssertionError, match="metrics.csv differs"):
            super().test_logged_metrics_are_identical(runs)


# -- one share per rank (issue 37, item 1: "each sharded by data-parallel rank") ----------------


class _Tiny(hookloop.Module):
    def __init__(self, make_loader):
        super().__init__()
        self.net = torch.nn.Linear(8, 3)
        self.seen: list[int] = []
        self.make_loader = make_loader

    def train_dataloader(self):  # built in fit, once the process group is up
        return self.make_loader(self.trainer)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen += index.tolist()
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(8):
            yield torch.zeros(8), torch.tensor(i % 3), torch.tensor(i)


def _fit_outcome(root: str, make_loader) -> dict:
    """What fit under ddp did with the loader: the error it raised, or the samples this
    rank trained on and the warnings."""
    import warnings

    module = _Tiny(make_loader)
    trainer = hookloop.Trainer(plugins=["ddp"], max_epochs=1, default_root_dir=root, enable_progress_bar=False,
                               enable_checkpointing=False, logger=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module)
        except hookloop.ConfigurationError as error:
            return {"error": str(error)}
    return {"seen": module.seen, "warnings": [str(w.message) for w in caught if "split it by rank" in str(w.message)]}


def _rank_splits(root: str) -> dict:
    import datasets
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    from hookloop.testing import streaming

    rank = int(os.environ["RANK"])
    files = streaming.write_parquet(Path(root) / f"parquet.rank{rank}", 16)

    def hf(split):
        def make(trainer):
            stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
            if split is not None:
                stream = split_dataset_by_node(stream, rank=split, world_size=2)
            return StatefulDataLoader(stream, batch_size=2, collate_fn=streaming.StreamCollate(0.0))
        return make

    def litdata(trainer):
        from litdata import StreamingDataLoader, StreamingDataset

        directory = streaming.write_litdata(Path(root) / f"litdata.rank{rank}", 16)
        return StreamingDataLoader(StreamingDataset(input_dir=directory, drop_last=True), batch_size=2,
                                   collate_fn=streaming.StreamCollate(0.0))

    def built_at_start(trainer):  # what a script gets building the dataset before fit (GLOBAL_RANK unset)
        return dataset_before_fit

    from litdata import StreamingDataLoader, StreamingDataset

    dataset_before_fit = StreamingDataLoader(
        StreamingDataset(input_dir=streaming.write_litdata(Path(root) / f"litdata.rank{rank}", 16), drop_last=True),
        batch_size=2, collate_fn=streaming.StreamCollate(0.0))
    cases = {"hf_not_split": hf(None), "hf_split": hf(rank), "hf_other_rank": hf(1 - rank),
             "litdata_in_fit": litdata, "litdata_before_fit": built_at_start,
             "plain": lambda trainer: torch.utils.data.DataLoader(_Stream(), batch_size=2)}
    return {name: _fit_outcome(f"{root}/{name}{rank}", make) for name, make in cases.items()}


@pytest.mark.slow
def test_an_iterable_dataset_not_split_by_rank_is_refused_or_warned(tmp_path):
    ranks = run_processes(_rank_splits, nprocs=2, args=(str(tmp_path),), timeout=400)
    for rank, outcome in enumerate(ranks):
        # Hugging Face: not split, or split for another rank -> an error on every rank
        assert "split_dataset_by_node" in outcome["hf_not_split"]["error"]
        assert "is split for rank" in outcome["hf_other_rank"]["error"]
        # ... split for this rank: its own half of the 16 samples (the parquet rows are 0..15)
        assert "error" not in outcome["hf_split"], outcome["hf_split"]
        # LitData built in train_dataloader() (the process group is up): it splits itself
        assert "error" not in outcome["litdata_in_fit"], outcome["litdata_in_fit"]
        # LitData built before fit without GLOBAL_RANK: every rank reads as rank 0 -> refused on both
        assert "build it once the processes are up" in outcome["litdata_before_fit"]["error"]
        # anything else: trains, with the warning on rank 0 only
        assert len(outcome["plain"]["warnings"]) == (1 if rank == 0 else 0)
    for name in ("hf_split", "litdata_in_fit"):
        halves = [set(r[name]["seen"]) for r in ranks]
        assert not halves[0] & halves[1] and halves[0] | halves[1] == set(range(16)), (name, halves)
