"""What a checkpoint is checked for on load, and what a save refuses to replace (issue 32).

* A sharded checkpoint's ``latest`` tag names an entry inside its own directory: a tag
  that leads out of it (``..``, an absolute path, a symbolic link) is refused, never
  followed into another run's checkpoint (:func:`hookloop.tag_entry`, used by every
  strategy that follows a tag).
* A checkpoint's format is checked: a newer one is refused naming both versions.
* An empty directory, a pytorch-lightning checkpoint, a damaged ``last.ckpt`` and
  ``last.prev.ckpt`` beside intact top-k files, a sharded checkpoint missing a shard:
  each an error that says what it is and what to do (or a fall-back).
* A non-finite state never replaces a finite ``last.ckpt``.

The fsdp checkpoints are written in this process (a world of one); DeepSpeed's, which
need a launch, are in the tests marked slow.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.testing import TinyClassifier, tiny_dataset

FSDP = {"plugins": ["fsdp"], "plugin_options": {"fsdp": {"state_dict_type": "sharded"}}}


def fit(root: Path, steps: int = 2, ckpt_path=None, module=None, **kwargs) -> hookloop.Trainer:
    options = {"max_steps": steps, "default_root_dir": str(root), "enable_progress_bar": False,
               "num_sanity_val_steps": 0, **kwargs}
    trainer = hookloop.Trainer(**options)
    trainer.fit(module or TinyClassifier(), DataLoader(tiny_dataset(), batch_size=16), ckpt_path=ckpt_path)
    return trainer


def last_of(root: Path) -> Path:
    return root / "logs" / "version_0" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Two fsdp runs (sharded checkpoints, a world of one): ``mine`` (2 steps) and
    ``other`` (16 steps), and the weights each ended with."""
    root = tmp_path_factory.mktemp("fsdp_runs")
    weights = {}
    for name, steps in (("mine", 2), ("other", 16)):
        module = TinyClassifier()
        fit(root / name, steps, module=module, **FSDP)
        weights[name] = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                         for k, v in module.state_dict().items()}
    return root, weights


def committed(checkpoint: Path) -> Path:
    return checkpoint / (checkpoint / "latest").read_text().strip()


# -- 1. a tag never leads out of its checkpoint ------------------------------------------------


def _without_tags(source: Path, target: Path) -> Path:
    """A copy of the checkpoint directory ``source`` holding only its ``latest`` file."""
    target.mkdir(parents=True)
    shutil.copy(source / "latest", target / "latest")
    return target


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_a_latest_tag_leading_out_of_the_directory_is_refused_not_followed(fsdp_runs, tmp_path, how):
    root, weights = fsdp_runs
    other_tag = committed(last_of(root / "other"))  # .../other/logs/version_0/checkpoints/last.ckpt/step16
    evil = _without_tags(last_of(root / "mine"), tmp_path / "shared" / "last.ckpt")
    if how == "relative":
        tag = os.path.relpath(other_tag, evil)  # ../../../.../other/.../step16
    elif how == "absolute":
        tag = str(other_tag)
    else:  # a tag of the directory that is a link to another run's tag
        tag = "step2"
        (evil / tag).symlink_to(other_tag, target_is_directory=True)
    (evil / "latest").write_text(tag + "\n")
    module = TinyClassifier()
    with pytest.raises(hookloop.CheckpointError) as raised:
        fit(tmp_path / "resumed", 20, ckpt_path=evil, module=module, **FSDP)
    message = str(raised.value)
    assert f"checkpoint {str(evil)!r}: its 'latest' file names the tag {tag!r}" in message, message
    assert "hookloop does not follow a tag out of its checkpoint" in message, message
    # nothing of the other run was loaded: the module is as it was built
    assert all(torch.equal(v, TinyClassifier().state_dict()[k]) for k, v in module.state_dict().items()
               if not hasattr(v, "to_local"))


def test_a_tag_inside_the_directory_still_loads(fsdp_runs, tmp_path):
    root, weights = fsdp_runs
    trainer = fit(tmp_path / "resumed", 16, ckpt_path=last_of(root / "other"), **FSDP)
    assert trainer.global_step == 16  # resumed at step 16: nothing left to train


def test_tag_entry_refuses_every_name_that_is_not_an_entry_of_the_directory(tmp_path):
    directory = tmp_path / "ckpt"
    (directory / "step1").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (directory / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
    (directory / "inner").symlink_to(directory / "step1", target_is_directory=True)
    assert hookloop.tag_entry(directory, "step1") == directory / "step1"
    assert hookloop.tag_entry(directory, "inner") == directory / "inner"  # a link that stays inside
    for tag, why in [("", "it is empty"), ("/etc", "it is an absolute path"), ("..", "it is a path"),
                     ("a/../../outside", "it is a path"), ("step1/..", "it is a path"),
                     ("link", "symbolic link that leads out of the directory")]:
        with pytest.raises(hookloop.CheckpointError, match=why):
            hookloop.tag_entry(directory, tag)



# -- 7. an fsdp checkpoint missing a shard -----------------------------------------------------


def _two_fsdp_saves(root: Path) -> Path:
    """An fsdp run (sharded, a world of one) whose last.ckpt is at step 8 and
    last.prev.ckpt at step 4 (4 steps an epoch); returns last.ckpt."""
    fit(root, 8, max_epochs=None, **FSDP)
    last = last_of(root)
    assert committed(last).name == "step8" and committed(last.with_name("last.prev.ckpt")).name == "step4"
    return last


@pytest.mark.parametrize("shard", ["model", "optimizer"])
def test_an_fsdp_checkpoint_missing_a_shard_names_it_and_falls_back_like_a_damaged_file(tmp_path, shard):
    last = _two_fsdp_saves(tmp_path / "run")
    missing = committed(last) / shard / "__0_0.distcp"
    missing.unlink()
    with pytest.raises(hookloop.CheckpointError) as raised:
        fit(tmp_path / "explicit", 12, max_epochs=None, ckpt_path=last, **FSDP)
    assert str(raised.value) == (
        f"sharded checkpoint {str(committed(last))!r} is incomplete: its {shard} shards name {missing.name} "
        f"(written by 1 process), which is missing. Resume from an earlier checkpoint (last.prev.ckpt is the one "
        f"before last.ckpt)")
    # ckpt_path="last" (and a restart) falls back to last.prev.ckpt, as for a damaged file
    with pytest.warns(UserWarning, match=rf"newest checkpoint .*last\.ckpt.* cannot be loaded \(sharded checkpoint "
                                         rf".*is incomplete: its {shard} shards name __0_0\.distcp"):
        trainer = fit(tmp_path / "run", 12, max_epochs=None, ckpt_path="last", **FSDP)
    assert trainer.global_step == 12


def test_hookloop_fsdp_collate_names_a_missing_model_shard(tmp_path):
    from hookloop_fsdp.cli import collate

    last = _two_fsdp_saves(tmp_path / "run")
    (committed(last) / "model" / "__0_0.distcp").unlink()
    with pytest.raises(hookloop.CheckpointError, match=r"is incomplete: its model shards name __0_0\.distcp \(one per "
                                                       r"rank\), which is missing"):
        collate(last, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_an_fsdp_checkpoint_with_a_truncated_shard_names_it(tmp_path):
    last = _two_fsdp_saves(tmp_path / "run")
    shard = committed(last) / "model" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(hookloop.CheckpointError, match=r"is incomplete: its model shards name __0_0\.distcp, shorter "
                                                       r"than the metadata says \(truncated\)\. Resume from an earlier"):
        fit(tmp_path / "explicit", 12, max_epochs=None, ckpt_path=last, **FSDP)



# -- 8. TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 -----------------------------------------------------


class Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def test_torch_force_no_weights_only_load_neither_breaks_a_resume_nor_makes_loads_unsafe(fsdp_runs, tmp_path,
                                                                                         monkeypatch):
    """The workaround beside hookloop's TORCH_FORCE_WEIGHTS_ONLY_LOAD made torch refuse
    every load inside hookloop.weights_only_loads (DCP's entries here, DeepSpeed's shards
    in test_world_size_change.py); the loads inside stay weights-only, and the variable is
    the user's again after."""
    root, _ = fsdp_runs
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert fit(tmp_path / "resumed", 17, ckpt_path=last_of(root / "other"), **FSDP).global_step == 17
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
    planted = tmp_path / "planted.pt"
    torch.save({"x": Payload(tmp_path / "ran")}, planted)
    with pytest.raises(hookloop.CheckpointError, match="posix.system"):
        with hookloop.weights_only_loads(planted):
            torch.load(planted, weights_only=False)  # as DeepSpeed's loader calls it
    assert not (tmp_path / "ran").exists()
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"


# -- 2. a checkpoint's format is checked ------------------------------------------------------


def _single_file_run(root: Path, steps: int = 4, **kwargs) -> hookloop.Trainer:
    return fit(root, steps, **kwargs)


def _rewritten(source: Path, target: Path, change) -> Path:
    checkpoint = hookloop.safe_load(source)
    change(checkpoint)
    torch.save(checkpoint, target)
    return target


def test_a_checkpoint_of_a_newer_format_is_refused_naming_both_versions(tmp_path):
    from hookloop import _version
    from hookloop.resume.checkpoint import FORMAT_VERSION

    saved = last_of(tmp_path / "run")
    _single_file_run(tmp_path / "run")
    newer = _rewritten(saved, tmp_path / "newer.ckpt",
                       lambda c: c["hookloop"].update(format=FORMAT_VERSION + 1, version="99.0.0"))
    module = TinyClassifier()
    with pytest.raises(hookloop.CheckpointError) as raised:
        fit(tmp_path / "resumed", 8, ckpt_path=newer, module=module)
    assert str(raised.value) == (
        f"checkpoint {str(newer)!r} was written by hookloop 99.0.0 in checkpoint format {FORMAT_VERSION + 1}, and "
        f"this hookloop ({_version.__version__}) reads formats up to {FORMAT_VERSION}: upgrade hookloop (pip install "
        f"--upgrade hookloop and its plugins) to resume from it")
    assert torch.equal(module.net[0].weight, TinyClassifier().net[0].weight)  # nothing was loaded
    with pytest.raises(hookloop.CheckpointError, match="checkpoint format 3, and this hookloop"):
        TinyClassifier.load_from_checkpoint(newer)


def test_a_checkpoint_of_an_older_format_or_without_one_still_loads(tmp_path):
    saved = last_of(tmp_path / "run")
    _single_file_run(tmp_path / "run")
    older = _rewritten(saved, tmp_path / "older.ckpt", lambda c: c["hookloop"].update(format=1, version="0.1.0"))
    unmarked = _rewritten(saved, tmp_path / "unmarked.ckpt", lambda c: c.pop("hookloop"))
    for path in (older, unmarked):
        assert fit(tmp_path / path.stem, 6, ckpt_path=path).global_step == 6


# -- 3. an empty directory ---------------------------------------------------------------------


def test_an_empty_directory_is_said_to_hold_no_checkpoint(tmp_path):
    empty = tmp_path / "empty.ckpt"
    empty.mkdir()
    with pytest.raises(hookloop.CheckpointError) as raised:
        fit(tmp_path / "run", ckpt_path=empty)
    assert str(raised.value).startswith(f"checkpoint {str(empty)!r} is an empty directory: it holds no checkpoint")
    assert "which only the strategy that wrote it" not in str(raised.value)


# -- 4. a pytorch-lightning checkpoint ---------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_checkpoint(tmp_path_factory):
    """A real pytorch-lightning checkpoint: the tiny classifier's layers as a
    LightningModule, one step of Lightning's Trainer, then ``trainer.save_checkpoint``."""
    pl = pytest.importorskip("pytorch_lightning")
    from torch import nn
    from torch.nn import functional as F

    class LitClassifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TinyClassifier(seed=3).net

        def training_step(self, batch, batch_idx):
            x, y = batch[0], batch[1]
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    path = tmp_path_factory.mktemp("lightning") / "lightning.ckpt"
    module = LitClassifier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, DataLoader(tiny_dataset(), batch_size=16))
        trainer.save_checkpoint(path)
    assert isinstance(module.net, nn.Sequential)
    return path, {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_a_lightning_checkpoint_is_named_as_lightnings_with_how_to_load_its_weights(lightning_checkpoint, tmp_path):
    import pytorch_lightning as pl

    path, weights = lightning_checkpoint
    saved = torch.load(path, weights_only=True)
    with pytest.raises(hookloop.CheckpointError) as raised:
        fit(tmp_path / "run", ckpt_path=path)
    assert saved["global_step"] == 1
    assert str(raised.value) == (
        f"checkpoint {str(path)!r} was written by pytorch-lightning {pl.__version__} (epoch {saved['epoch']}, global "
        f"step 1), not "
        f"by hookloop: hookloop cannot resume Lightning's loop state (its 'loops' and callbacks). To start from its "
        f"weights, load them into the module before fit: module.load_state_dict(torch.load(path, "
        f"weights_only=True)['state_dict']), or MyModule.load_from_checkpoint(path)")
    # and what it says works: the weights load into the same layers, exactly
    module = TinyClassifier()
    module.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    assert all(torch.equal(module.state_dict()[k], v) for k, v in weights.items())
    loaded = TinyClassifier.load_from_checkpoint(path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())


# -- 5. last.ckpt and last.prev.ckpt damaged: the other checkpoints beside them ----------------


def test_both_last_checkpoints_damaged_names_the_intact_checkpoints_beside_them(tmp_path):
    trainer = fit(tmp_path, 12, max_epochs=None,
                  callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=4, every_n_epochs=0, save_top_k=-1)])
    directory = Path(trainer.log_dir) / "checkpoints"
    for name in ("last.ckpt", "last.prev.ckpt"):
        data = bytearray((directory / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (directory / name).write_bytes(bytes(data))
    damaged_topk = directory / "epoch=0-step=4.ckpt"
    damaged_topk.write_bytes(damaged_topk.read_bytes()[:100])  # truncated: not listed
    with pytest.raises(hookloop.CheckpointError) as raised:
        fit(tmp_path, 16, max_epochs=None, ckpt_path="last")
    message = str(raised.value)
    assert message.startswith("neither checkpoint can be loaded: "), message
    intact = [directory / "epoch=2-step=12.ckpt", directory / "epoch=1-step=8.ckpt"]  # newest first
    assert message.endswith(
        f" Intact checkpoints beside them, newest first: {', '.join(p.name for p in intact)} (in {str(directory)!r}): "
        f"resume from one with ckpt_path={str(intact[0])!r}"), message
    # and that works
    assert fit(tmp_path / "again", 16, max_epochs=None, ckpt_path=intact[0]).global_step == 16


# -- 9. a non-finite state never replaces a finite last.ckpt -----------------------------------


class NanFromEpoch(TinyClassifier):
    """NaN data from epoch ``bad`` on (nan_guard is opt-in): the weights become NaN."""

    def __init__(self, bad: int = 1):
        super().__init__()
        self.bad = bad

    def training_step(self, batch, batch_idx):
        if self.current_epoch >= self.bad:
            batch = [batch[0] * float("nan"), *batch[1:]]
        return super().training_step(batch, batch_idx)


def finite(state: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


def test_nan_weights_do_not_replace_a_finite_last_ckpt_and_are_written_beside_it(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, None, max_epochs=3, module=NanFromEpoch(bad=1))
    directory = Path(trainer.log_dir) / "checkpoints"
    last = hookloop.safe_load(directory / "last.ckpt")
    assert finite(last["state_dict"]) and last["loop"]["global_step"] == 4  # epoch 0's, finite
    nonfinite = hookloop.safe_load(directory / "last.nonfinite.ckpt")
    assert not finite(nonfinite["state_dict"]) and nonfinite["loop"]["global_step"] == 12  # the newest state
    previous = directory / "last.prev.ckpt"  # none: epoch 0's save was the first
    assert not previous.exists() or finite(hookloop.safe_load(previous)["state_dict"])
    messages = [str(w.message) for w in caught if "not finite" in str(w.message)]
    assert messages == [
        f"the model's weights are not finite (NaN or inf) at global step 8: {str(directory / 'last.ckpt')!r} keeps "
        f"the last finite state (global step 4), and this one and later ones are written to "
        f"{str(directory / 'last.nonfinite.ckpt')!r}. Plugins=['nan_guard'] (hookloop.NanGuard) skips or stops on a "
        f"NaN loss before it reaches the weights"], messages
    # ckpt_path="last" resumes from the finite state
    assert fit(tmp_path, 5, max_epochs=None, ckpt_path="last").global_step == 5


def test_finite_weights_are_written_as_before(tmp_path):
    trainer = fit(tmp_path, None, max_epochs=2)
    directory = Path(trainer.log_dir) / "checkpoints"
    assert hookloop.safe_load(directory / "last.ckpt")["loop"]["global_step"] == 8
    assert not (directory / "last.nonfinite.ckpt").exists()
