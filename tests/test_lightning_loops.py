"""Lightning's loops in one process: test, predict, several validation loaders,
val_check_interval, the sanity check, fast_dev_run, overfit_batches, fractional limits.

Every number is checked against a computation done here by hand on the same data.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset

import hookloop
from conftest import TinyModule, max_abs_diff, reference_loop, state_of, tiny_data


class Evaluated(TinyModule):
    """TinyModule with test and predict steps, and validation on several loaders."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits, y))
        self.log("test_acc", (logits.argmax(-1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).softmax(-1)


class Events:
    """Counts validation batches and runs (sanity check apart)."""

    hookloop_role = "observer"

    def __init__(self):
        self.validations, self.sanity_batches, self.val_batches, self.train_batches = [], 0, 0, 0

    @hookloop.hookimpl
    def on_validation_batch_end(self, trainer):
        if trainer.sanity_checking:
            self.sanity_batches += 1
        else:
            self.val_batches += 1

    @hookloop.hookimpl
    def on_validation_end(self, trainer):
        if not trainer.sanity_checking:
            self.validations.append((trainer.current_epoch, trainer.batch_idx))

    @hookloop.hookimpl
    def on_train_batch_end(self):
        self.train_batches += 1


def trainer(**kw):
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("num_sanity_val_steps", 0)
    return hookloop.Trainer(**kw)


# -- test and predict ---------------------------------------------------------------------


def test_test_returns_batch_weighted_metrics_per_loader():
    module, data = Evaluated(), tiny_data(50, seed=3)
    results = trainer().test(module, DataLoader(data, batch_size=16), verbose=False)
    x, y = data.tensors
    with torch.no_grad():
        logits = module(x)
    assert len(results) == 1
    assert results[0]["test_acc"] == pytest.approx((logits.argmax(-1) == y).float().mean().item(), abs=1e-6)
    assert results[0]["test_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), abs=1e-6)


def test_predict_returns_per_batch_outputs_in_dataset_order():
    module, data = Evaluated(), tiny_data(21, seed=4)
    predictions = trainer().predict(module, DataLoader(data, batch_size=8))
    assert [p.shape[0] for p in predictions] == [8, 8, 5]
    with torch.no_grad():
        expected = module(data.tensors[0]).softmax(-1)
    assert torch.allclose(torch.cat(predictions), expected, atol=1e-6)


def test_predict_without_predict_step_calls_forward_and_can_keep_nothing():
    module = TinyModule()
    x = tiny_data(12).tensors[0]  # a tensor is a dataset of its rows: each batch is the input
    out = trainer().predict(module, DataLoader(x, batch_size=5))
    with torch.no_grad():
        assert torch.allclose(torch.cat(out), module(x), atol=1e-6)
    assert trainer().predict(module, DataLoader(x, batch_size=5), return_predictions=False) is None


def test_self_log_in_predict_is_an_error():
    class Logs(Evaluated):
        def predict_step(self, batch, batch_idx):
            self.log("x", 1.0)

    with pytest.raises(hookloop.ConfigurationError, match="predict"):
        trainer().predict(Logs(), DataLoader(tiny_data(8), batch_size=4))


# -- several validation loaders -----------------------------------------------------------


def test_several_validation_loaders_get_dataloader_idx_and_suffixed_metrics():
    module = Evaluated()
    a, b = tiny_data(24, seed=5), tiny_data(10, seed=6)
    results = trainer().validate(module, [DataLoader(a, batch_size=8), DataLoader(b, batch_size=4)], verbose=False)

    def acc(data):
        with torch.no_grad():
            return (module(data.tensors[0]).argmax(-1) == data.tensors[1]).float().mean().item()

    assert [list(r) for r in results] == [["val_acc/dataloader_idx_0"], ["val_acc/dataloader_idx_1"]]
    assert results[0]["val_acc/dataloader_idx_0"] == pytest.approx(acc(a), abs=1e-6)
    assert results[1]["val_acc/dataloader_idx_1"] == pytest.approx(acc(b), abs=1e-6)


def test_several_loaders_need_a_step_that_takes_dataloader_idx():
    loaders = [DataLoader(tiny_data(8), batch_size=4)] * 2
    with pytest.raises(hookloop.ConfigurationError, match="dataloader_idx"):
        trainer().validate(TinyModule(), loaders)


# -- when validation runs -----------------------------------------------------------------


@pytest.mark.parametrize("interval,every,expected", [
    (1.0, 1, [(0, 10), (1, 10)]),                      # end of every epoch (the default)
    (3, 1, [(0, 3), (0, 6), (0, 9), (1, 3), (1, 6), (1, 9)]),  # every 3 batches, per epoch
    (0.5, 1, [(0, 5), (0, 10), (1, 5), (1, 10)]),      # half an epoch = 5 batches
    (4, None, [(0, 4), (0, 8), (1, 2), (1, 6), (1, 10)]),  # every 4 batches across epochs
    (1.0, 2, [(1, 10)]),                               # check_val_every_n_epoch=2
])
def test_val_check_interval(interval, every, expected):
    events = Events()
    t = trainer(plugins=[events], max_epochs=2, val_check_interval=interval, check_val_every_n_epoch=every)
    t.fit(TinyModule(), DataLoader(tiny_data(80), batch_size=8), DataLoader(tiny_data(8), batch_size=8))
    assert events.validations == expected


def test_val_check_interval_longer_than_an_epoch_is_refused():
    t = trainer(max_epochs=1, val_check_interval=11)
    with pytest.raises(hookloop.ConfigurationError, match="check_val_every_n_epoch=None"):
        t.fit(TinyModule(), DataLoader(tiny_data(80), batch_size=8), DataLoader(tiny_data(8), batch_size=8))


class Stream(IterableDataset):
    def __init__(self, n):
        self.data = tiny_data(n)

    def __iter__(self):
        return iter(zip(*self.data.tensors))


def test_fractions_need_a_sized_loader():
    t = trainer(max_epochs=1, val_check_interval=0.5)
    with pytest.raises(hookloop.ConfigurationError, match="no length"):
        t.fit(TinyModule(), DataLoader(Stream(16), batch_size=4), DataLoader(tiny_data(8), batch_size=4))
    t = trainer(max_epochs=1, limit_train_batches=0.5)
    with pytest.raises(hookloop.ConfigurationError, match="no length"):
        t.fit(TinyModule(), DataLoader(Stream(16), batch_size=4))


def test_sanity_check_runs_n_batches_keeps_no_metrics_and_changes_no_training():
    events = Events()
    data, val = tiny_data(64), DataLoader(tiny_data(40, seed=7), batch_size=8)
    torch.manual_seed(5)
    with_check = Evaluated()
    t = hookloop.Trainer(plugins=[events], max_epochs=2, enable_checkpointing=False, num_sanity_val_steps=2)
    t.fit(with_check, DataLoader(data, batch_size=8, shuffle=True), val)
    torch.manual_seed(5)
    without = Evaluated()
    trainer(max_epochs=2).fit(without, DataLoader(data, batch_size=8, shuffle=True), val)
    assert events.sanity_batches == 2 and events.val_batches == 2 * 5
    # the check reads the validation loader (an iterator draws a seed) and is still invisible
    assert max_abs_diff(state_of(with_check), state_of(without)) == 0.0
    assert not t.sanity_checking

    seen = Events()
    t = hookloop.Trainer(plugins=[seen], max_epochs=1, limit_train_batches=1, enable_checkpointing=False,
                         num_sanity_val_steps=-1)
    t.fit(Evaluated(), DataLoader(data, batch_size=8), val)
    assert seen.sanity_batches == 5  # -1: the whole validation set


def test_sanity_check_metrics_never_reach_callback_metrics():
    class Marks(Evaluated):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("during_sanity", float(self.trainer.sanity_checking))

    t = hookloop.Trainer(max_epochs=1, enable_checkpointing=False, num_sanity_val_steps=1)
    t.fit(Marks(), DataLoader(tiny_data(16), batch_size=8), DataLoader(tiny_data(8), batch_size=8))
    assert t.callback_metrics["during_sanity"] == 0.0


# -- debugging runs and limits --------------------------------------------------------------


def test_fast_dev_run_runs_n_batches_of_every_loop_and_saves_nothing(tmp_path, capsys):
    events = Events()
    t = hookloop.Trainer(fast_dev_run=True, max_epochs=5, plugins=[events], default_root_dir=str(tmp_path))
    module = Evaluated()
    t.fit(module, DataLoader(tiny_data(64), batch_size=8), DataLoader(tiny_data(64), batch_size=8))
    assert (events.train_batches, events.val_batches, events.sanity_batches) == (1, 1, 0)
    assert t.global_step == 1 and t.current_epoch == 1
    assert not list(tmp_path.rglob("*.ckpt"))
    t3 = hookloop.Trainer(fast_dev_run=3)
    tested = []

    class Counts(Evaluated):
        def test_step(self, batch, batch_idx):
            tested.append(batch_idx)

    t3.test(Counts(), DataLoader(tiny_data(64), batch_size=8), verbose=False)
    assert tested == [0, 1, 2]
    assert "fast_dev_run" in capsys.readouterr().out


def test_overfit_batches_repeats_the_first_batches_unshuffled():
    seen = []

    class Records(TinyModule):
        def training_step(self, batch, batch_idx):
            seen.append(batch[0][:, 0].tolist())
            return super().training_step(batch, batch_idx)

    events = Events()
    t = trainer(overfit_batches=2, max_epochs=3, plugins=[events])
    t.fit(Records(), DataLoader(tiny_data(64), batch_size=8, shuffle=True), DataLoader(tiny_data(64), batch_size=8))
    first_two = [tiny_data(64).tensors[0][i * 8:(i + 1) * 8, 0].tolist() for i in range(2)]
    assert seen == first_two * 3
    assert events.val_batches == 2 * 3


@pytest.mark.parametrize("limit,expected", [(0.5, 5), (0.25, 2), (3, 3), (1.0, 10), (0, 0)])
def test_limit_train_batches_as_count_or_fraction(limit, expected):
    events = Events()
    trainer(max_epochs=1, limit_train_batches=limit, plugins=[events]).fit(
        TinyModule(), DataLoader(tiny_data(80), batch_size=8))
    assert events.train_batches == expected


def test_fraction_below_one_batch_is_refused():
    with pytest.raises(hookloop.ConfigurationError, match="less than one batch"):
        trainer(max_epochs=1, limit_train_batches=0.05).fit(TinyModule(), DataLoader(tiny_data(80), batch_size=8))


@pytest.mark.parametrize("setting", [
    {"limit_val_batches": 1.5}, {"limit_val_batches": -1}, {"val_check_interval": 0.0},
    {"val_check_interval": 2.5}, {"num_sanity_val_steps": -2}, {"fast_dev_run": -1},
    {"check_val_every_n_epoch": None, "val_check_interval": 0.5}, {"overfit_batches": 2.0},
])
def test_bad_loop_settings_are_refused_at_construction(setting):
    with pytest.raises(hookloop.ConfigurationError):
        hookloop.Trainer(**setting)


def test_training_still_matches_the_hand_written_loop_with_validation_mid_epoch():
    data = tiny_data(100)
    torch.manual_seed(3)
    reference = TinyModule(scheduler=True)
    reference_loop(reference, DataLoader(data, batch_size=16, shuffle=True), epochs=2)
    torch.manual_seed(3)
    ours = TinyModule(scheduler=True)
    hookloop.Trainer(max_epochs=2, enable_checkpointing=False, val_check_interval=2).fit(
        ours, DataLoader(data, batch_size=16, shuffle=True), DataLoader(tiny_data(20, seed=9), batch_size=8))
    assert max_abs_diff(state_of(reference), state_of(ours)) == 0.0
