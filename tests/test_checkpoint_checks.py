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
