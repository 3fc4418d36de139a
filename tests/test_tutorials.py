"""Every code block of the tutorials (docs/tutorials/*.md) is run, as written (issue 34,
item 5).

A page is read top to bottom in a fresh folder, the way a reader follows it:

* a ``python title="NAME"`` block is written to NAME (the files later blocks run);
* a ``python`` block without a title is run as a script;
* a ``sh`` block is run by bash (``set -e``), with this interpreter's ``bin`` first on
  ``PATH`` (``python`` and ``hookloop`` are the installed ones);
* a block preceded by ``<!-- not-run: REASON -->`` is not run: a cluster's sbatch file,
  the set-up commands this test runs inside, an output shown. Those are listed in
  :data:`NOT_RUN`, so that none is skipped silently: a new one fails
  :func:`test_every_tutorial_block_is_run_or_says_why_not` until it is listed there.

The multi-node page's rendezvous port (29400) is replaced by a free one, and the
environment is cleaned of launcher and hookloop variables (``OMP_NUM_THREADS`` too: the
first-run page shows the line hookloop prints when it sets it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, free_port

PAGES = REPO / "docs" / "tutorials"
FENCE = re.compile(r"(?:<!-- not-run: (?P<reason>[^\n]*?) -->\n)?"
                   r"^```(?P<lang>\w*)(?P<info>[^\n]*)\n(?P<code>.*?)^```$", re.S | re.M)
OMP_LINE = "hookloop: OMP_NUM_THREADS=1 per process (set it to override)"

#: (page, the block's first line): every block the test does not run, with its reason in
#: the page.
NOT_RUN = {
    ("first-run.md", "make demo    # creates .venv with what the demo needs, trains digits on 2 "
                     "processes, plots the metrics"),
    ("first-run.md", OMP_LINE),
    ("porting-lightning.md", "import lightning.pytorch as pl"),
    ("multi-node.md", "#!/bin/bash"),
}


@dataclass
class Block:
    page: str
    lang: str
    title: str | None
    code: str
    reason: str | None  # why it is not run; None: it is run

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0]


def blocks(page: Path) -> list[Block]:
    found = []
    for m in FENCE.finditer(page.read_text()):
        title = re.search(r'title="([^"]+)"', m.group("info"))
        found.append(Block(page.name, m.group("lang"), title.group(1) if title else None,
                           m.group("code"), m.group("reason")))
    return found


def tutorials() -> list[Path]:
    return sorted(PAGES.glob("*.md"))


def test_every_tutorial_block_is_run_or_says_why_not():
    pages = {p.name for p in tutorials()}
    assert {"first-run.md", "porting-lightning.md", "nanogpt.md", "multi-node.md"} <= pages
    not_run, run = set(), 0
    for page in tutorials():
        for block in blocks(page):
            if block.reason is not None:
                assert block.reason.strip(), f"{page.name}: a not-run block needs its reason"
                not_run.add((block.page, block.first_line))
            else:
                assert block.lang in ("python", "sh"), (
                    f"{page.name}: a ```{block.lang} block is neither run nor marked "
                    f"<!-- not-run: REASON -->:\n{block.code}")
                run += 1
    assert not_run == NOT_RUN, f"not-run blocks changed: {sorted(not_run ^ NOT_RUN)}"
    assert run >= 12


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOOKLOOP_", "TORCHELASTIC_", "PET_"))
           and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_page(page: Path, folder: Path) -> list[tuple[Block, str]]:
    """Each run block of ``page`` with its output (stdout and stderr), in order."""
    env, port, outputs = clean_env(), str(free_port()), []
    written: set[str] = set()
    for i, block in enumerate(blocks(page)):
        if block.reason is not None:
            continue
        if block.lang == "python" and block.title:
            mode = "a" if block.title in written else "w"
            with open(folder / block.title, mode) as f:
                f.write(block.code)
            written.add(block.title)
            continue
        if block.lang == "python":
            script = folder / f"block_{i}.py"
            script.write_text(block.code)
            command = [sys.executable, str(script)]
        else:
            code = block.code.replace("127.0.0.1:29400", f"127.0.0.1:{port}")
            command = ["bash", "-e", "-c", code]
        done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                              timeout=300)
        output = done.stdout + done.stderr
        assert done.returncode == 0, (
            f"{page.name}, block {i} failed ({done.returncode}):\n{block.code}\n{output}")
        outputs.append((block, output))
    return outputs


@pytest.mark.slow
def test_first_run(tmp_path):
    (one, two, plot) = run_page(PAGES / "first-run.md", tmp_path)
    assert float(re.search(r"val_acc (\S+)", one[1]).group(1)) > 0.85, one[1]
    assert float(re.search(r"val_acc (\S+)", two[1]).group(1)) > 0.85, two[1]
    # hookloop's one line about OMP_NUM_THREADS, torchrun's 4-line block gone
    assert two[1].splitlines().count(OMP_LINE) == 1, two[1]
    assert "Setting OMP_NUM_THREADS" not in two[1] and "*****" not in two[1], two[1]
    assert (tmp_path / "logs" / "version_1" / "metrics.csv").is_file()
    assert ".png" in plot[1], plot[1]


@pytest.mark.slow
def test_porting_a_lightning_module(tmp_path):
    (run,) = run_page(PAGES / "porting-lightning.md", tmp_path)
    assert re.search(r"^test_loss 0\.0\d+$", run[1], re.M), run[1]


@pytest.mark.slow
def test_porting_nanogpt_ends_with_the_hand_written_loops_weights(tmp_path):
    outputs = run_page(PAGES / "nanogpt.md", tmp_path)
    assert "largest difference of a weight" in outputs[-1][1]  # the page's own assertion passed


@pytest.mark.slow
def test_two_nodes_on_localhost(tmp_path):
    (run,) = run_page(PAGES / "multi-node.md", tmp_path)
    lines = sorted(run[1].splitlines()[:2])
    assert lines == ["node 0: rank 0 of 2, 8 steps", "node 1: rank 1 of 2, 8 steps"], run[1]
