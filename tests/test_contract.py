"""The hook contract as documented: issue 10's contract defects, each with a test that
failed before its fix, and ``hookloop check``.

Plugins here are what a third party writes: installed as distributions with entry points
(``install_fake_distribution`` lays out what pip leaves in site-packages), used through
``hookloop run`` in real processes where the launch path matters (those tests are marked
slow); ``hookloop check`` and ``hookloop plugins`` run in this process through
``hookloop.tools.cli.main``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, SequentialSampler

import hookloop
import hookloop.tools.cli
import hookloop.testing
from conftest import (REPO, TinyModule, fit_profiled, install_fake_distribution, max_abs_diff, run_python, state_of,
                      tiny_data)
from hookloop.contract import versioning
from hookloop.engine.defaults import Defaults

HOOKLOOP = [sys.executable, "-m", "hookloop"]

# A third party's local-SGD strategy (subclassing hookloop_ddp.DDP) and CSV observer.
LOCALSGD = '''
import hookloop
import hookloop.testing
from hookloop_ddp import DDP

class LocalSGD(DDP):
    """Post-local SGD on ddp: all-reduce for 2 steps, then average every 2 steps."""

    hookloop_name = "localsgd"

    def __init__(self):
        super().__init__(comm_hook="post_localsgd", localsgd_start_iter=2, model_averaging_period=2)
'''

CSVLOG = '''
import os
import hookloop
import hookloop.testing

class CsvLog:
    """Writes rank, epoch and loss per epoch to csvlog.rank<R>.csv."""

    hookloop_role = "observer"

    @hookloop.hookimpl
    def on_train_epoch_end(self, trainer, epoch, metrics):
        with open(f"csvlog.rank{trainer.global_rank}.csv", "a") as f:
            f.write(f"{epoch},{metrics['train_loss']:.6f}\\n")
'''

SCRIPT = '''
import sys
sys.path.insert(0, {tests!r})
import hookloop
import hookloop.testing
from conftest import TinyModule, tiny_data
from torch.utils.data import DataLoader

class InCode:
    hookloop_name = "in_code"
    hookloop_role = "observer"
    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        names = sorted(hookloop.contract.registry.plugin_name(p) for p in trainer.plugins)
        print(f"RANK{{trainer.global_rank}} strategy={{type(trainer.strategy).__name__}} plugins={{names}}", flush=True)

hookloop.Trainer(plugins={code!r}, max_epochs=2, enable_checkpointing=False).fit(
    TinyModule(), DataLoader(tiny_data(32), batch_size=4))
'''


@pytest.fixture
def third_party(site):
    install_fake_distribution(site, "hookloop-localsgd", {"localsgd": "hl_localsgd:LocalSGD"}, {"hl_localsgd": LOCALSGD},
                              requires=["hookloop-ddp"])
    install_fake_distribution(site, "hookloop-csvlog", {"csvlog": "hl_csvlog:CsvLog"}, {"hl_csvlog": CSVLOG})
    return site


def run_script(tmp_path, site, code_plugins, cli):
    script = SCRIPT.format(tests=str(REPO / "tests"), code="__CODE__").replace("'__CODE__'", code_plugins)
    (tmp_path / "train.py").write_text(script)
    return run_python(HOOKLOOP + ["run", *cli, "train.py"], cwd=tmp_path, env={"PYTHONPATH": str(site)}, timeout=300)


# -- 1.1: plugins from code and from the command line combine ---------------------------------


@pytest.mark.slow  # a 2-process job launched by `hookloop run`
def test_code_plugins_and_run_plugins_combine(tmp_path, third_party):
    """`hookloop run --plugins localsgd,csvlog` with Trainer(plugins=[InCode()]) in the
    script: all three are used (the command-line ones were dropped)."""
    out = run_script(tmp_path, third_party, "[InCode()]", ["--plugins", "localsgd,csvlog", "--devices", "2"])
    lines = sorted(re.findall(r"RANK\d strategy=\w+ plugins=\[[^\]]*\]", out.stdout))
    assert lines == [f"RANK{r} strategy=LocalSGD plugins=['csv', 'csvlog', 'in_code', 'localsgd', 'model_summary', 'progress']" for r in (0, 1)]
    for r in (0, 1):
        assert len((tmp_path / f"csvlog.rank{r}.csv").read_text().splitlines()) == 2


@pytest.mark.slow  # a 2-process job launched by `hookloop run`: the note is printed once per rank
def test_a_strategy_in_code_replaces_the_command_lines_and_says_so_once(tmp_path, third_party):
    out = run_script(tmp_path, third_party, "[InCode(), 'ddp']", ["--plugins", "localsgd,csvlog", "--devices", "2"])
    lines = sorted(re.findall(r"RANK\d strategy=\w+ plugins=\[[^\]]*\]", out.stdout))
    assert lines == [f"RANK{r} strategy=DDP plugins=['csv', 'csvlog', 'ddp', 'in_code', 'model_summary', 'progress']" for r in (0, 1)]
    note = "the strategy 'ddp' named in code replaces 'localsgd' from --plugins / HOOKLOOP_PLUGINS"
    assert out.stdout.count(note) == 2  # once per process (each rank builds its Trainer)


# -- 1.4: the per-step events ---------------------------------------------------------------


def test_before_optimizer_step_sees_unscaled_gradients():
    """A gradient-norm monitor under fp16: the GradScaler's scale is removed first."""
    norms = []

    class GradNorm:
        hookloop_role = "observer"

        @hookloop.hookimpl
        def on_before_optimizer_step(self, optimizer):
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
            norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    torch.manual_seed(0)
    module = TinyModule()
    reference = TinyModule()
    reference.load_state_dict(module.state_dict())
    loader = DataLoader(tiny_data(32), batch_size=8)
    hookloop.Trainer(plugins=[hookloop.plugin("amp", allow_cpu_fp16=True, init_scale=2.0**10), GradNorm()],
                     precision="16-mixed", max_epochs=1, enable_checkpointing=False).fit(module, loader)
    x, y = next(iter(loader))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    assert len(norms) == 4
    assert norms[0] == pytest.approx(expected, rel=1e-3)  # not 1024 times it


def calls_per_step(plugins) -> float:
    """Python calls (and C calls made from Python) per training step (over 2N minus N
    steps, which cancels set-up)."""

    def count(steps):
        calls = 0

        def profile(frame, event, arg):
            nonlocal calls
            if event in ("call", "c_call"):
                calls += 1

        # the loop alone: no built-in observers
        trainer = hookloop.Trainer(plugins=plugins, max_steps=steps, enable_checkpointing=False, num_sanity_val_steps=0,
                                   enable_progress_bar=False, logger=False)
        fit_profiled(trainer, TinyModule(), DataLoader(tiny_data(8 * 40), batch_size=8), profile)
        return calls

    count(2)  # first calls: imports, caches
    return (count(20) - count(10)) / 10


def test_events_nobody_implements_cost_nothing_per_step():
    class EpochsOnly:
        hookloop_role = "observer"

        @hookloop.hookimpl
        def on_train_epoch_end(self):
            pass

    class EveryBatch(EpochsOnly):
        @hookloop.hookimpl
        def on_train_batch_start(self):
            pass

    class TwoEvents(EveryBatch):
        @hookloop.hookimpl
        def on_train_batch_end(self, trainer):
            pass

    alone = calls_per_step([])
    assert calls_per_step([EpochsOnly()]) == alone
    # a per-step event costs its caller and the implementation: 2 calls, not pluggy's ~12
    assert calls_per_step([EveryBatch()]) == alone + 2
    assert calls_per_step([TwoEvents()]) == alone + 2 + 3  # on_train_batch_end: and loss.detach()


# -- 1.5: an override of an inherited hook implementation stays one -----------------------------


class ShardsNothing:
    hookloop_role = "strategy"

    def __init__(self):
        self.samplers = []

    @hookloop.hookimpl(tryfirst=True)
    def configure_sampler(self, dataloader, training):
        sampler = SequentialSampler(dataloader.dataset)
        self.samplers.append(("base", sampler))
        return sampler


class Reversed(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


class OverridesWithoutDecorator(ShardsNothing):
    def configure_sampler(self, dataloader, training):  # no @hookimpl: still a hook
        sampler = Reversed(len(dataloader.dataset))
        self.samplers.append(("override", sampler))
        return sampler


def test_an_undecorated_override_of_a_hook_implementation_stays_one():
    seen = []

    class Records(TinyModule):
        def training_step(self, batch, batch_idx):
            seen.append(batch[0][0, 0].item())
            return super().training_step(batch, batch_idx)

    strategy = OverridesWithoutDecorator()
    trainer = hookloop.Trainer(plugins=[strategy], max_epochs=1, enable_checkpointing=False)
    trainer.fit(Records(), DataLoader(tiny_data(16), batch_size=4, shuffle=True))
    assert [kind for kind, _ in strategy.samplers] == ["override"]
    assert seen == [tiny_data(16).tensors[0][i, 0].item() for i in (15, 11, 7, 3)]
    impl = next(i for i in trainer.hook.configure_sampler.get_hookimpls() if i.plugin is strategy)
    assert impl.opts["tryfirst"]  # with the options it inherited


# -- 1.6: documentation that disagreed with the code ----------------------------------------------


def test_hookspecs_names_the_defaults_plugin_and_the_hooks_it_leaves_alone():
    from hookloop.contract import hookspecs

    doc = inspect.getdoc(hookspecs)
    assert "``hookloop.defaults``" in doc and "``single``" not in doc  # it said "built-in ``single`` plugin"
    sentence = re.search(r"except (.*?), whose default", " ".join(doc.split())).group(1)
    left = set(re.findall(r"``(\w+)``", sentence))
    firstresult = {name for name in dir(hookspecs) if getattr(getattr(hookspecs, name), "hookloop_spec", {}).get("firstresult")}
    implemented = {name for name in dir(Defaults) if hasattr(getattr(Defaults, name), "hookloop_impl")}
    assert left == firstresult - implemented


def test_quoted_readme_sections_exist():
    """'README.md, "Section"' references (and 'benchmarks/README.md, "Section"', where the
    measurements moved in issue 34) point at headings that exist in that file."""
    def headings(page: str) -> set[str]:
        text = (REPO / page).read_text()
        return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", text, re.M)}

    pattern = r'((?:benchmarks/)?README\.md),\s*"([^"]+)"'
    references = []
    for path in [REPO / "README.md", *REPO.glob("docs/**/*.md"), REPO / "benchmarks" / "README.md",
                 *REPO.glob("plugins/*/README.md"), *REPO.glob("examples/*/README.md"),
                 *REPO.glob("examples/*.py")]:
        references += [(path.name, *m.groups()) for m in re.finditer(pattern, path.read_text())]
    assert references  # examples/gpt.py has one
    assert [r for r in references if r[2] not in headings(r[1])] == []


# -- 1.7: errors that name the plugin, the close hook and the real arguments ---------------------------


def test_unknown_hook_names_the_plugin_and_the_close_hook():
    class Typo:
        hookloop_name = "typo"

        @hookloop.hookimpl
        def on_train_batch_ended(self, trainer):
            pass

    with pytest.raises(hookloop.PluginValidationError) as info:
        hookloop.Trainer(plugins=[Typo()])
    message = str(info.value)
    assert "plugin 'typo' (test_unknown_hook_names_the_plugin_and_the_close_hook.<locals>.Typo.on_train_batch_ended)" in message
    assert "rename it to 'on_train_batch_end'" in message
    assert " object at 0x" not in message


def test_misspelled_argument_lists_the_hooks_arguments():
    class Misspelled:
        hookloop_name = "misspelled"

        @hookloop.hookimpl
        def on_train_batch_end(self, trainer, batch_index):
            pass

    with pytest.raises(hookloop.PluginValidationError, match=re.escape(
            "argument 'batch_index' is not an argument of on_train_batch_end. Fix: rename it to 'batch_idx'; "
            "on_train_batch_end takes trainer, outputs, loss, batch, batch_idx")):
        hookloop.Trainer(plugins=[Misspelled()])


MISTAKES = {
    "good": ('''
class Plugin:
    """Counts batches.

    every: count every N batches
    """
    hookloop_role = "observer"
    hookloop_requires = ">=2,<3"  # a good plugin says which contract it follows
    def __init__(self, every=1):
        self.every = every
    @hookloop.hookimpl
    def on_train_batch_end(self, trainer, batch_idx):
        pass
''', None),
    "unknown_hook": ('''
class Plugin:
    hookloop_role = "observer"
    @hookloop.hookimpl
    def on_train_batch_ended(self, trainer):
        pass
''', "'on_train_batch_ended' is not a hookloop hook"),
    "bad_argument": ('''
class Plugin:
    hookloop_role = "observer"
    @hookloop.hookimpl
    def on_train_epoch_end(self, trainer, epoch_metrics):
        pass
''', "argument 'epoch_metrics' is not an argument of on_train_epoch_end"),
    "no_role": ('''
class Plugin:
    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        pass
''', "declares no hookloop_role"),
    "bad_role": ('''
class Plugin:
    hookloop_role = "obsever"
''', "hookloop_role='obsever' is not a role"),
    "undocumented_option": ('''
class Plugin:
    """Does something."""
    hookloop_role = "observer"
    def __init__(self, threshold=0.5):
        self.threshold = threshold
''', "option 'threshold' is not documented"),
    "import_fails": ('''
raise RuntimeError("broken at import")
class Plugin:
    hookloop_role = "observer"
''', "RuntimeError: broken at import"),
    "missing_dependency": ('''
class Plugin:
    hookloop_role = "observer"
''', "needs not-a-real-package-hl, which is not installed\n    fix: pip install not-a-real-package-hl"),
}


@pytest.fixture
def mistakes(site, monkeypatch):
    """The plugins of :data:`MISTAKES` installed in ``site``, for ``hookloop.tools.cli.main`` in
    this process: hookloop's once-per-process notes (versioning._TOLD) start empty and
    end as they were, and the ``hl_*`` modules imported from ``site`` are forgotten
    afterwards (the next test imports its own)."""
    for name, (source, _) in MISTAKES.items():
        requires = ["not-a-real-package-hl"] if name == "missing_dependency" else []
        install_fake_distribution(site, f"hl-{name}", {name: f"hl_{name}:Plugin"},
                                  {f"hl_{name}": "import hookloop\n" + textwrap.dedent(source)}, requires=requires)
    importlib.invalidate_caches()
    monkeypatch.setattr(versioning, "_TOLD", set())
    before = set(sys.modules)
    yield site
    for module in set(sys.modules) - before:
        if (getattr(sys.modules[module], "__file__", None) or "").startswith(str(site)):
            del sys.modules[module]


def test_hookloop_check_a_good_plugin_and_each_mistake(mistakes, capsys):
    assert hookloop.tools.cli.main(["check", "good", "ddp", "amp"]) == 0
    assert capsys.readouterr().out.splitlines() == ["good: ok", "ddp: ok", "amp: ok"]
    for name, (_, message) in MISTAKES.items():
        if message is None:
            continue
        code = hookloop.tools.cli.main(["check", name])
        stdout = capsys.readouterr().out
        assert code == 1, (name, stdout)
        assert message in stdout, (name, stdout)
        assert "fix:" in stdout


def test_plugins_load_reports_the_problems_instead_of_ok(mistakes, capsys):
    code = hookloop.tools.cli.main(["plugins", "--load"])
    stdout = capsys.readouterr().out
    assert code == 1
    rows = {line.split()[0]: line for line in stdout.splitlines() if line and not line.startswith(" ")}
    assert rows["good"].endswith("ok")
    for name in ("unknown_hook", "bad_argument", "undocumented_option"):
        assert "problem(s), see below" in rows[name]
    assert "'on_train_batch_ended' is not a hookloop hook" in stdout


# -- 1.8: options on the command line and in the environment ---------------------------------------


SHOW_OPTIONS = '''
import hookloop
import hookloop.testing
t = hookloop.Trainer(plugins=["amp"], precision="bf16-mixed", plugin_options={"amp": {"growth_interval": 7}})
amp = t.plugins[0]
print(f"OPTIONS init_scale={amp.init_scale} growth_interval={amp.growth_interval} allow_cpu_fp16={amp.allow_cpu_fp16}")
'''


@pytest.mark.slow  # the options reach a launched interpreter through hookloop run's real hand-off
def test_plugin_options_from_the_environment_the_command_line_and_code(tmp_path):
    (tmp_path / "show.py").write_text(SHOW_OPTIONS)
    env = {"HOOKLOOP_PLUGIN_OPTIONS": "amp.init_scale=8; amp.allow_cpu_fp16=true; amp.growth_interval=3"}
    out = run_python(HOOKLOOP + ["run", "--plugin-option", "amp.init_scale=1024", "show.py"], cwd=tmp_path, env=env)
    # per option: code beats the command line, which beats the environment
    assert "OPTIONS init_scale=1024 growth_interval=7 allow_cpu_fp16=True" in out.stdout


def test_bad_plugin_options_are_clear_errors():
    with pytest.raises(hookloop.ConfigurationError, match="must be PLUGIN.OPTION=VALUE"):
        hookloop.contract.registry.parse_plugin_options(["amp-init_scale=3"])
    with pytest.raises(hookloop.ConfigurationError, match="no option 'init_scal' \\(did you mean 'init_scale'\\?\\); its options: allow_cpu_fp16, init_scale, growth_interval"):
        hookloop.Trainer(plugins=["amp"], plugin_options={"amp": {"init_scal": 2}})


def test_options_for_a_plugin_name_nobody_knows_are_refused(tmp_path):
    # A misspelt plugin name: its options would otherwise be silently unused.
    with pytest.raises(hookloop.ConfigurationError,
                       match=r"options are given for plugin 'ampp' \(init_scale\), but no plugin of that name is "
                             r"installed or in the run \(did you mean 'amp'\?\); plugins: .*\bddp\b.*\."):
        hookloop.Trainer(plugins=["amp"], plugin_options={"ampp": {"init_scale": 2}}, default_root_dir=tmp_path)
    # A plugin object given in code is known by its name: the options reach it, and are
    # refused as options (value is no constructor argument: options construct plugins,
    # tests/test_plugin_options.py), not as a name nobody knows.
    with pytest.raises(hookloop.ConfigurationError, match=r"plugin 'rank_counter' has no option 'value'; its options: none"):
        hookloop.Trainer(plugins=[RankCounter()], plugin_options={"rank_counter": {"value": 2.0}},
                         default_root_dir=tmp_path)


def test_options_for_an_installed_plugin_outside_the_run_are_kept_for_the_runs_that_use_it(tmp_path):
    # examples/gan.py sets ddp's options in code; run alone it has no ddp, and that is fine.
    trainer = hookloop.Trainer(plugin_options={"ddp": {"find_unused_parameters": True}}, default_root_dir=tmp_path)
    assert "ddp" not in [hookloop.contract.registry.plugin_name(p) for p in trainer.plugins]
    trainer = hookloop.Trainer(plugins=["ddp"], plugin_options={"ddp": {"find_unused_parameters": True}},
                               default_root_dir=tmp_path)
    assert trainer.strategy.find_unused_parameters is True
    # The same for a blocked built-in observer.
    trainer = hookloop.Trainer(plugins=["no:progress"], plugin_options={"progress": {"refresh_seconds": 2.0}},
                               default_root_dir=tmp_path)
    assert "progress" not in [hookloop.contract.registry.plugin_name(p) for p in trainer.plugins]


# -- 1.8: state each rank holds on its own survives a checkpoint -------------------------------


class RankCounter:
    """State that differs per rank (as local SGD's optimizer state does)."""

    hookloop_name = "rank_counter"
    hookloop_role = "extension"

    def __init__(self):
        self.value, self.restored = 0.0, None

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer):
        self.value += trainer.global_rank + 1

    @hookloop.hookimpl
    def on_save_rank_checkpoint(self, trainer, rank_state):
        rank_state["rank_counter"] = {"value": self.value, "rank": trainer.global_rank, "t": torch.tensor([self.value])}

    @hookloop.hookimpl
    def on_load_rank_checkpoint(self, rank_state, rank_states):
        self.restored = (rank_state["rank_counter"], len(rank_states))


def per_rank_state(root: str) -> dict:
    """One rank of a 2-process ddp job: train, checkpoint, resume with a fresh plugin."""
    first = RankCounter()
    trainer = hookloop.Trainer(plugins=["ddp", first], max_epochs=1, default_root_dir=root)
    trainer.fit(TinyModule(), DataLoader(tiny_data(32), batch_size=4))
    second = RankCounter()
    resumed = hookloop.Trainer(plugins=["ddp", second], max_epochs=2, default_root_dir=root)
    resumed.fit(TinyModule(), DataLoader(tiny_data(32), batch_size=4), ckpt_path="last")
    return {"rank": resumed.global_rank, "saved": first.value, "restored": second.restored}


@pytest.mark.slow  # hookloop_processes spawns the ranks
def test_per_rank_plugin_state_is_restored_to_its_rank(hookloop_processes, tmp_path):
    results = hookloop_processes(per_rank_state, nprocs=2, args=(str(tmp_path),), timeout=180)
    assert [r["saved"] for r in results] == [4.0, 8.0]  # 4 batches per rank x (rank + 1)
    for r, result in enumerate(results):
        state, count = result["restored"]
        assert count == 2
        assert state["rank"] == r and state["value"] == result["saved"] and torch.equal(state["t"], torch.tensor([result["saved"]]))


def rank_of(exit_on_rank: int):
    import os

    rank = int(os.environ["RANK"])
    if rank == exit_on_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    return rank


@pytest.mark.slow  # the process fixture itself: spawned ranks
def test_the_process_fixture_names_the_failing_rank(hookloop_processes):
    assert hookloop_processes(rank_of, nprocs=3, args=(-1,)) == [0, 1, 2]
    with pytest.raises(hookloop.testing.ProcessError, match="rank 1 raised ValueError: rank 1 fails on purpose"):
        hookloop_processes(rank_of, nprocs=2, args=(1,))


def hangs_on_rank_one():
    import os
    import time

    if os.environ["RANK"] == "1":
        time.sleep(600)


@pytest.mark.slow  # the process fixture itself: spawned ranks
def test_the_process_fixture_kills_stragglers_after_its_timeout(hookloop_processes):
    import time

    start = time.monotonic()
    # 30 s: rank 0 must have started (spawn, import torch: 2-4 s on 2 idle cores, 10-20 s
    # when the machine is loaded) and finished by then; rank 1 sleeps 600 s.
    with pytest.raises(hookloop.testing.ProcessError, match=r"ran past 30 s: rank\(s\) \[1\] still running"):
        hookloop_processes(hangs_on_rank_one, nprocs=2, timeout=30)
    assert time.monotonic() - start < 120
