"""Copy Lightning's unit tests of the areas hookloop claims into ``vendor/`` (whole files).

    python -m tests.lightning_unit.vendor_tests [MIRROR_GIT_DIR]

Every file is copied verbatim from the commit named in NOTICE.md: the test files of
`FILES`, the helpers they import (``tests_pytorch/helpers/``, its own tests left out),
Lightning's ``tests_pytorch/conftest.py`` and the package ``__init__.py`` files on the
way. Only import statements change, at run time (run.py), never in these files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENDOR = HERE / "vendor"
MIRROR = "/work/.mirror/Lightning-AI+pytorch-lightning/repo"
# Tag 2.6.5: the mirror has no 2.6.6 tag, and the tests of its newest commit (the one
# tests/lightning_scripts/NOTICE.md names) import what 2.6.6 lacks (runif.py:
# _TORCH_GREATER_EQUAL_2_11). 2.6.5 is the release closest to the reference 2.6.6.
COMMIT = "be98784a1a03581b7051a355ae1084fd352d7cea"
ROOT = "tests/tests_pytorch"

# The test files of the 24 areas issue 35 measures, relative to tests/tests_pytorch.
FILES = (
    "callbacks/test_early_stopping.py",
    "checkpointing/test_model_checkpoint.py",
    "checkpointing/test_checkpoint_callback_frequency.py",
    "callbacks/test_lr_monitor.py",
    "callbacks/test_timer.py",
    "callbacks/test_weight_averaging.py",
    "callbacks/test_stochastic_weight_avg.py",
    "callbacks/test_finetuning_callback.py",
    "callbacks/test_prediction_writer.py",
    "callbacks/test_gradient_accumulation_scheduler.py",
    "trainer/logging_/test_train_loop_logging.py",
    "trainer/logging_/test_eval_loop_logging.py",
    "trainer/optimization/test_manual_optimization.py",
    "trainer/optimization/test_multiple_optimizers.py",
    "trainer/optimization/test_optimizers.py",
    "trainer/flags/test_val_check_interval.py",
    "trainer/flags/test_check_val_every_n_epoch.py",
    "trainer/flags/test_limit_batches.py",
    "trainer/flags/test_min_max_epochs.py",
    "trainer/flags/test_fast_dev_run.py",
    "trainer/flags/test_overfit_batches.py",
    "loops/test_training_loop.py",
    "loops/test_evaluation_loop.py",
    "tuner/test_lr_finder.py",
)

# Lightning's test harness, not code under test: imported from pytorch-lightning 2.6.6 in
# both runs (run.py): the fixtures (conftest), RunIf's skip conditions, the package paths.
HARNESS = ("__init__.py", "conftest.py", "helpers/runif.py")


def _git(*args: str) -> str:
    return subprocess.run(["git", "--git-dir", MIRROR, *args], check=True, capture_output=True, text=True).stdout


def wanted() -> list[str]:
    """Every vendored path, relative to tests/tests_pytorch."""
    helpers = [p[len(ROOT) + 1:] for p in _git("ls-tree", "--name-only", COMMIT, f"{ROOT}/helpers/").split()
               if p.endswith(".py") and not p.rsplit("/", 1)[-1].startswith("test_")]
    packages = {str(parent / "__init__.py") for f in FILES for parent in Path(f).parents if str(parent) != "."}
    return sorted(set(FILES) | set(helpers) | packages | set(HARNESS))


def main(mirror: str = MIRROR) -> None:
    global MIRROR
    MIRROR = mirror
    for path in wanted():
        out = VENDOR / "tests_pytorch" / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_git("show", f"{COMMIT}:{ROOT}/{path}"))
    print(f"vendored {len(wanted())} files from {COMMIT}")


if __name__ == "__main__":
    main(*sys.argv[1:])
