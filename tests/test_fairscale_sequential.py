"""hookloop-fairscale's ddp_sequential: 2 pipeline stages on 2 gloo processes
(torch.distributed.pipelining, GPipe), held to one-process runs made here on the same data.

One launch of tests/scripts/fairscale_sequential_battery.py runs every multi-process
check; the refusals run in this process.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, max_abs_diff, state_of

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from fairscale_sequential_battery import DATA, VAL, Losses, SeqNet  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "fairscale_sequential_battery.py"


@pytest.fixture(scope="module")
def battery(jobs):
    run = jobs.run("ddp_sequential")  # tests/jobs.py
    return run.ranks(SCRIPT.name), run.stdout(SCRIPT.name)


def single_process(batch_size=8, epochs=2, optimizer="sgd", **kwargs):
    """The same module, data and loop in one process, without any plugin."""
    losses = Losses()
    trainer = hookloop.Trainer(plugins=[losses], max_epochs=epochs, num_sanity_val_steps=1,
                               enable_checkpointing=False, **kwargs)
    module = SeqNet(seed=0, optimizer=optimizer)
    trainer.fit(module, DataLoader(DATA, batch_size=batch_size), DataLoader(VAL, batch_size=6))
    return trainer, module, losses.losses


@pytest.mark.slow
def test_two_stages_on_two_processes_follow_the_one_process_loss_curve(battery):
    ranks, _ = battery
    trainer, module, losses = single_process()
    for rank, record in enumerate(ranks):
        run = record["pipeline"]
        assert run["global_step"] == 12
        # Every rank reports the last stage's loss, step by step.
        assert run["losses"] == pytest.approx(losses, abs=1e-5)
        for name in ("val_loss", "val_acc", "train_loss"):
            assert run["metrics"][name] == pytest.approx(trainer.callback_metrics[name], abs=1e-5), name
        # Each stage held only its layers: Linear(8, 16) | Linear(16, 16), Linear(16, 3).
        assert run["stage_parameters"] == [144, 323][rank]
        # After fit every rank holds the whole trained model, unwrapped.
        assert max_abs_diff(run["state"], state_of(module)) <= 1e-6
        assert run["model_after"] == "_StepModule"


@pytest.mark.slow
def test_accumulation_and_clipping_over_the_stages(battery):
    ranks, _ = battery
    _, module, losses = single_process(optimizer="adam", accumulate_grad_batches=2, gradient_clip_val=0.05)
    for record in ranks:
        assert record["accumulate_clip"]["losses"] == pytest.approx(losses, abs=1e-5)
        assert max_abs_diff(record["accumulate_clip"]["state"], state_of(module)) <= 1e-6


@pytest.mark.slow
def test_bf16_composes(battery):
    ranks, _ = battery
    _, bf16, _ = single_process(precision="bf16-mixed")
    _, fp32, _ = single_process()
    for record in ranks:
        # Within bf16's rounding of the one-process bf16 run, and not the fp32 run (which
        # the same pipeline matches to 1e-7): the stages ran under autocast. Micro-batches
        # sum their bf16 weight gradients in fp32, so the pipeline is a little nearer fp32.
        assert max_abs_diff(record["bf16"]["state"], state_of(bf16)) < 2e-2
        assert max_abs_diff(record["bf16"]["state"], state_of(fp32)) > 1e-4


@pytest.mark.slow
def test_one_stage_two_replicas_is_data_parallel(battery):
    ranks, _ = battery
    _, module, _ = single_process(batch_size=16)  # the two replicas' unshuffled shares, together
    for record in ranks:
        assert record["replicas"]["stage_parameters"] == 467
        assert max_abs_diff(record["replicas"]["state"], state_of(module)) <= 1e-5


@pytest.mark.slow
def test_balance_is_chosen_by_rank_0_and_printed(battery):
    ranks, stdout = battery
    assert ("hookloop-fairscale: ddp_sequential balance [1, 4] (2 stages x 1 replicas), chosen no "
            "example_input_array to time the layers on; by parameter count (parameters per stage: 144, 323)") in stdout
    assert [record["auto_balance"]["stage_parameters"] for record in ranks] == [144, 323]


@pytest.mark.slow
def test_checkpoint_gathers_the_stages_under_the_original_keys_and_resumes(battery):
    ranks, _ = battery
    checkpoint = torch.load(ranks[0]["last_ckpt"], weights_only=True)
    plain = SeqNet()
    assert list(checkpoint["state_dict"]) == list(plain.state_dict())  # sequential_module.0.weight ...
    plain.load_state_dict(checkpoint["state_dict"])
    assert max_abs_diff(state_of(plain), ranks[0]["pipeline"]["state"]) == 0.0
    # Each stage's optimizer state, gathered into the plain optimizer's format.
    assert sorted(checkpoint["optimizer_states"][0]["state"]) == [0, 1, 2, 3, 4, 5]
    plain.configure_optimizers().load_state_dict(checkpoint["optimizer_states"][0])
    for record in ranks:  # stopped after 1 epoch, resumed by a module with other weights
        assert max_abs_diff(record["resumed"]["state"], record["pipeline"]["state"]) <= 1e-6


@pytest.mark.slow
def test_validate_reports_the_last_stage_metrics_on_every_rank(battery):
    ranks, _ = battery
    expected = hookloop.Trainer(enable_checkpointing=False).validate(SeqNet(seed=3), DataLoader(VAL, batch_size=6))
    for record in ranks:
        for name, value in expected[0].items():
            assert record["validate"][0][name] == pytest.approx(value, abs=1e-6)


# -- refused at start, naming the fix ------------------------------------------------------------


class Outside(SeqNet):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)


class Manual(SeqNet):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize("module, kwargs, message", [
    (SeqNet, {}, "2 pipeline stages and 1 processes: devices must be stages x replicas"),
    (SeqNet, {"precision": "16-mixed"}, "'16-mixed' is not supported by ddp_sequential"),
    (Manual, {}, "does not support manual optimization"),
    (SeqNet, {"global_batch_size": 16}, r"global_batch_size=16 is not supported by ddp_sequential: the stages"),
])
def test_ddp_sequential_refuses_what_it_cannot_run(module, kwargs, message):
    trainer = hookloop.Trainer(plugins=[hookloop.plugin("ddp_sequential", balance=[2, 3])], max_epochs=1,
                               enable_checkpointing=False, **kwargs)
    with pytest.raises(hookloop.ConfigurationError, match=message):
        trainer.fit(module(), DataLoader(DATA, batch_size=8))


def test_ddp_sequential_refuses_parameters_outside_the_sequential_and_predict():
    trainer = hookloop.Trainer(plugins=[hookloop.plugin("ddp_sequential", balance=[5])], max_epochs=1,
                               enable_checkpointing=False)
    with pytest.raises(hookloop.ConfigurationError, match=r"trainable parameters outside it \(head.weight"):
        trainer.fit(Outside(), DataLoader(DATA, batch_size=8))
    with pytest.raises(hookloop.ConfigurationError, match="ddp_sequential does not predict"):
        trainer.predict(SeqNet(), DataLoader(DATA, batch_size=8))
