"""The acceptance table's cases: Lightning's own scripts, demos, docs example and tests.

Each `Case` names a vendored source (``vendor/``, see NOTICE.md) and how to run it: as a
script (``__main__`` with its own command-line arguments) or, for Lightning's tests, by
calling the test function with its fixtures as plain arguments. ``ddp`` says how the
two-process run is asked for: ``"env"`` (the script's Trainer leaves ``strategy``/``devices``
to their defaults, so Lightning's ``PL_TRAINER_*`` and hookloop's
``HOOKLOOP_TRAINER_DEFAULTS`` environment defaults set them), ``"args"`` (the script's own
command line: ``ddp_args``), or a reason it runs in one process only. A `blocked` case
cannot run here at all (say why); it is listed, never faked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

VENDOR = Path(__file__).resolve().parent / "vendor"


@dataclass(frozen=True)
class Case:
    name: str
    source: str  # the mirror path (what the table shows)
    vendored: str | None = None  # path under vendor/
    kind: str = "script"  # "script" | "test"
    argv: tuple = ()
    function: str | None = None  # kind == "test"
    kwargs: dict = field(default_factory=dict)  # the test's parameters (tmp_path is added)
    ddp: str = "env"  # "env" | "args" | a reason for one process only
    ddp_args: tuple = ()
    data: tuple = ()  # local data the script reads: "wikitext2", "mnist"
    blocked: str | None = None
    fast: bool = True  # part of the default pytest run (one process)
    timeout: float = 300  # seconds, per framework and mode


def _t(name, src, fn, **kw):
    return Case(name, f"tests/tests_pytorch/{src}::{fn}", f"lightning_tests/{name}.py", kind="test",
                function=fn, **kw)


TV = "needs torchvision (no build for torch 2.13.0 CPU)"
GYM = ("needs gym<0.26 (it unpacks 4 values from env.step; gym 0.26 returns 5; gym 0.25.2 is on the "
       "index but not in the test environment), and its Trainer(accelerator='cpu', devices=1, "
       "val_check_interval=100) trains Lightning's default 1000 epochs of environment steps: no "
       "argument of the script shortens it")
CASES = [
    Case("bug_report_model", "examples/pytorch/bug_report/bug_report_model.py", "examples/bug_report_model.py"),
    Case("basics_transformer", "examples/pytorch/basics/transformer.py", "examples/basics_transformer.py",
         data=("wikitext2",), fast=False, timeout=1800),  # 20 epochs over 100 validation batches each
    Case("docs_cli_intermediate", "docs/source-pytorch/cli/lightning_cli_intermediate.rst (main.py)",
         "docs/lightning_cli_intermediate_main.py", argv=("fit", "--trainer.max_epochs", "2"),
         ddp="args", ddp_args=("--trainer.accelerator", "cpu", "--trainer.strategy", "ddp",
                               "--trainer.devices", "2")),
    Case("docs_lightning_module_starter", "docs/source-pytorch/common/lightning_module.rst (Starter Example)",
         "docs/lightning_module_starter.py", data=("wikitext2",)),
    _t("train_loop_logging", "trainer/logging_/test_train_loop_logging.py", "test__training_step__log"),
    _t("eval_loop_logging", "trainer/logging_/test_eval_loop_logging.py", "test__validation_step__log"),
    _t("early_stopping_patience", "callbacks/test_early_stopping.py", "test_early_stopping_patience",
       kwargs={"loss_values": [6, 5, 4, 4, 3, 3], "patience": 1, "expected_stop_epoch": 3}),
    _t("should_stop_mid_epoch", "loops/test_training_loop.py", "test_should_stop_mid_epoch"),
    _t("batch_start_minus_one", "loops/test_training_loop.py", "test_on_train_batch_start_return_minus_one",
       kwargs={"max_epochs": 2, "batch_idx_": 5}),
    _t("training_starts_with_seed", "loops/test_training_loop.py", "test_training_starts_with_seed",
       kwargs={"seed_once": False}),
    _t("step_with_optimizer_closure", "trainer/optimization/test_manual_optimization.py",
       "test_step_with_optimizer_closure"),
    _t("model_checkpoint_topk_all", "checkpointing/test_model_checkpoint.py", "test_model_checkpoint_topk_all"),
    Case("basics_autoencoder", "examples/pytorch/basics/autoencoder.py", "examples/basics_autoencoder.py",
         blocked=TV + ": transforms.ToTensor() in its datamodule, save_image in its callback"),
    Case("basics_backbone_image_classifier", "examples/pytorch/basics/backbone_image_classifier.py",
         "examples/basics_backbone_image_classifier.py", blocked=TV + ": transforms.ToTensor() in its datamodule"),
    Case("basics_profiler_example", "examples/pytorch/basics/profiler_example.py",
         blocked=TV + " and a CIFAR10 download; a torchvision model"),
    Case("computer_vision_fine_tuning", "examples/pytorch/domain_templates/computer_vision_fine_tuning.py",
         "examples/computer_vision_fine_tuning.py", blocked=TV + ": ImageFolder, transforms, a pretrained resnet"),
    Case("generative_adversarial_net", "examples/pytorch/domain_templates/generative_adversarial_net.py",
         "examples/generative_adversarial_net.py",
         blocked="hardcodes Trainer(accelerator='gpu', devices=1); no GPU here"),
    Case("imagenet", "examples/pytorch/domain_templates/imagenet.py", blocked=TV + " and the ImageNet data"),
    Case("reinforce_learn_Qnet", "examples/pytorch/domain_templates/reinforce_learn_Qnet.py",
         blocked=GYM),
    Case("reinforce_learn_ppo", "examples/pytorch/domain_templates/reinforce_learn_ppo.py",
         blocked=GYM),
    Case("semantic_segmentation", "examples/pytorch/domain_templates/semantic_segmentation.py",
         blocked=TV + ": torchvision.transforms at import"),
    Case("fp8_distributed_transformer", "examples/pytorch/fp8_distributed_transformer/train.py",
         blocked="needs CUDA GPUs (float8 training, torchao)"),
    Case("tensor_parallel", "examples/pytorch/tensor_parallel/train.py",
         blocked="needs CUDA GPUs (ModelParallelStrategy)"),
    Case("servable_module", "examples/pytorch/servable_module/production.py",
         blocked=TV + ": a torchvision resnet18 and CIFAR10"),
]

BY_NAME = {c.name: c for c in CASES}


@dataclass(frozen=True)
class Documented:
    """A difference between the frameworks on a case that docs/decisions.md records."""

    case: str
    mode: str  # "1p" | "ddp"
    what: str  # the substring of the comparison's finding it explains
    decision: str  # a phrase that docs/decisions.md contains


DOCUMENTED: list[Documented] = [
    # fit(max_steps=2) stops inside epoch 0: Lightning then reports current_epoch 1
    Documented("training_starts_with_seed", "1p", "current_epoch 0 instead of 1",
               "Unlike Lightning, `current_epoch` and the position inside the"),
    Documented("training_starts_with_seed", "ddp", "current_epoch 0 instead of 1",
               "Unlike Lightning, `current_epoch` and the position inside the"),
    # trainer.should_stop = True at batch 4 of epoch 0: the same, asserted by Lightning's test
    Documented("should_stop_mid_epoch", "1p", "`assert trainer.current_epoch == 1`",
               "Unlike Lightning, `current_epoch` and the position inside the"),
    Documented("should_stop_mid_epoch", "ddp", "`assert trainer.current_epoch == 1`",
               "Unlike Lightning, `current_epoch` and the position inside the"),
    # Lightning's tests assert callback_metrics values are Tensors: hookloop's are floats
    *[Documented(case, mode, "assert all(isinstance(v, Tensor) for v in trainer.callback_metrics.values())",
                 "`callback_metrics` values are Python floats, not Lightning's 0-dim")
      for case in ("train_loop_logging", "eval_loop_logging") for mode in ("1p", "ddp")],
    # the test patches Lightning's Strategy.backward: hookloop has no Strategy class
    *[Documented("step_with_optimizer_closure", mode, "cannot import name 'Strategy'",
                 "There is no `Strategy` base class either") for mode in ("1p", "ddp")],
    # shuffled training with dropout and a validation each epoch: Lightning's validation
    # draws a seed (its loader's iterator), hookloop's restores the generators
    *[Documented("basics_transformer", mode, "train_loss",
                 "Validation draws nothing from the random generators") for mode in ("1p", "ddp")],
]

# The cases that do not match Lightning on this branch yet, with the first error (the lead's
# to-do list; `python -m tests.lightning_scripts.table` prints the whole table), keyed by
# case name (both modes) or "name/ddp". The pytest file runs them as strict xfails: one
# that starts to match fails the run until it is removed from here.
NOT_YET: dict[str, str] = {}
