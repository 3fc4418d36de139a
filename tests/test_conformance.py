"""hookloop.testing's conformance suites, run on every in-tree plugin (so the kit is
proven on real plugins before authors rely on it), and shown to fail plugins that break
the contract.

Each strategy suite is one launch through the strategy's own launcher (torchrun,
horovodrun, spawn) of hookloop/testing/worker.py on 2 processes (ddp2 and dp: one, as a
CPU machine gives them; ddp2's two-node path is tests/test_ddp_multinode.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hookloop.testing import (
    DevicesConformance,
    ObserverConformance,
    PrecisionConformance,
    StrategyConformance,
)
import hookloop
from conftest import install_fake_distribution
from tiers import at_least  # noqa: E402


#: The several-bucket model (three more fits of ~34 MiB in each strategy's launch) runs
#: for ddp in `make test`, for every strategy in `make test-full`.
FULL = at_least("full")


@pytest.mark.slow
class TestDDPConformance(StrategyConformance):
    plugin = "ddp"


@pytest.mark.slow
class TestDDPSpawnConformance(StrategyConformance):
    plugin = "ddp_spawn"
    wide = FULL


@pytest.mark.slow
class TestDDP2Conformance(StrategyConformance):
    plugin = "ddp2"
    wide = FULL
    world_size = 1


@pytest.mark.slow
class TestDPConformance(StrategyConformance):
    plugin = "dp"
    wide = FULL
    world_size = 1


@pytest.mark.slow
class TestHorovodConformance(StrategyConformance):
    plugin = "horovod"
    wide = FULL
    options = {"scale_lr": False}  # the reference trains at the unscaled rate


@pytest.mark.check
class TestDeepSpeedConformance(StrategyConformance):
    plugin = "deepspeed_stage_2"
    wide = FULL
    checkpoint = "directory"


@pytest.mark.slow
class TestAmpConformance(PrecisionConformance):
    plugin = "amp"
    precision = "bf16-mixed"


class TestGpusConformance(DevicesConformance):
    plugin = "gpus"


class CountsBatches:
    """A minimal third-party observer: counts batches and notes epoch ends."""

    hookloop_role = "observer"

    def __init__(self):
        self.batches, self.epochs = 0, []

    @hookloop.hookimpl
    def on_train_batch_end(self, batch_idx):
        self.batches += 1

    @hookloop.hookimpl
    def on_validation_end(self, trainer, metrics):
        self.epochs.append(("validation", trainer.sanity_checking))

    @hookloop.hookimpl
    def on_train_epoch_end(self, epoch, metrics):
        self.epochs.append(("epoch", epoch))


@pytest.mark.slow
class TestObserverConformance(ObserverConformance):
    plugin = CountsBatches  # a class under test, before it is packaged


class DDPInFull(ObserverConformance):
    """The kit's ddp check is one 2-process job per observer (~30 s on 2 idle cores):
    `make test` runs it for the observers that write files of their own (csv,
    checkpoint, tensorboard, mlflow) and the test plugin; `make test-full`
    (make test-full) for every in-tree observer."""

    @pytest.mark.full  # the ddp check of an observer writing no file of its own
    def test_under_ddp_only_global_rank_zero_writes_files(self, ddp_runs):
        super().test_under_ddp_only_global_rank_zero_writes_files(ddp_runs)


# Every in-tree observer: the core's own and those of plugins/tensorboard, mlflow, monitor.
class TestProgressConformance(DDPInFull):
    plugin = "progress"


@pytest.mark.slow
class TestCSVConformance(ObserverConformance):
    plugin = "csv"
    resume_state = False  # its file and row count: a ckpt_path= resume starts a new run directory


@pytest.mark.slow
class TestCheckpointConformance(ObserverConformance):
    plugin = "checkpoint"
    options = {"monitor": "val_acc", "mode": "max", "save_top_k": 2}
    resume_state = False  # its files' paths: a ckpt_path= resume starts a new run directory


class TestEarlyStoppingConformance(DDPInFull):
    plugin = "early_stopping"
    options = {"monitor": "val_acc", "mode": "max", "patience": 5}


class TestLRMonitorConformance(DDPInFull):
    plugin = "lr_monitor"


@pytest.mark.slow
class TestTensorBoardConformance(ObserverConformance):
    plugin = "tensorboard"


@pytest.mark.slow
class TestMLflowConformance(ObserverConformance):
    plugin = "mlflow"


class TestDeviceStatsConformance(DDPInFull):
    plugin = "device_stats"
    options = {"every_n_steps": 1}


class TestThroughputConformance(DDPInFull):
    plugin = "throughput"
    options = {"every_n_steps": 1}


# -- the kit fails plugins that break the contract ---------------------------------------------

BROKEN = textwrap.dedent('''
    import torch
    import hookloop
    from hookloop_ddp import DDP


    class NoSampler(DDP):
        """Forgets to shard the data: every rank trains on all of it."""

        hookloop_name = "nosampler"

        @hookloop.hookimpl
        def configure_sampler(self, trainer, dataloader, training):
            return None


    class Meddles:
        """An observer that changes the weights."""

        hookloop_role = "observer"

        @hookloop.hookimpl
        def on_train_epoch_end(self, trainer):
            with torch.no_grad():
                for p in trainer.module.parameters():
                    p.mul_(0.99)
''')

SUITES = textwrap.dedent('''
    from hookloop.testing import ObserverConformance, StrategyConformance
    from hl_broken import Meddles


    class TestNoSampler(StrategyConformance):
        plugin = "nosampler"


    class TestMeddles(ObserverConformance):
        plugin = Meddles
''')


@pytest.mark.slow
def test_the_suites_fail_plugins_that_break_the_contract(site, tmp_path):
    install_fake_distribution(site, "hookloop-broken", {"nosampler": "hl_broken:NoSampler"}, {"hl_broken": BROKEN},
                              requires=["hookloop-ddp"])
    (tmp_path / "test_broken.py").write_text(SUITES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "test_broken.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    failed = {line.split("::")[-1].split(" ")[0] for line in proc.stdout.splitlines() if line.startswith("FAILED")}
    assert proc.returncode == 1, proc.stdout
    # sharding, and the reference it breaks; everything else about it is fine
    assert failed == {
        "test_training_shards_are_disjoint_and_complete",
        "test_agrees_with_the_one_process_reference",
        "test_gradient_accumulation_agrees_with_the_reference",
        "test_weights_are_unchanged_by_the_observer",
    }, proc.stdout


# -- a strategy with its own reference (no one-process tolerance) ------------------------------

EVERY_TWO = textwrap.dedent('''
    """DiLoCo-like: each rank steps on its own shard; every 2 optimizer steps the ranks
    average their weights and their optimizer's momentum. Not the one-process run: its
    reference is its own (every_two_reference), computed by hand in one process."""

    import math

    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.utils.data import DistributedSampler

    import hookloop
    from hookloop.testing.reference import TinyClassifier, tiny_dataset, weights
    from hookloop_ddp import DDP

    PERIOD = 2


    class EveryTwo(DDP):
        hookloop_name = "every_two"

        def configure_ddp(self, trainer, model):
            for tensor in model.state_dict().values():  # rank 0's start, as DDP's wrapper does
                dist.broadcast(tensor, 0)
            return model  # no gradient averaging: the ranks step apart

        @hookloop.hookimpl(wrapper=True)
        def optimizer_step(self, trainer, optimizer, model):
            stepped = yield
            if (trainer.global_step + 1) % PERIOD == 0:  # the step this call took
                with torch.no_grad():
                    for p in trainer.module.parameters():
                        for t in (p, optimizer.state[p]["momentum_buffer"]):
                            dist.all_reduce(t)
                            t.div_(trainer.world_size)
            return stepped


    def every_two_reference(epochs, batch_size, world_size, accumulate=1, n=64, seed=0):
        data = tiny_dataset(n)
        replicas = [TinyClassifier(seed=seed) for _ in range(world_size)]
        optimizers = [r.configure_optimizers() for r in replicas]
        samplers = [DistributedSampler(data, num_replicas=world_size, rank=r, shuffle=True, seed=0)
                    for r in range(world_size)]
        steps, taken = math.ceil(len(samplers[0]) / batch_size), 0
        for epoch in range(epochs):
            for sampler in samplers:
                sampler.set_epoch(epoch)
            orders = [list(sampler) for sampler in samplers]
            for i in range(steps):
                for replica, order in zip(replicas, orders):
                    x, y, _ = data[torch.tensor(order[i * batch_size:(i + 1) * batch_size])]
                    (F.cross_entropy(replica(x), y) / accumulate).backward()
                if (i + 1) % accumulate and i + 1 != steps:
                    continue
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                taken += 1
                if taken % PERIOD == 0:
                    with torch.no_grad():
                        groups = zip(*(list(r.parameters()) for r in replicas))
                        for params in groups:
                            buffers = [o.state[p]["momentum_buffer"] for o, p in zip(optimizers, params)]
                            for tensors in (params, buffers):
                                mean = sum(tensors[1:], tensors[0].clone()) / world_size
                                for t in tensors:
                                    t.copy_(mean)
        return weights(replicas[0])
''')

OWN_REFERENCE = textwrap.dedent('''
    from hookloop.testing import StrategyConformance, reference_fit, max_difference
    from hl_every_two import every_two_reference


    class TestEveryTwo(StrategyConformance):
        plugin = "every_two"
        reference = staticmethod(every_two_reference)
        resume_at = 12  # an averaging step: the ranks agree, and rank 0's checkpoint is the run's state


    def test_the_one_process_reference_is_not_this_strategys():
        assert max_difference(every_two_reference(2, 4, 2), reference_fit(2, 4, 2)) > 1e-3
''')


@pytest.mark.slow
def test_a_strategy_without_a_one_process_reference_supplies_its_own(site, tmp_path):
    """A DiLoCo-like strategy (local steps, averages every 2) checked against the reference
    it supplies (one launch of the kit's worker, ~40 s): every check of the suite passes,
    the reference checks included, to 1e-5; the one-process reference is 1e-3 or more away."""
    install_fake_distribution(site, "hookloop-every-two", {"every_two": "hl_every_two:EveryTwo"},
                              {"hl_every_two": EVERY_TWO}, requires=["hookloop-ddp"])
    (tmp_path / "test_every_two.py").write_text(OWN_REFERENCE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", "test_every_two.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SKIPPED" not in proc.stdout and " passed" in proc.stdout, proc.stdout


UNDER_RAY = textwrap.dedent('''
    from hookloop.testing import StrategyConformance
    from hl_every_two import every_two_reference


    class TestEveryTwoUnderRay(StrategyConformance):
        plugin = "every_two,ray"  # the third party's strategy under the ray launcher: no combined class
        reference = staticmethod(every_two_reference)
        resume_at = 12
''')


@pytest.mark.full
def test_a_third_party_strategy_composes_with_the_ray_launcher(site, tmp_path):
    """The DiLoCo-like strategy above under hookloop-ray (a local Ray cluster, ~70 s): the
    strategy suite passes as under torchrun, against the strategy's own reference."""
    install_fake_distribution(site, "hookloop-every-two", {"every_two": "hl_every_two:EveryTwo"},
                              {"hl_every_two": EVERY_TWO}, requires=["hookloop-ddp"])
    (tmp_path / "test_every_two_ray.py").write_text(UNDER_RAY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs",
                           "test_every_two_ray.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "10 passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout
