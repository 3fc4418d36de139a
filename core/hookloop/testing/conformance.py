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

from hookloop.testing.reference import TinyClassifier, max_difference, reference_fit, tiny_dataset, weights

WORKER = Path(__file__).with_name("worker.py")


def _hookloop(*args: str, cwd: Path, timeout: float, pythonpath: str | None = None) -> str:
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("HOOKLOOP_TRAINER_DEFAULTS", "HOOKLOOP_WORKER", "LOCAL_RANK")}
    if pythonpath:  # where the workers import a plugin class under test from
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
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

    A strategy whose result is not the one-process run's (local SGD, DiLoCo: the ranks
    step apart between averages) supplies its own ``reference``: a ``staticmethod`` with
    :func:`hookloop.testing.reference_fit`'s signature, ``reference(epochs, batch_size,
    world_size, accumulate=1, n=64, seed=0)`` returning the weights every rank must end
    with, computed in one process by hand; the reference checks then hold it to
    ``tolerance``. ``resume_at`` (the step the interrupted run stops at; default a few
    steps into the second epoch) lets such a strategy interrupt where its ranks agree.
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
    # Also train, interrupt (mid-epoch) and resume a ~34 MiB model, reduced by DDP in
    # several gradient buckets (the tiny model fits in one).
    wide: bool = True
    #: the weights the run must reach (default: reference_fit, the one-process run)
    reference: Any = None
    resume_at: int | None = None

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls, tmp_path_factory) -> dict[str, list[dict]]:
        """Every run of the worker, per name, one record per rank (rank order)."""
        if not cls.plugin:
            pytest.fail(f"{cls.__name__} must set plugin = '<name>'")
        out = tmp_path_factory.mktemp(f"conformance-{cls.plugin}")
        spec = {"batch_size": cls.batch_size, "samples": cls.samples, "epochs": cls.epochs,
                "devices": cls.world_size, "options": {cls.plugin: dict(cls.options)} if cls.options else {},
                "resume_at": cls.resume_at or cls.samples // (cls.batch_size * cls.world_size) + 3,
                "wide": cls.wide}
        (out / "spec.json").write_text(json.dumps(spec))
        _hookloop("run", "--plugins", cls.plugin, "--devices", str(cls.world_size), str(WORKER), str(out),
                  str(out / "spec.json"), cwd=out, timeout=cls.timeout)
        found: dict[str, list[dict]] = {}
        for name in ("fit", "accumulate", "interrupted", "resumed") + (("wide", "wide_interrupted", "wide_resumed")
                                                                          if cls.wide else ()):
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
        fit = self.reference or reference_fit
        reference = fit(self.epochs, self.batch_size, self.world_size, n=self.samples, seed=10)
        for record in self.ranks(runs, "fit"):
            assert max_difference(record["final"], reference) <= self.tolerance

    def test_gradient_accumulation_agrees_with_the_reference(self, runs):
        if self.tolerance is None:
            pytest.skip(f"{self.plugin}: no reference tolerance declared (tolerance = None)")
        fit = self.reference or reference_fit
        reference = fit(1, self.batch_size, self.world_size, accumulate=2, n=self.samples, seed=10)
        for record in self.ranks(runs, "accumulate"):
            assert max_difference(record["final"], reference) <= self.tolerance

    def test_a_model_of_several_ddp_buckets_trains_alike_and_resumes_exactly(self, runs):
        """The wide model (``wide``): reduced in more than one DDP bucket where the strategy
        wraps in DistributedDataParallel; the ranks end with the same weights (where the
        strategy declares a reference ``tolerance``); interrupted after half an epoch and
        resumed, it ends as the uninterrupted run (exactly, when ``resume_tolerance`` is 0)."""
        if not self.wide:
            pytest.skip(f"{type(self).__name__}.wide is False: the several-bucket model is not run")
        straight, resumed = self.ranks(runs, "wide"), self.ranks(runs, "wide_resumed")
        interrupted = self.ranks(runs, "wide_interrupted")
        buckets = [r.get("ddp_buckets") for r in straight]
        if any(b is not None for b in buckets):
            assert all(b is not None and b > 1 for b in buckets), (
                f"the wide model was reduced in {buckets} DDP bucket(s) per rank: expected several")
        if self.tolerance is not None:
            for rank, record in enumerate(straight[1:], 1):
                differ = sorted(k for k in record["final"] if record["final"][k] != straight[0]["final"][k])
                assert not differ, (f"wide model: rank {rank} ended with other weights than rank 0 in {differ}: the "
                                    f"ranks reduce some gradient buckets differently")
        assert interrupted[0]["global_step"] < resumed[0]["global_step"] == straight[0]["global_step"]
        if self.resume_tolerance == 0.0:
            for rank, (a, b) in enumerate(zip(straight, resumed)):
                differ = sorted(k for k in a["final"] if a["final"][k] != b["final"][k])
                assert not differ, (f"wide model, rank {rank}: resumed at step {interrupted[0]['global_step']} "
                                    f"it ends with other weights than the uninterrupted run in {differ}")

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


def _written_during_sanity_check(plugins: list) -> set[str]:
    """The files under the run's root (relative paths) created or changed between
    ``on_sanity_check_start`` and the end of ``on_sanity_check_end`` of a short fit."""
    from hookloop import hookimpl

    class Snapshots:
        hookloop_name = "conformance_sanity_snapshots"
        hookloop_role = "observer"

        def __init__(self):
            self.before: dict | None = None
            self.after: dict = {}

        @staticmethod
        def _files(root) -> dict:
            root = Path(root)
            return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

        @hookimpl(tryfirst=True)
        def on_sanity_check_start(self, trainer):
            self.before = self._files(trainer.default_root_dir)

        @hookimpl(trylast=True)
        def on_sanity_check_end(self, trainer):
            self.after = self._files(trainer.default_root_dir)

    snapshots = Snapshots()
    _fit(plugins + [snapshots], epochs=1)
    assert snapshots.before is not None, "the conformance run's sanity check did not run"
    return {path for path, data in snapshots.after.items() if snapshots.before.get(path) != data}

#: The resume point of the observer and extension suites: 64 samples of 8 (per rank: 4
#: under 2 ddp ranks), 8 optimizer steps an epoch, 2 epochs; stopped at step 11.
RESUME_AT = 11


def _normalized(relative: str) -> str:
    """A file's path with its numbers and ids blanked (versions, timestamps, pids, run ids)."""
    import re

    return re.sub(r"\d+", "#", re.sub(r"[0-9a-f]{32}", "<id>", relative))


def _files(root: Path) -> list[str]:
    return sorted(_normalized(p.relative_to(root).as_posix()) for p in Path(root).rglob("*") if p.is_file())


def _fit_in(root: Path, plugins: list, batch_size: int, **kw) -> dict:
    """Fit TinyClassifier on 64 samples for 2 epochs with the default observers, logs in
    ``root``; the result: weights, global step, files written, the last checkpoint."""
    import hookloop
    from torch.utils.data import DataLoader

    from hookloop.contract.registry import plugin_name
    from hookloop.resume.rundir import newest_last_checkpoint

    torch.manual_seed(0)
    module = TinyClassifier(seed=10)
    ckpt_path = kw.pop("ckpt_path", None)
    trainer = hookloop.Trainer(plugins=plugins, max_epochs=2, num_sanity_val_steps=1, default_root_dir=str(root), **kw)
    trainer.fit(module, DataLoader(tiny_dataset(), batch_size=batch_size),
                DataLoader(tiny_dataset(16, seed=2), batch_size=batch_size), ckpt_path=ckpt_path)
    last = newest_last_checkpoint(Path(root))
    return {"weights": weights(module), "global_step": trainer.global_step, "files": _files(root),
            "name": plugin_name(plugins[0]) if plugins else None,
            "last": torch.load(last, map_location="cpu", weights_only=False) if last else None}


def _resume_runs(make, root: Path, batch_size: int = 8) -> dict:
    """An uninterrupted run, one stopped at :data:`RESUME_AT`, and its resume from
    ``last.ckpt`` by a new Trainer and plugin object."""
    return {"straight": _fit_in(root / "straight", [make()], batch_size),
            "interrupted": _fit_in(root / "resume", [make()], batch_size, max_steps=RESUME_AT),
            "resumed": _fit_in(root / "resume", [make()], batch_size, ckpt_path="last")}


def _assert_state_resumed(runs: dict, what: str, tolerance: float = 0.0, weights: bool = True,
                          state: bool = True) -> None:
    straight, resumed = runs["straight"], runs["resumed"]
    name = straight["name"]
    if weights:
        assert runs["interrupted"]["global_step"] == RESUME_AT < resumed["global_step"] == straight["global_step"]
        diff = max_difference(straight["weights"], resumed["weights"])
        assert diff <= tolerance, (f"{name!r}: resumed at step {RESUME_AT} the {what}'s run ends {diff} from the "
                                   f"uninterrupted run (its state not restored, or restored late?)")
    saved = straight["last"]["plugins"] if straight["last"] else {}
    if name not in saved or not state:
        return  # saves no state
    got = (resumed["last"] or {}).get("plugins", {}).get(name)
    assert got is not None, f"{name!r}: the resumed run saved no state under {name!r}"
    try:
        diff = _max_state_difference(saved[name], got)
    except AssertionError as exc:
        diff = f"({exc})"
    assert diff == 0.0, (f"{name!r}: after a resume at step {RESUME_AT} the {what}'s checkpoint state is "
                         f"{got!r}, the uninterrupted run's {saved[name]!r}: restore it in on_load_checkpoint")


def _plugin_ref(plugin: Any) -> tuple[str, str | None]:
    """How a worker process makes ``plugin``: its installed name, or ``module:Class`` and
    the folder its module is imported from."""
    import inspect

    if isinstance(plugin, str):
        if not plugin:
            pytest.fail("set plugin = '<name>' (or the plugin class) on the conformance class")
        return plugin, None
    cls = plugin if isinstance(plugin, type) else type(plugin)
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        pytest.fail(f"{cls.__qualname__}: a plugin class run under ddp must be importable (module level of a module)")
    folder = Path(inspect.getfile(cls)).resolve().parent
    for _ in range(cls.__module__.count(".")):
        folder = folder.parent
    return f"{cls.__module__}:{cls.__qualname__}", str(folder)


def _launch_kit(out: Path, kind: str, plugin: Any, options: dict) -> dict:
    """Run :func:`_kit_worker` on 2 ddp ranks (gloo) and collect what each rank recorded."""
    ref, folder = _plugin_ref(plugin)
    (out / "spec.json").write_text(json.dumps({"kind": kind, "plugin": ref, "options": options}))
    script = out / "kit_worker.py"
    script.write_text("import sys\nfrom hookloop.testing.conformance import _kit_worker\n"
                      "_kit_worker(sys.argv[1], sys.argv[2])\n")
    _hookloop("run", "--plugins", "ddp", "--devices", "2", str(script), str(out), str(out / "spec.json"),
              cwd=out, timeout=300, pythonpath=folder)
    ranks = [torch.load(out / f"kit.rank{r}.pt", weights_only=False) for r in (0, 1)]
    if kind == "observer":
        return {"ranks": ranks, "files": {run: _files(out / run) for run in ("without", "with")}}
    from hookloop.resume.rundir import newest_last_checkpoint

    last = {}
    for run, folder_name in (("straight", "straight"), ("resumed", "resume")):
        path = newest_last_checkpoint(out / folder_name)
        last[run] = {"name": ranks[0]["name"], "weights": None,
                     "last": torch.load(path, map_location="cpu", weights_only=False) if path else None}
    return {"ranks": ranks, "last": last}


class _WriteLog:
    """An audit hook (:func:`sys.addaudithook`): the files under ``root/<run>`` this process
    opens for writing, renames or removes."""

    FLAGS = None

    def __init__(self, root: Path):
        import os

        self.root, self.run, self.paths = str(Path(root).resolve()), None, {}
        self.flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def __call__(self, event: str, args: tuple) -> None:
        if self.run is None or event not in ("open", "os.rename", "os.remove", "os.truncate"):
            return
        try:
            import os

            if event == "open":
                path, mode, flags = args
                if not (isinstance(flags, int) and flags & self.flags) and not (mode and any(c in str(mode) for c in "wax+")):
                    return
            else:
                path = args[1] if event == "os.rename" else args[0]
            if not isinstance(path, (str, bytes, os.PathLike)):
                return
            path = os.path.abspath(os.fsdecode(path))
            base = os.path.join(self.root, self.run) + os.sep
            if path.startswith(base):
                self.paths[self.run].add(_normalized(path[len(base):]))
        except Exception:
            return


def _kit_worker(out: str, spec_path: str) -> None:
    """One rank of :func:`_launch_kit`'s job (started by ``hookloop run``)."""
    import os
    import sys

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    ref, options = spec["plugin"], spec["options"]
    if ":" in ref:
        import importlib

        module, _, qualname = ref.partition(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        plugin: Any = obj
    else:
        plugin = ref

    def make():
        return _make(plugin, options)

    root = Path(out)
    if spec["kind"] == "observer":
        log = _WriteLog(root)
        sys.addaudithook(log)
        record: dict = {"rank": rank}
        for run, plugins in (("without", []), ("with", [make()])):
            log.run, log.paths[run] = run, set()
            _fit_in(root / run, plugins, batch_size=4)
            log.run = None
            record[run] = sorted(log.paths[run])
    else:
        runs = _resume_runs(make, root, batch_size=4)
        record = {"rank": rank, "name": runs["straight"]["name"],
                  **{run: {"weights": r["weights"], "global_step": r["global_step"]} for run, r in runs.items()}}
    torch.save(record, root / f"kit.rank{rank}.pt")


def _make(plugin: Any, options: dict) -> Any:
    """The plugin object: by installed name, or from a class (or an object) under test."""
    import hookloop

    if isinstance(plugin, str):
        if not plugin:
            pytest.fail("set plugin = '<name>' (or the plugin class) on the conformance class")
        return hookloop.plugin(plugin, **options)
    return plugin(**options) if isinstance(plugin, type) else plugin


class ObserverConformance:
    """What every observer must do: not change the math, get its events in the
    documented order (docs/hooks.md's ``fit`` sequence, restricted to its hooks), and
    write nothing during the sanity check.

    Set ``plugin`` (its installed name, or its class) and optionally ``options``, and
    ``resume_state = False`` for an observer whose checkpoint state belongs to its run
    directory (a logger's file and row count, a list of checkpoint files): a
    ``ckpt_path=`` resume starts a new run directory, so that state starts afresh.
    """

    plugin: Any = ""
    options: dict = {}
    resume_state: bool = True

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
        from hookloop.contract.checks import implementations

        from hookloop.testing.order import FIT_ORDER, received_events

        observer = self.make()
        implemented = {name for name, _, _ in implementations(observer)}
        assert received_events(observer) == [name for name in FIT_ORDER if name in implemented]

    def test_writes_nothing_during_the_sanity_check(self):
        """The sanity check fires ``on_validation_end`` with ``sanity_checking=True`` (and the
        other validation events, ``trainer.sanity_checking`` set); its metrics are discarded,
        so an observer writes no row, file or checkpoint then (contract 2.0, CHANGELOG.md)."""
        torch.manual_seed(0)
        baseline = _written_during_sanity_check([])
        torch.manual_seed(0)
        written = _written_during_sanity_check([self.make()])
        extra = sorted(path for path in written if path not in baseline)
        assert not extra, (
            f"the observer wrote {', '.join(extra)} (under the run's root) during the sanity check: "
            f"on_validation_end gets sanity_checking=True then (trainer.sanity_checking in the other "
            f"hooks); return without writing")

    # -- under ddp, and across a resume ------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def ddp_runs(cls, tmp_path_factory) -> dict:
        """One ``hookloop run --plugins ddp --devices 2`` job fitting twice, without and with
        the observer; what each rank opened for writing, and the one-process run's files."""
        pytest.importorskip("hookloop_ddp")
        out = tmp_path_factory.mktemp("observer-ddp")
        single = out / "single"
        _fit_in(single, [_make(cls.plugin, cls.options)], batch_size=8)
        return {"single": _files(single), **_launch_kit(out, "observer", cls.plugin, cls.options)}

    def test_under_ddp_only_global_rank_zero_writes_files(self, ddp_runs):
        """2 ddp ranks (gloo): rank 1 opens no file for writing that it does not open without
        the observer, and the run directory holds the files of the one-process run (names
        compared with their numbers and ids blanked: timestamps, pids, versions)."""
        with_it = ddp_runs["ranks"][1]["with"]
        without = ddp_runs["ranks"][1]["without"]
        extra = sorted(set(with_it) - set(without))
        assert not extra, (f"{self.plugin!r}: global rank 1 wrote {extra} under ddp: an observer writes files on "
                           f"global rank 0 only (if trainer.is_global_zero / trainer.global_rank == 0)")
        assert ddp_runs["files"]["with"] == ddp_runs["single"], (
            f"{self.plugin!r}: under 2 ddp ranks the run directory holds "
            f"{sorted(set(ddp_runs['files']['with']) - set(ddp_runs['single']))} beyond the one-process run's files "
            f"and lacks {sorted(set(ddp_runs['single']) - set(ddp_runs['files']['with']))}")

    def test_its_checkpoint_state_comes_back_after_a_resume(self, tmp_path):
        """One process: an uninterrupted run, and one stopped mid-epoch (``max_steps``) then
        resumed from its ``last.ckpt`` by a new observer object. The observer's state
        (``on_save_checkpoint``) is under its name only, and the resumed run's last
        checkpoint holds the same state as the uninterrupted run's. An observer that
        saves nothing, or declares ``resume_state = False``, passes."""
        runs = _resume_runs(lambda: _make(self.plugin, self.options), tmp_path)
        # The state only: an observer's effect on the weights is test_weights_are_unchanged_by_the_observer's.
        _assert_state_resumed(runs, what="observer", weights=False, state=self.resume_state)


class ExtensionConformance:
    """What every extension (role ``"extension"``: a plugin that changes training, e.g. SWA,
    EMA, an accumulation or learning-rate schedule) must do: train with the default
    observers (checkpoint, CSV logger) in one process and under ddp (2 processes, gloo),
    keep its checkpoint state under its own name, and make a resumed run end exactly as an
    uninterrupted one. The resume point: 64 samples, 8 optimizer steps an epoch, 2 epochs;
    the run is stopped by ``max_steps=11`` (epoch 1, 3 steps in), and a new Trainer and a
    new plugin object resume from its ``last.ckpt``.

    Set ``plugin`` (its installed name; or its class, which the ddp workers import from
    the class's module), optionally ``options`` and ``resume_tolerance`` (0.0).
    """

    plugin: Any = ""
    options: dict = {}
    resume_tolerance: float = 0.0

    @pytest.fixture(scope="class")
    @classmethod
    def single(cls, tmp_path_factory) -> dict:
        root = tmp_path_factory.mktemp("extension-single")
        runs = _resume_runs(lambda: _make(cls.plugin, cls.options), root)
        runs["baseline"] = _fit_in(root / "baseline", [], batch_size=8)
        return runs

    @pytest.fixture(scope="class")
    @classmethod
    def ddp(cls, tmp_path_factory) -> dict:
        pytest.importorskip("hookloop_ddp")
        return _launch_kit(tmp_path_factory.mktemp("extension-ddp"), "extension", cls.plugin, cls.options)

    def test_trains_with_the_default_observers(self, single):
        straight = single["straight"]
        assert straight["global_step"] == 16, f"an uninterrupted run made {straight['global_step']} steps, not 16"
        assert all(torch.isfinite(t).all() for t in straight["weights"].values()), "non-finite weights"
        assert straight["files"].count("logs/version_#/metrics.csv") == 1, (
            f"the CSV logger wrote no metrics.csv alongside the extension: {straight['files']}")
        assert straight["last"] is not None, f"no last.ckpt alongside the extension: {straight['files']}"
        extra = sorted(set(straight["last"]["plugins"]) - set(single["baseline"]["last"]["plugins"]) - {straight["name"]})
        assert not extra, (f"{straight['name']!r} saved checkpoint state under {extra}, not under its own name "
                           f"(checkpoint['plugins'][{straight['name']!r}])")

    def test_resumed_in_one_process_it_ends_as_an_uninterrupted_run(self, single):
        _assert_state_resumed(single, what="extension", tolerance=self.resume_tolerance)

    def test_under_ddp_the_ranks_agree_and_a_resume_ends_as_an_uninterrupted_run(self, ddp):
        ranks = ddp["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1], "one record per rank expected"
        diff = max_difference(ranks[0]["straight"]["weights"], ranks[1]["straight"]["weights"])
        assert diff == 0.0, f"under ddp the ranks end {diff} apart: the extension changed one rank's training only"
        for record in ranks:
            assert record["straight"]["global_step"] == 16
            diff = max_difference(record["straight"]["weights"], record["resumed"]["weights"])
            assert diff <= self.resume_tolerance, (
                f"rank {record['rank']}: resumed at step 11 under ddp it ends {diff} from the uninterrupted run")
        _assert_state_resumed({"straight": ddp["last"]["straight"], "resumed": ddp["last"]["resumed"]},
                              what="extension", weights=False)


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


class ResumeConformance:
    """Kill anywhere, restart, bit-identical: a strategy's resume certificate.

    One job (:mod:`hookloop.testing.resume`: dropout, a shuffled loader with
    ``num_workers=2, persistent_workers=True``, a random augmentation in ``__getitem__``,
    every rank seeded differently, gradient accumulation, clipping, a per-step LR
    scheduler, ``ModelCheckpoint(every_n_train_steps=2)``) runs twice per seed: once
    uninterrupted, and once under ``hookloop run --max-restarts 4`` where attempt 0 is
    SIGKILLed inside a step, attempt 1 inside a checkpoint save (half-way through the
    file), attempt 2 inside a validation, attempt 3 inside an accumulation window, and
    attempt 4 finishes. Its final weights, optimizer state (every rank's, parameters
    included), schedulers and ``metrics.csv`` rows must equal the uninterrupted run's
    exactly. The seed picks the step or batch within each category; a failure names the
    seed and the points, and :meth:`kill_points` gives them back.

    Class attributes: ``plugin`` (its name; ``""`` for hookloop's single-process default),
    ``options`` (plugin options), ``world_size`` (2), ``checkpoint`` (``"file"``: global
    rank 0 writes, and is the rank killed in the save; ``"directory"``: every rank writes
    its shard, the last rank is killed in its write), ``restarts`` (``"agent"``: torch's
    elastic agent restarts the workers; ``"rerun"``: the strategy launches without an
    agent (spawn, one plain process), so the kit runs the same command again with
    ``fit(ckpt_path="last")``, as a user re-runs a job), ``refuses_restarts`` (a strategy
    that cannot restart workers: a piece of the error ``hookloop run --max-restarts 1``
    must fail with; the kill tests are then not run), ``seeds`` (``(2,)``; ``(2, 0, 1, 6)``
    when ``HOOKLOOP_TEST_FULL=1``), ``timeout`` (s, per job), ``loader`` (the training
    loader: ``"map"``, a ``DataLoader`` of a map-style dataset; ``"stateful"``,
    ``"stateful_trainer"``, ``"hf_streaming"``, ``"litdata"``: :mod:`hookloop.testing.streaming`).
    """

    plugin: str = ""
    options: dict = {}
    world_size: int = 2
    checkpoint: str = "file"
    restarts: str = "agent"
    refuses_restarts: str | None = None
    # Seed 2: the step kill resumes mid-epoch, the accumulation kill is in the first
    # window after the validation kill's resume (where a checkpoint marker not restored
    # would save mid-window).
    seeds: tuple = (2,)
    full_seeds: tuple = (2, 0, 1, 6)
    timeout: float = 900  # per job (all its attempts); a loaded 2-core machine needs ~4x an idle one
    # What the job holds; a failing strategy is diagnosed by turning one off in a subclass
    # (persistent_workers = False, dropout = 0.0, augment = False, kinds = ("step",)...).
    persistent_workers: bool = True
    dropout: float = 0.25
    augment: bool = True
    kinds: tuple = ("step", "save", "validation", "accumulation")
    # The training loader (hookloop.testing.streaming.LOADERS): "map" (a DataLoader of a
    # map-style dataset), "stateful", "stateful_trainer", "hf_streaming" or "litdata".
    loader: str = "map"
    # The job's shape: per rank and epoch 8 micro-batches of 4 samples, 2 per optimizer
    # step (4 steps an epoch), a checkpoint every 2 steps, 3 validation batches, 4 epochs.
    batch_size = 4
    micro_batches = 8
    accumulate = 2
    every_n_train_steps = 2
    val_batches = 3
    epochs = 4

    # -- the plan -----------------------------------------------------------------------

    @classmethod
    def kill_points(cls, seed: int) -> list[dict]:
        """The kill points of ``seed``, one per attempt: inside a step (epoch 0, after the
        first checkpoint), inside a save (epoch 1), inside the validation at the end of
        epoch 2, inside an accumulation window (epoch 3). Each after the one before, so
        each attempt reaches its own."""
        import random

        rng = random.Random(seed)
        steps = cls.micro_batches // cls.accumulate  # optimizer steps per epoch
        every, last = cls.every_n_train_steps, cls.world_size - 1
        saver = 0 if cls.checkpoint == "file" else last
        window = rng.randrange(steps)
        points = [
            {"kind": "step", "rank": last, "at": rng.randint(every + 1, steps)},
            {"kind": "save", "rank": saver, "at": rng.choice([s for s in range(steps + 1, 2 * steps + 1) if s % every == 0])},
            {"kind": "validation", "rank": last, "epoch": 2, "batch": rng.randrange(cls.val_batches)},
            {"kind": "accumulation", "rank": last, "epoch": 3, "batch": window * cls.accumulate + cls.accumulate - 1},
        ]
        return [p for p in points if p["kind"] in cls.kinds]

    @classmethod
    def run_seeds(cls) -> tuple:
        import os

        return tuple(cls.full_seeds) if os.environ.get("HOOKLOOP_TEST_FULL") == "1" else tuple(cls.seeds)

    # -- running the jobs ---------------------------------------------------------------

    @classmethod
    def _command(cls, out: Path, spec: Path, max_restarts: int | None) -> list[str]:
        args = [sys.executable, "-m", "hookloop", "run"]
        if cls.plugin:
            args += ["--plugins", cls.plugin]
        args += ["--devices", str(cls.world_size)]
        if max_restarts is not None:
            args += ["--max-restarts", str(max_restarts)]
        return [*args, str(Path(__file__).with_name("resume_job.py")), str(out), str(spec)]

    @classmethod
    def _start(cls, cmd: list[str], cwd: Path, attempt: int | None = None):
        import os
        import subprocess

        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_")) and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
        if attempt is not None:
            from hookloop.testing.resume import ATTEMPT_ENV

            env[ATTEMPT_ENV] = str(attempt)
        # A session of its own: a job that hangs is ended with every process it started.
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    @classmethod
    def _finish(cls, proc, what: str) -> tuple[int, str]:
        import os
        import signal
        import subprocess

        try:
            output, _ = proc.communicate(timeout=cls.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise AssertionError(f"{what}: hung past {cls.timeout}s, killed with its processes:\n{output[-6000:]}")
        finally:
            try:  # nothing the job started outlives it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return proc.returncode, output

    @classmethod
    def _spec(cls, out: Path, kills: list[dict]) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        spec = {"batch_size": cls.batch_size, "world_size": cls.world_size, "micro_batches": cls.micro_batches,
                "val_batches": cls.val_batches, "epochs": cls.epochs, "accumulate": cls.accumulate,
                "every_n_train_steps": cls.every_n_train_steps, "restarts": cls.restarts, "kills": kills,
                "persistent_workers": cls.persistent_workers, "loader": cls.loader, "dropout": cls.dropout, "augment": cls.augment,
                "options": {cls.plugin: dict(cls.options)} if cls.plugin and cls.options else {}}
        path = out / "spec.json"
        path.write_text(json.dumps(spec))
        return path

    @classmethod
    def _collect(cls, out: Path) -> dict:
        import csv

        ranks = [torch.load(out / f"final.rank{r}.pt", weights_only=False) if (out / f"final.rank{r}.pt").exists()
                 else None for r in range(cls.world_size)]
        tables = []
        for path in sorted(out.glob("root/**/metrics.csv")):
            with open(path, newline="") as f:
                tables.append([{k: v for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)])
        killed = sorted(out.glob("killed.attempt*.json"), key=lambda p: int(p.stem.split("attempt")[1]))
        return {"ranks": ranks, "metrics": tables, "killed": [json.loads(p.read_text()) for p in killed]}

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls, tmp_path_factory) -> dict:
        """Per seed: the uninterrupted and the killed job's results, and the kill points."""
        if cls.refuses_restarts is not None:
            out = tmp_path_factory.mktemp(f"resume-{cls.plugin}-refused")
            status, log = cls._finish(cls._start(cls._command(out, cls._spec(out, []), 1), out), "refused job")
            return {"refused": {"status": status, "log": log, "trained": bool(list(out.glob("final.rank*.pt")))}}
        results = {}
        for seed in cls.run_seeds():
            root = tmp_path_factory.mktemp(f"resume-{cls.plugin or 'single'}-seed{seed}")
            kills = cls.kill_points(seed)
            runs = {"straight": [], "killed": kills}
            agent = cls.restarts == "agent"
            restarts = len(kills) if agent else None
            jobs = {name: (root / name, cls._spec(root / name, plan)) for name, plan in runs.items()}
            # Both at once: the wall time of the killed one (which restarts several times).
            if agent:
                procs = {name: cls._start(cls._command(out, spec, restarts), out) for name, (out, spec) in jobs.items()}
                outcome = {name: cls._finish(proc, f"{name} job") for name, proc in procs.items()}
            else:
                outcome = {}
                straight = cls._start(cls._command(*jobs["straight"], None), jobs["straight"][0], attempt=0)
                logs = []
                for a in range(len(kills) + 1):
                    status, log = cls._finish(cls._start(cls._command(*jobs["killed"], None), jobs["killed"][0], attempt=a),
                                              f"killed job, attempt {a}")
                    logs.append(f"--- attempt {a}: exit status {status}\n{log}")
                    if status == 0:
                        break
                outcome["killed"] = (status, "\n".join(logs))
                outcome["straight"] = cls._finish(straight, "straight job")
            for name, (status, log) in outcome.items():
                (jobs[name][0] / "output.log").write_text(log)  # for a failure's diagnosis
            results[seed] = {"kills": kills, "log": {n: o[1] for n, o in outcome.items()},
                             "status": {n: o[0] for n, o in outcome.items()},
                             **{name: cls._collect(out) for name, (out, _) in jobs.items()}}
        return results

    def where(self, seed: int, result: dict) -> str:
        return (f"[{type(self).__name__}, plugin {self.plugin or '(single process)'!r}, seed {seed}; kill points, "
                f"attempt by attempt: {result['kills']}; reproduce: {type(self).__name__}.kill_points({seed})]")

    # -- the certificate ----------------------------------------------------------------

    def refused(self, runs) -> bool:
        """For a strategy that cannot restart workers (``refuses_restarts``): assert that
        ``hookloop run --max-restarts 1`` fails up front with that error, and say so."""
        if self.refuses_restarts is None:
            assert "refused" not in runs
            return False
        refused = runs["refused"]
        assert refused["status"] != 0, f"{self.plugin}: hookloop run --max-restarts 1 ran instead of refusing:\n{refused['log'][-4000:]}"
        assert self.refuses_restarts in refused["log"], f"{self.plugin}: not the expected refusal:\n{refused['log'][-4000:]}"
        assert not refused["trained"], f"{self.plugin}: refused, yet a worker trained"
        return True

    def test_every_attempt_died_where_planned_and_the_last_finished(self, runs):
        if self.refused(runs):
            return
        for seed, result in runs.items():
            where = self.where(seed, result)
            assert result["status"]["straight"] == 0, f"the uninterrupted job failed {where}:\n{result['log']['straight'][-6000:]}"
            assert result["status"]["killed"] == 0, f"the killed job did not finish {where}:\n{result['log']['killed'][-8000:]}"
            assert result["killed"]["killed"] == result["kills"], (
                f"the kills that happened differ from the plan {where}:\n{result['log']['killed'][-6000:]}")
            assert result["straight"]["killed"] == []

    def _final(self, runs):
        for seed, result in runs.items():
            where = self.where(seed, result)
            for rank, (a, b) in enumerate(zip(result["straight"]["ranks"], result["killed"]["ranks"])):
                assert a is not None and b is not None, f"rank {rank} wrote no final state {where}"
                yield where, rank, a, b

    def test_final_weights_are_bit_identical(self, runs):
        if self.refused(runs):
            return
        for where, rank, straight, resumed in self._final(runs):
            assert resumed["global_step"] == straight["global_step"], where
            assert straight["weights"].keys() == resumed["weights"].keys()
            differ = {k: float((straight["weights"][k] - resumed["weights"][k]).abs().max())
                      for k in straight["weights"] if not torch.equal(straight["weights"][k], resumed["weights"][k])}
            assert not differ, f"rank {rank}: weights differ from the uninterrupted run's (max |diff| per tensor: {differ}) {where}"

    def test_optimizer_and_scheduler_states_are_bit_identical(self, runs):
        if self.refused(runs):
            return
        for where, rank, straight, resumed in self._final(runs):
            for i, (a, b) in enumerate(zip(straight["optimizers"], resumed["optimizers"])):
                params = [float((x - y).abs().max()) for ga, gb in zip(a["params"], b["params"]) for x, y in zip(ga, gb)]
                assert max(params, default=0.0) == 0.0, f"rank {rank} optimizer {i}: parameters differ by {max(params)} {where}"
                assert _max_state_difference(a["groups"], b["groups"]) == 0.0, (
                    f"rank {rank} optimizer {i}: param groups (lr...) differ: {a['groups']} vs {b['groups']} {where}")
                diff = _max_state_difference(a["state"], b["state"])
                assert diff == 0.0, f"rank {rank} optimizer {i}: state (momentum...) differs by {diff} {where}"
            assert straight["schedulers"] == resumed["schedulers"], f"rank {rank}: scheduler states differ {where}"

    def test_logged_metrics_are_identical(self, runs):
        if self.refused(runs):
            return
        for seed, result in runs.items():
            where = self.where(seed, result)
            straight, killed = result["straight"]["metrics"], result["killed"]["metrics"]
            assert len(straight) == 1, f"the uninterrupted run wrote {len(straight)} metrics.csv files {where}"
            if self.restarts == "agent":
                # One run directory, every row once: the resumed attempts dropped and rewrote theirs.
                assert len(killed) == 1, f"the restarted run wrote {len(killed)} metrics.csv files {where}"
                rows = {i: row for i, row in enumerate(killed[0])}
                diff = [(i, row, straight[0][i] if i < len(straight[0]) else None) for i, row in rows.items()
                        if i >= len(straight[0]) or row != straight[0][i]]
                assert len(killed[0]) == len(straight[0]) and not diff, (
                    f"metrics.csv differs from the uninterrupted run's ({len(killed[0])} vs {len(straight[0])} rows; "
                    f"first differing rows: {diff[:3]}) {where}")
            else:
                # Every re-run writes a run directory of its own: each row it wrote is a row of
                # the uninterrupted run, and together they are all of them.
                reference = [json.dumps(r, sort_keys=True) for r in straight[0]]
                written = {json.dumps(r, sort_keys=True) for table in killed for r in table}
                assert written == set(reference), (
                    f"metrics.csv rows differ: {sorted(written - set(reference))[:3]} not in the uninterrupted run, "
                    f"{sorted(set(reference) - written)[:3]} missing {where}")


def _max_state_difference(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, "optimizer state shapes differ"
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"optimizer state keys differ: {list(a)} vs {list(b)}"
        return max((_max_state_difference(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max((_max_state_difference(x, y) for x, y in zip(a, b)), default=0.0)
    if a is None or b is None:
        assert a is b, "optimizer state present in one run only"
        return 0.0
    return 0.0 if a == b else float("inf")
