"""No block of code is copied between plugins, or between a plugin and the core.

What two plugins both need belongs in the core's public helpers (``hookloop``), not in
copies (issue 20, "shared helpers instead of copies in plugins"). This reads every
``.py`` under ``plugins/*/src`` and ``core/hookloop`` with :mod:`tokenize` and fails,
naming both places, when ``WINDOW`` consecutive logical lines appear in two different
plugins, or in a plugin and the core. A line is compared by its tokens, so reformatting
a copy does not hide it; comments, docstrings, blank lines and import lines do not count,
and a copy whose variables were renamed is still one: every name is folded to ``N``
(attribute names after a dot are kept: they say what is called), every string to ``S``
and every number to ``0``. Copies inside one plugin or
inside the core are another matter (not checked here).
"""

from __future__ import annotations

import io
import keyword
import textwrap
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: logical lines a copied block must span to be reported
WINDOW = 8
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER}


def logical_lines(source: str) -> list[tuple[int, tuple[str, ...]]]:
    """``(first physical line, tokens)`` of each logical line of ``source`` that is not
    a docstring, an import, or only punctuation."""
    lines: list[tuple[int, tuple[str, ...]]] = []
    current: list[tokenize.TokenInfo] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in _SKIP:
            continue
        if token.type == tokenize.NEWLINE:
            if current:
                words = _folded(current)
                docstring = all(t.type == tokenize.STRING for t in current)
                trivial = all(not (t.type == tokenize.NAME or t.type == tokenize.NUMBER or t.type == tokenize.STRING) for t in current)
                if not docstring and not trivial and words[0] not in ("import", "from"):
                    lines.append((current[0].start[0], words))
            current = []
            continue
        current.append(token)
    return lines


def _folded(tokens: list[tokenize.TokenInfo]) -> tuple[str, ...]:
    words, previous = [], ""
    for t in tokens:
        if t.type == tokenize.NAME and not keyword.iskeyword(t.string) and previous != ".":
            words.append("N")
        elif t.type == tokenize.STRING or t.type in _FSTRING:
            words.append("S")
        elif t.type == tokenize.NUMBER:
            words.append("0")
        else:
            words.append(t.string)
        previous = t.string
    return tuple(words)


_FSTRING = {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, n)}


def sources() -> dict[str, list[Path]]:
    """The files of each unit: ``core`` and one entry per plugin."""
    units = {"core": sorted((ROOT / "core" / "hookloop").rglob("*.py"))}
    for src in sorted((ROOT / "plugins").glob("*/src")):
        units[f"plugin {src.parent.name}"] = sorted(src.rglob("*.py"))
    return units


def find_copies(units: dict[str, list[Path]], window: int = WINDOW) -> list[str]:
    """One message per block of ``window`` logical lines found in two units (one message
    per pair of places, the first window of a longer copied run only)."""
    seen: dict[tuple, tuple[str, Path, int]] = {}
    found: dict[tuple, str] = {}
    for unit, files in units.items():
        for path in files:
            lines = logical_lines(path.read_text(encoding="utf-8"))
            for start in range(len(lines) - window + 1):
                key = tuple(words for _, words in lines[start:start + window])
                first = seen.setdefault(key, (unit, path, lines[start][0]))
                if first[0] == unit:
                    continue
                pair = (first[1], path)
                if pair in found:
                    continue
                found[pair] = (f"{_shown(first[1])}:{first[2]} ({first[0]}) and "
                               f"{_shown(path)}:{lines[start][0]} ({unit}) share {window} logical "
                               f"lines, from: {' '.join(key[0])[:80]}")
    return list(found.values())


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def test_finder_reports_a_copy_between_two_units(tmp_path):
    """The finder itself: a block pasted from one plugin into another (renamed around
    it, reindented, its names changed) is reported with both places; the same block once is not."""
    block = "\n".join(f"    value_{i} = compute({i}, 'x') + other[{i}]" for i in range(WINDOW))
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text(f"def one():\n{block}\n    return 1\n")
    b.write_text("class K:\n    def two(self):\n        import os\n" + textwrap.indent(block, "    ") + "\n        return 2\n")
    b.write_text(b.read_text().replace("value_", "renamed_").replace("'x'", "'y'"))
    c.write_text("def three():\n" + "\n".join(f"    value_{i} = thing.compute({i}, 'y') + other[{i}]" for i in range(WINDOW)) + "\n")
    copies = find_copies({"plugin p": [a], "plugin q": [b], "core": [c]})
    assert len(copies) == 1 and "a.py:2 (plugin p)" in copies[0] and "b.py:4 (plugin q)" in copies[0], copies
    assert find_copies({"plugin p": [a, c]}) == []  # within one unit: not checked here


def test_no_block_is_copied_between_plugins_or_into_the_core():
    copies = find_copies(sources())
    assert not copies, (
        f"{len(copies)} block(s) of {WINDOW}+ logical lines copied between plugins or between a plugin "
        f"and the core: move the code into a core helper (hookloop) and call it from both:\n  "
        + "\n  ".join(copies))


# ---------------------------------------------------------------------------------------
# What the copies got wrong, now that each strategy uses the one core helper
# ---------------------------------------------------------------------------------------

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402


class _DrawsInSetup(TinyModule):
    """Draws from torch's generator in ``setup``: right after the strategy's
    ``setup_environment``, before anything else of the run draws."""

    def setup(self, stage):
        self.drawn = torch.rand(4)


@pytest.mark.parametrize("strategy", ["ddp", "horovod"])
def test_a_strategy_seeds_the_generators_again_from_seed_everything(strategy):
    """Every strategy that starts a process group seeds the generators again from
    ``seed_everything``'s seed (``hookloop.reset_seed``), as Lightning's do, whatever
    the script drew before ``fit`` (here: building the model). horovod did not
    (ddp's copy of that step was ddp's own)."""
    hookloop.seed_everything(123)
    torch.rand(5)  # the script draws before fit: e.g. a model's initialisation
    module = _DrawsInSetup()
    trainer = hookloop.Trainer(plugins=[strategy], max_steps=1, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(tiny_data(16), batch_size=8))
    torch.manual_seed(123)
    assert torch.equal(module.drawn, torch.rand(4))


@pytest.mark.parametrize("strategy", ["deepspeed", "horovod"])
def test_sampler_seed_is_an_option_of_every_strategy_checked_at_construction(strategy):
    """The samplers' seed (ddp's ``sampler_seed``) is an option of every strategy that
    shares out the data, checked when the plugin is made."""
    assert hookloop.plugin(strategy, sampler_seed=7).sampler_seed == 7
    with pytest.raises(hookloop.ConfigurationError, match="sampler_seed='7'.*must be an integer"):
        hookloop.plugin(strategy, sampler_seed="7")


class _Schedules(TinyModule):
    """SGD with ``schedulers`` StepLRs on the one optimizer (a DeepSpeed engine has one)."""

    def __init__(self, schedulers: int):
        super().__init__(momentum=0.0)
        self.schedulers = schedulers

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for _ in range(self.schedulers)]


def test_deepspeed_resume_with_another_number_of_schedulers_is_refused(tmp_path):
    """A checkpoint of two LR schedulers resumed into a run with one: every strategy
    refuses it naming both counts (the core's ``load_scheduler_states``). deepspeed's own
    copy of the restore zipped the two lists, silently restoring the first schedule and
    dropping the second."""
    def trainer(steps, root, callbacks=()):
        return hookloop.Trainer(plugins=["deepspeed"], accelerator="cpu", max_steps=steps, logger=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                                enable_checkpointing=False, default_root_dir=str(root))

    class SaveAtTheEnd(hookloop.Callback):
        def on_train_end(self, trainer, module):
            trainer.save_checkpoint(path)  # while the engine is there

    loader = DataLoader(tiny_data(32), batch_size=8)
    path = tmp_path / "two_schedulers.ckpt"
    first = trainer(2, tmp_path / "first", [SaveAtTheEnd()])
    first.fit(_Schedules(2), loader)
    assert path.is_dir()
    with pytest.raises(hookloop.CheckpointError, match=r"holds 2 LR scheduler\(s\) and configure_optimizers returned 1"):
        trainer(4, tmp_path / "second").fit(_Schedules(1), loader, ckpt_path=str(path))


def test_the_scaler_and_clipping_hooks_are_where_the_contract_says():
    """fp16 with clipping: ``configure_grad_scaler`` once, at ``setup``; ``clip_gradients``
    at every optimizer step, right after ``on_before_optimizer_step`` (observers see the
    unclipped gradients), with the Trainer's value and algorithm; and the weights are
    those of a hand-written GradScaler loop that clips the unscaled gradients."""
    from hookloop_amp import AMP

    calls = []

    class Tracer:
        hookloop_name, hookloop_role = "tracer", "observer"

        @hookloop.hookimpl
        def configure_grad_scaler(self, device, options):
            calls.append(("configure_grad_scaler", device.type, dict(options)))

        @hookloop.hookimpl
        def on_before_optimizer_step(self):
            calls.append(("on_before_optimizer_step",))

        @hookloop.hookimpl
        def clip_gradients(self, clip_val, algorithm):
            calls.append(("clip_gradients", clip_val, algorithm))

    loader = DataLoader(tiny_data(32), batch_size=8)
    module = TinyModule()
    reference = TinyModule()
    trainer = hookloop.Trainer(plugins=[AMP(allow_cpu_fp16=True, init_scale=2.0**8), Tracer()], precision="16-mixed",
                               max_epochs=1, gradient_clip_val=0.05, enable_checkpointing=False, logger=False,
                               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader)
    assert calls[0] == ("configure_grad_scaler", "cpu", {"init_scale": 2.0**8, "growth_interval": 2000})
    assert calls[1:] == [("on_before_optimizer_step",), ("clip_gradients", 0.05, "norm")] * 4

    opt = torch.optim.SGD(reference.parameters(), lr=reference.lr, momentum=reference.momentum)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(reference(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
    for (name, a), b in zip(module.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
