"""`hookloop plugins` says when a backend is installed but not built, with the command.

The optional plugin-side contract is ``hookloop_build_status()`` (docs/plugin-authors.md):
``None`` when ready, else the message. The real states are made here: an empty torch
extensions directory (DeepSpeed's CPU ops not compiled), and a copy of the installed
Horovod package without its compiled PyTorch extension (Horovod built without PyTorch).

``hookloop plugins`` runs in this process (``hookloop.tools.cli.main``); the Horovod reference,
``horovod_usable``, needs a fresh interpreter, so the two tests that use it are slow.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import install_fake_distribution
from hookloop.tools import cli
DEEPSPEED_NOT_BUILT = "not built: run 'make backends' (or python -m hookloop_deepspeed.build_ops)"
HOROVOD_NOT_BUILT = "not built: run 'make backends' (or plugins/horovod/build_horovod.sh)"
DEEPSPEED_ROWS = ["deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
                  "deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme"]


def status_column(stdout: str) -> dict[str, str]:
    """``{plugin: its DEPENDENCIES cell}`` of the table (the cell is everything after the role)."""
    out = {}
    for line in stdout.splitlines()[1:]:
        cells = line.split(maxsplit=4)
        if len(cells) == 5:
            out[cells[0]] = cells[4].strip()
    return out


def horovod_usable(env: dict | None = None) -> bool:
    """The reference for Horovod: build_horovod.sh's own check, in a fresh interpreter
    (``import horovod.torch`` alone only warns when the extension is missing)."""
    import os

    code = "import horovod.torch as hvd; assert hvd.gloo_built()"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=120)
    return proc.returncode == 0


def ops_compiled() -> bool:
    """The reference for DeepSpeed: torch's own rule for where the JIT ops live."""
    from torch.utils.cpp_extension import _get_build_directory

    ops = ("deepspeed_shm_comm", "cpu_adam", "fused_adam")
    return all((Path(_get_build_directory(op, False)) / f"{op}.so").is_file() for op in ops)


def plugins_table(capsys) -> str:
    """``hookloop plugins``' stdout, run in this process; the command must succeed."""
    code = cli.main(["plugins"])
    out = capsys.readouterr()
    assert code == 0, f"hookloop plugins failed ({code}):\n{out.out}\n{out.err}"
    return out.out


@pytest.mark.slow  # horovod_usable: the reference in a fresh interpreter
def test_built_backends_are_ok(capsys):
    assert ops_compiled(), "DeepSpeed's CPU ops are not compiled here: run `make backends`"
    assert horovod_usable(), "Horovod is not built here: run `make backends`"
    cells = status_column(plugins_table(capsys))
    assert {name: cells[name] for name in DEEPSPEED_ROWS + ["horovod"]} == dict.fromkeys(DEEPSPEED_ROWS + ["horovod"], "ok")


@pytest.mark.slow  # horovod_usable: the reference in a fresh interpreter
def test_unbuilt_backends_say_how_to_build(tmp_path, site, monkeypatch, capsys):
    empty_ops = tmp_path / "torch_extensions"
    empty_ops.mkdir()
    # The installed Horovod, less its compiled extension, first on the path.
    installed = Path(importlib.util.find_spec("horovod").submodule_search_locations[0])
    shutil.copytree(installed, site / "horovod", ignore=shutil.ignore_patterns("mpi_lib_v2*", "__pycache__"))
    # And a third-party plugin using the contract.
    install_fake_distribution(
        site, "hookloop-needsbuild", {"needsbuild": "hl_needsbuild:NeedsBuild"},
        {"hl_needsbuild": "class NeedsBuild:\n    hookloop_role = 'extension'\n"
                          "    hookloop_build_status = staticmethod(lambda: 'run `needsbuild-compile`')\n"},
    )
    env = {"TORCH_EXTENSIONS_DIR": str(empty_ops), "PYTHONPATH": str(site)}
    assert not horovod_usable(env)  # really not usable

    # This process as that environment: site is first on sys.path (the fixture), and a
    # Horovod imported by an earlier test is out of sys.modules for the test (find_spec
    # would return the imported one's spec), restored after it.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(empty_ops))
    monkeypatch.delitem(sys.modules, "horovod", raising=False)
    importlib.invalidate_caches()
    before = set(sys.modules)
    try:
        cells = status_column(plugins_table(capsys))
    finally:
        for name in set(sys.modules) - before:  # hl_needsbuild, imported from site
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(site)):
                del sys.modules[name]
    assert {name: cells[name] for name in DEEPSPEED_ROWS} == dict.fromkeys(DEEPSPEED_ROWS, DEEPSPEED_NOT_BUILT)
    assert cells["horovod"] == HOROVOD_NOT_BUILT
    assert cells["needsbuild"] == "not built: run `needsbuild-compile`"
    assert cells["ddp"] == "ok"  # plugins without the contract are unaffected
    assert list(empty_ops.iterdir()) == []  # looking created nothing


def test_contract_on_a_third_party_plugin(site, tmp_path):
    from hookloop.contract import registry

    marker = tmp_path / "imported"
    install_fake_distribution(
        site, "hookloop-needsbuild", {"needsbuild": "hl_needsbuild:NeedsBuild", "quiet": "hl_quiet:Quiet",
                                      "broken": "hl_needsbuild:Broken"},
        {
            "hl_needsbuild": """
                class NeedsBuild:
                    hookloop_role = "extension"
                    @staticmethod
                    def hookloop_build_status():
                        return "run `needsbuild-compile`"

                class Broken(NeedsBuild):
                    @staticmethod
                    def hookloop_build_status():
                        raise OSError("disk gone")
                """,
            # Declares no build status: listing must not import it.
            "hl_quiet": f"open({str(marker)!r}, 'w').write('x')\nclass Quiet:\n    hookloop_role = 'observer'\n",
        },
    )
    infos = registry.installed_plugins()
    assert infos["needsbuild"].build_status() == "run `needsbuild-compile`"
    assert infos["broken"].build_status() == (
        "unknown (broken.hookloop_build_status() raised OSError: disk gone)")
    assert infos["quiet"].build_status() is None
    assert not marker.exists()


def test_stale_extension_lock_is_cleared(tmp_path):
    """A build killed mid-way leaves torch's ``lock`` file; torch's loader then waits for
    it forever (observed: a CI install hung 90 minutes on async_io's). build_ops removes
    a lock whose folder has been idle, and leaves a live build's lock alone."""
    import os
    import time

    from hookloop_deepspeed.build_ops import clear_stale_lock

    stale, live = tmp_path / "async_io", tmp_path / "cpu_adam"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "lock").touch()
        (folder / "build.ninja").write_text("rule cxx\n")
    old = time.time() - 3600
    for path in stale.iterdir():
        os.utime(path, (old, old))
    assert clear_stale_lock(stale) is True
    assert not (stale / "lock").exists() and (stale / "build.ninja").exists()
    assert clear_stale_lock(live) is False
    assert (live / "lock").exists()
    assert clear_stale_lock(tmp_path / "never_built") is False
