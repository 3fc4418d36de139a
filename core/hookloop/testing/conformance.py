"""Conformance suites by role: subclass one in your plugin's tests and name your plugin.

    from hookloop.testing import StrategyConformance

    class TestLocalSGD(StrategyConformance):
        plugin = "localsgd"          # the entry-point name (installed), as users type it
        tolerance = 1e-4             # agreement with the 1-process reference (None: skip)

pytest collects the inherited tests (the base classes' names do not start with
``Test``, so they are not collected on their own). Each suite runs your plugin for real:
a strategy on ``world_size`` processes through its own launcher (``hookloop run
--plugins NAME``), an observer or precision plugin in this process and under ddp.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from .reference import TinyClassifier, max_difference, reference_fit, tiny_dataset, weights

WORKER = Path(__file__).with_name("worker.py")


def _hookloop(*args: str, cwd: Path, timeout: float) -> str:
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("HOOKLOOP_TRAINER_DEFAULTS", "HOOKLOOP_WORKER", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "hookloop", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"hookloop {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout + proc.stderr


class StrategyConformance:
    """What every strategy must do, checked on ``world_size`` real processes.

    Class attributes to set: ``plugin`` (its name); optionally ``options`` (plugin
    options), ``world_size`` (2), ``tolerance`` (max weight difference from the
    1-process reference, ``None`` to skip: e.g. local SGD, which averages only every few
    steps), ``resume_tolerance`` (0.0: a resumed run ends bit-identical on CPU),
    ``checkpoint`` (``"file"``: hookloop's single file, read back on every rank;
    ``"directory"``: a sharded checkpoint only the strategy reads), ``timeout`` (s).
    """

    plugin: str = ""
    options: dict = {}
    world_size: int = 2
    tolerance: float | None = 1e-5
    resume_tolerance: float = 0.0
    checkpoint: str = "file"
    timeout: float = 300
    batch_size = 4
    samples = 64
    epochs = 2

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls, tmp_path_factory) -> dict[str, list[dict]]:
        """Every run of the worker, per name, one record per rank (rank order)."""
        if not cls.plugin:
            pytest.fail(f"{cls.__name__} must set plugin = '<name>'")
        out = tmp_path_factory.mktemp(f"conformance-{cls.plugin}")
        spec = {"batch_size": cls.batch_size, "samples": cls.samples, "epochs": cls.epochs,
                "devices": cls.world_size, "options": {cls.plugin: dict(cls.options)} if cls.options else {},
                "resume_at": cls.samples // (cls.batch_size * cls.world_size) + 3}
        (out / "spec.json").write_text(json.dumps(spec))
        _hookloop("run", "--plugins", cls.plugin, "--devices", str(cls.world_size), str(WORKER), str(out),
                  str(out / "spec.json"), cwd=out, timeout=cls.timeout)
        found: dict[str, list[dict]] = {}
        for name in ("fit", "accumulate", "interrupted", "resumed"):
            files = sorted(out.glob(f"{name}.rank*.pt"), key=lambda p: int(p.stem.split("rank")[1]))
            found[name] = [torch.load(f, weights_only=False) for f in files]
        return found

    def ranks(self, runs, name: str) -> list[dict]:
        records = runs[name]
        assert [r["rank"] for r in records] == list(range(self.world_size)), f"{name}: one record per rank expected"
        return records

    def test_every_rank_starts_from_the_same_weights(self, runs):
        records = self.ranks(runs, "fit")
        for record in records[1:]:
            assert max_difference(record["initial"], records[0]["initial"]) == 0.0, (
                "the ranks start from different weights: broadcast rank 0's (DDP does when it wraps)")
        assert max_difference(records[0]["initial"], weights(TinyClassifier(seed=10))) == 0.0

    def test_training_shards_are_disjoint_and_complete(self, runs):
        records = self.ranks(runs, "fit")
        per_epoch = [r["seen_train"][: len(r["seen_train"]) // self.epochs] for r in records]
        everything = sorted(i for seen in per_epoch for i in seen)
        assert everything == list(range(self.samples)), "every sample once per epoch across the ranks"

    def test_validation_covers_every_sample(self, runs):
        records = self.ranks(runs, "fit")
        seen = {i for r in records for i in r["seen_val"]}
        assert seen == set(range(self.samples // 2))

    def test_collectives(self, runs):
        records = self.ranks(runs, "fit")
        w = self.world_size
        values = [[float(r + 1), -float(r)] for r in range(w)]
        expected = {
            "sum": [sum(v[i] for v in values) for i in (0, 1)],
            "mean": [sum(v[i] for v in values) / w for i in (0, 1)],
            "max": [max(v[i] for v in values) for i in (0, 1)],
            "min": [min(v[i] for v in values) for i in (0, 1)],
        }
        for record in records:
            for op, value in expected.items():
                assert record["reduce"][op] == pytest.approx(value), op
            assert record["broadcast"] == {"from": w - 1, "data": [w - 1] * 3}
            assert record["broadcast_none"] is None
            assert record["gathered"] == [r * 10 for r in range(w)]

    def test_checkpoint_is_written_once_and_read_by_every_rank(self, runs):
        records = self.ranks(runs, "fit")
        for record in records:
            assert record["checkpoint_files"] == ["saved.ckpt"], "one checkpoint, no per-rank copies or temporary files"
            if self.checkpoint == "directory":
                assert record["checkpoint_is_dir"]
                continue
            assert not record["checkpoint_is_dir"]
            assert not any(k.startswith(("module.", "_forward_module.")) for k in record["checkpoint_keys"]), (
                "checkpoint keys carry a wrapper's prefix: save trainer.module's state_dict")
            assert record["checkpoint_keys"] == sorted(weights(TinyClassifier()))
            assert max_difference(record["checkpoint_weights"], record["final"]) == 0.0

    def test_resume_continues_like_an_uninterrupted_run(self, runs):
        straight, resumed = self.ranks(runs, "fit"), self.ranks(runs, "resumed")
        interrupted = self.ranks(runs, "interrupted")
        assert interrupted[0]["global_step"] < resumed[0]["global_step"] == straight[0]["global_step"]
        for a, b in zip(straight, resumed):
            assert max_difference(a["final"], b["final"]) <= self.resume_tolerance

    def test_agrees_with_the_one_process_reference(self, runs):
        if self.tolerance is None:
            pytest.skip(f"{self.plugin}: no reference tolerance declared (tolerance = None)")
        reference = reference_fit(self.epochs, self.batch_size, self.world_size, n=self.samples, seed=10)
        for record in self.ranks(runs, "fit"):
            assert max_difference(record["final"], reference) <= self.tolerance

    def test_gradient_accumulation_agrees_with_the_reference(self, runs):
        if self.tolerance is None:
            pytest.skip(f"{self.plugin}: no reference tolerance declared (tolerance = None)")
        reference = reference_fit(1, self.batch_size, self.world_size, accumulate=2, n=self.samples, seed=10)
        for record in self.ranks(runs, "accumulate"):
            assert max_difference(record["final"], reference) <= self.tolerance

    def test_teardown_leaves_no_process_group_and_the_module_unwrapped(self, runs):
        for name in ("fit", "resumed"):
            for record in self.ranks(runs, name):
                assert not record["process_group_left"], f"{name}: teardown left the process group initialised"
                assert record["module_is_model_or_inside_it"], (
                    f"{name}: after teardown trainer.model is a {record['model_after']}; give back the "
                    f"unwrapped model (the step module, or the user's module)")


def _fit(plugins: list, precision: str = "32", epochs: int = 2, seed: int = 0, module: Any = None):
    import hookloop
    from torch.utils.data import DataLoader

    module = module or TinyClassifier(seed=seed)
    # Logs go to a temporary run directory, not into the author's working directory.
    with tempfile.TemporaryDirectory(prefix="hookloop-conformance-") as root:
        trainer = hookloop.Trainer(plugins=plugins, precision=precision, max_epochs=epochs, num_sanity_val_steps=1,
                                   default_root_dir=root)
        trainer.fit(module, DataLoader(tiny_dataset(), batch_size=8, shuffle=True),
                    DataLoader(tiny_dataset(16, seed=2), batch_size=8))
    return trainer, module


def _make(plugin: Any, options: dict) -> Any:
    """The plugin object: by installed name, or from a class (or an object) under test."""
    import hookloop

    if isinstance(plugin, str):
        if not plugin:
            pytest.fail("set plugin = '<name>' (or the plugin class) on the conformance class")
        return hookloop.plugin(plugin, **options)
    return plugin(**options) if isinstance(plugin, type) else plugin


class ObserverConformance:
    """What every observer must do: not change the math, and get its events in the
    documented order (docs/hooks.md's ``fit`` sequence, restricted to its hooks).

    Set ``plugin`` (its installed name, or its class) and optionally ``options``.
    """

    plugin: Any = ""
    options: dict = {}

    def make(self):
        return _make(self.plugin, self.options)

    def test_weights_are_unchanged_by_the_observer(self):
        torch.manual_seed(0)
        _, without = _fit([])
        torch.manual_seed(0)
        _, with_it = _fit([self.make()])
        assert max_difference(weights(without), weights(with_it)) == 0.0, (
            "the run's weights changed: an observer must not touch the math (gradients, RNG, optimizer)")

    def test_events_arrive_in_the_documented_order(self):
        from hookloop.contract import implementations

        from .order import FIT_ORDER, received_events

        observer = self.make()
        implemented = {name for name, _, _ in implementations(observer)}
        assert received_events(observer) == [name for name in FIT_ORDER if name in implemented]


class PrecisionConformance:
    """What every precision plugin must do: compose with the single-process default and
    with ddp (it trains, and 2 ddp ranks agree with each other and with one process
    within ``tolerance``).

    Set ``plugin`` (its installed name; the ddp check runs it in other processes, by
    name), ``precision`` (the setting it applies, e.g. ``"bf16-mixed"``), and optionally
    ``options`` and ``tolerance``.
    """

    plugin: str = ""
    precision: str = "bf16-mixed"
    options: dict = {}
    tolerance: float = 0.05

    def make(self):
        return _make(self.plugin, self.options)

    def test_composes_with_the_single_process_default(self):
        torch.manual_seed(0)
        trainer, module = _fit([self.make()], precision=self.precision)
        assert trainer.global_step == 16
        assert all(torch.isfinite(t).all() for t in weights(module).values())
        assert trainer.callback_metrics["val_acc"] > 0.5, "it trains: above chance (0.33) on the tiny task"
        torch.manual_seed(0)
        _, full = _fit([], precision="32")
        assert max_difference(weights(module), weights(full)) <= self.tolerance

    def test_composes_with_ddp(self, tmp_path):
        pytest.importorskip("hookloop_ddp")
        import hookloop

        script = tmp_path / "precision_ddp.py"
        script.write_text(_PRECISION_DDP.format(plugin=self.plugin, precision=self.precision,
                                                options=json.dumps(self.options)))
        _hookloop("run", "--plugins", "ddp", "--devices", "2", str(script), str(tmp_path), cwd=tmp_path, timeout=300)
        ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert max_difference(ranks[0], ranks[1]) == 0.0, "the ddp ranks disagree"
        single = reference_fit(2, 4, world_size=2, seed=10)  # fp32, one process, the union batches
        assert max_difference(ranks[0], single) <= self.tolerance


_PRECISION_DDP = '''
import json, sys, torch
import hookloop
from torch.utils.data import DataLoader
from hookloop.testing.reference import TinyClassifier, tiny_dataset, weights
options = json.loads({options!r})
plugin = hookloop.plugin({plugin!r}, **options)
trainer = hookloop.Trainer(plugins=[plugin], precision={precision!r}, max_epochs=2, enable_checkpointing=False)
module = TinyClassifier(seed=10)
trainer.fit(module, DataLoader(tiny_dataset(), batch_size=4))
torch.save(weights(module), f"{{sys.argv[1]}}/rank{{trainer.global_rank}}.pt")
'''


class DevicesConformance:
    """What every devices plugin must do where it runs (a machine without GPUs here):
    answer ``select_devices`` with ``None`` or a list of device indices, before any
    process starts, and leave a run that trains like one without it.

    Set ``plugin`` (its installed name, or its class) and optionally ``options``.
    """

    plugin: Any = ""
    options: dict = {}

    def make(self):
        return _make(self.plugin, self.options)

    def test_select_devices_answers_a_list_of_indices_or_none(self):
        import hookloop

        trainer = hookloop.Trainer(plugins=[self.make()])
        chosen = trainer.hook.select_devices(config=trainer.config)
        assert chosen is None or (isinstance(chosen, list) and all(isinstance(i, int) and i >= 0 for i in chosen))

    def test_a_run_with_it_trains_like_one_without_it(self):
        torch.manual_seed(0)
        _, with_it = _fit([self.make()])
        torch.manual_seed(0)
        _, without = _fit([])
        assert max_difference(weights(with_it), weights(without)) == 0.0
