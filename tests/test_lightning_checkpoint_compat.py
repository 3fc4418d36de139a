"""Issue 35, items 5, 6, 7 and item 3's ModelCheckpoint/EarlyStopping names: what
Lightning's ModelCheckpoint does with the files of a checkpoint directory and what its
checkpoints hold, compared with pytorch-lightning 2.6.6 running the same module code in
the same test (written once against ``fw.LightningModule``, as tests/oracle does).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from test_lightning_semantics import _data, _trainer

sys.path.insert(0, str(Path(__file__).resolve().parent / "oracle"))
import frameworks  # noqa: E402

FRAMEWORKS = ("lightning", "hookloop")


def _scored(fw, scores, fail_at_step=None):
    """A module that logs ``score`` = ``scores[current_epoch]`` after each validation."""

    class Scored(fw.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            if fail_at_step is not None and self.global_step == fail_at_step:
                raise RuntimeError("the data went away")
            x, y = batch
            return F.cross_entropy(self.layer(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.layer(x), y))

        def on_validation_epoch_end(self):
            self.log("score", torch.tensor(scores[self.current_epoch]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Scored()


def _fit(fw, root, scores, callbacks, max_epochs, ckpt_path=None, fail_at_step=None):
    fw.seed_everything(0)
    trainer = _trainer(fw, str(root), max_epochs=max_epochs, callbacks=callbacks, num_sanity_val_steps=0)
    loaders = (DataLoader(_data(20), batch_size=4), DataLoader(_data(8, seed=2), batch_size=4))
    trainer.fit(_scored(fw, scores, fail_at_step), *loaders, ckpt_path=ckpt_path)
    return trainer


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def _plain(value, root: Path):
    """A checkpoint value comparable across the two runs: tensors as floats, the run's
    root directory as ``ROOT``."""
    if isinstance(value, torch.Tensor):
        return round(float(value), 6)
    if isinstance(value, str):
        return value.replace(str(root), "ROOT")
    if isinstance(value, dict):
        return {_plain(k, root): _plain(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, root) for v in value]
    return value


# -- 7. Lightning's keys in hookloop's checkpoints ---------------------------------------------


def test_checkpoints_carry_lightnings_keys_and_callback_states(tmp_path):
    """The same run's last.ckpt: every top-level key Lightning writes is there, with
    Lightning's values for epoch, global_step and each callback's state, read with
    ``weights_only=True``."""
    seen = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        root = tmp_path / name
        ckpt = fw.ModelCheckpoint(dirpath=str(root / "ckpts"), monitor="score", save_top_k=2, save_last=True)
        stopper = fw.EarlyStopping(monitor="score", patience=1)
        _fit(fw, root, [0.5, 0.3, 0.4, 0.2], [ckpt, stopper], max_epochs=4)
        checkpoint = torch.load(root / "ckpts" / "last.ckpt", weights_only=True)
        seen[name] = (checkpoint, root)
    lightning, hookloop_ = seen["lightning"][0], seen["hookloop"][0]
    assert set(lightning) <= set(hookloop_), set(lightning) - set(hookloop_)
    for key in ("epoch", "global_step", "pytorch-lightning_version"):
        assert hookloop_[key] == lightning[key], key
    assert _plain(hookloop_["callbacks"], seen["hookloop"][1]) == _plain(lightning["callbacks"], seen["lightning"][1])
    assert hookloop_["loops"] is None  # docs/decisions.md, "Lightning's checkpoint keys"


def test_state_key_state_dict_and_load_state_dict_are_lightnings(tmp_path):
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        ckpt = fw.ModelCheckpoint(dirpath=str(tmp_path / name), monitor="score", save_top_k=2)
        stopper = fw.EarlyStopping(monitor="score")
        assert ckpt.state_key == ("ModelCheckpoint{'monitor': 'score', 'mode': 'min', 'every_n_train_steps': 0, "
                                  "'every_n_epochs': 1, 'train_time_interval': None}"), name
        assert stopper.state_key == "EarlyStopping{'monitor': 'score', 'mode': 'min'}", name
        _fit(fw, tmp_path / name, [0.5, 0.3, 0.4], [ckpt, stopper], max_epochs=3)
        state = ckpt.state_dict()
        fresh = fw.ModelCheckpoint(dirpath=str(tmp_path / name), monitor="score", save_top_k=2)
        fresh.load_state_dict(state)
        assert (fresh.best_model_path, float(fresh.best_model_score), fresh.kth_best_model_path) == (
            ckpt.best_model_path, float(ckpt.best_model_score), ckpt.kth_best_model_path), name
        assert Path(ckpt.kth_best_model_path).name == "epoch=2-step=15.ckpt", name
        assert float(ckpt.current_score) == pytest.approx(0.4), name
        other = fw.EarlyStopping(monitor="score")
        other.load_state_dict(stopper.state_dict())
        assert (other.wait_count, float(other.best_score)) == (1, pytest.approx(0.3)), name


def test_dirpath_is_the_resolved_directory_after_setup(tmp_path):
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        ckpt = fw.ModelCheckpoint(monitor="score")
        assert ckpt.dirpath is None, name
        _fit(fw, tmp_path / name, [0.5], [ckpt], max_epochs=1)
        assert ckpt.dirpath is not None and Path(ckpt.dirpath).is_absolute() == Path(tmp_path).is_absolute(), name
        assert Path(ckpt.best_model_path).parent == Path(ckpt.dirpath), name
        assert Path(ckpt.dirpath).name == "checkpoints", name


def test_save_top_k_without_a_monitor_is_refused_as_in_lightning():
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        with pytest.raises(Exception, match=r"ModelCheckpoint\(save_top_k=3, monitor=None\) is not a valid"):
            fw.ModelCheckpoint(save_top_k=3, monitor=None)
        for k in (-1, 0, 1):
            fw.ModelCheckpoint(save_top_k=k, monitor=None)


# -- 5. a second run into the same dirpath ------------------------------------------------------


def test_a_second_run_into_the_same_dirpath_versions_its_files(tmp_path):
    """Lightning never writes over another run's files in a shared dirpath: the second
    run's are ``-v1`` (``last-v1.ckpt`` too), and the first run's stay as they were."""
    files, first = {}, {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        shared = tmp_path / name / "ckpts"
        for run in (1, 2):
            ckpt = fw.ModelCheckpoint(dirpath=str(shared), monitor="score", save_top_k=2, save_last=True)
            _fit(fw, tmp_path / name / f"run{run}", [0.5, 0.3], [ckpt], max_epochs=2)
            if run == 1:
                first[name] = {p.name: p.read_bytes() for p in shared.iterdir() if not p.name.startswith(".")}
        files[name] = _listing(shared)
        for file, content in first[name].items():
            assert (shared / file).read_bytes() == content, (name, file)
    assert files["hookloop"] == files["lightning"]
    assert "last-v1.ckpt" in files["hookloop"] and "epoch=1-step=10-v1.ckpt" in files["hookloop"]


# -- 6. resuming into the same dirpath ---------------------------------------------------------


def test_resuming_into_the_same_dirpath_keeps_the_checkpoint_it_resumed_from(tmp_path):
    files = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        shared = tmp_path / name / "ckpts"
        scores = [0.5, 0.3, 0.4, 0.2]
        ckpt = fw.ModelCheckpoint(dirpath=str(shared), monitor="score", save_top_k=1)
        _fit(fw, tmp_path / name / "run1", scores, [ckpt], max_epochs=2)
        resumed_from = ckpt.best_model_path
        assert Path(resumed_from).name == "epoch=1-step=10.ckpt"
        ckpt = fw.ModelCheckpoint(dirpath=str(shared), monitor="score", save_top_k=1)
        _fit(fw, tmp_path / name / "run2", scores, [ckpt], max_epochs=4, ckpt_path=resumed_from)
        # the better epoch 3 pushed it out of the top 1, and it is still there
        assert Path(ckpt.best_model_path).name == "epoch=3-step=20.ckpt", name
        assert os.path.exists(resumed_from), name
        files[name] = _listing(shared)
    assert files["hookloop"] == files["lightning"]


# -- save_on_exception, save_last="link" --------------------------------------------------------


def test_save_on_exception_saves_where_fit_failed(tmp_path):
    files = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        ckpt = fw.ModelCheckpoint(dirpath=str(tmp_path / name / "ckpts"), monitor="score", save_on_exception=True)
        with pytest.raises(RuntimeError, match="the data went away"):
            _fit(fw, tmp_path / name, [0.5, 0.3, 0.4], [ckpt], max_epochs=3, fail_at_step=7)
        files[name] = _listing(tmp_path / name / "ckpts")
        saved = torch.load(tmp_path / name / "ckpts" / "epoch=1-step=7.ckpt", weights_only=True)
        assert (saved["epoch"], saved["global_step"]) == (1, 7), name
    assert files["hookloop"] == files["lightning"] == ["epoch=0-step=5.ckpt", "epoch=1-step=7.ckpt"]


def test_save_last_link_is_a_symbolic_link_to_the_newest_checkpoint(tmp_path):
    seen = {}
    for name in FRAMEWORKS:
        fw = frameworks.load(name)
        directory = tmp_path / name / "ckpts"
        ckpt = fw.ModelCheckpoint(dirpath=str(directory), monitor="score", save_top_k=2, save_last="link")
        _fit(fw, tmp_path / name, [0.5, 0.3, 0.4], [ckpt], max_epochs=3)
        last = directory / "last.ckpt"
        assert last.is_symlink(), name
        seen[name] = (_listing(directory), os.readlink(last), Path(ckpt.last_model_path).name)
    assert seen["hookloop"] == seen["lightning"]
    assert seen["hookloop"][1] == "epoch=2-step=15.ckpt"
