"""The ``nn.Sequential`` a pipeline splits, and how many of its layers go in each stage.

Shared by ``pipe`` (stages on devices of one process) and ``ddp_sequential`` (stages on
processes). A ``balance`` is a list of layer counts, one per stage, in order, summing
to the number of layers. When none is given it is chosen, and printed:

* by time, with fairscale's own helper (``fairscale.nn.pipe.balance.balance_by_time``),
  when the module has an ``example_input_array`` (Lightning's attribute) to time the
  layers on; it runs on the CPU and on CUDA;
* otherwise by parameter count: contiguous stages whose largest parameter count is as
  small as it can be.

(fairscale's other helper, ``balance_by_size``, measures CUDA memory and runs on CUDA
only; the parameter count is its device-free stand-in.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hookloop


def sequential_of(module: nn.Module, plugin: str) -> nn.Sequential:
    """``module.sequential_module``, the ``nn.Sequential`` a pipeline splits, or a clear error."""
    sequential = getattr(module, "sequential_module", None)
    name = type(module).__name__
    fix = (
        f"put the layers to pipeline in an nn.Sequential stored as self.sequential_module in "
        f"{name}.__init__, and call it in forward/training_step (as Lightning's sequential "
        f"plugin asked): self.sequential_module = nn.Sequential(layer1, layer2, ...)"
    )
    if sequential is None:
        raise hookloop.ConfigurationError(
            f"the {plugin!r} strategy splits the module's sequential_module into pipeline "
            f"stages, and {name} has no sequential_module: {fix}"
        )
    if not isinstance(sequential, nn.Sequential):
        raise hookloop.ConfigurationError(
            f"the {plugin!r} strategy splits {name}.sequential_module into pipeline stages, "
            f"which needs an nn.Sequential, and it is a {type(sequential).__name__}: {fix}"
        )
    if len(sequential) == 0:
        raise hookloop.ConfigurationError(f"{name}.sequential_module is empty: there are no layers to pipeline")
    return sequential


def check_balance_option(plugin: str, balance: Any) -> None:
    """The option's own shape: ``None`` or a list of positive layer counts."""
    if balance is None:
        return
    if (not isinstance(balance, (list, tuple)) or not balance
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in balance)):
        raise hookloop.ConfigurationError(
            f"{plugin} option balance={balance!r} must be a list of positive layer counts, one "
            f"per stage (e.g. [2, 3]: the first 2 layers, then the next 3), or None to choose it"
        )


def check_balance(plugin: str, balance: list[int], sequential: nn.Sequential) -> list[int]:
    """``balance`` when it places every layer of ``sequential`` exactly once."""
    check_balance_option(plugin, balance)
    layers = len(sequential)
    if sum(balance) != layers:
        example = _example(layers, len(balance))
        raise hookloop.ConfigurationError(
            f"{plugin} balance={list(balance)} places {sum(balance)} layers, but "
            f"sequential_module has {layers}: give one layer count per stage, summing to "
            f"{layers}{f' (e.g. {example})' if example else ''}, or balance=None to choose one"
        )
    return list(balance)


def _example(layers: int, stages: int) -> list[int] | None:
    if stages < 1 or stages > layers:
        return None
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def balance_by_parameters(sequential: nn.Sequential, stages: int) -> list[int]:
    """Contiguous stages of ``sequential`` whose largest parameter count is smallest.

    Every stage gets at least one layer; among equally good splits the earliest
    boundaries win. Exact (dynamic programming over the boundaries).
    """
    costs = [sum(p.numel() for p in layer.parameters()) for layer in sequential]
    n = len(costs)
    if not 1 <= stages <= n:
        raise hookloop.ConfigurationError(
            f"cannot split {n} layers into {stages} stages: each stage needs at least one layer"
        )
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest-stage cost of the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def choose_balance(plugin: str, module: nn.Module, sequential: nn.Sequential, stages: int,
                   device: torch.device) -> tuple[list[int], str]:
    """A balance for ``stages`` stages, and how it was chosen (for the printed note)."""
    sample = getattr(module, "example_input_array", None)
    if isinstance(sample, torch.Tensor) and stages > 1:
        try:
            from fairscale.nn.pipe.balance import balance_by_time

            balance = balance_by_time(stages, sequential, sample.to(device), device=device)
            if len(balance) == stages and sum(balance) == len(sequential):
                return list(balance), "by time (fairscale's balance_by_time on the module's example_input_array)"
        except Exception as exc:  # profiling failed (an in-place layer, an odd input): say so
            reason = f"fairscale's balance_by_time failed ({type(exc).__name__}: {exc}); "
        else:
            reason = "fairscale's balance_by_time gave no usable balance; "
    else:
        reason = "" if stages == 1 else "no example_input_array to time the layers on; "
    balance = balance_by_parameters(sequential, stages)
    counts = _stage_parameters(sequential, balance)
    return balance, f"{reason}by parameter count (parameters per stage: {', '.join(map(str, counts))})"


def _stage_parameters(sequential: nn.Sequential, balance: list[int]) -> list[int]:
    counts, start = [], 0
    for size in balance:
        counts.append(sum(p.numel() for layer in list(sequential)[start:start + size] for p in layer.parameters()))
        start += size
    return counts


def stage_ranges(balance: list[int]) -> list[range]:
    """The layer indices of each stage."""
    ranges, start = [], 0
    for size in balance:
        ranges.append(range(start, start + size))
        start += size
    return ranges
