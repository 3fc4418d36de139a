"""Lightning's own unit tests of the areas hookloop claims, as a differential oracle.

The vendored test files (vendor/, NOTICE.md) run under pytest twice, in separate
processes: under pytorch-lightning 2.6.6 as written, and with their imports rewritten to
hookloop (run.py). Every test that passes under Lightning must pass under hookloop or be
listed in status.toml with its category and reason; a listed test that passes now fails
this test too, so the list only shrinks (a fix removes its entry). Lightning's outcomes
are stored (expected/, tests/stored.py: ``make oracle``); ``make test-full`` runs
hookloop on every file and Lightning again. The table: ``python -m tests.lightning_unit.table``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the harness is `tests.lightning_unit`

from tests.lightning_scripts.rewrite import rewrite  # noqa: E402
from tests.lightning_unit import aliases  # noqa: E402
from tests.lightning_unit.run import VENDOR, run_files  # noqa: E402
from tests.lightning_unit.table import (  # noqa: E402
    CATEGORIES,
    compare,
    load_status,
    run_reference,
    stored_reference,
)
from tests.lightning_unit.vendor_tests import FILES  # noqa: E402


def test_vendored_files_are_there():
    assert all((VENDOR / f).is_file() for f in FILES)


def test_status_entries_name_a_category_a_reason_and_a_test_passing_under_lightning():
    for file, entries in load_status().items():
        assert file in FILES, f"status.toml: {file} is not a vendored test file"
        reference = stored_reference(file)
        for test, (category, reason) in entries.items():
            assert category in CATEGORIES, f"status.toml: {file}::{test}: category {category!r} not in {set(CATEGORIES)}"
            assert reason, f"status.toml: {file}::{test} gives no reason"
            assert reference.get(test, {}).get("outcome") == "passed", (
                f"status.toml: {file}::{test} does not pass under Lightning (its stored outcome: "
                f"{reference.get(test)}); remove the entry")


def test_a_name_hookloop_lacks_fails_the_test_that_uses_it_not_the_file():
    source = ("import pytest\n"
              "from lightning.pytorch.callbacks import ThroughputMonitor\n"
              "from lightning.pytorch.callbacks.early_stopping import EarlyStopping\n"
              "from lightning.pytorch.loggers.logger import DummyLogger\n"
              "REASONS = [DummyLogger.experiment]\n")
    ns: dict = {}
    exec(rewrite(source, "hookloop", missing="placeholder"), ns)  # the module imports: collection works
    import hookloop

    assert ns["EarlyStopping"] is hookloop.EarlyStopping
    with pytest.raises(ImportError, match="DummyLogger"):
        ns["REASONS"][0]()
    with pytest.raises(TypeError, match="hookloop_lacks_ThroughputMonitor"):
        with pytest.raises(ns["ThroughputMonitor"]):
            pass
    with pytest.raises(ImportError, match="ThroughputMonitor"):
        class Sub(ns["ThroughputMonitor"]):
            pass


def test_lightning_names_alias_the_installed_reference_and_go_away():
    import pytorch_lightning

    with aliases.installed():
        import lightning.pytorch.callbacks.early_stopping as es

        assert es is pytorch_lightning.callbacks.early_stopping
        assert logging.getLogger("lightning.pytorch.callbacks") is logging.getLogger("pytorch_lightning.callbacks")
    assert "lightning" not in sys.modules and "lightning.pytorch.callbacks" not in logging.root.manager.loggerDict
    with pytest.raises(ImportError):
        import lightning  # noqa: F401



def test_docs_lightning_lists_every_name_the_tests_use_with_its_status():
    """Issue 35: docs/lightning.md lists every Lightning name the vendored tests use, with
    its status as hookloop decides it now (tests/lightning_unit/names.py): regenerate with
    ``python -m tests.lightning_unit.names --write`` when a name is added or changes status."""
    from tests.lightning_unit import names

    text = names.DOC.read_text()
    assert names.BEGIN in text and names.END in text, "docs/lightning.md lost its generated names block"
    written = text[text.index(names.BEGIN):text.index(names.END) + len(names.END)]
    assert written == names.render(), (
        "docs/lightning.md's list of the names Lightning's unit tests use is out of date: "
        "run python -m tests.lightning_unit.names --write")
    used = {name for _, name in names.used_names()}
    assert {"ModelCheckpoint", "Trainer(max_epochs=)", "trainer.global_step", "log(on_step=)"} <= used


def test_the_names_status_is_hookloops_not_a_hand_written_list(tmp_path):
    """A name hookloop has is supported, a refusal is refused, a private one not claimed,
    one hookloop lacks missing; a 'not supported' row turns missing into not supported."""
    import hookloop
    from tests.lightning_unit import names

    trainer = hookloop.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    assert names.status("import", "ModelCheckpoint", trainer) == "supported"
    assert names.status("import", "CombinedLoader", trainer) == "refused"
    assert names.status("import", "_FitLoop", trainer) == "not claimed"
    assert names.status("import", "NoSuchLightningName", trainer) == "missing"
    assert names.status("import", "Strategy", trainer) == "not supported"
    assert names.status("call", "Trainer(max_epochs=)", trainer) == "supported"
    assert names.status("call", "Trainer(no_such_argument=)", trainer) == "missing"
    assert names.status("trainer", "trainer.global_step", trainer) == "supported"
    assert names.status("trainer", "trainer.no_such_attribute", trainer) == "missing"

@pytest.mark.full
@pytest.mark.parametrize("file", FILES)
def test_hookloop_fails_only_where_status_says(file, tmp_path):
    """Runs the file under hookloop (and, for the stored outcomes, under Lightning again) in
    new pytest processes: minutes per file. Without stored outcomes it fails naming `make oracle`."""
    reference = stored_reference(file)
    fresh = run_reference(file, tmp_path)
    moved = {t: (r["outcome"], fresh.get(t, {}).get("outcome")) for t, r in reference.items()
             if r["outcome"] == "passed" and fresh.get(t, {}).get("outcome") != "passed"}
    assert not moved, f"tests passing in the stored Lightning outcomes fail now (run `make oracle`?): {moved}"
    results = run_files("hookloop", [file], tmp_path / "hookloop")[file]
    row = compare(reference, results, load_status().get(file, {}))
    unlisted = {t: f"{r['outcome']}: {r['message']}" for t, r in row["unlisted"].items()}
    assert not unlisted and not row["stale"], (
        f"{file}: tests passing under Lightning that fail under hookloop without a status.toml entry: "
        f"{unlisted}; entries to remove: {row['stale']}")
