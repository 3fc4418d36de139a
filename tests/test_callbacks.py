"""Lightning-style callbacks (``hookloop.Callback``): same events, arguments and results as
pytorch-lightning 2.6.6; state in checkpoints; callbacks hookloop cannot call are refused.

The comparisons with Lightning are the oracle's cases (tests/oracle/cases.py:
``callback_events``, ``finetuning``, ``accumulation_schedule``, ``prediction_writer``), run
here alone, under one process and under ddp (2 processes, gloo).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import TinyModule, tiny_data

ORACLE = Path(__file__).resolve().parent / "oracle"
sys.path.insert(0, str(ORACLE))

from cases import CASES  # noqa: E402
from test_lightning_oracle import _run, differences  # noqa: E402

CALLBACK_CASES = ("callback_events", "finetuning", "accumulation_schedule", "prediction_writer")
RUNS = [(case, mode) for case in CALLBACK_CASES for mode in CASES[case][1]]


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> dict:
    """{mode: {framework: {case: observations}}} for the callback cases."""
    base = tmp_path_factory.mktemp("callbacks")
    out: dict = {}
    for mode in ("one", "ddp"):
        names = [c for c in CALLBACK_CASES if mode in CASES[c][1]]
        procs = {}
        for fw in ("lightning", "hookloop"):
            root = base / f"{fw}-{mode}"
            root.mkdir()
            cmd_out = base / f"{fw}-{mode}.json"
            # _run passes every case; restrict to ours through --cases
            proc = _run(fw, mode, cmd_out, root, cases=",".join(names))
            if mode == "ddp":
                proc.wait(timeout=600)  # two ddp runs at once would need 4 processes on 2 cores
            procs[fw] = (proc, cmd_out)
        for fw, (proc, cmd_out) in procs.items():
            proc.wait(timeout=600)
            assert proc.returncode == 0 and cmd_out.is_file(), cmd_out.with_suffix(".log").read_text()[-4000:]
            out.setdefault(mode, {})[fw] = json.loads(cmd_out.read_text())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case,mode", RUNS, ids=[f"{c}-{m}" for c, m in RUNS])
def test_callbacks_do_what_lightnings_do(observed, case, mode):
    light, hook = observed[mode]["lightning"][case], observed[mode]["hookloop"][case]
    assert "error" not in light, light.get("error")
    assert "error" not in hook, hook.get("error")
    diff = differences(light, hook)
    assert not diff, f"{len(diff)} difference(s) from Lightning 2.6.6:\n" + "\n".join(diff[:40])


@pytest.mark.slow
def test_the_finetuning_case_unfreezes_into_three_param_groups(observed):
    # What the comparison above is about: without the callback called, one group trains.
    epochs = observed["one"]["hookloop"]["finetuning"]["four_epochs"]["epochs"]
    assert [e["groups"] for e in epochs[2:]] == [1, 2, 3, 3]


# -- callbacks hookloop cannot call are errors ----------------------------------------------


def test_a_lightning_callback_is_refused_naming_the_import_to_change():
    import pytorch_lightning as pl

    class Counter(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pass

    with pytest.raises(hookloop.ConfigurationError, match=r"Counter, which is neither a hookloop.Callback.*would never "
                       r"call it.*Lightning callback.*change `from lightning.pytorch.callbacks import Callback` "
                       r"\(or pytorch_lightning's\) to `from hookloop import Callback`"):
        hookloop.Trainer(callbacks=[Counter()])

    class Unfreeze(pl.callbacks.BaseFinetuning):
        pass

    with pytest.raises(hookloop.ConfigurationError, match=r"Unfreeze.*change `from lightning.pytorch.callbacks "
                       r"import BaseFinetuning` \(or pytorch_lightning's\) to `from hookloop import BaseFinetuning`"):
        hookloop.Trainer(callbacks=[Unfreeze()])
    with pytest.raises(hookloop.ConfigurationError, match=r"\(StochasticWeightAveraging\), which hookloop does not "
                       r"have: make the class subclass hookloop.Callback"):
        hookloop.Trainer(callbacks=[pl.callbacks.StochasticWeightAveraging(swa_lrs=0.1)])


def test_a_plain_object_with_hook_methods_is_refused():
    class Printer:
        def on_train_epoch_end(self, trainer, pl_module):
            print("epoch")

    with pytest.raises(hookloop.ConfigurationError, match=r"Printer.*would never call it.*subclass hookloop.Callback"
                       r".*@hookloop.hookimpl"):
        hookloop.Trainer(callbacks=[Printer()])


def test_a_callback_class_instead_of_an_instance_is_refused():
    with pytest.raises(hookloop.ConfigurationError, match=r"the class BatchCounter, not an instance of it: pass "
                       r"callbacks=\[BatchCounter\(...\)\]"):
        hookloop.Trainer(callbacks=[BatchCounter])


def test_an_on_method_that_is_no_lightning_hook_is_refused_naming_it():
    class Old(hookloop.Callback):
        def on_epoch_start(self, trainer, pl_module):  # Lightning 1.x's, removed
            pass

    with pytest.raises(hookloop.ConfigurationError, match=r"Old defines on_epoch_start.*never be called"):
        hookloop.Trainer(callbacks=[Old()])

    class Typo(hookloop.Callback):
        def on_train_epoch_ends(self, trainer, pl_module):
            pass

    with pytest.raises(hookloop.ConfigurationError, match=r"did you mean 'on_train_epoch_end'"):
        hookloop.Trainer(callbacks=[Typo()])


def test_hookimpl_plugins_and_callbacks_mix_in_callbacks():
    seen = []

    class Plugin:
        hookloop_role = "observer"

        @hookloop.hookimpl
        def on_train_end(self, trainer):
            seen.append("plugin")

    class Cb(hookloop.Callback):
        def on_train_end(self, trainer, pl_module):
            seen.append(("callback", pl_module is module))

    module = TinyModule()
    trainer = hookloop.Trainer(callbacks=[Plugin(), Cb()], max_epochs=1, enable_progress_bar=False, logger=False,
                               enable_checkpointing=False)
    trainer.fit(module, DataLoader(tiny_data(16), batch_size=8))
    assert sorted(map(str, seen)) == ["('callback', True)", "plugin"]
    assert [type(c).__name__ for c in trainer.callbacks][:2] == ["Plugin", "Cb"]


# -- state in checkpoints ---------------------------------------------------------------------


class BatchCounter(hookloop.Callback):
    def __init__(self):
        self.count = 0
        self.loaded_from: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state_dict):
        self.count = state_dict["count"]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["batch_counter_saw"] = self.count

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.loaded_from.append(checkpoint["batch_counter_saw"])


def test_a_callbacks_state_is_saved_under_its_state_key_and_resumes(tmp_path):
    loader = DataLoader(tiny_data(40), batch_size=8)  # 5 batches an epoch
    first = BatchCounter()
    trainer = hookloop.Trainer(callbacks=[first], max_epochs=2, default_root_dir=tmp_path, enable_progress_bar=False,
                               logger=False, enable_checkpointing=False)
    trainer.fit(TinyModule(), loader)
    path = trainer.save_checkpoint(tmp_path / "two.ckpt")
    checkpoint = hookloop.safe_load(path)
    assert checkpoint["callbacks"] == {"BatchCounter": {"count": 10}}
    assert checkpoint["batch_counter_saw"] == 10

    resumed = BatchCounter()
    trainer = hookloop.Trainer(callbacks=[resumed], max_epochs=3, default_root_dir=tmp_path,
                               enable_progress_bar=False, logger=False, enable_checkpointing=False)
    trainer.fit(TinyModule(), loader, ckpt_path=path)
    assert resumed.loaded_from == [10]
    assert resumed.count == 15  # 10 restored + the third epoch's 5


# -- what a callback costs per step ------------------------------------------------------------


def test_a_callback_costs_per_step_only_for_the_per_step_hooks_it_overrides():
    from test_contract import calls_per_step

    class EpochsOnly(hookloop.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            pass

    class EveryBatch(EpochsOnly):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pass

    alone = calls_per_step([])
    assert calls_per_step([EpochsOnly()]) == alone
    # the event's caller, the adapter's function, the callback's method
    assert calls_per_step([EveryBatch()]) == alone + 3


# -- on_exception and the built-in callbacks' errors --------------------------------------------


def test_on_exception_gets_lightnings_arguments():
    import pytorch_lightning as pl

    def run(Callback, Module, Trainer, **kw):
        seen = []

        class Fails(Module):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(8, 3)

            def training_step(self, batch, batch_idx):
                raise RuntimeError("step 0 fails")

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        class Watch(Callback):
            def on_exception(self, trainer, pl_module, exception):
                seen.append((trainer is trainer_, pl_module is module, type(exception).__name__, str(exception)))

        module = Fails()
        trainer_ = Trainer(callbacks=[Watch()], max_epochs=1, logger=False, enable_checkpointing=False,
                           enable_progress_bar=False, **kw)
        with pytest.raises(RuntimeError, match="step 0 fails"):
            trainer_.fit(module, DataLoader(tiny_data(16), batch_size=8))
        return seen

    lightning = run(pl.Callback, pl.LightningModule, pl.Trainer, accelerator="cpu", enable_model_summary=False)
    assert lightning == [(True, True, "RuntimeError", "step 0 fails")]
    assert run(hookloop.Callback, hookloop.Module, hookloop.Trainer) == lightning


def test_accumulation_scheduler_refuses_what_lightning_refuses():
    loader = DataLoader(tiny_data(16), batch_size=8)
    with pytest.raises(hookloop.ConfigurationError, match=r"You have set `accumulate_grad_batches` and are using the "
                                                          r"`GradientAccumulationScheduler` callback"):
        hookloop.Trainer(callbacks=[hookloop.GradientAccumulationScheduler({1: 2})], accumulate_grad_batches=2,
                         max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False).fit(TinyModule(), loader)

    class Manual(TinyModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = F.cross_entropy(self(batch[0]), batch[1])
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()

    with pytest.raises(RuntimeError, match="not supported for manual optimization"):  # Lightning's type
        hookloop.Trainer(callbacks=[hookloop.GradientAccumulationScheduler({1: 2})], max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False).fit(Manual(), loader)
    with pytest.raises(hookloop.ConfigurationError, match="Epoch should be an int greater than or equal to 0"):
        hookloop.GradientAccumulationScheduler({-1: 2})


def test_prediction_writer_refuses_an_unknown_interval():
    with pytest.raises(hookloop.ConfigurationError, match=r"write_interval.*'batch', 'epoch', 'batch_and_epoch'"):
        hookloop.BasePredictionWriter("step")
