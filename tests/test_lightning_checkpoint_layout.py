"""Issue 35: where ModelCheckpoint writes when the run has no logger, and the arguments it
refuses, compared with pytorch-lightning 2.6.6 running the same module code in the same
test (docs/decisions.md, "A run without a logger").
"""

from __future__ import annotations

import datetime
import sys
import warnings
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

import hookloop
from test_lightning_checkpoint_compat import FRAMEWORKS, _fit, _scored
from test_lightning_semantics import _data

sys.path.insert(0, str(Path(__file__).resolve().parent / "oracle"))
import frameworks  # noqa: E402


def _tree(root: Path) -> list[str]:
    """Every file and folder under ``root``, relative to it."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def _both(tmp_path, run) -> dict[str, list[str]]:
    """``run(fw, root)`` under each framework, in its own root; the trees they leave."""
    trees = {}
    for name in FRAMEWORKS:
        root = tmp_path / name
        root.mkdir()
        run(frameworks.load(name), root)
        trees[name] = _tree(root)
    return trees


def test_without_a_logger_checkpoints_go_to_default_root_dir_checkpoints(tmp_path):
    """``logger=False``: the checkpoint directory is ``default_root_dir/checkpoints``
    (Lightning's ``__resolve_ckpt_dir``), ``trainer.log_dir`` is ``default_root_dir``, and
    nothing else is written: no ``logs/version_N``, no resume ``last.ckpt``."""
    seen = {}

    def run(fw, root):
        ckpt = fw.ModelCheckpoint(monitor="score", filename="{epoch}", save_top_k=-1)
        trainer = _fit(fw, root, [0.5, 0.3], [ckpt], max_epochs=2)
        seen[fw.name] = (ckpt.dirpath == str(root / "checkpoints"), Path(trainer.log_dir) == root)

    trees = _both(tmp_path, run)
    assert trees["hookloop"] == trees["lightning"] == ["checkpoints", "checkpoints/epoch=0.ckpt",
                                                       "checkpoints/epoch=1.ckpt"]
    assert seen["hookloop"] == seen["lightning"] == (True, True)


def test_without_a_logger_dirpath_holds_only_what_lightning_writes(tmp_path):
    """``dirpath == default_root_dir`` (Lightning's tests do this): only the files named by
    ``filename``, and ``save_last=True``'s ``last.ckpt`` without a ``last.prev.ckpt``."""
    def run(fw, root):
        _fit(fw, root, [0.5, 0.3, 0.4], [fw.ModelCheckpoint(dirpath=str(root), filename="{epoch}", every_n_epochs=2,
                                                           save_top_k=-1)], max_epochs=3)

    trees = _both(tmp_path, run)
    assert trees["hookloop"] == trees["lightning"] == ["epoch=1.ckpt"]

    def run_last(fw, root):
        ckpt = fw.ModelCheckpoint(filename="{step}", monitor="step", mode="max", save_last=True, save_top_k=2,
                                  every_n_train_steps=1)
        _fit(fw, root, [0.5], [ckpt], max_epochs=1)

    (tmp_path / "last").mkdir()
    trees = _both(tmp_path / "last", run_last)
    assert trees["hookloop"] == trees["lightning"] == ["checkpoints", "checkpoints/last.ckpt",
                                                       "checkpoints/step=4.ckpt", "checkpoints/step=5.ckpt"]


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"save_top_k": -3}, r"Invalid value for save_top_k=-3. Must be >= -1"),
    ({"every_n_epochs": -3}, r"Invalid value for every_n_epochs=-3. Must be >= 0"),
    ({"every_n_train_steps": -3}, r"Invalid value for every_n_train_steps=-3. Must be >= 0"),
    ({"mode": "up"}, r"`mode` can be min, max but got up"),
    ({"every_n_train_steps": 1, "every_n_epochs": 2}, r"Combination of parameters every_n_train_steps=1, "
                                                      r"every_n_epochs=2 and train_time_interval=None should be"),
    ({"train_time_interval": datetime.timedelta(minutes=1), "every_n_train_steps": 2},
     r"Combination of parameters every_n_train_steps=2"),
])
def test_bad_arguments_are_refused_in_lightnings_words(kwargs, words):
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        with pytest.raises(Exception, match=words) as raised:
            fw.ModelCheckpoint(**kwargs)
        assert type(raised.value).__name__ in ("MisconfigurationException", "ConfigurationError"), name


def test_zero_means_not_by_steps_or_epochs_as_in_lightning():
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        fw.ModelCheckpoint(every_n_train_steps=0)
        fw.ModelCheckpoint(every_n_epochs=0)
        fw.ModelCheckpoint(every_n_train_steps=0, every_n_epochs=0, train_time_interval=datetime.timedelta(minutes=1))


def test_a_checkpoint_callback_with_checkpointing_off_is_refused():
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        trainer = fw.pl.Trainer if name == "lightning" else fw.hl.Trainer
        with pytest.raises(Exception, match="`enable_checkpointing=False` but found `ModelCheckpoint`"):
            trainer(enable_checkpointing=False, callbacks=[fw.ModelCheckpoint(monitor="foo")], logger=False)


def test_a_filename_naming_a_metric_not_logged_writes_0(tmp_path):
    """Lightning formats a name that was not logged as 0; hookloop does too, and warns."""
    caught = []

    def run(fw, root):
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            _fit(fw, root, [0.5], [fw.ModelCheckpoint(dirpath=str(root), monitor="score", filename="{val_acc:.2f}")],
                 max_epochs=1)
        caught.extend(str(w.message) for w in found if fw.name == "hookloop")

    trees = _both(tmp_path, run)
    assert trees["hookloop"] == trees["lightning"] == ["val_acc=0.00.ckpt"]
    assert any("names 'val_acc', which was not logged" in m for m in caught), caught


def test_a_subclass_file_extension_names_the_files(tmp_path):
    def run(fw, root):
        class Ext(fw.ModelCheckpoint):
            FILE_EXTENSION = ".tpkc"

        _fit(fw, root, [0.5], [Ext(dirpath=str(root), monitor="score", save_last=True)], max_epochs=1)

    trees = _both(tmp_path, run)
    assert trees["hookloop"] == trees["lightning"] == ["epoch=0-step=5.tpkc", "last.tpkc"]


def test_train_time_interval_saves_when_the_time_is_up(tmp_path):
    """An interval of zero is up after every batch: a checkpoint per optimizer step."""
    def run(fw, root):
        _fit(fw, root, [0.5, 0.4], [fw.ModelCheckpoint(dirpath=str(root), save_top_k=-1,
                                                      train_time_interval=datetime.timedelta(0))], max_epochs=2)

    trees = _both(tmp_path, run)
    assert trees["hookloop"] == trees["lightning"]
    assert trees["hookloop"] == sorted(f"epoch={(s - 1) // 5}-step={s}.ckpt" for s in range(1, 11))


def test_without_a_logger_ckpt_path_last_resumes_from_dirpaths_last(tmp_path):
    """``save_last=True`` into a ``dirpath``: ``ckpt_path="last"`` resumes from it, as
    Lightning's (which looks in the checkpoint callback's directory)."""
    steps = {}
    for name in FRAMEWORKS:
        fw, root = frameworks.load(name), tmp_path / name
        _fit(fw, root, [0.5], [fw.ModelCheckpoint(dirpath=str(root / "ck"), save_last=True)], max_epochs=1)
        trainer = _fit(fw, root, [0.5, 0.4], [fw.ModelCheckpoint(dirpath=str(root / "ck"), save_last=True)],
                       max_epochs=2, ckpt_path="last")
        steps[name] = (trainer.global_step, trainer.current_epoch)
    assert steps["hookloop"] == steps["lightning"] == (10, 2)


def test_with_a_logger_last_ckpt_is_a_copy_and_the_resume_file_is_kept(tmp_path):
    """Pins the documented difference in save counts (docs/decisions.md, "A run without a
    logger"): with a logger, dirpath's last.ckpt is a copy of the top-k file saved with it
    (one serialisation), and the run directory keeps its own resume last.ckpt."""
    ckpt = hookloop.ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="score", save_last=True)
    trainer = hookloop.Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, max_epochs=1,
                               num_sanity_val_steps=0, callbacks=[ckpt])  # the default logger
    trainer.fit(_scored(frameworks.load("hookloop"), [0.5]), DataLoader(_data(20), batch_size=4),
                DataLoader(_data(8, seed=2), batch_size=4))
    assert (tmp_path / "ck" / "last.ckpt").read_bytes() == Path(ckpt.best_model_path).read_bytes()
    assert (Path(trainer.log_dir) / "checkpoints" / "last.ckpt").is_file()
    assert Path(trainer.log_dir).parent == tmp_path / "logs"
