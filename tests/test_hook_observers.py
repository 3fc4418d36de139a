"""``hookloop.dispatch.observe_hook_calls`` (issue 22): one way to watch every hook call, the
step's resolved events included, that the ``ledger`` and the ``profiler`` share and that
composes. The reference is what the implementations themselves record (``Recorder``: its
own list of calls, a closed form of the loop: N batches x the per-step hooks), and the
per-step Python calls of a run without observers (``sys.setprofile``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pluggy._callers import _multicall
from torch.utils.data import DataLoader

import hookloop
from hookloop.observers.ledger import Ledger
from hookloop.dispatch import observe_hook_calls

from conftest import TinyModule, tiny_data

BATCHES = 8
#: the per-step events the recorder implements (each once per batch, accumulate 1)
PER_STEP = ("on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
            "on_before_optimizer_step", "on_train_batch_end")


class Recorder:
    """Records each call of its implementations (one per name of ``PER_STEP``, each a
    plain ``list.append``): the ground truth of what ran."""

    hookloop_name = "recorder"
    hookloop_role = "observer"

    def __init__(self):
        self.calls: list[str] = []


def _recording(name: str):
    def hook(self):
        self.calls.append(name)

    hook.__name__ = name
    return hookloop.hookimpl(hook)


for _name in PER_STEP:
    setattr(Recorder, _name, _recording(_name))


def trainer_with(plugins, root, **kwargs):
    options = dict(max_epochs=1, default_root_dir=str(root), enable_progress_bar=False, logger=False,
                   enable_checkpointing=False, num_sanity_val_steps=0)
    options.update(kwargs)
    return hookloop.Trainer(plugins=plugins, **options)


def fit(trainer, batches: int = BATCHES):
    trainer.fit(TinyModule(), DataLoader(tiny_data(8 * batches), batch_size=8))
    return trainer


def functions(trainer) -> dict:
    """Every registered implementation's function, and the plugin manager's hookexec."""
    pm = trainer.plugin_manager
    found = {"hookexec": pm._inner_hookexec}
    for name, caller in vars(pm.hook).items():
        for impl in getattr(caller, "get_hookimpls", lambda: [])():
            found[(name, impl.plugin_name)] = impl.function
    return found


def test_ledger_and_profiler_in_one_run_both_see_every_call_and_leave_the_run_as_it_was(tmp_path):
    recorder = Recorder()
    ledger = Ledger(print_table=False, count_every=1)
    profiler = hookloop.plugin("profiler", wait=1, warmup=1, active=3)
    trainer = trainer_with([ledger, profiler, recorder], tmp_path)
    before = functions(trainer)
    fit(trainer)
    # the reference: each per-step implementation ran once per batch
    for name in PER_STEP:
        assert recorder.calls.count(name) == BATCHES, name
    # the ledger: steps 2..8 counted (count_every=1; step 1 is the warm-up), each implementation
    # call billed once to its own row: its own call and list.append's (a C call)
    assert (ledger._counted, ledger._timed) == (BATCHES - 1, 0)
    for name in PER_STEP:
        assert ledger.rows[f"recorder.{name}"]["calls/step"] == 2, name
    # the profiler: batches 3, 4, 5 recorded (wait 1, warmup 1, active 3): each hook call in its
    # range and each implementation of the recorder in its own, exactly once per recorded batch
    (trace,) = sorted((Path(trainer.log_dir) / "profiler" / "rank0").iterdir())
    names = [e.get("name") for e in json.loads(trace.read_text())["traceEvents"]]
    for name in PER_STEP:
        assert names.count(f"hookloop/recorder.{name}") == 3, name
        assert names.count(f"hookloop/{name}") == 3, name
    # the ledger's own hooks and the profiler's are not in each other's rows or ranges twice
    assert names.count("hookloop/ledger.on_train_batch_start") == 3
    assert "hookloop/profiler.on_train_batch_end" not in names
    # both undone at teardown: every function and the hookexec are the ones before the run
    assert functions(trainer) == before
    assert trainer.plugin_manager._inner_hookexec is _multicall
    assert sys.getprofile() is None


def calls_between(trainer, start: int, stop: int, undo_at: int | None = None, undos=()) -> int:
    """Python calls and C calls from batch ``start``'s ``on_train_batch_start`` to batch
    ``stop``'s; at batch ``undo_at`` (before counting) the ``undos`` run, in order."""
    calls = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1

    class Window:
        hookloop_role = "observer"

        @hookloop.hookimpl(tryfirst=True)
        def on_train_batch_start(self, batch_idx):
            if batch_idx == undo_at:
                for undo in undos:
                    undo()
            if batch_idx == start:
                sys.setprofile(profile)
            elif batch_idx == stop:
                sys.setprofile(None)

    trainer.plugin_manager.register(Window(), name="window")
    try:
        fit(trainer, batches=stop + 2)
    finally:
        sys.setprofile(None)
    return calls[0]


@pytest.mark.parametrize("order", ["first_added_first", "last_added_first"])
def test_two_observers_undone_in_either_order_leave_no_trace(tmp_path, order):
    # reference: the same run without observers
    baseline = calls_between(trainer_with([Recorder()], tmp_path / "plain"), 4, 8)

    recorder = Recorder()
    trainer = trainer_with([recorder], tmp_path / "observed")
    before = functions(trainer)
    seen = {"calls": [], "impls": [], "listed": {}}

    def on_call(name, impls, kwargs):
        seen["calls"].append(name)
        seen["listed"][name] = [impl.plugin_name for impl in impls]

    undo_calls = observe_hook_calls(trainer, on_call, lambda name, impls, kwargs: seen["calls"].append("/" + name))
    undo_impls = observe_hook_calls(trainer, before_impl=lambda name, impl: seen["impls"].append((impl.plugin_name, name)))
    undos = [undo_calls, undo_impls] if order == "first_added_first" else [undo_impls, undo_calls]
    # observed for batches 0 and 1, undone at batch 2 (mid-run: the step's events resolved
    # while observing), then counted over batches 4..7
    observed = calls_between(trainer, 4, 8, undo_at=2, undos=undos)
    assert observed == baseline
    after = functions(trainer)
    assert {key: after[key] for key in before} == before
    assert trainer.plugin_manager._inner_hookexec is _multicall
    # while observed, both saw every per-step call of batches 0 and 1, the calls in pairs; batch
    # 2's on_train_batch_start, during which they were undone (before the recorder's turn), has
    # its call's before and after, and not the recorder's implementation
    for name in PER_STEP:
        assert seen["impls"].count(("recorder", name)) == 2, name
        pairs = 3 if name == "on_train_batch_start" else 2
        assert seen["calls"].count(name) == seen["calls"].count("/" + name) == pairs, name
        # a resolved event's implementations as pluggy lists them (its dispatch's order)
        assert seen["listed"][name] == [impl.plugin_name for impl in getattr(trainer.hook, name).get_hookimpls()]
    undo_calls()  # twice: nothing
    assert trainer.plugin_manager._inner_hookexec is _multicall


def test_observers_compose_with_pluggy_monitoring_and_nest(tmp_path):
    trainer = trainer_with([Recorder()], tmp_path)
    events = []
    undo_pluggy = trainer.plugin_manager.add_hookcall_monitoring(
        lambda name, impls, kwargs: events.append(("pluggy", name)), lambda *a: None)
    undo_a = observe_hook_calls(trainer, lambda name, impls, kwargs: events.append(("a", name)),
                                lambda name, impls, kwargs: events.append(("/a", name)))
    undo_b = observe_hook_calls(trainer, lambda name, impls, kwargs: events.append(("b", name)),
                                lambda name, impls, kwargs: events.append(("/b", name)),
                                before_impl=lambda name, impl: events.append(("b-impl", name)))
    fit(trainer, batches=2)
    undo_b()
    undo_a()  # ours in either order, then pluggy's (its undo is last-in-first-out)
    undo_pluggy()
    assert trainer.plugin_manager._inner_hookexec is _multicall
    # pluggy's monitor sends the step's events through pluggy: it and both observers see them
    calls = [e for e in events if e[1] == "on_before_backward"]
    assert calls == [("a", "on_before_backward"), ("b", "on_before_backward"), ("pluggy", "on_before_backward"),
                     ("b-impl", "on_before_backward"), ("/b", "on_before_backward"), ("/a", "on_before_backward")] * 2


def test_bad_callbacks_are_refused(tmp_path):
    trainer = trainer_with([], tmp_path)
    with pytest.raises(hookloop.ConfigurationError, match="not callable"):
        observe_hook_calls(trainer, "print")
