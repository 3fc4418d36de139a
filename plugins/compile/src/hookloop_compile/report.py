"""What torch.compile did during a stretch of training: graphs, graph breaks, recompiles.

Dynamo's bookkeeping is process-wide and cumulative (``torch._dynamo.utils.counters``,
``get_compilation_metrics()``), so :func:`snapshot` is taken when the model is wrapped
and :func:`since` reports the difference: a second ``fit`` in the same process, or a test
run after another, reports its own compilations only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

#: How many graph-break and recompile reasons the report lists (the counts cover all).
FIRST_FEW = 5


def _dynamo():
    from torch._dynamo import utils

    return utils


def snapshot() -> dict[str, Any]:
    """Dynamo's counters now: the baseline :func:`since` subtracts."""
    utils = _dynamo()
    metrics = utils.get_compilation_metrics()
    return {
        "graphs": int(utils.counters["stats"]["unique_graphs"]),
        "breaks": Counter(utils.counters["graph_break"]),
        "last_metric": metrics[-1] if metrics else None,
    }


def _first_line(reason: str, limit: int = 200) -> str:
    line = str(reason).strip().splitlines()[0] if str(reason).strip() else str(reason)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def since(base: dict[str, Any]) -> dict[str, Any]:
    """The graphs compiled, the graph breaks (with the first few reasons) and the
    recompilations (with the first few reasons) since ``base`` (:func:`snapshot`)."""
    utils = _dynamo()
    breaks = Counter(utils.counters["graph_break"])
    breaks.subtract(base["breaks"])
    breaks = Counter({reason: n for reason, n in breaks.items() if n > 0})
    metrics = list(utils.get_compilation_metrics())
    last = base["last_metric"]
    if last is not None:
        # the compilation records kept since the baseline (a bounded deque: if the
        # baseline's record has rotated out, every record kept is newer)
        for i, record in enumerate(metrics):
            if record is last:
                metrics = metrics[i + 1:]
                break
    reasons = [str(m.recompile_reason).strip() for m in metrics if getattr(m, "recompile_reason", None)]
    return {
        "graphs": int(utils.counters["stats"]["unique_graphs"]) - base["graphs"],
        "graph_breaks": sum(breaks.values()),
        "graph_break_reasons": [{"reason": _first_line(r), "count": n} for r, n in breaks.most_common(FIRST_FEW)],
        "recompiles": len(reasons),
        "recompile_reasons": [_first_line(r) for r in dict.fromkeys(reasons)][:FIRST_FEW],
    }


def describe(report: dict[str, Any]) -> str:
    """The report as the few lines rank 0 prints."""

    def plural(n: int, word: str) -> str:
        return f"{n} {word}{'' if n == 1 else 's'}"

    lines = [
        f"compile: {plural(report['graphs'], 'graph')}, {plural(report['graph_breaks'], 'graph break')}, "
        f"{plural(report['recompiles'], 'recompile')} in the first training epoch "
        f"(backend {report['backend']}; compiled: {', '.join(report['compiled']) or 'nothing'})"
    ]
    lines += [f"  graph break (x{b['count']}): {b['reason']}" for b in report["graph_break_reasons"]]
    lines += [f"  recompile: {r}" for r in report["recompile_reasons"]]
    return "\n".join(lines)
