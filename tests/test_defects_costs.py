"""Issue 17 §2, defect 13: per-step costs that are paid for nothing.

* 13a: under manual optimization, every ``self.manual_backward(loss)`` resolved (and, until
  issue 34, compiled with ``exec``) the callers of ``on_before_backward``/``on_after_backward``
  again when someone implements them; now once per fit, as on the automatic path.
* 13b: the SIGTERM agreement (``hookloop.distributed.faults.Preemption.agreed``) was a blocking
  all-reduce at every optimizer step: each rank waited there for the slowest. It is now
  started at a boundary and read at the next agreement, on a gloo side group (since issue
  33 every ``stop_check_every_n_steps`` boundaries: tests/test_faults.py).

Counted, never timed (the timings are in benchmarks/ddp_throughput.py).
"""

from __future__ import annotations


import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import TinyModule, fit_profiled, tiny_data
from hookloop import dispatch


class ManualTiny(TinyModule):
    automatic_optimization = False

    def __init__(self):
        super().__init__(seed=0)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class AroundBackward:
    """Implements both backward events (as ddp's manual-optimization helper does)."""

    hookloop_role = "observer"

    def __init__(self):
        self.before = self.after = 0

    @hookloop.hookimpl
    def on_before_backward(self, loss):
        self.before += 1

    @hookloop.hookimpl
    def on_after_backward(self):
        self.after += 1


def test_manual_backward_resolves_the_backward_events_once_per_fit_not_per_call():
    compiled = 0

    def profile(frame, event, arg):
        nonlocal compiled
        if event == "call" and frame.f_code is dispatch._plain_caller.__code__:
            compiled += 1

    def fit(steps):
        nonlocal compiled
        observer = AroundBackward()
        trainer = hookloop.Trainer(plugins=[observer], max_steps=steps, enable_checkpointing=False, logger=False,
                                   enable_progress_bar=False, num_sanity_val_steps=0)
        compiled = 0
        fit_profiled(trainer, ManualTiny(), DataLoader(tiny_data(8 * 40), batch_size=8), profile)
        assert observer.before == observer.after == steps  # the events still reach the plugin
        assert getattr(trainer, "_backward_events", None) is None  # dropped with the run
        return compiled

    ten, twenty = fit(10), fit(20)
    # before: 2 resolutions per manual_backward (ten=20 + setup, twenty=40 + setup)
    assert twenty == ten, (ten, twenty)
    assert ten <= 6  # the fit's own resolutions: a constant


class BackwardAtTrainStart(ManualTiny):
    def on_train_start(self):  # before the loop's steps exist
        x, y = next(iter(DataLoader(tiny_data(16), batch_size=8)))
        self.manual_backward(torch.nn.functional.cross_entropy(self(x), y))


def test_manual_backward_outside_the_steps_still_reaches_the_events():
    observer = AroundBackward()
    trainer = hookloop.Trainer(plugins=[observer], max_steps=2, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False)
    trainer.fit(BackwardAtTrainStart(), DataLoader(tiny_data(16), batch_size=8))
    assert observer.before == observer.after == 3


# -- 13b: the SIGTERM agreement ---------------------------------------------------------------

STEPS = 6


class WaitsForPeer(TinyModule):
    """Global rank 1 ends each step k (on_train_batch_end, before the loop's agreement at
    boundary k) only once global rank 0 has *started* step k + 1, i.e. once rank 0 has
    passed boundary k's agreement. A blocking agreement cannot let rank 0 pass before rank
    1 has contributed to it: the two wait for each other until rank 1 gives up."""

    def __init__(self, store_path: str, fit_index: int):
        super().__init__(seed=0)
        self.store_path, self.fit_index = store_path, fit_index

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_rank == 0:
            self.store().set(f"fit{self.fit_index}/started/{batch_idx}", "1")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        from datetime import timedelta

        if self.trainer.global_rank == 1 and batch_idx + 1 < STEPS:
            key = f"fit{self.fit_index}/started/{batch_idx + 1}"
            try:
                self.store().wait([key], timedelta(seconds=30))
            except Exception as exc:
                raise AssertionError(f"global rank 0 did not start step {batch_idx + 2} while rank 1 had not "
                                     f"reached the boundary after step {batch_idx + 1}: the agreement blocked "
                                     f"({exc})") from None

    def store(self):
        import torch.distributed as dist

        if not hasattr(self, "_store"):
            self._store = dist.FileStore(f"{self.store_path}.{self.fit_index}", 2)
        return self._store


def agreement_does_not_block(store_path: str) -> dict:
    import torch.distributed as dist

    from hookloop.distributed import collectives as hookloop_dist

    seen = []
    for fit_index in range(2):  # a second fit in the process: a new default group, a new side group
        # an agreement at every boundary (the default's every 16 would leave none in 6 steps)
        trainer = hookloop.Trainer(plugins=["ddp"], max_steps=STEPS, enable_checkpointing=False, logger=False,
                                   enable_progress_bar=False, process_group_timeout=60, stop_check_every_n_steps=1)
        module = WaitsForPeer(store_path, fit_index)
        trainer.fit(module, DataLoader(tiny_data(8 * STEPS * 2), batch_size=8))
        seen.append(trainer.global_step)
    return {"steps": seen, "group_left": dist.is_initialized(), "side_group_kept": bool(hookloop_dist._CPU_GROUPS),
            "weights": {k: v.clone() for k, v in module.state_dict().items()}}


@pytest.mark.slow
def test_the_sigterm_agreement_lets_a_rank_pass_a_boundary_its_peer_has_not_reached(hookloop_processes, tmp_path):
    results = hookloop_processes(agreement_does_not_block, nprocs=2, args=(str(tmp_path / "store"),), timeout=240)
    for r in results:
        assert r["steps"] == [STEPS, STEPS]
        assert not r["group_left"] and not r["side_group_kept"]  # the side group went with the run's group
    a, b = (r["weights"] for r in results)
    assert all(torch.equal(a[k], b[k]) for k in a)  # still one model: DDP synchronised every step
