"""hookloop-tp: tensor parallelism with DTensor (``torch.distributed.tensor.parallel``).

    hookloop run --plugins tp --devices 2 train.py
    Trainer(plugins=["tp"], devices=2)
    Trainer(plugins=[hookloop.plugin("tp", colwise=("fc_in",), rowwise=("fc_out",))], devices=2)

The plan comes from the module (``tensor_parallel_plan`` or
``configure_tensor_parallel(mesh)``) or is made automatically (:func:`auto_plan`).
"""

from .plan import auto_plan, module_plan
from .strategy import TP, TensorParallel

__all__ = ["TP", "TensorParallel", "auto_plan", "module_plan"]
