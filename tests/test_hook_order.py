"""docs/hooks.md's "Order of the hooks" against traced real runs.

A plugin implementing every hook records each call of a real ``fit`` (training,
validation, the sanity check, gradient accumulation, checkpoints), a resumed ``fit``,
one that raises, and ``test``/``predict``; each trace must equal the sequence the page
documents under the same scenario, so the page cannot drift from the code.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, TinyModule, tiny_data
from hookloop.contract.checks import specs
from hookloop.testing.order import FIT_ORDER, documented_fit

DOC = REPO / "docs" / "hooks.md"


def documented(scenario: str) -> list[str]:
    """The hook names of the block under ``<!-- hook-order: scenario -->`` (indentation
    and ``# comments`` are for the reader)."""
    text = DOC.read_text()
    match = re.search(rf"<!-- hook-order: {scenario} -->\s*```[a-z]*\n(.*?)```", text, re.S)
    assert match, f"docs/hooks.md has no block for {scenario!r}"
    lines = [line.split("#")[0].strip() for line in match.group(1).splitlines()]
    return [line for line in lines if line]


def make_tracer(calls: list):
    """A plugin with every hook of the contract, recording its name (and returning
    None, so the defaults and the other plugins still do the work)."""

    def recorder(name):
        def hook(self):
            calls.append(name)

        return hookloop.hookimpl(hook)

    namespace = {"hookloop_name": "tracer", "hookloop_role": "observer"}
    namespace.update({name: recorder(name) for name in specs()})
    return type("Tracer", (), namespace)()


class Hooked(TinyModule):
    """Defines configure_model (model_init_context shows) and logs with sync_dist
    (reduce shows)."""

    def configure_model(self):
        pass

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)


def run(scenario: str, tmp_path) -> list[str]:
    calls: list[str] = []
    kw = dict(max_epochs=2, accumulate_grad_batches=2, num_sanity_val_steps=1, default_root_dir=str(tmp_path))
    loaders = (DataLoader(tiny_data(16), batch_size=8), DataLoader(tiny_data(8), batch_size=8))
    if scenario == "fit":
        # The conformance kit's copy of the documented run (hookloop.testing.order).
        documented_fit([make_tracer(calls)], root=str(tmp_path))
    elif scenario == "resume":
        # traced too (into another list), so its checkpoint holds per-rank state
        hookloop.Trainer(plugins=[make_tracer([])], **{**kw, "max_epochs": 1}).fit(Hooked(), *loaders)
        hookloop.Trainer(plugins=[make_tracer(calls)], **kw).fit(Hooked(), *loaders, ckpt_path="last")
    elif scenario == "exception":
        class Fails(Hooked):
            def training_step(self, batch, batch_idx):
                if batch_idx == 1:
                    raise RuntimeError("boom")
                return super().training_step(batch, batch_idx)

        with pytest.raises(RuntimeError, match="boom"):
            hookloop.Trainer(plugins=[make_tracer(calls)], **kw).fit(Fails(), *loaders)
    elif scenario == "test":
        hookloop.Trainer(plugins=[make_tracer(calls)]).test(Hooked(), loaders[1], verbose=False)
    elif scenario == "predict":
        hookloop.Trainer(plugins=[make_tracer(calls)]).predict(Hooked(), DataLoader(tiny_data(8).tensors[0], batch_size=8))
    return calls


@pytest.mark.parametrize("scenario", ["fit", "resume", "exception", "test", "predict"])
def test_documented_hook_order_is_the_order_of_a_real_run(scenario, tmp_path):
    assert run(scenario, tmp_path) == documented(scenario)


def test_the_conformance_kit_carries_the_documented_fit_order():
    """Observers are checked against hookloop.testing.order.FIT_ORDER (the page is not
    installed with the package): it must be the page's sequence."""
    assert FIT_ORDER == documented("fit")


def test_every_hook_appears_in_the_documented_order():
    shown = set()
    for scenario in ("fit", "resume", "exception", "test", "predict"):
        shown.update(documented(scenario))
    # launch_command: called by hookloop run or the re-launch, never inside a worker;
    # barrier, broadcast: a world of one process calls no collective but reduce
    # (tests/test_lightning_ddp.py and the conformance kit run them with 2 processes);
    # configure_grad_scaler, clip_gradients: fp16 and gradient_clip_val only
    # (tests/test_no_copies.py traces them).
    # on_device_mesh: only when an enabled plugin claims a mesh dimension (hookloop.mesh);
    # describe_model: only under `hookloop plan`, instead of training (tests/test_tp.py runs it)
    assert set(specs()) - shown == {"launch_command", "barrier", "broadcast", "configure_grad_scaler", "clip_gradients",
                                    "on_device_mesh", "describe_model"}


if __name__ == "__main__":  # print the traces, to write the page
    import sys
    import tempfile
    from pathlib import Path

    for scenario in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"== {scenario}")
            print("\n".join(run(scenario, Path(tmp))))
