"""What one training step costs on this rank, beside its wall time: the process's CPU
seconds and the Python calls it makes. Shared by nd_memory.py's probe (hookloop) and
handwritten_nd.py (no hookloop), so both sides are measured the same way.

On 2 shared cores the wall time of one run moves by +-20 % between rounds, more than
the differences nd_step_time.py looks for; the work a step does (CPU time, calls) moves
much less, and says whether a difference comes from the code or from the machine.
"""

from __future__ import annotations

import sys
import time

#: the interval whose Python calls are counted: from the end of optimizer step 2 to the
#: end of step 3 (steady state: AdamW's state exists; a warm-up interval, not timed)
COUNTED_STEP = 3


class StepWork:
    """Call :meth:`tick` at the end of every optimizer step with the number of steps done."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.main_thread_cpu: list[float] = []
        self.calls: int | None = None
        self._last: tuple[float, float, float] | None = None
        self._count = 0

    def _profile(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self._count += 1

    def tick(self, steps_done: int) -> None:
        now = (time.perf_counter(), time.process_time(), time.thread_time())
        if steps_done == COUNTED_STEP and sys.getprofile() == self._profile:
            sys.setprofile(None)
            self.calls = self._count
        if self._last is not None:
            self.times.append(now[0] - self._last[0])
            self.cpu.append(now[1] - self._last[1])
            self.main_thread_cpu.append(now[2] - self._last[2])
        if steps_done == COUNTED_STEP - 1:
            self._count = 0
            sys.setprofile(self._profile)
        self._last = (time.perf_counter(), time.process_time(), time.thread_time())

    def record(self) -> dict:
        return {"times": self.times, "cpu": self.cpu, "main_thread_cpu": self.main_thread_cpu, "calls": self.calls}
