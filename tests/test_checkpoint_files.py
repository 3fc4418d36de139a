"""The files ``atomic_save`` writes: the permissions of a plain ``open(path, "w")``."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import hookloop


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask,expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_checkpoint_gets_the_mode_of_a_plain_open_under_the_umask(tmp_path, umask, expected):
    old = os.umask(umask)
    try:
        path = hookloop.atomic_save({"w": torch.arange(3)}, tmp_path / "last.ckpt")
        with open(tmp_path / "plain.txt", "w"):
            pass
        # Overwriting goes through a new temporary file: it must get the same mode.
        hookloop.atomic_save({"w": torch.arange(4)}, path)
        after_overwrite = mode_of(path)
        umask_now = os.umask(umask)
    finally:
        os.umask(old)
    assert 0o666 & ~umask == expected  # the mode worked out by hand
    assert mode_of(tmp_path / "plain.txt") == expected
    assert mode_of(path) == expected and after_overwrite == expected
    assert umask_now == umask  # reading the umask did not change it
    assert torch.equal(hookloop.safe_load(path)["w"], torch.arange(4))
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "last.prev.ckpt", "plain.txt"]
