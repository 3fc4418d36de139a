"""The distribution holds the layout: every folder of the core is a package of the wheel,
and ``hookloop new-plugin``'s templates travel as package data (issue 34 item 1)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "hookloop"


@pytest.mark.slow
def test_the_wheel_holds_every_module_of_the_core_and_the_scaffold_templates(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=600,
                   stdout=subprocess.DEVNULL)
    (wheel,) = tmp_path.glob("hookloop-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(CORE.parent)) for p in CORE.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".tmpl")}
    assert sources - names == set(), "missing from the wheel"
    templates = {p.name for p in (CORE / "tools" / "templates").glob("*.tmpl")}
    assert {"strategy.py.tmpl", "pyproject.toml.tmpl", "README.md.tmpl"} <= templates
