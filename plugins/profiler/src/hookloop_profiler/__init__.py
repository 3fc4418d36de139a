"""``profiler``: where a training run's time goes, per rank.

``mode="torch"`` (the default): ``torch.profiler`` on a schedule (``wait``, ``warmup``,
``active`` steps, ``repeat`` cycles; one profiler step per training batch), every hook
implementation called inside ``torch.profiler.record_function("hookloop/<plugin>.<hook>")``
and every hook call inside ``"hookloop/<hook>"`` (``hookloop.dispatch.observe_hook_calls``,
the step's resolved events included, which stay direct calls), so the
chrome traces (``<run dir>/profiler/rank<R>/trace.<cycle>.json``, one per cycle) and
``key_averages()`` show the time of each plugin's hook. At the end of ``fit`` each rank
writes the per-hook table to ``<run dir>/profiler/hooks.rank<R>.txt``; global rank 0
prints its own.

``mode="simple"``: wall time of the loop's phases, as Lightning's ``SimpleProfiler``:
``fetch`` (from the end of the previous batch to ``on_train_batch_start``: the loader's
``next`` and the loop's bookkeeping), ``training_step`` (the forward and the loss, inside
the strategy's wrapper), ``backward``, ``optimizer_step``, ``hooks`` (the ``on_*`` events,
outermost calls), ``validation`` (each validation run inside fit, the sanity check apart),
with calls, total and mean, and ``fit`` (from ``setup`` to ``on_fit_end``). Written to
``<run dir>/profiler/simple.rank<R>.txt`` and ``.json``; global rank 0 prints its table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import hookloop
from hookloop.dispatch import observe_hook_calls

__all__ = ["Profiler"]

_MODES = ("torch", "simple")
PHASES = ("fetch", "training_step", "backward", "optimizer_step", "hooks", "validation", "sanity_check")


class Profiler:
    """Profile a training run per rank: torch.profiler traces with per-hook times, or the
    wall time of the loop's phases.

    mode: "torch" (traces and a per-hook table) or "simple" (phase wall times)
    wait: batches skipped at the start of each cycle (torch mode; default 1)
    warmup: batches profiled and thrown away before the active ones (default 1)
    active: batches recorded per cycle (default 3)
    repeat: cycles (default 1; 0: until training ends)
    record_shapes: torch.profiler's record_shapes (default False)
    profile_memory: torch.profiler's profile_memory (default False)
    with_stack: torch.profiler's with_stack (default False)
    row_limit: rows of the printed per-hook table (default 20)
    """

    hookloop_name = "profiler"
    hookloop_role = "observer"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    hookloop_autoload = False  # by name only (HOOKLOOP_AUTOLOAD_PLUGINS=1 leaves it out)

    def __init__(self, mode: str = "torch", wait: int = 1, warmup: int = 1, active: int = 3, repeat: int = 1,
                 record_shapes: bool = False, profile_memory: bool = False, with_stack: bool = False,
                 row_limit: int = 20):
        if mode not in _MODES:
            raise hookloop.ConfigurationError(f"profiler mode={mode!r} must be 'torch' or 'simple'")
        for option, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                     ("repeat", repeat, 0), ("row_limit", row_limit, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise hookloop.ConfigurationError(f"profiler {option}={value!r} must be an integer >= {least}")
        self.mode, self.wait, self.warmup, self.active, self.repeat = mode, wait, warmup, active, repeat
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.row_limit = row_limit
        self._undo: list = []
        self._profiler = None
        self._hook_rows: dict[str, list[float]] = {}  # name -> [calls, total us, self us] over cycles
        self._cycle = 0
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._fit_start = self._fit_time = None
        self._mark = None  # where the next fetch starts
        self._depth = 0
        self._hooks_start = 0.0
        self._in_validation = self._training = False
        self._started: dict[str, float] = {}
        self._ranges: list = []  # torch mode: the open record_function ranges

    # -- shared ------------------------------------------------------------------------

    def _out_dir(self, trainer) -> Path:
        path = Path(trainer.log_dir) / "profiler"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _add(self, phase: str, seconds: float) -> None:
        self.totals[phase] = self.totals.get(phase, 0.0) + seconds
        self.calls[phase] = self.calls.get(phase, 0) + 1

    @hookloop.hookimpl
    def setup(self, trainer, stage):
        if stage != "fit":
            return
        self.totals, self.calls, self._hook_rows, self._cycle = {}, {}, {}, 0
        self._fit_start, self._fit_time, self._mark, self._depth = time.perf_counter(), None, None, 0
        self._in_validation = self._training = False
        # every hook call, the step's resolved events included (hookloop.dispatch.observe_hook_calls)
        if self.mode == "torch":
            self._ranges = []
            self._undo.append(observe_hook_calls(trainer, self._enter_hook, self._exit_range,
                                                 before_impl=self._enter_impl, after_impl=self._exit_impl))
        else:
            self._undo.append(observe_hook_calls(trainer, self._before_hook, self._after_hook))

    @hookloop.hookimpl
    def teardown(self, trainer):
        if self._profiler is not None:  # fit raised: stop (and write what was recorded)
            self._stop(trainer)
        while self._undo:
            self._undo.pop()()

    # -- torch mode ------------------------------------------------------------------------

    def _start(self, trainer) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and trainer.root_device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        folder = self._out_dir(trainer) / f"rank{trainer.global_rank}"
        folder.mkdir(parents=True, exist_ok=True)

        def ready(prof) -> None:
            prof.export_chrome_trace(str(folder / f"trace.{self._cycle}.json"))
            self._cycle += 1
            for row in prof.key_averages():
                if row.key.startswith("hookloop/"):
                    sums = self._hook_rows.setdefault(row.key, [0, 0.0, 0.0])
                    sums[0] += row.count
                    sums[1] += row.cpu_time_total
                    sums[2] += row.self_cpu_time_total

        self._profiler = profile(activities=activities, on_trace_ready=ready,
                                 schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active,
                                                   repeat=self.repeat),
                                 record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                                 with_stack=self.with_stack)
        self._profiler.start()

    # Each hook call inside record_function("hookloop/<hook>"), each implementation inside
    # "hookloop/<plugin>.<hook>" (but the profiler's own: its on_train_batch_end steps the
    # profiler inside the call's range). The ranges nest: one stack.

    def _enter_hook(self, hook_name, impls, kwargs) -> None:
        import torch

        self._ranges.append(torch.autograd.profiler.record_function(f"hookloop/{hook_name}").__enter__())

    def _exit_range(self, *_) -> None:
        self._ranges.pop().__exit__(None, None, None)

    def _enter_impl(self, hook_name, impl) -> None:
        if impl.plugin is not self:
            import torch

            label = f"hookloop/{impl.plugin_name}.{hook_name}"
            self._ranges.append(torch.autograd.profiler.record_function(label).__enter__())

    def _exit_impl(self, hook_name, impl) -> None:
        if impl.plugin is not self:
            self._exit_range()

    def _stop(self, trainer) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        rows = sorted(self._hook_rows.items(), key=lambda kv: -kv[1][1])
        lines = [f"{'hook (plugin.hook)':<56} {'calls':>7} {'total ms':>10} {'self ms':>10} {'mean us':>10}"]
        for name, (count, total, own) in rows:
            lines.append(f"{name:<56} {int(count):>7} {total / 1e3:>10.3f} {own / 1e3:>10.3f} {total / max(count, 1):>10.1f}")
        table = "\n".join(lines)
        out = self._out_dir(trainer)
        (out / f"hooks.rank{trainer.global_rank}.txt").write_text(table + "\n")
        if trainer.is_global_zero:
            shown = "\n".join(lines[:self.row_limit + 1])
            trainer.print(f"hookloop profiler: time per hook over the {self._cycle} profiled cycle(s) of "
                          f"{self.active} step(s), rank 0 (traces in {out}/rank<R>/):\n{shown}")

    @hookloop.hookimpl
    def on_train_start(self, trainer):
        self._training = True
        if self.mode == "torch":
            self._start(trainer)
        else:
            for optimizer in trainer.optimizers:
                self._undo.append(_time_optimizer_step(self, optimizer).remove)

    @hookloop.hookimpl(trylast=True)
    def on_train_batch_end(self, trainer):
        if self._profiler is not None:
            self._profiler.step()

    @hookloop.hookimpl
    def on_train_end(self, trainer):
        self._training = False
        if self._profiler is not None:
            self._stop(trainer)

    # -- simple mode ------------------------------------------------------------------------
    # Every phase is exclusive of the others (their sum is at most fit's time): the
    # boundaries are the outermost hook calls, seen by observe_hook_calls.

    def _before_hook(self, hook_name, impls, kwargs) -> None:
        now = time.perf_counter()
        self._depth += 1
        if self._depth != 1:
            return
        if hook_name == "on_train_batch_start" and self._mark is not None:
            self._add("fetch", now - self._mark)  # from the last hook's end: the loader's next
        elif hook_name == "on_after_backward" and "backward" in self._started:
            self._add("backward", now - self._started.pop("backward"))
        if hook_name == "on_validation_start":
            self._in_validation, self._started["validation"] = True, now
        if not self._in_validation:
            self._hooks_start = now

    def _after_hook(self, hook_name, impls, kwargs) -> None:
        self._depth -= 1
        if self._depth:
            return
        now = time.perf_counter()
        if hook_name == "on_validation_end":
            self._in_validation = False
            start = self._started.pop("validation", None)
            if start is not None:
                self._add("sanity_check" if kwargs.get("sanity_checking") else "validation", now - start)
        elif not self._in_validation:
            self._add("hooks", now - self._hooks_start)
        if hook_name == "on_before_backward":
            self._started["backward"] = now
        self._mark = now if self._training else None
        if hook_name == "on_fit_end":
            self._report(kwargs["trainer"], now)

    @hookloop.hookimpl
    def forward_context(self):
        return _Phase(self, "training_step") if self.mode == "simple" else None

    @hookloop.hookimpl
    def on_train_batch_start(self):
        """(simple mode: the end of the fetch is this hook call's start)"""

    @hookloop.hookimpl
    def on_before_backward(self):
        """(simple mode: the boundary is this hook call's end, seen by observe_hook_calls)"""

    @hookloop.hookimpl
    def on_after_backward(self):
        """(simple mode: the boundary is this hook call's start)"""

    @hookloop.hookimpl
    def on_validation_start(self):
        self._in_validation = True

    @hookloop.hookimpl
    def on_validation_end(self):
        self._in_validation = False

    def _report(self, trainer, now: float) -> None:
        if self._fit_start is None:
            return
        self._fit_time = now - self._fit_start
        report = {"fit": self._fit_time,
                  "phases": {p: {"calls": self.calls[p], "total": self.totals[p],
                                 "mean": self.totals[p] / self.calls[p]} for p in PHASES if p in self.calls}}
        lines = [f"{'phase':<16} {'calls':>7} {'total s':>10} {'mean ms':>10} {'% of fit':>9}"]
        for phase, row in report["phases"].items():
            lines.append(f"{phase:<16} {row['calls']:>7} {row['total']:>10.4f} {row['mean'] * 1e3:>10.3f} "
                         f"{100 * row['total'] / self._fit_time:>8.1f}%")
        lines.append(f"{'fit':<16} {1:>7} {self._fit_time:>10.4f}")
        table = "\n".join(lines)
        out = self._out_dir(trainer)
        rank = trainer.global_rank
        (out / f"simple.rank{rank}.txt").write_text(table + "\n")
        (out / f"simple.rank{rank}.json").write_text(json.dumps(report, indent=1) + "\n")
        if trainer.is_global_zero:
            trainer.print(f"hookloop profiler (simple): wall time of the loop's phases, rank 0 "
                          f"({out}/simple.rank<R>.txt):\n{table}")


class _Phase:
    """A re-entrant timer around each training forward (``forward_context``); evaluation
    forwards are not counted."""

    def __init__(self, owner: Profiler, phase: str):
        self.owner, self.phase, self.start = owner, phase, None

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.owner._training and not self.owner._in_validation:
            self.owner._add(self.phase, time.perf_counter() - self.start)
        return False


def _time_optimizer_step(owner: Profiler, optimizer: Any):
    """torch's per-optimizer step hooks around ``optimizer.step()``; the handle removes both."""
    inner = getattr(optimizer, "optimizer", optimizer)  # hookloop's LoopOptimizer wraps the torch one
    starts: list[float] = []

    def pre(*_):
        starts.append(time.perf_counter())

    def post(*_):
        if starts:
            owner._add("optimizer_step", time.perf_counter() - starts.pop())

    handles = [inner.register_step_pre_hook(pre), inner.register_step_post_hook(post)]

    class _Both:
        @staticmethod
        def remove():
            for handle in handles:
                handle.remove()

    return _Both
