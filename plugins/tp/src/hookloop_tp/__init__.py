"""hookloop-tp: tensor parallelism with DTensor (``torch.distributed.tensor.parallel``).

    hookloop run --plugins tp --devices 2 train.py
    Trainer(plugins=["tp"], devices=2)
    Trainer(plugins=[hookloop.plugin("tp", colwise=("fc_in",), rowwise=("fc_out",))], devices=2)

The plan comes from the module (``tensor_parallel_plan`` or
``configure_tensor_parallel(mesh)``), from a Hugging Face model's
``config.base_model_tp_plan`` (:func:`hf_plan`), from the option ``plan``, or is made
automatically (:func:`auto_plan`); :func:`resolve` picks it. The split model checks
itself against the whole one on the first batch (:mod:`.verify`), and
:func:`describe_plan` writes a plan as the table printed at start.
"""

from .plan import Plan, auto_plan, expand_plan, hf_plan, module_plan, resolve
from .strategy import TP, TensorParallel
from .verify import describe_plan

__all__ = ["TP", "TensorParallel", "Plan", "auto_plan", "describe_plan", "expand_plan", "hf_plan", "module_plan",
           "resolve"]
