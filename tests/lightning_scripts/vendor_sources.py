"""Copy Lightning's sources into ``vendor/`` (run again to refresh from the mirror).

    python -m tests.lightning_scripts.vendor_sources [MIRROR_GIT_DIR]

Whole files are copied verbatim. Lightning's tests are *extracts*: the file's license
header, the file's own import statements reduced to the names the chosen function (and
the module-level helpers it calls) use, then those helpers and the function, verbatim.
The extract is needed because a test file's other imports (``tests_pytorch.helpers``,
``RunningStage``...) would fail for reasons unrelated to the function under test.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENDOR = HERE / "vendor"
MIRROR = "/work/.mirror/Lightning-AI+pytorch-lightning/repo"

# mirror path -> vendor path
FILES = {
    "src/lightning/pytorch/demos/__init__.py": "lightning_demos/__init__.py",
    "src/lightning/pytorch/demos/boring_classes.py": "lightning_demos/boring_classes.py",
    "src/lightning/pytorch/demos/lstm.py": "lightning_demos/lstm.py",
    "src/lightning/pytorch/demos/transformer.py": "lightning_demos/transformer.py",
    "src/lightning/pytorch/demos/mnist_datamodule.py": "lightning_demos/mnist_datamodule.py",
    "examples/pytorch/bug_report/bug_report_model.py": "examples/bug_report_model.py",
    "examples/pytorch/basics/transformer.py": "examples/basics_transformer.py",
    "examples/pytorch/basics/autoencoder.py": "examples/basics_autoencoder.py",
    "examples/pytorch/basics/backbone_image_classifier.py": "examples/basics_backbone_image_classifier.py",
    "examples/pytorch/domain_templates/generative_adversarial_net.py": "examples/generative_adversarial_net.py",
    "examples/pytorch/domain_templates/computer_vision_fine_tuning.py": "examples/computer_vision_fine_tuning.py",
}

# (mirror test file, function, module-level helpers it needs) -> vendor path
TESTS = {
    "lightning_tests/train_loop_logging.py": (
        "tests/tests_pytorch/trainer/logging_/test_train_loop_logging.py", "test__training_step__log", []),
    "lightning_tests/eval_loop_logging.py": (
        "tests/tests_pytorch/trainer/logging_/test_eval_loop_logging.py", "test__validation_step__log", []),
    "lightning_tests/early_stopping_patience.py": (
        "tests/tests_pytorch/callbacks/test_early_stopping.py", "test_early_stopping_patience", []),
    "lightning_tests/should_stop_mid_epoch.py": (
        "tests/tests_pytorch/loops/test_training_loop.py", "test_should_stop_mid_epoch", []),
    "lightning_tests/batch_start_minus_one.py": (
        "tests/tests_pytorch/loops/test_training_loop.py", "test_on_train_batch_start_return_minus_one", []),
    "lightning_tests/training_starts_with_seed.py": (
        "tests/tests_pytorch/loops/test_training_loop.py", "test_training_starts_with_seed", []),
    "lightning_tests/step_with_optimizer_closure.py": (
        "tests/tests_pytorch/trainer/optimization/test_manual_optimization.py", "test_step_with_optimizer_closure",
        ["assert_emtpy_grad"]),
    "lightning_tests/model_checkpoint_topk_all.py": (
        "tests/tests_pytorch/checkpointing/test_model_checkpoint.py", "test_model_checkpoint_topk_all", []),
}


# (mirror docs page, the first line of each code block, in order) -> vendor path: the blocks, dedented
DOCS = {
    "docs/lightning_cli_intermediate_main.py": ("docs/source-pytorch/cli/lightning_cli_intermediate.rst",
                                                ("# main.py",)),
    "docs/lightning_module_starter.py": ("docs/source-pytorch/common/lightning_module.rst",
                                         ("import lightning as L", "from lightning.pytorch.demos import WikiText2")),
}


def code_block(rst: str, marker: str) -> str:
    """The first ``.. code:: python`` block of a docs page that contains ``marker``."""
    import textwrap

    lines = rst.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.strip() == marker)
    end = start
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith("    ")):
        end += 1
    return textwrap.dedent("".join(lines[start:end])).rstrip() + "\n"


def show(path: str) -> str:
    return subprocess.run(["git", "-C", MIRROR, "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout


def extract(source: str, function: str, helpers: list[str]) -> str:
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    header_end = tree.body[0].lineno - 1 if tree.body else 0
    while header_end and (lines[header_end - 1].strip().startswith('"""') or not lines[header_end - 1].strip()):
        header_end -= 1  # keep the comment header, not the module docstring
    header = "".join(lines[:header_end])
    wanted = set(helpers) | {function}
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted]
    used = {n.id for d in defs for n in ast.walk(d) if isinstance(n, ast.Name)}
    used |= {n.value.id for d in defs for n in ast.walk(d)
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    imports = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            keep = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used]
            if not keep:
                continue
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in keep)
            if isinstance(node, ast.Import):
                imports.append(f"import {names}\n")
            else:
                imports.append(f"from {'.' * node.level}{node.module} import {names}\n")
    body = []
    for d in defs:
        start = (d.decorator_list[0].lineno if d.decorator_list else d.lineno) - 1
        body.append("".join(lines[start:d.end_lineno]))
    return header + "".join(imports) + "\n\n" + "\n\n".join(body)


def main(mirror: str = MIRROR) -> None:
    global MIRROR
    MIRROR = mirror
    commit = subprocess.run(["git", "-C", MIRROR, "log", "-1", "--format=%H %cs"], check=True,
                            capture_output=True, text=True).stdout.strip()
    for src, dst in FILES.items():
        out = VENDOR / dst
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(show(src))
    for dst, (src, function, helpers) in TESTS.items():
        out = VENDOR / dst
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# Extract of Lightning's {src}::{function} (see ../NOTICE.md)\n"
                       + extract(show(src), function, helpers))
    for dst, (src, markers) in DOCS.items():
        out = VENDOR / dst
        out.parent.mkdir(parents=True, exist_ok=True)
        page = show(src)
        out.write_text(f"# The code blocks of Lightning's {src} (see ../NOTICE.md)\n"
                       + "\n\n".join(code_block(page, m) for m in markers))
    print(f"vendored from {commit}")


if __name__ == "__main__":
    main(*sys.argv[1:])
