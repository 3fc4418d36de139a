"""docs/errors.md, the catalogue of bad input, checked row by row.

Every row of the catalogue has an id, what the user did, what is raised and the exact
message. This module holds one trigger per id (``@row("C01")``): it does the bad thing for
real and lets the error out. The tests check that the ids of the document and of the
triggers are the same set (no row without a test, no test without a row), and, per row,
the exception's class and that its message matches the documented one: ``<name>`` in the
documented message stands for a run-specific part (a path, a list of installed plugins),
and runs of whitespace compare equal (a long message may wrap in the document).

A row whose "raises" column reads ``exit 2`` is a command: its trigger returns
:class:`Exit`, and the documented message is what the command prints on stderr.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset

import hookloop
import hookloop.tools.cli
from conftest import REPO, TinyModule, install_fake_distribution, tiny_data

DOC = REPO / "docs" / "errors.md"
SECTIONS = ("configuration", "plugins", "strategies' options", "launch", "environment", "data", "module", "checkpoints",
            "run directories")

# ---------------------------------------------------------------------------------------
# Reading the catalogue
# ---------------------------------------------------------------------------------------

_ID = re.compile(r"^[A-Z]\d\d$")
_PLACEHOLDER = re.compile(r"<[a-z][a-z0-9 _-]*>")


@dataclass(frozen=True)
class Row:
    id: str
    section: str
    did: str
    raises: str
    message: str


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row; ``\\|`` is a pipe inside a cell."""
    parts = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [p.strip().replace("\\|", "|") for p in parts]


def _code(cell: str) -> str:
    """The text of a cell that is one code span (`` `x` `` or ``` `` x `` ```)."""
    for fence in ("``", "`"):
        if cell.startswith(fence) and cell.endswith(fence) and len(cell) > 2 * len(fence):
            inner = cell[len(fence):-len(fence)]
            return inner.strip() if fence == "``" else inner
    return cell


def read_catalogue(path: Path = DOC) -> list[Row]:
    rows, section = [], None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip().lower()
            continue
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if not _ID.match(cells[0]):
            continue  # the header and the |---| line
        assert len(cells) == 4, f"docs/errors.md row {cells[0]} needs 4 cells, has {len(cells)}: {line}"
        rows.append(Row(cells[0], section, _code(cells[1]), _code(cells[2]), _code(cells[3])))
    return rows


def message_pattern(documented: str) -> re.Pattern:
    """The documented message as a regex: ``<placeholders>`` match anything, whitespace
    matches any whitespace, the rest is literal."""
    parts = []
    for i, piece in enumerate(_PLACEHOLDER.split(documented)):
        if i:
            parts.append(r".*?")
        parts += [r"\s+" if token.isspace() else re.escape(token) for token in re.split(r"(\s+)", piece) if token]
    return re.compile("".join(parts), re.S)


ROWS = read_catalogue() if DOC.is_file() else []

# ---------------------------------------------------------------------------------------
# Triggers: one per row id
# ---------------------------------------------------------------------------------------

TRIGGERS: dict[str, Callable[[Path], object]] = {}


def row(row_id: str):
    def register(function):
        assert row_id not in TRIGGERS, f"two triggers for {row_id}"
        TRIGGERS[row_id] = function
        return function

    return register


@dataclass
class Exit:
    """What a command did: its exit status and its stderr."""

    code: int
    stderr: str


def in_process_command(*args: str) -> Exit:
    """``hookloop ARGS`` through the same ``main`` as the console script, in this process."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = hookloop.tools.cli.main(list(args))
    return Exit(code, err.getvalue())


def loader(n: int = 16, batch_size: int = 8, seed: int = 1) -> DataLoader:
    return DataLoader(tiny_data(n, seed=seed), batch_size=batch_size)


def quiet(**kwargs) -> hookloop.Trainer:
    """A Trainer that writes nothing (no logs, no checkpoints, no progress bar)."""
    kwargs.setdefault("max_epochs", 1)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_progress_bar", False)
    return hookloop.Trainer(**kwargs)


class Stream(IterableDataset):
    """A dataset without a length."""

    def __iter__(self):
        return iter(zip(*tiny_data(16).tensors))


def saved_run(tmp: Path, module: nn.Module | None = None) -> Path:
    """One epoch of ``module`` (a TinyModule) under ``tmp``; returns its last.ckpt."""
    trainer = hookloop.Trainer(max_epochs=1, default_root_dir=str(tmp), enable_progress_bar=False)
    trainer.fit(module or TinyModule(), loader())
    return Path(trainer.checkpoint_callback.last_model_path)


# -- configuration ------------------------------------------------------------------------


@row("C01")
def _(tmp):
    hookloop.Trainer(max_epochs=-2)


@row("C02")
def _(tmp):
    hookloop.Trainer(accumulate_grad_batches=0)


@row("C30")
def _(tmp):
    hookloop.Trainer(global_batch_size=0)


@row("C31")
def _(tmp):
    hookloop.Trainer(global_batch_size=64, accumulate_grad_batches=2)


@row("C32")
def _(tmp):
    hookloop.Trainer(nodes="2:1")


@row("C33")
def _(tmp):
    hookloop.Trainer(nodes="0:2")


@row("C34")
def _(tmp):
    hookloop.Trainer(nodes="a:b")


@row("C35")
def _(tmp):
    hookloop.Trainer(nodes="1:2", elastic_batch="fixed")


@row("C03")
def _(tmp):
    hookloop.Trainer(accelerator="tpu")


@row("C04")
def _(tmp):
    hookloop.Trainer(precision="fp8")


@row("C05")
def _(tmp):
    hookloop.Trainer(devices=0)


@row("C06")
def _(tmp):
    hookloop.Trainer(devices=[0, 0])


@row("C07")
def _(tmp):
    hookloop.Trainer(devices="two")


@row("C08")
def _(tmp):
    hookloop.Trainer(limit_val_batches=1.5)


@row("C09")
def _(tmp):
    hookloop.Trainer(val_check_interval=2.5)


@row("C10")
def _(tmp):
    hookloop.Trainer(check_val_every_n_epoch=None, val_check_interval=0.5)


@row("C11")
def _(tmp):
    hookloop.Trainer(num_sanity_val_steps=-2)


@row("C12")
def _(tmp):
    hookloop.Trainer(fast_dev_run=-1)


@row("C13")
def _(tmp):
    hookloop.Trainer(gradient_clip_val=0)


@row("C14")
def _(tmp):
    hookloop.Trainer(gradient_clip_algorithm="l2")


@row("C15")
def _(tmp):
    # at the launch (a process a launcher placed gives nodes without an endpoint)
    hookloop.Trainer(plugins=["ddp"], nodes=2, logger=False).fit(TinyModule(), loader())


@row("C16")
def _(tmp):
    hookloop.Trainer(node_rank=1)


@row("C17")
def _(tmp):
    hookloop.Trainer(check_val_every_n_epoch=0)


@row("C18")
def _(tmp):
    hookloop.Trainer(process_group_timeout=0)


@row("C19")
def _(tmp):
    hookloop.Trainer(requeue_on_preemption="yes")


@row("C20")
def _(tmp):
    hookloop.Trainer(enable_checkpointing="no")


@row("C21")
def _(tmp):
    hookloop.Trainer(max_restarts=-1)


@row("C22")
def _(tmp):
    hookloop.Trainer(default_root_dir=None)


@row("C23")
def _(tmp):
    hookloop.Trainer(gradient_clip_val=float("nan"))


@row("C24")
def _(tmp):
    hookloop.Trainer(process_group_timeout=float("inf"))


@row("C25")
def _(tmp):
    hookloop.Trainer(devices=2.5)


@row("C26")
def _(tmp):
    hookloop.Trainer(max_time={"hours": float("nan")})


@row("C27")
def _(tmp):
    quiet(devices=[0, 3], accelerator="cpu").fit(TinyModule(), loader())


@row("C28")
def _(tmp):
    quiet().fit(TinyModule(), loader(), ckpt_path=3)


@row("C29")
def _(tmp):
    hookloop.Trainer(max_time={"hours": -1})


# -- plugins ------------------------------------------------------------------------------


@row("P01")
def _(tmp):
    hookloop.Trainer(plugins=["ddpp"])


@row("P02")
def _(tmp):
    site = tmp / "site"
    install_fake_distribution(
        site, "hookloop-needsdep", {"needsdep": "hl_needsdep:P"},
        {"hl_needsdep": "import some_backend_that_is_not_here\nclass P: pass\n"},
        requires=["hookloop", "some-backend-that-is-not-here>=1.0"],
    )
    import importlib

    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        hookloop.Trainer(plugins=["needsdep"])
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("hl_needsdep", None)
        importlib.invalidate_caches()


@row("P03")
def _(tmp):
    hookloop.Trainer(plugins=["ddp", "deepspeed"])


@row("P04")
def _(tmp):
    class MyPlugin:
        @hookloop.hookimpl
        def on_train_batch_end(self, trainer, batch_index):  # the contract says batch_idx
            pass

    hookloop.Trainer(plugins=[MyPlugin()])


@row("P05")
def _(tmp):
    class MyPlugin:
        @hookloop.hookimpl
        def on_train_batch_ended(self, trainer):
            pass

    hookloop.Trainer(plugins=[MyPlugin()])


@row("P06")
def _(tmp):
    class MyPlugin:
        hookloop_role = "magic"

    hookloop.Trainer(plugins=[MyPlugin()])


@row("P07")
def _(tmp):
    hookloop.Trainer(plugins=["amp"], plugin_options={"amp": {"init_scal": 1024}})


@row("P08")
def _(tmp):
    import os

    os.environ["HOOKLOOP_PLUGIN_OPTIONS"] = "amp.init_scale"
    try:
        hookloop.Trainer()
    finally:
        del os.environ["HOOKLOOP_PLUGIN_OPTIONS"]


@row("P09")
def _(tmp):
    class One:
        hookloop_role = "precision"

    class Other:
        hookloop_role = "precision"

    hookloop.Trainer(plugins=[One(), Other()])


@row("P10")
def _(tmp):
    hookloop.plugin("early_stopping", monitor="val_loss", modee="min")


@row("P11")
def _(tmp):
    hookloop.Trainer(plugins=["amp"], plugin_options={"ampp": {"init_scale": 1024}}, default_root_dir=tmp)


@row("P12")
def _(tmp):
    hookloop.Trainer(plugins=[hookloop.EarlyStopping(monitor="val_loss")],
                     plugin_options={"early_stopping": {"patience": 5}}, default_root_dir=tmp)


@row("P16")
def _(tmp):
    class MyPlugin:
        hookloop_role = "observer"
        hookloop_requires = ">=1,<2"

    hookloop.Trainer(plugins=[MyPlugin()], default_root_dir=tmp)


@row("P17")
def _(tmp):
    hookloop.Trainer(plugins=["ddp", "torchrun", "spawn"], default_root_dir=tmp)


@row("P18")
def _(tmp):
    class Mine(hookloop.DistributedSampling):
        hookloop_name, hookloop_role = "mine", "strategy"
        hookloop_launcher = "checkpoint"

    hookloop.Trainer(plugins=[Mine()], default_root_dir=tmp)


# -- strategies' and observers' options ----------------------------------------------------


@row("S01")
def _(tmp):
    hookloop.Trainer(plugins=["deepspeed"], plugin_options={"deepspeed": {"stage": 7}})


@row("S02")
def _(tmp):
    hookloop.plugin("deepspeed", stage=2, offload_parameters=True)


@row("S03")
def _(tmp):
    hookloop.ModelCheckpoint(monitor="val_loss", mode="lowest")


@row("S04")
def _(tmp):
    hookloop.ModelCheckpoint(save_top_k=-2)


@row("S05")
def _(tmp):
    hookloop.Trainer(plugins=["early_stopping"],
                     plugin_options={"early_stopping": {"monitor": "val_loss", "mode": "up"}})


@row("S06")
def _(tmp):
    hookloop.EarlyStopping(monitor="val_loss", patience=-1)


@row("S07")
def _(tmp):
    hookloop.plugin("fsdp", sharding_strategy="FULL")


@row("S08")
def _(tmp):
    hookloop.Trainer(plugins=["fsdp"], plugin_options={"fsdp": {"state_dict_type": "fulll"}})


@row("S09")
def _(tmp):
    hookloop.Trainer(plugins=["pipe"], plugin_options={"pipe": {"balance": [2, 0]}})


@row("S10")
def _(tmp):
    class Seq(TinyModule):
        def __init__(self):
            super().__init__()
            self.sequential_module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                                                   nn.Linear(16, 3))

        def forward(self, x):
            return self.sequential_module(x)

    quiet(plugins=[hookloop.plugin("pipe", balance=[2, 2])]).fit(Seq(), loader())


@row("S11")
def _(tmp):
    hookloop.Trainer(plugins=["ddp"], plugin_options={"ddp": {"process_group_backend": "nope"}})


@row("S12")
def _(tmp):
    hookloop.LearningRateMonitor(logging_interval="batch")


@row("S13")
def _(tmp):
    trainer = quiet(enable_checkpointing=True,
                    callbacks=[hookloop.ModelCheckpoint(monitor="val_accuracy", dirpath=tmp / "ck")])
    trainer.fit(TinyModule(), loader(), loader(8))


@row("S14")
def _(tmp):
    trainer = quiet(callbacks=[hookloop.EarlyStopping(monitor="val_los")])
    trainer.fit(TinyModule(), loader(), loader(8))


@row("S15")
def _(tmp):
    trainer = quiet(plugin_options={"checkpoint": {"async_save": "yes"}}, enable_checkpointing=True,
                    default_root_dir=str(tmp))
    trainer.fit(TinyModule(), loader())


@row("S16")
def _(tmp):
    hookloop.Tuner(quiet(plugins=["deepspeed_stage_3"])).lr_find(TinyModule(), loader())


@row("S17")
def _(tmp):
    quiet(plugins=["ddp_sequential", "ema"]).fit(TinyModule(), loader())


@row("S18")
def _(tmp):
    quiet(plugins=["pipeline", "ema"]).fit(TinyModule(), loader())


@row("S19")
def _(tmp):
    hookloop.EarlyStopping(monitor="val_loss", min_delta=float("nan"))


@row("S20")
def _(tmp):
    hookloop.EarlyStopping(monitor="val_loss", stopping_threshold=float("nan"))


@row("S21")
def _(tmp):
    hookloop.Trainer(plugins=["amp"], plugin_options={"amp": {"init_scale": float("inf")}})


@row("S22")
def _(tmp):
    hookloop.Trainer(plugins=["amp"], plugin_options={"amp": {"growth_interval": 0}})


# -- launch -------------------------------------------------------------------------------


@row("L02")
def _(tmp):
    (tmp / "train.py").write_text("print('must not run')\n")
    return in_process_command("run", "--plugins", "ddpp", "train.py")


@row("L03")
def _(tmp):
    quiet(devices=2).fit(TinyModule(), loader())


@row("L04")
def _(tmp):
    (tmp / "train.py").write_text("print('must not run')\n")
    return in_process_command("run", "--plugin-option", "amp.init_scale", "train.py")


@row("L05")
def _(tmp):
    return in_process_command("plot", str(tmp / "nowhere"))


@row("L06")
def _(tmp):
    return in_process_command("new-plugin", "My-Plugin", "--role", "observer")


@row("L07")
def _(tmp):
    (tmp / "train.py").write_text("print('must not run')\n")
    return in_process_command("run", "--plugins", "horovod", "--devices", "2", "--max-restarts", "1",
                              str(tmp / "train.py"))


@row("L08")
def _(tmp):
    (tmp / "train.py").write_text("print('must not run')\n")
    return in_process_command("run", "--plugins", "ddp", "--devices", "2", "trian.py")


@row("L09")
def _(tmp):
    (tmp / "train.py").write_text("print('must not run')\n")
    return in_process_command("run", "--plugins", "ddp", "--accelerator", "cpu", "--devices", "0,3", "train.py")


# -- environment ----------------------------------------------------------------------------


def _environment_rows(**variables: str):
    """Set ``variables`` in this process's environment for one trigger (restored after)."""
    import contextlib
    import os

    @contextlib.contextmanager
    def scope():
        before = {name: os.environ.get(name) for name in [*variables, "HOOKLOOP_LAUNCHER_PID"]}
        os.environ.pop("HOOKLOOP_LAUNCHER_PID", None)
        os.environ.update(variables)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    return scope()


@row("E01")
def _(tmp):
    with _environment_rows(HOOKLOOP_PLUGINS="ddpp"):
        hookloop.Trainer()


@row("E02")
def _(tmp):
    (tmp / "train.py").write_text("print('must not run')\n")
    with _environment_rows(HOOKLOOP_PLUGINS="ddpp"):
        return in_process_command("run", "train.py")


@row("E03")
def _(tmp):
    with _environment_rows(HOOKLOOP_AUTOLOAD_PLUGINS="maybe"):
        hookloop.Trainer()


@row("E04")
def _(tmp):
    with _environment_rows(HOOKLOOP_MESH="tp=x"):
        hookloop.Trainer()


@row("E05")
def _(tmp):
    import warnings

    with _environment_rows(HOOKLOOP_TRAINER_DEFAULTS='{"max_epochs": 1}'), warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning, raised: its class and message
        hookloop.Trainer(max_epochs=3, default_root_dir=str(tmp))


# -- data ---------------------------------------------------------------------------------


@row("D01")
def _(tmp):
    quiet(limit_train_batches=0.5).fit(TinyModule(), DataLoader(Stream(), batch_size=4))


@row("D02")
def _(tmp):
    quiet(val_check_interval=0.5).fit(TinyModule(), DataLoader(Stream(), batch_size=4), loader(8))


@row("D03")
def _(tmp):
    quiet(limit_train_batches=0.05).fit(TinyModule(), loader(80))


@row("D04")
def _(tmp):
    quiet(val_check_interval=11).fit(TinyModule(), loader(80), loader(8))


@row("D05")
def _(tmp):
    quiet().fit(TinyModule())


@row("D12")
def _(tmp):
    quiet(global_batch_size=20).fit(TinyModule(), loader(32))


@row("D13")
def _(tmp):
    quiet(global_batch_size=16).fit(TinyModule(), DataLoader(tiny_data(16), batch_sampler=[list(range(16))]))


@row("D14")
def _(tmp):
    import sys

    saved = sys.modules.get("torchdata.stateful_dataloader")
    sys.modules["torchdata.stateful_dataloader"] = None  # import fails as if torchdata were not installed
    try:
        quiet(stateful_dataloader=True).fit(TinyModule(), loader())
    finally:
        if saved is None:
            del sys.modules["torchdata.stateful_dataloader"]
        else:
            sys.modules["torchdata.stateful_dataloader"] = saved


@row("D06")
def _(tmp):
    quiet().fit(TinyModule(), loader(), datamodule=hookloop.DataModule())


@row("D07")
def _(tmp):
    quiet().fit(TinyModule(), [loader(), loader()])


@row("D08")
def _(tmp):
    quiet().fit(TinyModule(), tiny_data(16))


@row("D09")
def _(tmp):
    class MyModel(TinyModule):
        validation_step = None

    quiet().fit(MyModel(), loader(), loader(8))


@row("D10")
def _(tmp):
    class MyModel(TinyModule):
        pass

    quiet().validate(MyModel(), [loader(8), loader(8)])


@row("D11")
def _(tmp):
    class MyModel(TinyModule):
        def test_step(self, batch, batch_idx):
            pass

    quiet().test(MyModel())


# -- module -------------------------------------------------------------------------------


@row("M01")
def _(tmp):
    class MyModel(TinyModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y, reduction="none")

    quiet().fit(MyModel(), loader())


@row("M02")
def _(tmp):
    class MyModel(TinyModule):
        def training_step(self, batch, batch_idx):
            return 0.5

    quiet().fit(MyModel(), loader())


@row("M03")
def _(tmp):
    class MyModel(TinyModule):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

    quiet().fit(MyModel(), loader())


@row("M04")
def _(tmp):
    class MyModel(TinyModule):
        def training_step(self, batch, batch_idx, optimizer_idx):
            return super().training_step(batch, batch_idx)

    quiet().fit(MyModel(), loader())


@row("M06")
def _(tmp):
    class MyModel(TinyModule):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt)

    quiet().fit(MyModel(), loader())


@row("M07")
def _(tmp):
    class MyModel(TinyModule):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return {"optimizer": opt, "lr_scheduler": plateau, "monitor": "val_lost"}

    quiet().fit(MyModel(), loader(), loader(8))


@row("M09")
def _(tmp):
    class MyModel(TinyModule):
        def training_step(self, batch, batch_idx):
            self.optimizers()

    quiet().fit(MyModel(), loader())


@row("M10")
def _(tmp):
    class MyModel(hookloop.Module):
        def __init__(self, loss=nn.CrossEntropyLoss()):
            super().__init__()
            self.save_hyperparameters()

    MyModel()


@row("M11")
def _(tmp):
    class MyModel(hookloop.Module):
        def __init__(self, lr=0.1):
            super().__init__()
            self.save_hyperparameters("learning_rate")

    MyModel()


@row("M12")
def _(tmp):
    class MyModel(TinyModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y, reduction="none")
            self.log("train_loss", loss)
            return loss.mean()

    quiet().fit(MyModel(), loader())


@row("M13")
def _(tmp):
    class MyModel(TinyModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss_median", loss, reduce_fx="median")
            return loss

    quiet().fit(MyModel(), loader())


@row("M14")
def _(tmp):
    class MyModel(nn.Module):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    quiet().fit(MyModel(), loader())


@row("M15")
def _(tmp):
    class MyModel(TinyModule):
        def predict_step(self, batch, batch_idx):
            self.log("count", 1.0)
            return self(batch[0])

    quiet().predict(MyModel(), loader())


@row("M16")
def _(tmp):
    pl = pytest.importorskip("pytorch_lightning")

    class MyModel(pl.LightningModule):
        def training_step(self, batch, batch_idx):
            return self(batch)

        def configure_optimizers(self):
            return None

    quiet().fit(MyModel(), loader())


@row("M17")
def _(tmp):
    class MyModel(TinyModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            self.manual_backward(super().training_step(batch, batch_idx))
            self.clip_gradients(opt, gradient_clip_val=float("nan"))
            opt.step()

    quiet().fit(MyModel(), loader())


# -- checkpoints ---------------------------------------------------------------------------


@row("K01")
def _(tmp):
    quiet().fit(TinyModule(), loader(), ckpt_path=tmp / "nope.ckpt")


@row("K02")
def _(tmp):
    path = tmp / "last.ckpt"
    path.write_bytes(b"not a checkpoint at all")
    quiet().fit(TinyModule(), loader(), ckpt_path=path)


@row("K03")
def _(tmp):
    path = saved_run(tmp)

    class MyModel(TinyModule):
        def __init__(self):
            super().__init__()
            self.net[0] = nn.Linear(8, 32)
            self.net[2] = nn.Linear(32, 3)

    quiet(max_epochs=2).fit(MyModel(), loader(), ckpt_path=path)


@row("K04")
def _(tmp):
    quiet().validate(TinyModule(), loader(), ckpt_path="best")


@row("K05")
def _(tmp):
    (tmp / "sharded.ckpt").mkdir()
    (tmp / "sharded.ckpt" / "latest").write_text("global_step4\n")  # what a strategy's directory holds
    quiet().fit(TinyModule(), loader(), ckpt_path=tmp / "sharded.ckpt")


@row("K06")
def _(tmp):
    path = tmp / "weights.pt"
    torch.save(TinyModule().state_dict(), path)
    TinyModule.load_from_checkpoint(path)


@row("K07")
def _(tmp):
    path = tmp / "wrapped.ckpt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in TinyModule().state_dict().items()}}, path)
    TinyModule.load_from_checkpoint(path)


@row("K08")
def _(tmp):
    class TwoSchedulers(TinyModule):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1), torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)]

    path = saved_run(tmp, TwoSchedulers())
    quiet(max_epochs=2).fit(TinyModule(scheduler=True), loader(), ckpt_path=path)


@row("K09")
def _(tmp):
    path = tmp / "weights.pt"
    torch.save(TinyModule().state_dict(), path)
    quiet().fit(TinyModule(), loader(), ckpt_path=path)


@row("K10")
def _(tmp):
    path = saved_run(tmp)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit flipped inside the archive
    path.write_bytes(bytes(data))
    quiet().fit(TinyModule(), loader(), ckpt_path=path)


@row("K11")
def _(tmp):
    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    path = tmp / "shared.ckpt"
    torch.save({"loop": Payload()}, path)
    quiet().fit(TinyModule(), loader(), ckpt_path=path)


@row("K12")
def _(tmp):
    other = tmp / "other-run" / "checkpoints" / "last.ckpt" / "step16"
    (other / "model").mkdir(parents=True)
    (other / "model" / ".metadata").write_bytes(b"")
    shared = tmp / "shared" / "last.ckpt"
    shared.mkdir(parents=True)
    (shared / "latest").write_text(os.path.relpath(other, shared) + "\n")
    quiet(plugins=["fsdp"]).fit(TinyModule(), loader(), ckpt_path=shared)


def _marked(tmp: Path, fmt) -> Path:
    checkpoint = hookloop.safe_load(saved_run(tmp / "run"))
    checkpoint["hookloop"] = {"version": "99.0.0", "format": fmt}
    torch.save(checkpoint, tmp / "marked.ckpt")
    return tmp / "marked.ckpt"


@row("K17")
def _(tmp):
    fsdp = hookloop.plugin("fsdp", state_dict_type="sharded")
    trainer = hookloop.Trainer(plugins=[fsdp], max_steps=1, default_root_dir=str(tmp), enable_progress_bar=False)
    trainer.fit(TinyModule(), loader())
    path = Path(trainer.checkpoint_callback.last_model_path)
    (path / (path / "latest").read_text().strip() / "model" / "__0_0.distcp").unlink()
    quiet(plugins=[hookloop.plugin("fsdp", state_dict_type="sharded")], max_steps=2).fit(
        TinyModule(), loader(), ckpt_path=path)


@row("K18")
def _(tmp):
    # The files a 2-process ZeRO-2 save writes (what collate reads of them), rank 1's shard lost.
    tag = tmp / "copied" / "last.ckpt" / "global_step4"
    tag.mkdir(parents=True)
    (tag.parent / "latest").write_text("global_step4\n")
    (tag / ".hookloop-complete").write_text("global_step4\n")
    torch.save({"dp_world_size": 2, "ds_config": {"zero_optimization": {"stage": 2}}, "module": {}},
               tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return in_process_command("deepspeed", "collate", str(tag.parent), str(tmp / "OUT.pt"))


@row("K19")
def _(tmp):
    import uuid

    quiet().fit(TinyModule(), loader(), ckpt_path=f"memory://catalogue-{uuid.uuid4().hex}/nothing.ckpt")


@row("K20")
def _(tmp):
    import uuid

    from hookloop.resume import storage

    url = f"memory://catalogue-{uuid.uuid4().hex}/run/last.ckpt"
    storage.write_bytes(storage.join(url, "latest"), b"../../other-run/last.ckpt\n")
    quiet().fit(TinyModule(), loader(), ckpt_path=url)


@row("K21")
def _(tmp):
    import socket

    from hookloop.resume import storage

    with socket.socket() as s:  # a port nothing listens on: every connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    variables = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                 "AWS_MAX_ATTEMPTS": "1", storage.RETRIES_ENV: "2", storage.BACKOFF_ENV: "0.01",
                 storage.STAGING_ENV: str(tmp / "staging")}
    from hookloop.testing.s3 import clear_fsspec_cache

    with _environment_rows(**variables):
        clear_fsspec_cache()  # no client of another endpoint
        try:
            quiet(enable_checkpointing=True, callbacks=[hookloop.ModelCheckpoint(dirpath="s3://bucket/ck")]).fit(
                TinyModule(), loader())
        finally:
            clear_fsspec_cache()


@row("K13")
def _(tmp):
    quiet(max_epochs=2).fit(TinyModule(), loader(), ckpt_path=_marked(tmp, 3))


@row("K14")
def _(tmp):
    quiet(max_epochs=2).fit(TinyModule(), loader(), ckpt_path=_marked(tmp, "2"))


@row("K15")
def _(tmp):
    (tmp / "empty.ckpt").mkdir()
    quiet().fit(TinyModule(), loader(), ckpt_path=tmp / "empty.ckpt")


@row("K16")
def _(tmp):
    import warnings

    import pytorch_lightning as pl

    class LitModel(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TinyModule().net

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(LitModel(), loader())
        trainer.save_checkpoint(tmp / "lightning.ckpt")
    quiet().fit(TinyModule(), loader(), ckpt_path=tmp / "lightning.ckpt")


# -- run directories -----------------------------------------------------------------------


@row("R01")
def _(tmp):
    blocker = tmp / "a-file"
    blocker.write_text("not a directory")
    hookloop.Trainer(max_epochs=1, default_root_dir=str(blocker / "runs"),
                     enable_progress_bar=False).fit(TinyModule(), loader())


@row("R02")
def _(tmp):
    (tmp / "ck" / "last.ckpt").mkdir(parents=True)  # what a sharded (DeepSpeed) run left there
    quiet(enable_checkpointing=True, callbacks=[hookloop.ModelCheckpoint(dirpath=tmp / "ck", save_last=True)]).fit(TinyModule(), loader())


@row("R03")
def _(tmp):
    hookloop.Trainer(default_root_dir="gs://bucket/run")


@row("R04")
def _(tmp):
    hookloop.Trainer(default_root_dir="nosuch://bucket/run")


# ---------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------


def run_trigger(row_id: str, tmp: Path) -> tuple[str, str]:
    """(what was raised, the message) for the trigger of ``row_id``."""
    try:
        result = TRIGGERS[row_id](tmp)
    except Exception as exc:  # noqa: BLE001 - the point is to catch what the row documents
        return type(exc).__name__, str(exc)
    if isinstance(result, Exit):
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        prefix = "hookloop: error: "
        return f"exit {result.code}", last[len(prefix):] if last.startswith(prefix) else result.stderr
    return "nothing", ""


def test_every_row_has_a_trigger_and_every_trigger_a_row():
    documented = [r.id for r in ROWS]
    assert len(documented) == len(set(documented)), "an id appears twice in docs/errors.md"
    assert set(documented) == set(TRIGGERS), (
        f"rows without a trigger: {sorted(set(documented) - set(TRIGGERS))}; "
        f"triggers without a row: {sorted(set(TRIGGERS) - set(documented))}"
    )


def test_the_catalogue_is_complete_enough():
    assert len(ROWS) >= 40
    assert {r.section for r in ROWS} == set(SECTIONS)
    for r in ROWS:
        assert r.did and r.raises and r.message, r


def test_rows_are_distinct():
    # The same message may come from code and from a command (P01, L02), not twice from one.
    seen = [(r.raises, r.message) for r in ROWS]
    assert len(seen) == len(set(seen))


@pytest.mark.parametrize("entry", ROWS, ids=[r.id for r in ROWS])
def test_row(entry: Row, tmp_path):
    raised, message = run_trigger(entry.id, tmp_path)
    assert raised == entry.raises, f"{entry.id}: expected {entry.raises}, got {raised}: {message}"
    assert message_pattern(entry.message).fullmatch(message.strip()), (
        f"{entry.id}: the message differs from docs/errors.md\n  documented: {entry.message}\n  actual:     {message}"
    )


def test_message_pattern():
    pattern = message_pattern("checkpoint <path> does not exist.<hint>")
    assert pattern.fullmatch("checkpoint '/tmp/x.ckpt' does not exist.")
    assert pattern.fullmatch("checkpoint '/tmp/x.ckpt' does not exist. Did you mean y?")
    assert not pattern.fullmatch("checkpoint '/tmp/x.ckpt' is corrupt.")
    assert message_pattern("a (b) [c]\n  d").fullmatch("a (b) [c] d")


if __name__ == "__main__":
    # Print what every trigger raises (for writing a row): python tests/test_errors_catalogue.py [ID...]
    import os
    import tempfile

    for row_id in sys.argv[1:] or sorted(TRIGGERS):
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            raised, message = run_trigger(row_id, Path(tmp))
            print(json.dumps({"id": row_id, "raises": raised, "message": message}))
