"""The built-in plugin ``hookloop.defaults``: single-process defaults.

It implements every ``firstresult`` hook except ``select_devices``, ``spawn``,
``wrap_optimizer`` and ``configure_sampler`` (whose default is to do nothing). It is an
ordinary plugin, registered first and marked ``trylast``, so pluggy calls it last.
Strategies replace any of these by implementing the same hook and returning a value;
they never need a special case in the loop.
"""

from __future__ import annotations

import contextlib

import torch

from hookloop.contract.errors import CheckpointError
from hookloop.contract.hookspecs import hookimpl
from hookloop.distributed.launch import elastic_command
from hookloop.engine.optim import before_optimizer_step, load_scheduler_states
from hookloop.engine.settings import TrainerConfig
from hookloop.helpers import clip_parameters, local_rank_device
from hookloop.resume import checkpoint as ckpt


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
    def backward(self, trainer, loss):
        loss.backward(**trainer.backward_kwargs)
        return True

    @hookimpl(trylast=True)
    def optimizer_step(self, trainer, optimizer):
        before_optimizer_step(trainer, optimizer)
        optimizer.step()
        return True

    @hookimpl(trylast=True)
    def zero_grad(self, optimizer):
        optimizer.zero_grad(set_to_none=True)
        return True

    @hookimpl(trylast=True)
    def configure_grad_scaler(self, device, options):
        return torch.amp.GradScaler(device.type, **options)

    @hookimpl(trylast=True)
    def clip_gradients(self, trainer, optimizer, clip_val, algorithm):
        # in the module's order, as a hand-written loop's clip_grad_norm_(model.parameters())
        clip_parameters(optimizer, clip_val, algorithm, module=trainer.module)
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
        optimizer_states, scheduler_states = ckpt.optimizer_and_scheduler_states(checkpoint)
        if trainer.optimizers and optimizer_states:
            if len(optimizer_states) != len(trainer.optimizers):
                raise CheckpointError(
                    f"the checkpoint holds the state of {len(optimizer_states)} optimizer(s) and "
                    f"configure_optimizers returned {len(trainer.optimizers)}: resume with the "
                    f"optimizers it was saved with"
                )
            # the lengths are checked above
            for optimizer, state in zip(trainer.optimizers, optimizer_states, strict=True):
                optimizer.load_state_dict(state)
        load_scheduler_states(trainer, scheduler_states)
        return True
