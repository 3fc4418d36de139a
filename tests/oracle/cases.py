"""The oracle's cases: one Lightning-style script each, run under both frameworks.

A case is ``case(fw, root, ddp) -> dict`` of observations (plain JSON data). The module
classes are written once against ``fw.LightningModule``: under Lightning they are
LightningModules, under hookloop `hookloop.Module`s, with nothing else changed.
Observations are what a user looks at: ``callback_metrics``, the CSV log, the return
values of ``validate``/``test``/``predict``, the order of the events a callback and the
module receive, the optimizer steps and learning rates, the final weights, where early
stopping stopped and which checkpoints were written.

`CASES` maps a case name to (function, modes): modes is a subset of ("one", "ddp").
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from frameworks import EVENTS

REDUCE = ("mean", "sum", "max", "min")
MODULE_HOOKS = (
    "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
    "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_validation_start",
    "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end", "on_test_start", "on_test_end",
    "on_test_epoch_start", "on_test_epoch_end", "on_predict_start", "on_predict_end",
    "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
)


def data(n: int = 48, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(x, y)


def loader(ddp: bool, n: int = 48, seed: int = 1, batch_size: int = 4, train: bool = True) -> DataLoader:
    # Unshuffled: under ddp both frameworks' training DistributedSampler shuffles it anyway
    # (seeded, set_epoch each epoch); evaluation loaders stay in order.
    return DataLoader(data(n, seed), batch_size=batch_size)


def base_module(fw):
    class Base(fw.LightningModule):
        def __init__(self, lr: float = 0.1, momentum: float = 0.0):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
            self.lr, self.momentum = lr, momentum

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    return Base


def weights(module) -> list:
    return [round(v, 6) for v in torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()]


def _lr(trainer) -> float:
    return trainer.optimizers[0].param_groups[0]["lr"]


# -- logging ------------------------------------------------------------------------------


def case_log_matrix(fw, root, ddp):
    """self.log: on_step/on_epoch x reduce_fx x sync_dist x batch_size, from the training
    and validation steps and the epoch-level hooks."""
    Base = base_module(fw)

    class Logged(Base):
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            rank = self.trainer.global_rank + 1
            for fx in REDUCE:
                value = torch.tensor(float(batch_idx + 1) * rank)
                self.log(f"t_{fx}_both", value, on_step=True, on_epoch=True, reduce_fx=fx)
                self.log(f"t_{fx}_epoch", value, on_step=False, on_epoch=True, reduce_fx=fx)
                self.log(f"t_{fx}_sync", value, on_step=True, on_epoch=True, reduce_fx=fx, sync_dist=True)
            self.log("t_bs", torch.tensor(float(batch_idx) * rank), on_epoch=True, batch_size=rank + batch_idx,
                     sync_dist=True)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)
            self.log("val_max", torch.tensor(float(batch_idx)), reduce_fx="max")
            self.log("val_step", torch.tensor(float(batch_idx)), on_step=True, on_epoch=True)

        def on_train_epoch_start(self):
            self.log("epoch_start_value", torch.tensor(float(self.current_epoch) + 1.5))

        def on_train_epoch_end(self):
            self.log("epoch_end_value", torch.tensor(float(self.current_epoch) * 2.0))

        def on_validation_epoch_end(self):
            self.log("val_epoch_end_value", torch.tensor(float(self.current_epoch) + 0.25))

    fw.seed_everything(7)
    model = Logged()
    trainer = fw.trainer(root, ddp, max_epochs=2, log_every_n_steps=2, num_sanity_val_steps=0)
    trainer.fit(model, loader(ddp), loader(ddp, 24, seed=2, train=False))
    out = {"metrics": fw.metrics(trainer), "csv": fw.csv_entries(trainer)}
    out["validate"] = trainer.validate(model, loader(ddp, 24, seed=2, train=False), verbose=False)
    return out


def case_torchmetrics(fw, root, ddp):
    """torchmetrics Metric objects logged with self.log/log_dict (Lightning's pattern): the
    step value is the metric's forward result, the epoch value its compute() (the metric
    syncs itself across ranks), then reset(); a MetricCollection in log_dict; a metric
    updated in the steps and logged in on_train_epoch_end; the sanity check's updates
    forgotten. Observed: the metrics, the CSV, validate/test results, the update counts
    left after each run (0: reset)."""
    import torchmetrics

    Base = base_module(fw)

    class Scored(Base):
        def __init__(self):
            super().__init__()
            self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
            self.train_mean = torchmetrics.MeanMetric()
            self.train_max = torchmetrics.MaxMetric()
            self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
            self.val_mean = torchmetrics.MeanMetric()
            self.val_scores = torchmetrics.MetricCollection({
                "prec": torchmetrics.Precision(task="multiclass", num_classes=3, average="macro"),
                "rec": torchmetrics.Recall(task="multiclass", num_classes=3, average="macro"),
            }, prefix="val_")
            self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            loss = F.cross_entropy(logits, y)
            self.train_acc(logits, y)  # forward: the batch's accuracy is the step value
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True, prog_bar=True)
            self.train_mean.update(loss)  # update only: no step value
            self.log("train_mean", self.train_mean, on_epoch=True)
            self.train_max.update(logits.max())
            self.log("train_loss", loss)
            return loss

        def on_train_epoch_end(self):
            self.log("train_max", self.train_max)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            self.val_acc.update(logits, y)
            self.log("val_acc", self.val_acc)
            self.val_mean(F.cross_entropy(logits, y, reduction="none"))
            self.log("val_mean", self.val_mean, on_step=True)
            self.val_scores(logits, y)
            self.log_dict(self.val_scores)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.test_acc(self(x), y)
            self.log("test_acc", self.test_acc)

    def counts(model):
        return {name: int(m.update_count) for name, m in model.named_modules()
                if isinstance(m, torchmetrics.Metric)}

    fw.seed_everything(7)
    model = Scored()
    trainer = fw.trainer(root, ddp, max_epochs=2, log_every_n_steps=2, val_check_interval=0.5)
    trainer.fit(model, loader(ddp), loader(ddp, 24, seed=2, train=False))
    out = {"metrics": fw.metrics(trainer), "csv": fw.csv_entries(trainer), "counts_after_fit": counts(model)}
    out["validate"] = trainer.validate(model, loader(ddp, 24, seed=2, train=False), verbose=False)
    out["counts_after_validate"] = counts(model)
    # every run starts with no metrics: only what validate computed is left (fit's are gone)
    out["metrics_after_validate"] = fw.metrics(trainer)
    out["test"] = trainer.test(model, loader(ddp, 16, seed=4, train=False), verbose=False)
    out["counts_after_test"] = counts(model)
    out["metrics_after_test"] = fw.metrics(trainer)
    return out


def case_hook_order(fw, root, ddp):
    """The events a callback and the module receive during fit (with the sanity check,
    a mid-epoch validation and two epochs), validate, test and predict."""
    Base = base_module(fw)
    log: list = []

    def recorded(name):
        return lambda self, *a, **k: log.append("mod:" + name)

    Recorded = type("Recorded", (Base,), {name: recorded(name) for name in MODULE_HOOKS})

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.cross_entropy(self(batch[0]), batch[1]))

    Recorded.test_step = test_step
    Recorded.predict_step = lambda self, batch, batch_idx: self(batch[0])
    fw.seed_everything(7)
    model = Recorded()
    trainer = fw.trainer(root, ddp, callbacks=[fw.recorder(log)], max_epochs=2, limit_train_batches=4,
                         limit_val_batches=2, val_check_interval=2, num_sanity_val_steps=1)
    trainer.fit(model, loader(ddp), loader(ddp, 24, seed=2, train=False))
    log.append("---validate")
    trainer.validate(model, loader(ddp, 8, seed=2, train=False), verbose=False)
    log.append("---test")
    trainer.test(model, loader(ddp, 8, seed=2, train=False), verbose=False)
    log.append("---predict")
    trainer.predict(model, loader(ddp, 8, seed=2, train=False))
    return {"events": log}


# Every hook of Lightning's Callback that a run without checkpoints calls: the events both
# frameworks send.
CALLBACK_HOOKS = EVENTS


def describe(value, trainer, module):
    """An event argument as JSON: which object it is, or its value."""
    if value is trainer:
        return "trainer"
    if value is module:
        return "module"
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), round(float(value.detach().double().sum()), 5)]
    if hasattr(value, "param_groups"):
        return "optimizer"
    if isinstance(value, dict):
        return {str(k): describe(v, trainer, module) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v, trainer, module) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def case_callback_events(fw, root, ddp):
    """A Lightning ``Callback`` subclass (two of them, in list order) and the module's hooks:
    every event, in order, with its arguments (which objects, the values), during fit (with
    the sanity check, a mid-epoch validation, two epochs, accumulation of 2), validate with
    two loaders, test and predict; the training step returns a dict."""
    Base = base_module(fw)
    log: list = []

    def mod_hook(name):
        return lambda self, *a, **k: log.append("mod:" + name)

    Recorded = type("Recorded", (Base,), {name: mod_hook(name) for name in MODULE_HOOKS})

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        return {"loss": loss, "seen": x.sum().detach()}

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    Recorded.training_step = training_step
    Recorded.validation_step = validation_step
    Recorded.test_step = test_step
    Recorded.predict_step = lambda self, batch, batch_idx: self(batch[0])

    def cb_hook(tag, name):
        def hook(self, trainer, pl_module, *args, **kwargs):
            values = list(args) + [kwargs[k] for k in sorted(kwargs)]
            log.append([f"{tag}:{name}", describe(values, trainer, pl_module),
                        describe(pl_module, trainer, pl_module)])
        return hook

    def recorder(tag):
        return type(f"Recorder{tag}", (fw.Callback,), {name: cb_hook(tag, name) for name in CALLBACK_HOOKS})()

    fw.seed_everything(7)
    model = Recorded()
    trainer = fw.trainer(root, ddp, callbacks=[recorder("a"), recorder("b")], max_epochs=2,
                         limit_train_batches=4, limit_val_batches=2, val_check_interval=2,
                         num_sanity_val_steps=1, accumulate_grad_batches=2)
    trainer.fit(model, loader(ddp), loader(ddp, 24, seed=2, train=False))
    log.append("---validate")
    trainer.validate(model, [loader(ddp, 8, seed=2, train=False), loader(ddp, 8, seed=3, train=False)],
                     verbose=False)
    log.append("---test")
    trainer.test(model, loader(ddp, 8, seed=2, train=False), verbose=False)
    log.append("---predict")
    trainer.predict(model, loader(ddp, 8, seed=2, train=False))
    return {"events": log}


def case_finetuning(fw, root, ddp):
    """A BaseFinetuning subclass (Lightning's fine-tuning example on an MLP backbone): the
    backbone frozen (its BatchNorm trained), its top layer unfrozen at epoch 1 (lr from the
    first group / 10), the rest at epoch 2 (lr given); Adam and MultiStepLR. Per epoch: the
    param groups and their learning rates, what trains; the final weights and val_loss; the
    callback's state; then a resume from a checkpoint of epoch 2 to epoch 4."""

    class Finetuned(fw.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
                                          nn.ReLU())
            self.head = nn.Linear(16, 3)
            self.epochs = []

        def forward(self, x):
            return self.head(self.backbone(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self):
            opt = torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)
            return [opt], [torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2], gamma=0.5)]

        def on_train_epoch_end(self):
            opt = self.trainer.optimizers[0]
            self.epochs.append({
                "groups": len(opt.param_groups),
                "lrs": [g["lr"] for g in opt.param_groups],
                "sizes": [sum(p.numel() for p in g["params"]) for g in opt.param_groups],
                "trainable": sum(p.numel() for p in self.parameters() if p.requires_grad),
            })

    class Unfreeze(fw.BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone[3], optimizer)
            if epoch == 2:
                self.unfreeze_and_add_param_group(pl_module.backbone[:2], optimizer, lr=0.004)

    def state(callback):
        meta = callback.state_dict()["internal_optimizer_metadata"]
        return {str(k): [{"lr": g["lr"], "params": list(g["params"])} for g in groups] for k, groups in meta.items()}

    out = {}
    fw.seed_everything(7)
    model, callback = Finetuned(), Unfreeze()
    trainer = fw.trainer(root, ddp, callbacks=[callback], max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(model, loader(ddp), loader(ddp, 24, seed=2, train=False))
    ckpt = os.path.join(root, "epoch2.ckpt")
    trainer.save_checkpoint(ckpt)
    out["two_epochs"] = {"epochs": model.epochs, "state": state(callback)}
    trainer = fw.trainer(root, ddp, callbacks=[callback], max_epochs=4, num_sanity_val_steps=0)
    trainer.fit(model, loader(ddp), loader(ddp, 24, seed=2, train=False))
    out["four_epochs"] = {"epochs": model.epochs, "weights": weights(model), "state": state(callback),
                          "val_loss": fw.metrics(trainer)["val_loss"]}
    fw.seed_everything(7)
    resumed, callback = Finetuned(), Unfreeze()
    trainer = fw.trainer(root, ddp, callbacks=[callback], max_epochs=4, num_sanity_val_steps=0)
    trainer.fit(resumed, loader(ddp), loader(ddp, 24, seed=2, train=False), ckpt_path=ckpt)
    out["resumed"] = {"epochs": resumed.epochs, "weights": weights(resumed), "state": state(callback),
                      "val_loss": fw.metrics(trainer)["val_loss"]}
    return out


def case_accumulation_schedule(fw, root, ddp):
    """GradientAccumulationScheduler({1: 2, 2: 3}) over 3 epochs of 7 batches (cut windows
    at the epochs' ends): accumulate_grad_batches and global_step per epoch, the final
    weights."""
    Base = base_module(fw)

    class Recorded(Base):
        def on_train_epoch_end(self):
            self.seen.append([self.trainer.accumulate_grad_batches, self.trainer.global_step])

    fw.seed_everything(7)
    model = Recorded(momentum=0.5)
    model.seen = []
    trainer = fw.trainer(root, ddp, callbacks=[fw.GradientAccumulationScheduler(scheduling={1: 2, 2: 3})],
                         max_epochs=3, limit_train_batches=7, num_sanity_val_steps=0)
    trainer.fit(model, loader(ddp))
    return {"per_epoch": model.seen, "weights": weights(model)}


def case_prediction_writer(fw, root, ddp):
    """BasePredictionWriter with each write_interval, one and two loaders, with and without
    return_predictions: every write call's arguments (predictions, batch_indices, batch,
    batch_idx, dataloader_idx) and predict's return value."""
    Base = base_module(fw)
    Base.predict_step = lambda self, batch, batch_idx, dataloader_idx=0: self(batch[0])
    log: list = []

    class Writer(fw.BasePredictionWriter):
        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            log.append(["batch", describe([prediction, batch_indices, batch, batch_idx, dataloader_idx],
                                          trainer, pl_module)])

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            log.append(["epoch", describe([predictions, batch_indices], trainer, pl_module)])

    fw.seed_everything(7)
    model = Base()
    out = {}
    for interval in ("batch", "epoch", "batch_and_epoch"):
        for keep in (True, False):
            trainer = fw.trainer(root, ddp, callbacks=[Writer(interval)])
            result = trainer.predict(model, loader(ddp, 10, seed=2, train=False), return_predictions=keep)
            out[f"{interval}-{keep}"] = {"log": log[:], "returned": result is not None}
            log.clear()
    trainer = fw.trainer(root, ddp, callbacks=[Writer("batch_and_epoch")])
    trainer.predict(model, [loader(ddp, 10, seed=2, train=False), loader(ddp, 6, seed=3, train=False)])
    out["two_loaders"] = log[:]
    return out


LOG_HOOKS = (
    "on_train_start", "on_train_epoch_start", "on_train_batch_start", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end", "on_train_epoch_end",
    "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
    "on_validation_epoch_end", "on_test_start", "on_test_epoch_start", "on_test_batch_start", "on_test_batch_end",
    "on_test_epoch_end",
)


def case_log_hooks(fw, root, ddp):
    """self.log with its defaults from every module hook Lightning allows logging in: which
    keys appear (step/epoch), their values in callback_metrics, the CSV log and test()'s
    return."""
    Base = base_module(fw)

    def logging_hook(name):
        def hook(self, *args, **kwargs):
            count = self.counts[name] = self.counts.get(name, 0) + 1
            self.log(f"h_{name}", torch.tensor(float(count)))
        return hook

    Logging = type("Logging", (Base,), {name: logging_hook(name) for name in LOG_HOOKS})
    Logging.counts = None

    def init(self):
        Base.__init__(self)
        self.counts = {}

    Logging.__init__ = init
    Logging.test_step = lambda self, batch, batch_idx: self.log("t", F.cross_entropy(self(batch[0]), batch[1]))
    fw.seed_everything(7)
    model = Logging()
    trainer = fw.trainer(root, ddp, max_epochs=2, log_every_n_steps=1, num_sanity_val_steps=0)
    trainer.fit(model, loader(ddp, 16), loader(ddp, 8, seed=2, train=False))
    out = {"metrics": fw.metrics(trainer), "csv": fw.csv_entries(trainer)}
    out["test"] = trainer.test(model, loader(ddp, 8, seed=2, train=False), verbose=False)
    return out


# -- optimization -------------------------------------------------------------------------


def _stepped(fw, scheduler: str):
    Base = base_module(fw)

    class Stepped(Base):
        def __init__(self):
            super().__init__(lr=0.2, momentum=0.9)
            self.lrs: list = []

        def on_train_batch_end(self, *args, **kwargs):
            self.lrs.append([self.trainer.global_step, _lr(self.trainer)])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
            if scheduler == "step":
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 3}}
            if scheduler == "epoch":
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
                return [opt], [sched]
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}

    return Stepped


def case_optimization(fw, root, ddp):
    """accumulate_grad_batches x gradient_clip_val x schedulers (step interval with a
    frequency, epoch interval, ReduceLROnPlateau on a monitored metric): the steps taken,
    the learning rate after every batch, the final weights."""
    out = {}
    for name, sched, acc, clip, algo in (
            ("step_acc3_clipnorm", "step", 3, 0.05, "norm"),
            ("epoch_acc2_clipvalue", "epoch", 2, 0.01, "value"),
            ("plateau_acc1", "plateau", 1, None, "norm")):
        fw.seed_everything(3)
        model = _stepped(fw, sched)()
        trainer = fw.trainer(os.path.join(root, name), ddp, max_epochs=3, accumulate_grad_batches=acc,
                             gradient_clip_val=clip, gradient_clip_algorithm=algo, num_sanity_val_steps=0)
        trainer.fit(model, loader(ddp, 44), loader(ddp, 16, seed=2, train=False))
        out[name] = {"global_step": trainer.global_step, "lrs": model.lrs, "weights": weights(model)}
    return out


def case_loop_control(fw, root, ddp):
    """val_check_interval < 1, check_val_every_n_epoch > 1, limit_*_batches, max_steps
    stopping mid-epoch, on_train_batch_start returning -1 (inside an accumulation
    window): validations run, steps taken, final weights, metrics."""
    Base = base_module(fw)

    class Controlled(Base):
        def __init__(self, cut_at=None):
            super().__init__(lr=0.1)
            self.cut_at, self.validations = cut_at, []

        def on_train_batch_start(self, batch, batch_idx, *args):
            if self.cut_at is not None and batch_idx == self.cut_at:
                return -1

        def on_validation_epoch_end(self):
            if not self.trainer.sanity_checking:
                self.validations.append([self.trainer.current_epoch, self.trainer.global_step])

        def on_train_epoch_end(self):
            self.log("epochs_ended", torch.tensor(float(self.current_epoch + 1)))

    out = {}
    for name, kw, cut in (
            ("val_interval_quarter", dict(max_epochs=2, val_check_interval=0.25), None),
            ("val_every_2_epochs", dict(max_epochs=4, check_val_every_n_epoch=2, limit_train_batches=3), None),
            ("limits", dict(max_epochs=2, limit_train_batches=0.5, limit_val_batches=2), None),
            ("max_steps_mid_epoch", dict(max_steps=7), None),
            ("cut_in_window", dict(max_epochs=2, accumulate_grad_batches=2), 3)):
        fw.seed_everything(5)
        model = Controlled(cut)
        trainer = fw.trainer(os.path.join(root, name), ddp, num_sanity_val_steps=0, **kw)
        trainer.fit(model, loader(ddp, 48), loader(ddp, 16, seed=2, train=False))
        out[name] = {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                     "validations": model.validations, "weights": weights(model),
                     "metrics": fw.metrics(trainer)}
    return out


def case_manual(fw, root, ddp):
    """Manual optimization with two optimizers (toggle, manual_backward, clip_gradients,
    a scheduler stepped by the module)."""
    class Manual(fw.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 3)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt_a, opt_b = self.optimizers()
            loss_a = F.cross_entropy(self.a(x), y)
            opt_a.zero_grad()
            self.manual_backward(loss_a)
            self.clip_gradients(opt_a, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
            opt_a.step()
            loss_b = F.cross_entropy(self.b(x) + self.a(x).detach(), y)
            opt_b.zero_grad()
            self.manual_backward(loss_b)
            opt_b.step()
            if batch_idx == 32 // 4 // (2 if ddp else 1) - 1:
                self.lr_schedulers().step()
            self.log_dict({"loss_a": loss_a, "loss_b": loss_b}, on_epoch=True)

        def configure_optimizers(self):
            opt_a = torch.optim.SGD(self.a.parameters(), lr=0.3)
            opt_b = torch.optim.Adam(self.b.parameters(), lr=0.01)
            return [opt_a, opt_b], [torch.optim.lr_scheduler.StepLR(opt_a, 1, 0.5)]

    fw.seed_everything(11)
    model = Manual()
    trainer = fw.trainer(root, ddp, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(model, loader(ddp, 32))
    return {"global_step": trainer.global_step, "weights": weights(model), "metrics": fw.metrics(trainer)}


# -- evaluation ---------------------------------------------------------------------------


def case_evaluation(fw, root, ddp):
    """Several validation loaders, test and predict return values, a DataModule."""
    Base = base_module(fw)

    class Evaluated(Base):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)
            self.log("val_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)
            self.log("test_loss_sum", F.cross_entropy(self(x), y, reduction="sum"), reduce_fx="sum",
                     sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self(batch[0]).softmax(-1)

    class Data(fw.LightningDataModule):
        def setup(self, stage):
            self.train, self.val = data(48), data(16, seed=2)

        def train_dataloader(self):
            return DataLoader(self.train, batch_size=4, shuffle=ddp)

        def val_dataloader(self):
            return [DataLoader(self.val, batch_size=4), DataLoader(data(8, seed=3), batch_size=4)]

        def test_dataloader(self):
            return DataLoader(data(16, seed=4), batch_size=4)

    fw.seed_everything(13)
    model = Evaluated()
    trainer = fw.trainer(root, ddp, max_epochs=2, num_sanity_val_steps=0, limit_test_batches=3,
                         limit_predict_batches=2)
    trainer.fit(model, datamodule=Data())
    out = {"metrics": fw.metrics(trainer), "weights": weights(model), "optimizers_after_fit": len(trainer.optimizers)}
    out["validate"] = trainer.validate(model, datamodule=Data(), verbose=False)
    out["optimizers_after_validate"] = len(trainer.optimizers)
    out["test"] = trainer.test(model, datamodule=Data(), verbose=False)
    preds = trainer.predict(model, DataLoader(data(10, seed=4), batch_size=4))
    out["predict"] = [round(v, 6) for v in torch.cat(preds).flatten().tolist()]
    return out


def case_validation_rng(fw, root, ddp):
    """A shuffled training loader in one process, trained with and without validation (and
    its sanity check): the final weights of each."""
    Base = base_module(fw)
    out = {}
    for name, kw in (("with_validation", dict(num_sanity_val_steps=2)),
                     ("without_validation", dict(num_sanity_val_steps=0, limit_val_batches=0))):
        fw.seed_everything(17)
        model = Base()
        trainer = fw.trainer(os.path.join(root, name), ddp, max_epochs=2, **kw)
        trainer.fit(model, DataLoader(data(32), batch_size=4, shuffle=True),
                    DataLoader(data(8, seed=2), batch_size=4, shuffle=True))
        out[name] = weights(model)
    return out


# -- early stopping and checkpoints -------------------------------------------------------


def _scripted(fw, values):
    """A module that logs ``score`` = values[k] at the k-th validation (the sanity check
    logs nothing)."""
    Base = base_module(fw)

    class Scripted(Base):
        def __init__(self):
            super().__init__()
            self.k = 0

        def on_validation_epoch_end(self):
            if self.trainer.sanity_checking:
                return
            self.log("score", torch.tensor(values[min(self.k, len(values) - 1)]))
            self.k += 1

    return Scripted


EARLY_STOPPING = {
    "patience0": ([1.0, 0.9, 0.95, 0.8, 0.7, 0.6, 0.5, 0.4], dict(patience=0)),
    "patience1": ([1.0, 0.9, 0.95, 0.93, 0.8, 0.7, 0.6, 0.5], dict(patience=1)),
    "patience2": ([1.0, 0.9, 0.95, 0.93, 0.8, 0.85, 0.86, 0.9], dict(patience=2)),
    "min_delta": ([1.0, 0.9, 0.88, 0.87, 0.86, 0.7, 0.6, 0.5], dict(patience=1, min_delta=0.05)),
    "mode_max": ([0.1, 0.2, 0.3, 0.25, 0.24, 0.5, 0.6, 0.7], dict(patience=1, mode="max")),
    "not_finite": ([1.0, 0.9, math.nan, 0.8, 0.7, 0.6, 0.5, 0.4], dict(patience=3, check_finite=True)),
    "threshold": ([1.0, 0.9, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05], dict(patience=3, stopping_threshold=0.45)),
}


def case_early_stopping(fw, root, ddp):
    out = {}
    for name, (values, kw) in EARLY_STOPPING.items():
        fw.seed_everything(1)
        model = _scripted(fw, values)()
        es = fw.EarlyStopping(monitor="score", **kw)
        trainer = fw.trainer(os.path.join(root, name), ddp, callbacks=[es], max_epochs=len(values),
                             limit_train_batches=2, limit_val_batches=1)
        trainer.fit(model, loader(ddp, 16), loader(ddp, 8, seed=2, train=False))
        out[name] = {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
                     "validations": model.k, "wait_count": es.wait_count}
    return out


CHECKPOINTS = {
    "top1_min": (dict(monitor="score", mode="min", save_top_k=1), dict(max_epochs=5)),
    "top2_max": (dict(monitor="score", mode="max", save_top_k=2), dict(max_epochs=5)),
    "all": (dict(monitor="score", save_top_k=-1), dict(max_epochs=3)),
    "last_and_top1": (dict(monitor="score", save_top_k=1, save_last=True), dict(max_epochs=3)),
    "every_2_epochs": (dict(every_n_epochs=2, save_top_k=-1), dict(max_epochs=5)),
    "every_3_steps": (dict(every_n_train_steps=3, save_top_k=-1), dict(max_epochs=2)),
    "mid_epoch_val": (dict(monitor="score", save_top_k=1), dict(max_epochs=2, val_check_interval=0.5)),
    "val_every_2": (dict(monitor="score", save_top_k=2), dict(max_epochs=5, check_val_every_n_epoch=2)),
    "max_steps_mid_epoch": (dict(monitor="score", save_top_k=-1), dict(max_steps=6)),
}
SCORES = [0.5, 0.3, 0.4, 0.2, 0.6, 0.1, 0.35, 0.45, 0.25, 0.15]


def case_checkpoints(fw, root, ddp):
    out = {}
    for name, (kw, trainer_kw) in CHECKPOINTS.items():
        fw.seed_everything(1)
        model = _scripted(fw, SCORES)()
        dirpath = os.path.join(root, name, "ckpts")
        ckpt = fw.ModelCheckpoint(dirpath=dirpath, **kw)
        trainer = fw.trainer(os.path.join(root, name), ddp, callbacks=[ckpt], limit_train_batches=4,
                             limit_val_batches=1, num_sanity_val_steps=0, **trainer_kw)
        trainer.fit(model, loader(ddp, 32), loader(ddp, 8, seed=2, train=False))
        out[name] = {
            "best": os.path.basename(ckpt.best_model_path or ""),
            "best_k": {os.path.basename(k): round(float(v), 6) for k, v in ckpt.best_k_models.items()},
            "files": sorted(p.name for p in Path(dirpath).glob("*") if not p.name.startswith(".")),
            # the run directory's checkpoints/ (hookloop keeps its resume last.ckpt there)
            "run_dir_files": sorted(p.name for p in Path(fw.log_dir(trainer), "checkpoints").glob("*")
                                    if not p.name.startswith(".")),
        }
    return out


def case_observer_choices(fw, root, ddp):
    """Where hookloop's observers deliberately differ: a run without validation but with
    ``check_val_every_n_epoch=2`` (ModelCheckpoint ranks, EarlyStopping checks at epoch
    ends), and ``every_n_train_steps`` given with ``every_n_epochs``."""
    Base = base_module(fw)

    class EpochScore(Base):
        def on_train_epoch_end(self):
            self.log("score", torch.tensor(SCORES[self.current_epoch]))

    out = {}
    fw.seed_everything(1)
    dirpath = os.path.join(root, "no_val", "ckpts")
    ckpt = fw.ModelCheckpoint(dirpath=dirpath, monitor="score", save_top_k=1)
    trainer = fw.trainer(os.path.join(root, "no_val"), ddp, callbacks=[ckpt], max_epochs=4,
                         check_val_every_n_epoch=2, limit_train_batches=2)
    trainer.fit(EpochScore(), loader(ddp, 16))
    out["ckpt_no_val"] = {"best": os.path.basename(ckpt.best_model_path or "")}
    fw.seed_everything(1)
    es = fw.EarlyStopping(monitor="score", patience=0)
    trainer = fw.trainer(os.path.join(root, "es_no_val"), ddp, callbacks=[es], max_epochs=6,
                         check_val_every_n_epoch=2, limit_train_batches=2)
    trainer.fit(EpochScore(), loader(ddp, 16))
    out["es_no_val"] = {"epoch": trainer.current_epoch}
    try:
        both = fw.ModelCheckpoint(dirpath=os.path.join(root, "both", "ckpts"), every_n_train_steps=3,
                                  every_n_epochs=1, save_top_k=-1)
    except Exception as exc:  # Lightning refuses the pair
        out["both_intervals"] = {"refused": type(exc).__name__}
    else:
        fw.seed_everything(1)
        trainer = fw.trainer(os.path.join(root, "both"), ddp, callbacks=[both], max_epochs=2,
                             limit_train_batches=4, num_sanity_val_steps=0)
        trainer.fit(Base(), loader(ddp, 32))
        out["both_intervals"] = {"files": sorted(p.name for p in Path(root, "both", "ckpts").glob("epoch=*"))}
    return out


CASES = {
    "log_matrix": (case_log_matrix, ("one", "ddp")),
    "torchmetrics": (case_torchmetrics, ("one", "ddp")),
    "hook_order": (case_hook_order, ("one", "ddp")),
    "callback_events": (case_callback_events, ("one", "ddp")),
    "finetuning": (case_finetuning, ("one",)),  # frozen parameters at DDP's construction: ddp needs find_unused_parameters
    "accumulation_schedule": (case_accumulation_schedule, ("one", "ddp")),
    "prediction_writer": (case_prediction_writer, ("one", "ddp")),
    "log_hooks": (case_log_hooks, ("one", "ddp")),
    "optimization": (case_optimization, ("one", "ddp")),
    "loop_control": (case_loop_control, ("one", "ddp")),
    "manual": (case_manual, ("one",)),  # two models, one unused per backward: ddp needs find_unused_parameters
    "evaluation": (case_evaluation, ("one", "ddp")),
    "validation_rng": (case_validation_rng, ("one",)),
    "early_stopping": (case_early_stopping, ("one", "ddp")),
    "checkpoints": (case_checkpoints, ("one", "ddp")),
    "observer_choices": (case_observer_choices, ("one",)),
}
