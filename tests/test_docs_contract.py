"""What the docs promise plugin authors, checked against real runs (issue 20): where the
epoch's logger row is written (docs/decisions.md), what a resume does to the CSV log
(docs/how-to/observers.md), and that an extension may write the weights (docs/plugin-authors.md's example
run against a hand-written loop)."""

from __future__ import annotations

import csv
import re

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, TinyModule, tiny_data

QUIET = dict(enable_progress_bar=False, enable_model_summary=False)


def bullet(path, title: str) -> str:
    """The text of the bullet ``* **title**...`` of a docs page, on one line."""
    text = (REPO / path).read_text()
    start = text.index(f"* **{title}**")
    end = text.find("\n* ", start + 1)
    return " ".join(text[start:end if end > 0 else None].split())


# -- docs/decisions.md: the epoch's row, between the module's hook and the plugins' ---------


class EpochEndModule(TinyModule):
    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def on_train_epoch_end(self):
        self.log("module_end", 1.0)
        self.events.append("module on_train_epoch_end")


class Watcher:
    hookloop_name, hookloop_role = "watcher", "observer"

    def __init__(self, events: list):
        self.events = events

    @hookloop.hookimpl
    def on_log_metrics(self, metrics):
        if "module_end" in metrics:
            self.events.append("epoch row")

    @hookloop.hookimpl
    def on_train_epoch_end(self):
        self.events.append("plugin on_train_epoch_end")


def test_the_epoch_row_is_written_where_decisions_md_says(tmp_path):
    events: list = []
    trainer = hookloop.Trainer(plugins=[Watcher(events)], max_epochs=1, default_root_dir=str(tmp_path),
                               enable_checkpointing=False, **QUIET)
    trainer.fit(EpochEndModule(events), DataLoader(tiny_data(32), batch_size=8))
    traced = events
    assert traced == ["module on_train_epoch_end", "epoch row", "plugin on_train_epoch_end"]
    # The sentence says which: after the module's hook, and before or after the plugins'.
    text = bullet("docs/decisions.md", "An epoch's row")
    says_before = "before the plugins'" in text
    says_after = "after the module's and the plugins'" in text
    assert says_before != says_after, text
    assert "after the module's `on_train_epoch_end`" in text or says_after
    documented = ["module on_train_epoch_end", "epoch row", "plugin on_train_epoch_end"] if says_before \
        else ["module on_train_epoch_end", "plugin on_train_epoch_end", "epoch row"]
    assert documented == traced, text


# -- README.md: a ckpt_path= resume starts a new run directory -----------------------------


def rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_ckpt_path_resume_starts_a_new_run_directory_as_the_readme_says(tmp_path):
    loader = DataLoader(tiny_data(32), batch_size=8)  # 4 optimizer steps per epoch
    first = hookloop.Trainer(max_epochs=2, default_root_dir=str(tmp_path), log_every_n_steps=1, **QUIET)
    first.fit(TinyModule(), loader)
    run0 = tmp_path / "logs" / "version_0"
    before = (run0 / "metrics.csv").read_bytes()
    assert max(int(r["step"]) for r in rows(run0 / "metrics.csv")) == 8

    resumed = hookloop.Trainer(max_epochs=3, default_root_dir=str(tmp_path), log_every_n_steps=1, **QUIET)
    resumed.fit(TinyModule(), loader, ckpt_path=str(run0 / "checkpoints" / "last.ckpt"))
    # The first run's file is left as it was; the resume writes version_1 from step 9 on.
    assert (run0 / "metrics.csv").read_bytes() == before
    assert str(resumed.log_dir) == str(tmp_path / "logs" / "version_1")
    new = rows(tmp_path / "logs" / "version_1" / "metrics.csv")
    assert sorted({int(r["step"]) for r in new}) == [9, 10, 11, 12]
    assert {r["epoch"] for r in new} == {"2"}
    text = " ".join((REPO / "docs" / "how-to" / "observers.md").read_text().split())
    assert "`fit(ckpt_path=...)` starts a new run directory (`version_N+1`)" in text
    assert "a resumed run appends without duplicated or missing rows" not in text


# -- docs/plugin-authors.md: an extension may write the weights ----------------------------


def documented_ema_validation():
    text = (REPO / "docs" / "plugin-authors.md").read_text()
    assert "**An extension may write the weights**" in text
    code = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "class EMAValidation" in block)
    namespace: dict = {}
    exec(compile(code, "docs/plugin-authors.md (EMAValidation)", "exec"), namespace)
    return namespace["EMAValidation"]


class ValLosses:
    hookloop_name, hookloop_role = "val_losses", "observer"

    def __init__(self):
        self.seen: list[float] = []

    @hookloop.hookimpl
    def on_validation_end(self, trainer, metrics):
        if not trainer.sanity_checking:
            self.seen.append(metrics["val_loss"])


def test_the_documented_extension_validates_the_average_and_trains_the_weights(tmp_path):
    EMAValidation = documented_ema_validation()
    train, val = tiny_data(48), tiny_data(32, seed=2)

    # Reference: a hand-written loop keeping the average; validation on the average.
    ref = TinyModule()
    opt = ref.configure_optimizers()
    average, expected = None, []
    for _ in range(2):
        for x, y in DataLoader(train, batch_size=8):
            F.cross_entropy(ref(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            weights = [p.detach().clone() for p in ref.parameters()]
            average = weights if average is None else [0.8 * a + 0.2 * w for a, w in zip(average, weights)]
        trained = [p.detach().clone() for p in ref.parameters()]
        with torch.no_grad():
            for p, a in zip(ref.parameters(), average):
                p.copy_(a)
            expected.append(float(torch.stack([F.cross_entropy(ref(x), y) for x, y in DataLoader(val, batch_size=8)]).mean()))
            for p, t in zip(ref.parameters(), trained):
                p.copy_(t)

    module, watcher = TinyModule(), ValLosses()
    trainer = hookloop.Trainer(plugins=[EMAValidation(decay=0.8), watcher], max_epochs=2, num_sanity_val_steps=0,
                               default_root_dir=str(tmp_path), enable_checkpointing=False, logger=False, **QUIET)
    trainer.fit(module, DataLoader(train, batch_size=8), DataLoader(val, batch_size=8))
    assert len(watcher.seen) == 2
    for got, want in zip(watcher.seen, expected):
        assert abs(got - want) < 1e-6, (watcher.seen, expected)
    # the trained weights came back after each validation: training went on from them
    for p, q in zip(module.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    # and the average differs from them, so the swap was visible
    assert max(float((a - p.detach()).abs().max()) for a, p in zip(average, ref.parameters())) > 1e-3
