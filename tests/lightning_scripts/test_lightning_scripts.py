"""Lightning's own scripts, docs example and tests, run with imports changed only.

Each case runs under pytorch-lightning 2.6.6 (the reference) and under hookloop, from the
same vendored file with its imports rewritten (rewrite.py), seeds equal; what the Trainer
computed (callback_metrics, global_step, current_epoch, a checksum of the weights, after
each fit/validate/test/predict) must agree to 2e-3 or be a `Documented` difference.

``make test`` covers the fast cases in one process, against Lightning's numbers as stored
by ``make oracle`` (``expected/``, with the digest of what they depend on: a changed case
or harness without ``make oracle`` fails, naming it). ``make test-full`` adds the ddp runs
(2 processes, gloo) and the slow cases, and runs Lightning again for every case: where a
stored reference exists, Lightning's fresh numbers must equal it. The whole table,
blocked cases included: ``python -m tests.lightning_scripts.table``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the harness is `tests.lightning_scripts`

from tests.lightning_scripts.cases import CASES, NOT_YET, VENDOR  # noqa: E402
from tests.lightning_scripts.rewrite import lightning_imports, namespace, rewrite  # noqa: E402
from tests.lightning_scripts.table import (differences, reference_path, run_mode, run_reference,  # noqa: E402
                                           stored_reference)
from tiers import at_least  # noqa: E402

FULL = at_least("full")
RUNNABLE = [c for c in CASES if not c.blocked]


def _param(case, mode):
    # a launch of the case under hookloop (and, in the full tier, under Lightning)
    marks = [pytest.mark.slow if case.fast and mode == "1p" else pytest.mark.full]
    reason = NOT_YET.get(f"{case.name}/{mode}", NOT_YET.get(case.name))
    if reason:
        marks.append(pytest.mark.xfail(strict=True, reason=f"not yet: {reason}"))
    return pytest.param(case, mode, id=f"{case.name}-{mode}", marks=marks)


@pytest.mark.parametrize("path", sorted(p.relative_to(VENDOR).as_posix() for p in VENDOR.rglob("*.py")))
@pytest.mark.parametrize("framework", ["lightning", "hookloop"])
def test_rewriting_changes_import_statements_only(path, framework):
    source = (VENDOR / path).read_text()
    new = rewrite(source, framework)
    ast.parse(new)
    old_lines, new_lines = source.splitlines(), new.splitlines()
    assert len(old_lines) == len(new_lines)
    import_lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            import_lines.update(range(node.lineno - 1, node.end_lineno))
    changed = {i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b}
    assert changed <= import_lines
    left = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in lightning_imports(new)]
    if framework == "hookloop":
        assert left == []
    else:
        assert all(m.split(".")[0] in ("pytorch_lightning", "lightning_fabric") for m in left)


def test_rewritten_names_are_hookloops_and_missing_ones_fail_loudly():
    import hookloop
    import hookloop.contract.types

    ns: dict = {}
    exec(rewrite("import lightning as L\nfrom lightning.pytorch import LightningModule, callbacks\n"
                 "from lightning.pytorch.callbacks.early_stopping import EarlyStopping\n", "hookloop"), ns)
    assert ns["LightningModule"] is hookloop.Module
    assert ns["L"].Trainer is hookloop.Trainer
    assert ns["L"].pytorch.callbacks.EarlyStopping is hookloop.EarlyStopping is ns["EarlyStopping"]
    assert ns["callbacks"].ModelCheckpoint is hookloop.ModelCheckpoint
    # the annotation aliases Lightning's BoringModel imports (`-> STEP_OUTPUT`)
    exec(rewrite("from lightning.pytorch.utilities.types import STEP_OUTPUT, OptimizerLRScheduler\n", "hookloop"), ns)
    assert ns["STEP_OUTPUT"] is hookloop.contract.types.STEP_OUTPUT
    # the averaging callbacks are the averaging plugin's classes (hookloop-averaging)
    import hookloop_averaging

    exec(rewrite("from lightning.pytorch.callbacks import StochasticWeightAveraging\n", "hookloop"), ns)
    assert ns["StochasticWeightAveraging"] is hookloop_averaging.SWA
    with pytest.raises(ImportError, match="ThroughputMonitor"):
        exec(rewrite("from lightning.pytorch.callbacks import ThroughputMonitor\n", "hookloop"), {})
    # a name hookloop has gained resolves (issue 22's Tuner); one it lacks fails loudly
    assert namespace("lightning.pytorch").tuner.Tuner is hookloop.Tuner
    with pytest.raises(AttributeError, match="lightning.pytorch.loops"):
        namespace("lightning.pytorch").loops.FitLoop  # noqa: B018


def test_reference_rewrite_reaches_pytorch_lightning():
    import pytorch_lightning as pl

    ns: dict = {}
    exec(rewrite("import lightning as L\nimport lightning.pytorch as lp\n"
                 "from lightning.fabric.utilities.imports import _IS_WINDOWS\n", "lightning"), ns)
    assert ns["L"] is pl and ns["lp"] is pl and ns["_IS_WINDOWS"] is False


@pytest.mark.parametrize(("case", "mode"), [_param(c, "1p") for c in RUNNABLE]
                         + [_param(c, "ddp") for c in RUNNABLE if c.ddp in ("env", "args")])
def test_case_gives_lightnings_numbers(case, mode, tmp_path):
    ddp = mode == "ddp"
    if FULL:
        reference = run_reference(case, tmp_path, ddp)
        if reference_path(case, mode).is_file():
            stored = stored_reference(case, ddp)
            moved = differences(stored["ranks"][0] or {}, reference["ranks"][0] or {})
            assert not moved and (stored["ranks"][0] is None) == (reference["ranks"][0] is None), (
                f"Lightning's numbers for {case.name} ({mode}) moved since `make oracle` stored them: {moved}")
    else:
        reference = stored_reference(case, ddp)
    result, status = run_mode(case, tmp_path, ddp=ddp, reference=reference)
    assert status.startswith(("matches", "documented difference")), f"{case.source} ({mode}): {status}"


EARLY_STOPPING = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping


class Scripted(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def on_train_epoch_end(self):
        self.log("scripted", [5.0, 4.8, 4.0, 3.9, 3.8, 3.0][self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run(root, *args, **kwargs):
    loader = DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)
    trainer = Trainer(default_root_dir=root, max_epochs=6, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[EarlyStopping(*args, **kwargs)])
    trainer.fit(Scripted(), loader)
    return trainer.current_epoch
'''


@pytest.mark.parametrize("framework", ["lightning", "hookloop"])
def test_early_stopping_takes_lightnings_arguments(framework, tmp_path):
    """EarlyStopping(monitor, min_delta, patience, verbose, mode, strict, ...) in Lightning's
    order: positional min_delta, ``verbose``, and ``strict=False`` (a missing monitor skips
    the check). Lightning 2.6.6's epochs, hand-checked: 5.0 -> 4.8 improves by less than
    min_delta 0.5, so patience 1 stops after epoch 1 (current_epoch 2)."""
    ns: dict = {}
    exec(rewrite(EARLY_STOPPING, framework), ns)
    assert ns["run"](tmp_path / "a", "scripted", 0.5, 1, True) == 2
    assert ns["run"](tmp_path / "b", monitor="scripted", min_delta=0.15, patience=1) == 4  # 4.0 -> 3.9
    assert ns["run"](tmp_path / "c", monitor="absent", strict=False, verbose=False) == 6


STEP_ARGS = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer

seen = []


class StarArgs(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, *args):
        seen.append(("validation", len(args)))

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        seen.append(("test", dataloader_idx))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run(root):
    loader = lambda: DataLoader(TensorDataset(torch.ones(2, 2)), batch_size=2)  # noqa: E731
    trainer = Trainer(default_root_dir=root, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, num_sanity_val_steps=0)
    model = StarArgs()
    trainer.fit(model, loader(), loader())
    trainer.validate(model, [loader(), loader()])
    trainer.test(model, loader())
    trainer.test(model, [loader(), loader()])
    return seen
'''


@pytest.mark.parametrize("framework", ["lightning", "hookloop"])
def test_step_gets_dataloader_idx_only_with_several_loaders(framework, tmp_path):
    """Lightning calls an evaluation step with ``dataloader_idx`` only when there are several
    loaders: ``validation_step(self, *args)`` gets 2 arguments from one loader (Lightning's
    test_should_stop_mid_epoch relies on it), 3 from two."""
    ns: dict = {}
    exec(rewrite(STEP_ARGS, framework), ns)
    assert ns["run"](tmp_path) == [("validation", 2), ("validation", 3), ("validation", 3),
                                   ("test", 0), ("test", 0), ("test", 1)]
