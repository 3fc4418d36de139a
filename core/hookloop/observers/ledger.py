"""``ledger`` (opt-in): where the time of a training step goes, per plugin and hook.

``--plugins ledger`` or ``Trainer(plugins=["ledger"])`` (``hookloop.Ledger()``). For each
optimizer step, attributed to each ``plugin.hook`` implementation (time inside nested
hooks goes to the inner one), and to the core (the loop outside any hook: loading the
batch, ``training_step``, backward, the optimizer, the dispatch of events):

* **ms/step**: wall time (``time.perf_counter`` around each implementation);
* **calls/step**: Python calls and C calls made from Python (``sys.setprofile``'s
  ``call`` and ``c_call`` events), as benchmarks/loop_overhead.py counts them;
* **syncs/step**: host-device synchronisations. On CUDA: every synchronising operation
  ``torch.cuda.set_sync_debug_mode("warn")`` reports (its warnings are caught and
  counted, not shown). Elsewhere (CPU): calls of ``Tensor.item``, ``Tensor.tolist`` and
  ``Tensor.numpy``, which synchronise on an accelerator, and ``Tensor.cpu`` of a tensor
  not on the CPU. ``float(t)``, ``int(t)``, ``bool(t)`` and ``if t:`` go through type
  slots that ``sys.setprofile`` does not report: on the CPU they are not counted;
* **collectives/step**: calls of ``torch.distributed``'s collectives from Python (the
  outermost one: ``all_gather_object``'s inner ``all_gather`` is not counted again),
  seen as ``call`` events of their functions in ``torch.distributed.distributed_c10d``
  (FSDP2's ``all_gather_single``/``reduce_scatter_single`` among them) and in
  ``torch.distributed._functional_collectives`` (DTensor's).
  Collectives issued from C++ (DDP's bucketed gradient all-reduce) are not seen.

Steps are measured in turn: on *counted* steps (the second optimizer step, then every
``count_every``-th: 2, 2 + count_every, ...) the profile hook runs and no time is kept
(its cost would be billed to whatever it counts); on the others, *timed*, only the
clocks run. The first optimizer step (warm-up) is neither. Validation inside an epoch is
left out of the steps. The ledger's own code (its hooks, its callbacks, and the
observing helper's wrappers and dispatch: ``OBSERVER_CODES``) is not counted; its
remaining cost on timed steps, per implementation the helper's wrapper, the ledger's
``_before``/``_after`` and two clock reads, is measured by benchmarks/ledger.py.

The per-implementation split is :func:`hookloop.dispatch.observe_hook_calls`' (its
``before_impl``/``after_impl``, from ``setup`` to teardown): the step's resolved events
stay direct calls, not pluggy's dispatch (about ten calls each), which the run without
the ledger does not pay, and another observer (the profiler) can watch the same run.
Hook wrappers (``hookwrapper=True``/``wrapper=True``) are not split out: their time is
the core's.

At the end of ``fit``, global rank 0 prints the table (its own rank's numbers) and
writes ``ledger.json`` and ``ledger.txt`` in the run directory (``trainer.log_dir``).
"""

from __future__ import annotations

import json
import sys
import warnings
from time import perf_counter
from typing import Any

import torch

from hookloop.contract.errors import ConfigurationError
from hookloop.contract.hookspecs import hookimpl
from hookloop.dispatch import OBSERVER_CODES, observe_hook_calls

#: Tensor methods that wait for the device (on an accelerator), counted on the CPU
SYNC_METHODS = frozenset({"item", "tolist", "numpy"})
#: Tensor methods that synchronise when their tensor is not on the CPU
COPY_METHODS = frozenset({"cpu"})
#: ``torch.distributed`` collectives (and point-to-point calls) counted
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced",
    "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast",
    "reduce", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "gather", "scatter",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "all_gather_single", "reduce_scatter_single", "send_object_list",
    "recv_object_list",
)
#: ``torch.distributed._functional_collectives`` (DTensor's, tp's) counted
FUNCTIONAL_COLLECTIVES = (
    "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
    "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "permute_tensor",
)
CORE = "core (outside hooks)"
TOTAL = "total step"
COLUMNS = ("ms/step", "calls/step", "syncs/step", "collectives/step")


def collective_codes() -> frozenset:
    """The code objects of :data:`COLLECTIVES` (under their logging decorators)."""
    try:
        import torch.distributed.distributed_c10d as c10d
    except ImportError:  # pragma: no cover - torch built without distributed
        return frozenset()
    try:
        import torch.distributed._functional_collectives as functional
    except ImportError:  # pragma: no cover
        functional = None
    codes = set()
    for module, names in ((c10d, COLLECTIVES), (functional, FUNCTIONAL_COLLECTIVES)):
        for name in names:
            fn = getattr(module, name, None)
            while fn is not None and hasattr(fn, "__wrapped__"):
                fn = fn.__wrapped__
            code = getattr(fn, "__code__", None)
            if code is not None:
                codes.add(code)
    return frozenset(codes)


class Ledger:
    """Per-step wall time, Python calls, host-device syncs and collectives of every
    plugin's hook implementations and of the core, printed and saved at the end of fit.

    print_table: print the table on global rank 0 at the end of fit (default True)
    count_every: count calls, syncs and collectives on every this many optimizer steps
        (default 4; the profile hook slows the steps it counts about twofold)
    """

    hookloop_name = "ledger"
    hookloop_role = "observer"

    def __init__(self, print_table: bool = True, count_every: int = 4):
        if isinstance(count_every, bool) or not isinstance(count_every, int) or count_every < 1:
            raise ConfigurationError(
                f"ledger count_every={count_every!r} must be a positive whole number of optimizer steps "
                f"(--plugin-option ledger.count_every=4)")
        self.print_table = print_table
        self.count_every = count_every
        self.rows: dict[str, dict[str, float]] = {}
        self._reset()

    def _reset(self) -> None:
        self._buckets: dict[str, list] = {}  # key: [time (timed steps), calls, syncs, collectives, time discarded]
        self._core = self._cur = [0.0, 0, 0, 0, 0.0]
        self._stack: list[list] = [self._core]
        self._child = [0.0]
        self._by_impl: dict[Any, list] = {}  # pluggy's HookImpl: its bucket
        self._frames: list = []  # per observed implementation call: its start (None: not measured)
        self._undo = None
        self._active = False  # inside a step being measured
        self._counting = False  # the profile hook is on
        self._slot = 0  # where the wrappers add time: 0 on timed steps, 4 (discarded) on counted ones
        self._window_step: int | None = None
        self._window_start = 0.0
        self._window_time = 0.0
        self._windows = 0  # steps begun (the first is the warm-up)
        self._timed = self._counted = 0
        self._step_time = 0.0
        self._coll_frame = None
        self._cuda = False
        self._warnings: Any = None
        self._codes = collective_codes()

    # -- attribution ------------------------------------------------------------------------

    def _before(self, hook_name, impl) -> None:
        if not self._active or impl.plugin is self:
            self._frames.append(None)
            return
        bucket = self._by_impl.get(impl)
        if bucket is None:
            bucket = self._by_impl[impl] = self._buckets.setdefault(
                f"{impl.plugin_name}.{hook_name}", [0.0, 0, 0, 0, 0.0])
        self._stack.append(bucket)
        self._child.append(0.0)
        self._cur = bucket
        self._frames.append(perf_counter())

    def _after(self, hook_name, impl) -> None:
        t0 = self._frames.pop()
        if t0 is None:
            return
        dt = perf_counter() - t0
        inner = self._child.pop()
        bucket = self._stack.pop()
        self._cur = self._stack[-1]
        bucket[self._slot] += dt - inner
        self._child[-1] += dt

    @property
    def _own(self) -> set:
        own = self.__dict__.get("_own_codes")
        if own is None:
            own = self.__dict__["_own_codes"] = {
                f.__code__ for f in vars(type(self)).values() if hasattr(f, "__code__")} | OBSERVER_CODES
        return own

    def _profile(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code in self._own:
                return
            bucket = self._cur
            bucket[1] += 1
            if code in self._codes and self._coll_frame is None:
                bucket[3] += 1
                self._coll_frame = frame
        elif event == "c_call":
            if frame.f_code in self._own:
                return
            bucket = self._cur
            bucket[1] += 1
            if self._cuda:
                return
            name = getattr(arg, "__name__", None)
            if name in SYNC_METHODS:
                if isinstance(getattr(arg, "__self__", None), torch.Tensor):
                    bucket[2] += 1
            elif name in COPY_METHODS:
                tensor = getattr(arg, "__self__", None)
                if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu":
                    bucket[2] += 1
        elif event == "return" and frame is self._coll_frame:
            self._coll_frame = None

    def _showwarning(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            self._cur[2] += 1
        else:
            self._original_showwarning(message, category, filename, lineno, file, line)

    # -- steps ------------------------------------------------------------------------------

    def _open(self, trainer) -> None:
        self._window_step = trainer.global_step
        self._windows += 1
        self._window_time = 0.0
        warm_up = self._windows == 1
        self._counting = not warm_up and (self._windows - 2) % self.count_every == 0
        self._slot = 0 if not warm_up and not self._counting else 4
        self._cur = self._core
        self._active = True
        if self._slot == 0:
            self._snapshot = [bucket[0] for bucket in self._buckets.values()]
        if self._counting:
            if self._cuda:
                self._start_sync_debug()
            sys.setprofile(self._profile)
        self._window_start = perf_counter()

    def _close(self, trainer, complete: bool) -> None:
        """End the step being measured; ``complete``: its optimizer step ran."""
        if self._counting:
            sys.setprofile(None)
            if self._cuda:
                self._stop_sync_debug()
        elapsed = self._window_time + (perf_counter() - self._window_start if self._active else 0.0)
        self._active = False
        self._coll_frame = None
        if complete and self._windows > 1:
            if self._counting:
                self._counted += 1
            else:
                self._timed += 1
                self._step_time += elapsed
        elif self._slot == 0 and self._windows > 1:  # an incomplete timed step: its times are dropped
            for bucket, before in zip(self._buckets.values(), self._snapshot):
                bucket[0] = before
        self._counting = False
        self._window_step = None

    def _start_sync_debug(self) -> None:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=".*synchroniz")
        self._original_showwarning = warnings.showwarning
        warnings.showwarning = self._showwarning
        torch.cuda.set_sync_debug_mode("warn")

    def _stop_sync_debug(self) -> None:
        torch.cuda.set_sync_debug_mode("default")
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None

    # -- hooks ------------------------------------------------------------------------------

    @hookimpl(trylast=True)
    def setup(self, trainer, stage):
        if stage != "fit":
            return
        self._reset()
        self._cuda = trainer.root_device.type == "cuda"
        self._undo = observe_hook_calls(trainer, before_impl=self._before, after_impl=self._after)

    @hookimpl(tryfirst=True)
    def on_train_batch_start(self, trainer):
        if self._window_step is not None:
            if trainer.global_step == self._window_step:
                return  # accumulating: the same optimizer step
            self._close(trainer, True)
        self._open(trainer)

    @hookimpl(tryfirst=True)
    def on_validation_start(self, trainer):
        if self._window_step is not None and self._active:
            if self._counting:
                sys.setprofile(None)
            self._window_time += perf_counter() - self._window_start
            self._active = False

    @hookimpl(trylast=True)
    def on_validation_end(self, trainer):
        if self._window_step is not None and not self._active:
            self._active = True
            self._cur = self._core
            if self._counting:
                sys.setprofile(self._profile)
            self._window_start = perf_counter()

    @hookimpl(tryfirst=True)
    def on_train_epoch_end(self, trainer):
        if self._window_step is not None:
            self._close(trainer, trainer.global_step != self._window_step)

    @hookimpl(tryfirst=True)
    def on_train_end(self, trainer):
        if self._window_step is not None:
            self._close(trainer, trainer.global_step != self._window_step)

    @hookimpl
    def on_exception(self):
        self._stop()

    @hookimpl
    def teardown(self, trainer, stage):
        if stage != "fit":
            return
        self._stop()
        self.rows = self.table_rows()
        if trainer.global_rank == 0 and self._timed + self._counted:
            text = format_table(self.rows, self._timed, self._counted)
            if self.print_table:
                print(text, flush=True)
            try:
                directory = trainer.log_dir
                directory.mkdir(parents=True, exist_ok=True)
                (directory / "ledger.txt").write_text(text + "\n")
                (directory / "ledger.json").write_text(json.dumps(
                    {"timed_steps": self._timed, "counted_steps": self._counted,
                     "rows": {key: {c: (None if v != v else v) for c, v in values.items()}  # NaN: not measured
                              for key, values in self.rows.items()}}, indent=1) + "\n")
            except OSError as exc:
                print(f"hookloop ledger: could not write the table to the run directory: {exc}", flush=True)

    def _stop(self) -> None:
        if self._counting:
            sys.setprofile(None)
            if self._cuda:
                self._stop_sync_debug()
        self._counting = self._active = False
        if self._undo is not None:
            self._undo()
            self._undo = None

    # -- the table --------------------------------------------------------------------------

    def table_rows(self) -> dict[str, dict[str, float]]:
        """``{"plugin.hook": {"ms/step": ..., "calls/step": ..., "syncs/step": ...,
        "collectives/step": ...}, ..., CORE: ..., TOTAL: ...}``, heaviest first (rows
        with nothing measured are left out)."""
        timed, counted = self._timed, self._counted

        def row(bucket):
            return {
                "ms/step": bucket[0] / timed * 1000 if timed else float("nan"),
                "calls/step": bucket[1] / counted if counted else float("nan"),
                "syncs/step": bucket[2] / counted if counted else float("nan"),
                "collectives/step": bucket[3] / counted if counted else float("nan"),
            }

        hooks = {key: row(bucket) for key, bucket in self._buckets.items() if bucket[0] or bucket[1]}
        hooks = dict(sorted(hooks.items(), key=lambda kv: (-kv[1]["ms/step"] if timed else 0, kv[0])))
        total_time = self._step_time
        core = list(self._core)
        core[0] = total_time - sum(bucket[0] for bucket in self._buckets.values())
        total = [total_time] + [self._core[i] + sum(b[i] for b in self._buckets.values()) for i in (1, 2, 3)]
        return {**hooks, CORE: row(core), TOTAL: row(total)}


def format_table(rows: dict[str, dict[str, float]], timed: int, counted: int) -> str:
    """The ledger's rows as a text table."""
    width = max([len("plugin.hook")] + [len(k) for k in rows])
    lines = [f"hookloop ledger: per optimizer step ({timed} timed, {counted} counted steps)",
             f"{'plugin.hook':<{width}}  " + "  ".join(f"{c:>16}" for c in COLUMNS)]
    for key, values in rows.items():
        if key == TOTAL:
            lines.append("-" * len(lines[1]))
        lines.append(f"{key:<{width}}  " + "  ".join(
            f"{values[c]:>16.3f}" if c == "ms/step" else f"{values[c]:>16.1f}" for c in COLUMNS))
    return "\n".join(lines)
