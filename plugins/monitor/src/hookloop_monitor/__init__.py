"""hookloop-monitor: what every rank's hardware and loop are doing, as logged metrics.

* ``device_stats`` (:class:`DeviceStats`): GPU utilisation, memory, temperature and power
  (NVML), the CUDA allocator's peak, the process's CPU % and RSS, the machine's RAM use.
* ``throughput`` (:class:`Throughput`): samples/s and batches/s per rank and in total,
  step-time percentiles per rank, and the slowest rank.

Every rank measures; the values are gathered (``trainer.all_gather_object``) and every
rank hands the same row, ``rank<R>/<name>`` for each rank, to ``trainer.log_metrics``:
the loggers write it from rank 0, ``trainer.callback_metrics`` agree on every rank.
"""

from __future__ import annotations

from ._common import per_rank_row
from .device_stats import DeviceStats
from .throughput import Throughput, window_stats

__all__ = ["DeviceStats", "Throughput", "per_rank_row", "window_stats"]
