"""``hookloop deepspeed collate CKPT_DIR OUT.pt``: one fp32 state dict from a sharded checkpoint.

Registered under the entry-point group ``hookloop.commands``; the ``hookloop`` command
imports this module only when the sub-command runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import hookloop
from hookloop import CheckpointError

from .safe_globals import checkpoint_safe_globals

# The engine wraps the loop's step module, which holds the user's module as `module`.
_STEP_MODULE_PREFIX = "module."


def collate(checkpoint_dir: str | os.PathLike, output: str | os.PathLike, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Gather the shards of a DeepSpeed checkpoint directory into one fp32 state dict.

    The keys are those of the user's module (``net.0.weight``), so the file loads with
    ``module.load_state_dict(torch.load(output, weights_only=True))`` into the plain
    ``nn.Module``, without DeepSpeed. Optimizer state is dropped: the file holds weights
    and buffers only. Returns the state dict it wrote.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(
            f"{str(checkpoint_dir)!r} is not a directory: pass the checkpoint directory the "
            f"deepspeed strategy wrote (e.g. checkpoints/last.ckpt)"
        )
    if tag is None:
        from .strategy import _tagged

        tags = _tagged(checkpoint_dir)
        if not (checkpoint_dir / "latest").is_file() and not tags.tags():
            raise CheckpointError(f"{str(checkpoint_dir)!r} is not a DeepSpeed checkpoint (no 'latest' file); pass --tag")
        tag = tags.committed().name  # the newest complete tag when 'latest' names an interrupted save's
    shard_dir = hookloop.tag_entry(checkpoint_dir, tag, "--tag")
    if not shard_dir.is_dir():
        raise CheckpointError(f"{str(checkpoint_dir)!r} has no checkpoint tag {tag!r}")
    from .strategy import check_zero_shards

    check_zero_shards(checkpoint_dir, tag, stage=0)  # every shard there, before DeepSpeed reads any
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed reads its shards with torch.load(weights_only=False): inside this block
    # every load is weights-only, so a shared checkpoint cannot run code.
    with hookloop.weights_only_loads(checkpoint_dir, checkpoint_safe_globals()):
        if any(shard_dir.glob("*zero_pp_rank_*_optim_states.pt")):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            try:
                state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
            except Exception as exc:
                if hookloop.refused_object(exc) is not None:
                    raise  # weights_only_loads says which file holds what
                raise CheckpointError(f"cannot collate {str(shard_dir)!r}: {type(exc).__name__}: {exc}") from exc
        else:
            # ZeRO stage 0 keeps the whole model in one file; nothing to gather.
            files = sorted(shard_dir.glob("mp_rank_*_model_states.pt"))
            if not files:
                raise CheckpointError(f"{str(shard_dir)!r} holds no DeepSpeed model states")
            state = torch.load(files[0], map_location="cpu", weights_only=True)["module"]
    if state and all(k.startswith(_STEP_MODULE_PREFIX) for k in state):
        state = {k[len(_STEP_MODULE_PREFIX):]: v for k, v in state.items()}
    state = {
        k: (v.detach().float() if v.is_floating_point() else v.detach()).contiguous().clone()
        for k, v in state.items()
    }
    hookloop.atomic_save(state, output)
    return state


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hookloop deepspeed ...``."""
    from hookloop.tools.cli import collate_command

    return collate_command(
        "deepspeed", collate, argv,
        help="gather a sharded checkpoint into one fp32 state dict (optimizer state is dropped)",
        description=(
            "Gather the shards of a DeepSpeed checkpoint directory into one fp32 state dict "
            "with the keys of your module; load it with "
            "module.load_state_dict(torch.load(OUT, weights_only=True)). Optimizer state is "
            "dropped: use the directory itself to resume training."
        ),
        tag_help="the checkpoint tag to read (default: the 'latest' one)",
        kind=", fp32",
    )


if __name__ == "__main__":
    raise SystemExit(main())
