"""Issue 18: names and small API gaps that make real Lightning scripts fail.

Each behaviour is compared with pytorch-lightning 2.6.6 running the same module code
(written once against ``fw.LightningModule``, as tests/oracle does), or with a closed-form
value; the multi-process one runs on 2 real processes (gloo): tests/scripts/all_gather_ddp.py
in the shared ddp job (tests/jobs.py).
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

sys.path.insert(0, str(Path(__file__).resolve().parent / "oracle"))
import frameworks  # noqa: E402


def _data(n: int = 20, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _trainer(fw, root: str, logger: bool = True, **kw):
    """One process, no checkpoints or progress bar; a CSV logger unless ``logger=False``."""
    if fw.name == "lightning":
        from pytorch_lightning.loggers import CSVLogger

        return fw.pl.Trainer(accelerator="cpu", devices=1, default_root_dir=root,
                             logger=CSVLogger(root, name="lightning") if logger else False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kw)
    return hookloop.Trainer(accelerator="cpu", default_root_dir=root, logger=logger, enable_progress_bar=False,
                            enable_checkpointing=False, **kw)


def _run_both(make_module, fit_kwargs=None, **trainer_kwargs):
    """``make_module(fw)`` fitted under Lightning and hookloop; (module, trainer) of each."""
    out = {}
    for name in ("lightning", "hookloop"):
        fw = frameworks.load(name)
        fw.seed_everything(0)
        module = make_module(fw)
        with tempfile.TemporaryDirectory() as root:
            trainer = _trainer(fw, root, **trainer_kwargs)
            trainer.fit(module, **(fit_kwargs(fw) if fit_kwargs else {}))
            out[name] = (module, trainer)
    return out


def _base(fw, record: list):
    class Base(fw.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(_data(20), batch_size=4)

        def val_dataloader(self):
            return DataLoader(_data(8, seed=2), batch_size=4)

    Base.record = record
    return Base


# ---------------------------------------------------------------------------------------
# 1. Names
# ---------------------------------------------------------------------------------------


def test_rank_zero_helpers_are_importable_and_act_as_lightnings():
    from pytorch_lightning.utilities import rank_zero_only as pl_rank_zero_only

    from hookloop.distributed.ranks import rank_zero_info, rank_zero_only, rank_zero_warn

    assert hookloop.rank_zero_only is rank_zero_only and hookloop.rank_zero_info is rank_zero_info
    assert hookloop.rank_zero_warn is rank_zero_warn
    saved = (rank_zero_only.rank, pl_rank_zero_only.rank)
    try:
        results = {}
        for decorator in (rank_zero_only, pl_rank_zero_only):
            calls = []
            plain = decorator(lambda v: calls.append(v) or v)
            defaulted = decorator(lambda: "ran", default="skipped")
            seen = []
            for rank in (0, 1):
                decorator.rank = rank
                seen.append((plain(rank), defaulted()))
            results[decorator] = (seen, calls)
        assert results[rank_zero_only] == results[pl_rank_zero_only] == ([(0, "ran"), (None, "skipped")], [0])
        rank_zero_only.rank = 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rank_zero_warn("not on rank 1")
        assert not caught
        rank_zero_only.rank = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rank_zero_warn("on rank 0")
        assert [str(w.message) for w in caught] == ["on rank 0"]
    finally:
        rank_zero_only.rank, pl_rank_zero_only.rank = saved


def _names_module(fw):
    record: list = []

    class Names(_base(fw, record)):
        def setup(self, stage):
            record.append(("setup", self.global_rank, self.local_rank, self.logger is None, self.loggers == [],
                           self.trainer.state.fn, self.trainer.state.stage))

        def on_sanity_check_start(self):
            record.append(("sanity", self.trainer.state.fn, self.trainer.state.stage))

        def on_train_batch_start(self, batch, batch_idx):
            record.append(("batch", batch_idx, self.trainer.is_last_batch, self.trainer.state.stage))

        def on_validation_epoch_start(self):
            record.append(("val", self.trainer.state.fn, self.trainer.state.stage, self.trainer.sanity_checking))

        def on_train_end(self):
            record.append(("train_end", self.trainer.state.finished, self.trainer.state.stage))

    module = Names()
    module.record = record
    return module


def test_ranks_state_is_last_batch_and_no_logger_as_lightning():
    runs = _run_both(_names_module, max_epochs=2, num_sanity_val_steps=1, logger=False)
    (pl_module, pl_trainer), (hl_module, hl_trainer) = runs["lightning"], runs["hookloop"]
    assert hl_module.record == pl_module.record
    assert ("batch", 4, True, "train") in hl_module.record  # 20 samples in 5 batches
    for trainer in (pl_trainer, hl_trainer):
        assert trainer.state.fn == "fit" and trainer.state.finished and trainer.state.stage is None
        assert trainer.logger is None and trainer.loggers == []


def test_trainer_state_compares_as_the_old_string():
    seen = []

    class Probe(_base(frameworks.load("hookloop"), [])):
        def on_fit_start(self):
            seen.append((self.trainer.state == "fit", self.trainer.state in ("validate", "test"),
                         self.trainer.state == None))  # noqa: E711

    trainer = hookloop.Trainer(max_epochs=1, enable_checkpointing=False, logger=False, enable_progress_bar=False)
    assert trainer.state == None and trainer.state.fn is None  # noqa: E711
    trainer.fit(Probe())
    assert seen == [(True, False, False)]
    assert trainer.state == None and trainer.state.fn == "fit"  # noqa: E711


def _logged_module(fw):
    record: list = []

    class Logged(_base(fw, record)):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("hidden", 3.0, logger=False)
            self.log("both", float(batch_idx), on_step=True, on_epoch=True)
            return loss

        def on_train_epoch_end(self):
            record.append(sorted(self.trainer.logged_metrics))
            record.append(type(self.logger).__name__ == type(self.loggers[0]).__name__)
            record.append(len(self.loggers))

    module = Logged()
    module.record = record
    return module


def test_logged_metrics_and_loggers_as_lightning():
    runs = _run_both(_logged_module, max_epochs=2, num_sanity_val_steps=0, log_every_n_steps=2)
    (pl_module, pl_trainer), (hl_module, hl_trainer) = runs["lightning"], runs["hookloop"]
    assert hl_module.record == pl_module.record
    pl_logged = {k: float(v) for k, v in pl_trainer.logged_metrics.items()}
    hl_logged = dict(hl_trainer.logged_metrics)
    assert sorted(hl_logged) == sorted(pl_logged)
    for key, value in pl_logged.items():
        assert hl_logged[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert hl_module.logger is None  # detached after the run, as Lightning's trainer-less module


@pytest.mark.check  # reads the shared ddp job
def test_all_gather_stacks_each_ranks_tensor_under_two_processes(jobs):
    # tests/scripts/all_gather_ddp.py in the shared ddp job (tests/jobs.py): one step of
    # all_gather(..., sync_grads=True)
    ranks = jobs.run("ddp").ranks("all_gather_ddp")
    for rank, record in enumerate(ranks):
        assert record["ranks"] == (rank, rank, rank)
        assert torch.equal(record["v"], torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
        assert torch.equal(record["n"], torch.tensor([0.0, 1.0]))
        assert torch.equal(record["pair"], torch.tensor([0.0, 1.0]))
        # sync_grads: loss_r = sum over ranks of w * (k + 1); each rank's gradient flows
        # back to the rank that holds it, DDP averages: d/dw = (1 + 2) summed over the
        # two ranks' losses for the local slice, averaged: w = 1 - 1.0 * 3
        assert torch.allclose(record["w"], torch.full((2,), -2.0)), record["w"]


def test_all_gather_in_one_process_returns_the_tensors():
    class One(_base(frameworks.load("hookloop"), [])):
        def training_step(self, batch, batch_idx):
            got = self.all_gather({"t": torch.arange(3.0), "n": 2})
            self.__dict__["got"] = got
            return super().training_step(batch, batch_idx)

    module = One()
    hookloop.Trainer(max_steps=1, enable_checkpointing=False, logger=False, enable_progress_bar=False).fit(module)
    assert torch.equal(module.got["t"], torch.arange(3.0)) and torch.equal(module.got["n"], torch.tensor(2))


# ---------------------------------------------------------------------------------------
# 2. Issue 18's items 6, 7 and 8
# ---------------------------------------------------------------------------------------


def _setup_builds_data(fw):
    """(6) The datasets are built in setup; the *_dataloader() methods read them."""
    record: list = []

    class BuildsInSetup(_base(fw, record)):
        def setup(self, stage):
            record.append(("setup", stage))
            self.train_set, self.val_set = _data(20), _data(8, seed=2)

        def train_dataloader(self):
            record.append("train_dataloader")
            return DataLoader(self.train_set, batch_size=4)

        def val_dataloader(self):
            record.append("val_dataloader")
            return DataLoader(self.val_set, batch_size=4)

        def on_fit_end(self):
            record.append(("weights", self.layer.weight.detach().clone()))

    module = BuildsInSetup()
    module.record = record
    return module


def test_module_setup_runs_before_its_dataloader_methods():
    runs = _run_both(_setup_builds_data, max_epochs=2, num_sanity_val_steps=0, logger=False)
    pl_record, hl_record = runs["lightning"][0].record, runs["hookloop"][0].record
    assert [r for r in hl_record if r[0] != "weights"] == [r for r in pl_record if r[0] != "weights"]
    assert hl_record[0] == ("setup", "fit")
    assert torch.allclose(hl_record[-1][1], pl_record[-1][1], atol=1e-6)


def _steps_without_batch_idx(fw):
    """(7) training/validation/test/predict steps that take only the batch."""
    record: list = []

    class BatchOnly(_base(fw, record)):
        def training_step(self, batch):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("loss", loss)
            return loss

        def validation_step(self, batch):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def test_step(self, batch):
            x, y = batch
            self.log("test_loss", F.cross_entropy(self(x), y))

        def predict_step(self, batch):
            return self(batch[0]).argmax(-1)

    module = BatchOnly()
    module.record = record
    return module


def test_steps_without_batch_idx_run_as_lightning():
    results = {}
    for name in ("lightning", "hookloop"):
        fw = frameworks.load(name)
        fw.seed_everything(0)
        module = _steps_without_batch_idx(fw)
        with tempfile.TemporaryDirectory() as root:
            trainer = _trainer(fw, root, max_epochs=2, num_sanity_val_steps=1, logger=False)
            trainer.fit(module)
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            test = trainer.test(module, DataLoader(_data(8, seed=3), batch_size=4), verbose=False)
            predictions = trainer.predict(module, DataLoader(_data(8, seed=3), batch_size=4))
        results[name] = (metrics, test, torch.cat(predictions), module.layer.weight.detach().clone())
    pl, hl = results["lightning"], results["hookloop"]
    assert sorted(hl[0]) == sorted(pl[0]) == ["loss", "val_loss"]
    for key in pl[0]:
        assert hl[0][key] == pytest.approx(pl[0][key], rel=1e-5)
    assert hl[1][0]["test_loss"] == pytest.approx(pl[1][0]["test_loss"], rel=1e-5)
    assert torch.equal(hl[2], pl[2])
    assert torch.allclose(hl[3], pl[3], atol=1e-6)


def _loader_set_to_none(fw):
    """(8) ``model.val_dataloader = None``: Lightning's way to turn validation off."""
    record: list = []

    class Validates(_base(fw, record)):
        def on_validation_start(self):
            record.append("validated")

    module = Validates()
    module.val_dataloader = None
    module.record = record
    return module


def test_a_dataloader_attribute_set_to_none_means_no_loader():
    runs = _run_both(_loader_set_to_none, max_epochs=1, num_sanity_val_steps=2, logger=False)
    assert runs["hookloop"][0].record == runs["lightning"][0].record == []
    assert torch.allclose(runs["hookloop"][0].layer.weight, runs["lightning"][0].layer.weight, atol=1e-6)


def _retains_graph(fw):
    """(8) ``manual_backward(loss, retain_graph=True)``: a second backward through the
    same graph accumulates the same gradients again."""
    record: list = []

    class Twice(_base(fw, record)):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss, retain_graph=True)
            first = self.layer.weight.grad.clone()
            self.manual_backward(loss)
            record.append(torch.allclose(self.layer.weight.grad, 2 * first))
            opt.step()

    module = Twice()
    module.record = record
    return module


def test_manual_backward_passes_retain_graph_on():
    runs = _run_both(_retains_graph, max_epochs=1, num_sanity_val_steps=0, logger=False)
    hl, pl = runs["hookloop"][0], runs["lightning"][0]
    assert hl.record == pl.record == [True] * 5
    assert torch.allclose(hl.layer.weight, pl.layer.weight, atol=1e-6)


# ---------------------------------------------------------------------------------------
# 3. docs/lightning.md and the code cannot drift apart
# ---------------------------------------------------------------------------------------

PAGE = Path(__file__).resolve().parents[1] / "docs" / "lightning.md"


def _page_rows() -> list[tuple[str, str, str]]:
    rows = []
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[2] in ("supported", "difference", "not supported"):
            rows.append((cells[0], cells[1].strip("`"), cells[2]))
    return rows


def test_every_name_the_lightning_page_supports_is_importable():
    import importlib

    rows = _page_rows()
    assert len(rows) >= 15, "the table of docs/lightning.md was not found"
    for lightning, target, status in rows:
        if status == "not supported":
            assert not target, f"{lightning}: a name for an unsupported row"
            continue
        module_name, _, attr = target.rpartition(".")
        assert module_name, f"{lightning}: {target!r} is not a dotted name"
        module = importlib.import_module(module_name)
        assert hasattr(module, attr), f"docs/lightning.md: {lightning} -> {target}, which does not exist"


def test_the_trainer_attributes_the_lightning_page_lists_exist():
    text = PAGE.read_text().split("Trainer attributes Lightning code reads and that hookloop has:")[1]
    names = [n.strip("` .\n") for n in text.replace("\n", " ").split(",")]
    names = [n.split("`")[0] for n in names if n]
    trainer = hookloop.Trainer(enable_checkpointing=False, logger=False)
    missing = [n for n in names if not hasattr(trainer, n)]
    assert len(names) >= 20 and not missing, missing
