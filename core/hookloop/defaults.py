"""The built-in plugin: single-process defaults for every ``firstresult`` hook.

It is an ordinary plugin, registered first so pluggy calls it last. Strategies replace
any of these by implementing the same hook and returning a value; they never need a
special case in the loop.
"""

from __future__ import annotations

import contextlib


from . import checkpoint as ckpt
from .config import TrainerConfig
from .errors import CheckpointError
from .helpers import clip_gradients, local_rank_device
from .hookspecs import hookimpl
from .launch import elastic_command


class Defaults:
    hookloop_name = "hookloop.defaults"
    hookloop_role = "extension"

    # -- launching ----------------------------------------------------------------------

    @hookimpl(trylast=True)
    def launch_command(self, config: TrainerConfig, script: str, script_args: list):
        return elastic_command(config, script, script_args)

    # -- environment --------------------------------------------------------------------

    @hookimpl(trylast=True)
    def setup_environment(self, trainer):
        trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank = 1, 0, 0, 0
        trainer.root_device = local_rank_device(trainer, 0)
        return True

    # -- model and data -----------------------------------------------------------------

    @hookimpl(trylast=True)
    def model_init_context(self, trainer):
        return contextlib.nullcontext()

    @hookimpl(trylast=True)
    def wrap_model(self, trainer, model):
        return model.to(trainer.root_device)

    # -- the step -----------------------------------------------------------------------

    @hookimpl(trylast=True)
    def accumulation_context(self, trainer, model):
        return contextlib.nullcontext()

    @hookimpl(trylast=True)
    def backward(self, loss):
        loss.backward()
        return True

    @hookimpl(trylast=True)
    def optimizer_step(self, trainer, optimizer):
        clip_gradients(trainer, optimizer)
        optimizer.step()
        return True

    @hookimpl(trylast=True)
    def zero_grad(self, optimizer):
        optimizer.zero_grad(set_to_none=True)
        return True

    # -- collectives --------------------------------------------------------------------

    @hookimpl(trylast=True)
    def reduce(self, tensor):
        return tensor

    @hookimpl(trylast=True)
    def barrier(self):
        return True

    @hookimpl(trylast=True)
    def broadcast(self, obj):
        return obj

    # -- checkpoints --------------------------------------------------------------------

    @hookimpl(trylast=True)
    def save_checkpoint(self, trainer, checkpoint, path):
        if trainer.global_rank == 0:
            ckpt.atomic_save(checkpoint, path)
        trainer.barrier("save_checkpoint")  # nobody reads before the write is complete
        return path

    @hookimpl(trylast=True)
    def load_checkpoint(self, path):
        return ckpt.safe_load(path)

    @hookimpl(trylast=True)
    def load_model_state(self, trainer, checkpoint):
        if "state_dict" not in checkpoint:
            raise CheckpointError("checkpoint has no 'state_dict': it was not written by hookloop")
        ckpt.check_state_dict(trainer.module, checkpoint["state_dict"])
        trainer.module.load_state_dict(checkpoint["state_dict"])
        if trainer.optimizer is not None and checkpoint.get("optimizer") is not None:
            trainer.optimizer.load_state_dict(checkpoint["optimizer"])
        if trainer.lr_scheduler is not None and checkpoint.get("lr_scheduler") is not None:
            trainer.lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        return True
