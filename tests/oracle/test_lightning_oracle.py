"""pytorch-lightning 2.6.6 as the oracle: the same module code under both Trainers.

Every case of `cases.py` runs under `pytorch_lightning.Trainer` and `hookloop.Trainer`
(one process, and two processes with ddp under torchrun, gloo), and every observation
must be equal (floats to 1e-5 relative), except where docs/decisions.md documents a
deliberate difference. Each such difference is a `Documented` entry below: it names the
decision (a phrase of its entry in docs/decisions.md), the observations it excludes from the
equality, and a check that the difference is exactly the documented one. So a decision
that stops being true, or a decision that is no longer written down, fails here too.

Lightning's observations depend only on the cases, so they are stored (``expected/``,
written by ``make oracle`` with the digest of the harness's sources): ``make test`` runs
hookloop's two runs against them (a changed case without ``make oracle`` fails, naming it),
``make test-full`` runs Lightning again and fails if its numbers moved. The module-scoped
fixture runs hookloop once.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

pytestmark = pytest.mark.slow  # hookloop's runs: one process and a 2-process ddp job

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from cases import CASES  # noqa: E402

sys.path.insert(0, str(HERE.parent))
import stored  # noqa: E402

MODES = ("one", "ddp")


def _run(framework: str, mode: str, out: Path, root: Path, cases: str = "") -> subprocess.Popen:
    script = [str(HERE / "run_cases.py"), "--framework", framework, "--mode", mode, "--out", str(out),
              "--root", str(root)] + (["--cases", cases] if cases else [])
    if mode == "ddp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script]
    else:
        cmd = [sys.executable, *script]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_", "PL_"))}
    env["PYTHONWARNINGS"] = "ignore"
    log = open(out.with_suffix(".log"), "w")
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


STORE = HERE / "expected"
SOURCES = [HERE / "cases.py", HERE / "frameworks.py", HERE / "run_cases.py"]


def stored_path(mode: str) -> Path:
    return STORE / f"lightning-{mode}.json"


def observe(pairs: list[tuple[str, str]], base: Path) -> dict:
    """{(framework, mode): observations} of the given runs: the one-process runs side by
    side, the ddp runs one after the other (2 cores)."""
    jobs = {}

    def start(fw, mode):
        root = base / f"{fw}-{mode}"
        root.mkdir()
        jobs[(fw, mode)] = (_run(fw, mode, base / f"{fw}-{mode}.json", root), base / f"{fw}-{mode}.json")

    def finish(fw, mode):
        proc, out = jobs[(fw, mode)]
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert proc.returncode == 0 and out.is_file(), (
            f"{fw} {mode} run failed ({proc.returncode}):\n" + out.with_suffix(".log").read_text()[-4000:])

    one = [p for p in pairs if p[1] == "one"]
    for pair in one:
        start(*pair)
    for pair in one:
        finish(*pair)
    for pair in pairs:
        if pair[1] == "ddp":
            start(*pair)
            finish(*pair)
    return {pair: json.loads((base / f"{pair[0]}-{pair[1]}.json").read_text()) for pair in pairs}


def store_lightning_observations(base: Path) -> None:
    """``make oracle``: run the cases under pytorch-lightning and store its observations."""
    sources = stored.digest(SOURCES)
    for (_, mode), obs in observe([("lightning", m) for m in MODES], base).items():
        stored.save(stored_path(mode), sources, obs)


@pytest.fixture(scope="module")
def observations(tmp_path_factory) -> dict:
    """{mode: {framework: {case: observations}}}: hookloop's runs, and Lightning's as stored
    by ``make oracle`` (the full tier runs Lightning again: ``fresh_lightning``)."""
    base = tmp_path_factory.mktemp("oracle")
    sources = stored.digest(SOURCES)
    runs = observe([("hookloop", m) for m in MODES], base)
    return {mode: {"hookloop": runs[("hookloop", mode)],
                   "lightning": stored.load(stored_path(mode), sources)} for mode in MODES}


# -- comparison ---------------------------------------------------------------------------


def _close(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return abs(a - b) <= 2e-6 + 1e-5 * abs(a)
    return a == b


def differences(a, b, path: str = "") -> list[str]:
    """Every place where Lightning's observation ``a`` and hookloop's ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            p = f"{path}/{k}"
            if k not in a or k not in b:
                out.append(f"{p}: lightning {a.get(k, '<absent>')!r:.300} vs hookloop {b.get(k, '<absent>')!r:.300}")
            else:
                out += differences(a[k], b[k], p)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items under lightning, {len(b)} under hookloop: {a!r:.400} vs {b!r:.400}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{path}[{i}]")
        return out[:5] + ([f"{path}: {len(out) - 5} more"] if len(out) > 5 else [])
    return [] if _close(a, b) else [f"{path}: lightning {a!r:.300} vs hookloop {b!r:.300}"]


# -- documented differences ---------------------------------------------------------------


@dataclass
class Documented:
    """A deliberate difference: ``decision`` is a phrase of its entry in
    docs/decisions.md (white space folded); ``normalize(case, mode, lightning, hookloop)`` rewrites both
    observations of a case so that what remains must be equal, and returns True when the
    documented difference was seen in them (every entry must be seen in some case)."""

    name: str
    decision: str
    cases: tuple
    normalize: Callable = field(repr=False)


def _module_first(case, mode, light, hook) -> bool:
    """Within one event, Lightning calls the callbacks then the module; hookloop the module
    then the plugins. Put both in Lightning's order; seen when hookloop had the module first."""
    def canonical(events):
        out, seen, i = [], False, 0
        while i < len(events):
            name = events[i].split(":", 1)[-1]
            j = i
            while j < len(events) and events[j].split(":", 1)[-1] == name and not events[j].startswith("---"):
                j += 1
            group = events[i:j] or [events[i]]
            if [e.split(":")[0] for e in group] == ["mod", "cb"]:
                seen = True
            out += sorted(group, key=lambda e: e.startswith("mod:"))
            i = max(j, i + 1)
        return out, seen

    light["events"], _ = canonical(light["events"])
    hook["events"], seen = canonical(hook["events"])
    return seen


def _csv_step(case, mode, light, hook) -> bool:
    """hookloop's ``step`` column is ``trainer.global_step`` after the logged step (the
    number the checkpoint names carry); Lightning writes ``global_step - 1`` for the
    training rows. Shift hookloop's rows that have an epoch (an evaluation step row has
    none, and Lightning's step there, the batches logged so far, is hookloop's too); seen
    when the shifted steps are Lightning's."""
    shifted = [[s - 1 if e is not None else s, e, k, v] for s, e, k, v in hook["csv"]]
    hook["csv"] = sorted(shifted, key=lambda r: (r[0], -1 if r[1] is None else r[1], r[2], r[3]))
    train_steps = {s for s, e, k, v in light["csv"] if e is not None}
    return bool(train_steps) and train_steps == {s for s, e, k, v in hook["csv"] if e is not None}


def _predictions_gathered(case, mode, light, hook) -> bool:
    """Under ddp Lightning's ``predict`` returns each rank's share (rank 0's here: samples
    0, 2, 4, ... of an unshuffled loader); hookloop returns every sample once, in dataset
    order. Seen when rank 0's share is exactly every other row of hookloop's."""
    if mode != "ddp":
        return False
    rows = [hook["predict"][i:i + 3] for i in range(0, len(hook["predict"]), 3)]
    share = [v for row in rows[0::2] for v in row]
    seen = len(rows) == 10 and not differences(light["predict"], share)
    hook["predict"] = share
    return seen


def _validation_rng(case, mode, light, hook) -> bool:
    """hookloop's validation and sanity check draw nothing from the random generators, so a
    shuffled run trains the same with and without them; Lightning's consume draws. Compare
    the runs without validation; seen when hookloop's two runs are equal and Lightning's are not."""
    seen = (not differences(hook["with_validation"], hook["without_validation"])
            and bool(differences(light["with_validation"], light["without_validation"])))
    del light["with_validation"], hook["with_validation"]
    return seen


def _last_checkpoint(case, mode, light, hook) -> bool:
    """hookloop's checkpoint observer writes ``last.ckpt`` (keeping ``last.prev.ckpt``) at
    every epoch end, whatever ``save_last`` says; Lightning only with ``save_last=True``.
    With ``dirpath=`` (as the checkpoint cases give) hookloop's is in the run directory, so
    ``dirpath`` holds Lightning's files: drop the names only where Lightning wrote no
    last.ckpt; seen when hookloop had them."""
    seen = False
    for name, obs in hook.items():
        for where in ("files", "run_dir_files"):
            if "last.ckpt" not in light[name][where] and "last.ckpt" in obs[where]:
                obs[where] = [f for f in obs[where] if f != "last.ckpt"]
                seen = True
    return seen


def _previous_kept(case, mode, light, hook) -> bool:
    """Replacing ``last.ckpt`` keeps the previous one as ``last.prev.ckpt`` (a fallback for
    a damaged newest file); Lightning keeps none. Seen when hookloop had it."""
    seen = False
    for obs in hook.values():
        for where in ("files", "run_dir_files"):
            if "last.prev.ckpt" in obs[where]:
                obs[where].remove("last.prev.ckpt")
                seen = True
    return seen


def _stopped_epoch_stays(case, mode, light, hook) -> bool:
    """A run stopped inside an epoch (max_steps) keeps ``current_epoch`` at that epoch (its
    checkpoint resumes inside it); Lightning counts the epoch as done. Seen when hookloop's
    epoch is Lightning's minus one."""
    light, hook = light["max_steps_mid_epoch"], hook["max_steps_mid_epoch"]
    seen = hook["epoch"] == light["epoch"] - 1
    hook["epoch"] = light["epoch"]
    return seen


def _ranks_without_validation(case, mode, light, hook) -> bool:
    """No validation and ``check_val_every_n_epoch=2``: hookloop's ModelCheckpoint ranks
    at epoch ends (here the lowest score, epoch 3's); Lightning's never ranks."""
    seen = light["ckpt_no_val"]["best"] == "" and hook["ckpt_no_val"]["best"] == "epoch=3-step=8.ckpt"
    del light["ckpt_no_val"], hook["ckpt_no_val"]
    return seen


def _checks_without_validation(case, mode, light, hook) -> bool:
    """The same for EarlyStopping: hookloop's checks at epoch ends and stops (patience 0,
    scores 0.5, 0.3, 0.4: at the third epoch); Lightning's never checks and runs all 6."""
    seen = light["es_no_val"]["epoch"] == 6 and hook["es_no_val"]["epoch"] == 3
    del light["es_no_val"], hook["es_no_val"]
    return seen


def _refusals_named_as_lightnings(observed):
    """hookloop's ``ConfigurationError`` is the class its ``MisconfigurationException`` names
    (one class, two names): a refusal recorded under hookloop's name is Lightning's (the
    observer_choices case's ``every_n_train_steps`` with ``every_n_epochs``, refused by both
    since issue 35)."""
    if isinstance(observed, dict):
        return {k: ("MisconfigurationException" if k == "refused" and v == "ConfigurationError"
                    else _refusals_named_as_lightnings(v)) for k, v in observed.items()}
    if isinstance(observed, list):
        return [_refusals_named_as_lightnings(v) for v in observed]
    return observed


def _optimizers_per_run(case, mode, light, hook) -> bool:
    """``trainer.optimizers`` after ``validate``: hookloop's are the run's (none, validate
    builds none); Lightning keeps fit's."""
    seen = light["optimizers_after_validate"] == 1 and hook["optimizers_after_validate"] == 0
    hook["optimizers_after_validate"] = light["optimizers_after_validate"]
    return seen


DOCUMENTED = [
    Documented("optimizers belong to a run", "`trainer.optimizers` is filled by `fit` and emptied by `validate`/`test`/`predict`",
               ("evaluation",), _optimizers_per_run),
    Documented("checkpoint ranks without validation",
               "a run without validation ranks at epoch ends even with `check_val_every_n_epoch > 1`",
               ("observer_choices",), _ranks_without_validation),
    Documented("early stopping checks without validation",
               "a run without validation checks at epoch ends even with `check_val_every_n_epoch > 1`",
               ("observer_choices",), _checks_without_validation),
    Documented("a stopped epoch stays current", "Unlike Lightning, `current_epoch` and the position inside the epoch stay",
               ("loop_control",), _stopped_epoch_stays),
    Documented("predictions gathered", "Predictions are gathered", ("evaluation",), _predictions_gathered),
    Documented("validation draws no random numbers", "Validation draws nothing from the random generators",
               ("validation_rng",), _validation_rng),
    Documented("last.ckpt at every epoch end", "The observer writes `last.ckpt` at every epoch end",
               ("checkpoints",), _last_checkpoint),
    Documented("the previous last.ckpt is kept", "The last two checkpoints are kept", ("checkpoints",),
               _previous_kept),
    Documented("module hooks before callbacks", "Module hooks run before the plugins'", ("hook_order",),
               _module_first),
    Documented("csv step column is global_step", "The CSV log's `step` column", ("log_matrix", "log_hooks",
               "torchmetrics"), _csv_step),
]


def _documented_for(case: str) -> list[Documented]:
    return [d for d in DOCUMENTED if case in d.cases]


CASE_MODES = [(case, mode) for case, (_, modes) in CASES.items() for mode in modes]


@pytest.mark.parametrize("case,mode", CASE_MODES, ids=[f"{c}-{m}" for c, m in CASE_MODES])
def test_same_observations_as_lightning(observations, case, mode):
    light = json.loads(json.dumps(observations[mode]["lightning"][case]))
    hook = json.loads(json.dumps(observations[mode]["hookloop"][case]))
    assert "error" not in light, f"the case fails under Lightning itself: {light['error']}"
    assert "error" not in hook, f"runs under Lightning, fails under hookloop: {hook['error']}"
    hook = _refusals_named_as_lightnings(hook)
    for doc in _documented_for(case):
        doc.normalize(case, mode, light, hook)
    diff = differences(light, hook)
    assert not diff, f"{len(diff)} difference(s) from Lightning 2.6.6:\n" + "\n".join(diff[:40])


def test_every_documented_difference_is_written_and_seen(observations):
    decisions = " ".join((REPO / "docs" / "decisions.md").read_text().split())
    for doc in DOCUMENTED:
        assert doc.decision in decisions, (
            f"{doc.name!r} names the decision {doc.decision!r}, which docs/decisions.md no longer has")
        seen = False
        for case in doc.cases:
            for mode in CASES[case][1]:
                light = json.loads(json.dumps(observations[mode]["lightning"][case]))
                hook = json.loads(json.dumps(observations[mode]["hookloop"][case]))
                if "error" not in hook and "error" not in light:
                    seen |= bool(doc.normalize(case, mode, light, hook))
        assert seen, f"the documented difference {doc.name!r} no longer shows: remove it and its decision"


@pytest.mark.full
def test_stored_lightning_observations_are_what_lightning_computes(observations, tmp_path):
    """The stored numbers are Lightning's own: computed again, they have not moved."""
    fresh = observe([("lightning", m) for m in MODES], tmp_path)
    for mode in MODES:
        diff = differences(observations[mode]["lightning"], fresh[("lightning", mode)])
        assert not diff, (f"pytorch-lightning's {mode} observations moved since they were stored "
                          f"(`make oracle` stores them again):\n" + "\n".join(diff[:40]))
