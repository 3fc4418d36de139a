"""The DeepSpeed classes a DeepSpeed checkpoint may hold, besides tensors and plain data.

DeepSpeed reads its shards with ``torch.load(weights_only=False)``; hookloop-deepspeed
reads them inside :func:`hookloop.weights_only_loads`, which refuses every other pickled
object (a shared checkpoint cannot run code when it is resumed or collated). Each class
below is plain data: constructing it, or setting its attributes, runs no code of the
file's choosing.
"""

from __future__ import annotations


def checkpoint_safe_globals() -> list:
    """The classes DeepSpeed 0.19's ZeRO stage 0-3 shards pickle (checked with
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` on fp32/bf16, offload and
    scheduler runs), each with why it is needed."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [
        ZeroStageEnum,  # the ZeRO stage, in every *_optim_states.pt (an int Enum)
        LossScaler,  # the static loss scale of fp32/bf16 runs (numbers), in *_optim_states.pt
        DynamicLossScaler,  # the same for fp16 runs (numbers and a torch.dtype)
        fragment_address,  # (numel, start) of each parameter's slice, ZeRO 1/2 *_optim_states.pt
    ]
