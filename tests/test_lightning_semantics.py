"""Issue 18, item 9: silent differences from pytorch-lightning 2.6.6, each compared with
Lightning running the same module code (written once against ``fw.LightningModule``, as
tests/oracle does).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

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


def _trainer(fw, root: str, **kw):
    if fw.name == "lightning":
        return fw.pl.Trainer(accelerator="cpu", devices=1, default_root_dir=root, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, **kw)
    return hookloop.Trainer(accelerator="cpu", default_root_dir=root, logger=False, enable_progress_bar=False, **kw)


def _exact(metrics) -> dict:
    return {k: float(v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}


# -- b. epoch means in Lightning's dtype --------------------------------------------------


def _logging_module(fw):
    class Logs(fw.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.layer(x), y)
            g = torch.Generator().manual_seed(batch_idx)
            self.log("train_mean", torch.rand((), generator=g), on_step=False, on_epoch=True)
            self.log("train_forked", torch.rand((), generator=g) / 3, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            g = torch.Generator().manual_seed(100 + batch_idx)
            # 0.7 of 10 samples, in batches of 3, 3, 3, 1: a float32 mean and a float64
            # mean of these differ in the last bits
            self.log("val_acc", (self(x).argmax(-1) == y).float().mean())
            self.log("val_rand", torch.rand((), generator=g))
            self.log("val_tenth", torch.tensor(0.1) * (batch_idx + 1))
            self.log("val_int", torch.tensor(batch_idx + 1))  # an integer tensor
            self.log("val_double", torch.rand((), generator=g, dtype=torch.float64))
            self.log("val_sum", torch.rand((), generator=g), reduce_fx="sum")
            self.log("val_max", torch.rand((), generator=g), reduce_fx="max")
            self.log("val_py", 0.1 * (batch_idx + 1))

        def forward(self, x):
            return self.layer(x)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Logs


def test_epoch_means_are_bit_equal_to_lightnings():
    results = {}
    for name in ("lightning", "hookloop"):
        fw = frameworks.load(name)
        fw.seed_everything(0)
        module = _logging_module(fw)()
        with tempfile.TemporaryDirectory() as root:
            trainer = _trainer(fw, root, max_epochs=2, enable_checkpointing=False, num_sanity_val_steps=0)
            trainer.fit(module, DataLoader(_data(20), batch_size=3), DataLoader(_data(10, seed=2), batch_size=3))
            fitted = _exact(trainer.callback_metrics)
            validated = trainer.validate(module, DataLoader(_data(10, seed=2), batch_size=3), verbose=False)[0]
        results[name] = (fitted, _exact(validated))
    lightning, ours = results["lightning"], results["hookloop"]
    assert lightning[0].keys() == ours[0].keys()
    for key in lightning[0]:
        assert ours[0][key] == lightning[0][key], (key, ours[0][key], lightning[0][key])
    assert ours[1] == lightning[1]


# -- c. callback_metrics belong to one run ------------------------------------------------


def test_callback_metrics_are_reset_by_each_run_as_lightnings():
    seen = {}
    for name in ("lightning", "hookloop"):
        fw = frameworks.load(name)
        fw.seed_everything(0)

        class WithTest(_logging_module(fw)):
            def test_step(self, batch, batch_idx):
                self.log("test_loss", F.cross_entropy(self(batch[0]), batch[1]), prog_bar=True)

            def predict_step(self, batch, batch_idx):
                return self(batch[0])

        module, record = WithTest(), []
        with tempfile.TemporaryDirectory() as root:
            trainer = _trainer(fw, root, max_epochs=1, enable_checkpointing=False, num_sanity_val_steps=0)

            def val():
                return DataLoader(_data(10, seed=2), batch_size=3)

            trainer.fit(module, DataLoader(_data(20), batch_size=3), val())
            kept = trainer.callback_metrics
            record.append(("fit", _exact(trainer.callback_metrics)))
            trainer.test(module, val(), verbose=False)
            record.append(("test", _exact(trainer.callback_metrics)))
            record.append(("test progress bar", sorted(trainer.progress_bar_metrics)))
            trainer.validate(module, val(), verbose=False)
            record.append(("validate", _exact(trainer.callback_metrics)))
            trainer.predict(module, val())
            record.append(("predict", _exact(trainer.callback_metrics)))
            record.append(("kept from fit", sorted(kept)))
        seen[name] = record
    assert [r[0] for r in seen["hookloop"]] == [r[0] for r in seen["lightning"]]
    for ours, theirs in zip(seen["hookloop"], seen["lightning"]):
        assert ours == theirs, (ours, theirs)


# -- d. ModelCheckpoint(dirpath=...) writes only what Lightning writes there -------------


def _scored(fw):
    class Scored(_logging_module(fw)):
        def on_validation_epoch_end(self):
            self.log("score", torch.tensor([0.5, 0.3, 0.4, 0.2][self.current_epoch]))

    return Scored


def test_checkpoint_dirpath_holds_lightnings_files_and_last_still_resumes(tmp_path):
    files, resumed = {}, {}
    for name in ("lightning", "hookloop"):
        fw = frameworks.load(name)
        for variant, kw in (("default", {}), ("save_last", {"save_last": True})):
            fw.seed_everything(0)
            root = tmp_path / name / variant
            ckpt = fw.ModelCheckpoint(dirpath=str(root / "ckpts"), monitor="score", save_top_k=2, **kw)
            trainer = _trainer(fw, str(root), max_epochs=3, callbacks=[ckpt], num_sanity_val_steps=0)
            trainer.fit(_scored(fw)(), DataLoader(_data(20), batch_size=4), DataLoader(_data(8, seed=2), batch_size=4))
            files[(name, variant)] = sorted(p.name for p in (root / "ckpts").iterdir() if not p.name.startswith("."))
        # One more epoch: hookloop resumes from its own last.ckpt (in the run directory) with
        # ckpt_path="last"; Lightning trains the four epochs straight.
        fw.seed_everything(0)
        module = _scored(fw)()
        root = tmp_path / name / "default"
        trainer = _trainer(fw, str(root), max_epochs=4, num_sanity_val_steps=0,
                           callbacks=[fw.ModelCheckpoint(dirpath=str(root / "ckpts"), monitor="score", save_top_k=2)])
        loaders = (DataLoader(_data(20), batch_size=4), DataLoader(_data(8, seed=2), batch_size=4))
        if name == "hookloop":
            trainer.fit(module, *loaders, ckpt_path="last")
        else:
            trainer = _trainer(fw, str(tmp_path / "straight"), max_epochs=4, num_sanity_val_steps=0,
                               enable_checkpointing=False)
            trainer.fit(module, *loaders)
        resumed[name] = ({k: v.clone() for k, v in module.state_dict().items()}, trainer.global_step)
    for variant in ("default", "save_last"):
        assert files[("hookloop", variant)] == files[("lightning", variant)], variant
    assert "last.ckpt" not in files[("hookloop", "default")]
    assert resumed["hookloop"][1] == resumed["lightning"][1] == 20
    for key, value in resumed["lightning"][0].items():
        assert torch.allclose(resumed["hookloop"][0][key], value, atol=1e-6), key
