"""``hookloop fsdp collate CKPT_DIR OUT.pt``: one plain state dict from a sharded checkpoint.

Registered under the entry-point group ``hookloop.commands``; the ``hookloop`` command
imports this module only when the sub-command runs. The shards are merged by torch's
own converter, ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, which
needs no process group, with the metadata reader of :mod:`hookloop_fsdp.safe_dcp`
(a checkpoint holding pickled objects other than plain data is refused, not run).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hookloop import CheckpointError, tag_entry
from hookloop.resume.dcp import check_shards

from .checkpoint import LATEST, MODEL_DIR, committed_tag


def collate(checkpoint_dir: str | os.PathLike, output: str | os.PathLike, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Merge the model shards of a sharded fsdp checkpoint into one file at ``output``.

    The file holds the user's module's state dict (its keys, plain tensors in the dtype
    trained), so ``module.load_state_dict(torch.load(output, weights_only=True))`` loads
    it into the plain ``nn.Module``. Optimizer state is left out: resume from the
    directory itself. Written atomically (a temporary file, then a rename). Returns the
    state dict.
    """
    from .safe_dcp import to_torch_save  # dcp_to_torch_save, without unpickling objects

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(
            f"{str(checkpoint_dir)!r} is not a directory: pass the directory that the fsdp strategy "
            f"wrote with state_dict_type='sharded' (e.g. checkpoints/last.ckpt)")
    if tag is not None:
        shards = tag_entry(checkpoint_dir, tag, "--tag")
        if not (shards / MODEL_DIR / ".metadata").is_file():
            raise CheckpointError(f"{str(checkpoint_dir)!r} has no complete checkpoint tag {tag!r}")
    else:
        shards = committed_tag(checkpoint_dir)
    check_shards(shards, {"stepped": [False]})  # the model's shards: every file there, before DCP reads one
    output = Path(output)
    to_torch_save(shards / MODEL_DIR, output, source=shards)
    return torch.load(output, map_location="cpu", weights_only=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hookloop fsdp ...``."""
    from hookloop.tools.cli import collate_command

    return collate_command(
        "fsdp", collate, argv,
        help="merge a sharded checkpoint's model shards into one plain state dict (optimizer state is dropped)",
        description=(
            "Merge the model shards of a checkpoint directory written with state_dict_type='sharded' "
            "into one state dict with your module's keys, using torch.distributed.checkpoint's own "
            "converter; load it with module.load_state_dict(torch.load(OUT, weights_only=True)). "
            "Optimizer state is dropped: resume training from the directory itself."
        ),
        tag_help=f"the tag to read (default: the one named in '{LATEST}')",
    )


if __name__ == "__main__":
    raise SystemExit(main())
