"""Runs a list of training scenarios on the digits example under torchrun, one rank each.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/scripts/deepspeed_worker.py SPEC.json OUTDIR

SPEC.json is a list of scenarios; for each one every rank writes
``OUTDIR/<name>.rank<r>.pt`` (per-micro-batch losses, validation accuracy, what the
engine held, the engine's predictions on the validation set) as soon as it finishes, so
that the tests compare each against a reference computed without DeepSpeed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import hookloop  # noqa: E402
from digits import DigitsClassifier, digits_datasets  # noqa: E402


class Digits(DigitsClassifier):
    """The example's classifier, seeded, keeping its last validation logits."""

    def __init__(self, seed: int = 0, optimizer: str = "sgd", hidden: int = 64):
        torch.manual_seed(seed)
        super().__init__(hidden=hidden)
        self.optimizer_name = optimizer
        self.last_logits = None
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        from hookloop_deepspeed import memory

        # The learning rate this micro-batch's step runs at (schedules move after the step).
        self.lrs.append(float(memory.base_optimizer(self.trainer.optimizer).param_groups[0]["lr"]))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.last_logits = logits.detach().float()
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
            return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.3)
        if self.optimizer_name in ("adam_groups", "adamw_groups"):
            # Two groups with their own lr and weight decay, and betas/eps off the defaults,
            # so that any hyper-parameter lost on the way to DeepSpeedCPUAdam shows.
            cls = torch.optim.Adam if self.optimizer_name == "adam_groups" else torch.optim.AdamW
            weights = [p for n, p in self.named_parameters() if n.endswith("weight")]
            biases = [p for n, p in self.named_parameters() if n.endswith("bias")]
            optimizer = cls([{"params": weights, "lr": 0.01, "weight_decay": 0.05},
                             {"params": biases, "lr": 0.02, "weight_decay": 0.0}], betas=(0.85, 0.99), eps=1e-6)
            return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.3)
        if self.optimizer_name == "adam_amsgrad":
            return torch.optim.Adam(self.parameters(), lr=0.01, amsgrad=True)
        if self.optimizer_name == "sgd_only":  # for a schedule from the DeepSpeed config
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return super().configure_optimizers()


class DigitsConfigureModel(Digits):
    """Layers built in ``configure_model`` (ZeRO-3: inside ``zero.Init``), same initial weights."""

    def __init__(self, seed: int = 0, optimizer: str = "sgd", hidden: int = 64):
        hookloop.Module.__init__(self)
        self.lr, self.seed, self.optimizer_name, self.hidden = 0.1, seed, optimizer, hidden
        self.last_logits = None
        self.lrs = []
        self.net = None
        self.partitioned_at_creation = None

    def configure_model(self):
        if self.net is not None:
            return
        torch.manual_seed(self.seed)  # the RNG state Digits(seed) builds its layers from
        self.net = nn.Sequential(nn.Linear(64, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 10))
        self.partitioned_at_creation = all(hasattr(p, "ds_id") and p.numel() == 0 for p in self.net.parameters())


class DigitsCheckpointed(Digits):
    """The second layer runs through activation checkpointing; the math is unchanged."""

    def __init__(self, seed: int = 0, optimizer: str = "sgd"):
        super().__init__(seed, optimizer)
        self.checkpoint_backend = None

    def forward(self, x):
        import hookloop_deepspeed

        if self.training and self.checkpoint_backend is None:
            self.checkpoint_backend = "deepspeed" if hookloop_deepspeed.activations.is_deepspeed_active() else "torch"
        hidden = self.net[1](self.net[0](x))
        if self.training:
            return hookloop_deepspeed.checkpoint(self.net[2], hidden)
        return self.net[2](hidden)


class DigitsManual(Digits):
    """Manual optimization: manual_backward is the engine's backward, step() its step."""

    def __init__(self, seed: int = 0, optimizer: str = "sgd", two_optimizers: bool = False):
        super().__init__(seed, optimizer)
        self.automatic_optimization = False
        self.two_optimizers = two_optimizers

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss

    def on_train_epoch_end(self):
        self.lr_schedulers().step()  # the loop steps no scheduler under manual optimization

    def configure_optimizers(self):
        if self.two_optimizers:
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]
        return super().configure_optimizers()


MODULES = {"digits": Digits, "configure_model": DigitsConfigureModel, "checkpointed": DigitsCheckpointed,
           "manual": DigitsManual}


class Recorder:
    """Observer: the loss of every micro-batch, and what the engine held at the end."""

    hookloop_name = "recorder"
    hookloop_role = "observer"

    def __init__(self, val_x, val_y, watch_dir: str | None = None):
        self.val_x, self.val_y = val_x, val_y
        self.watch_dir = watch_dir
        self.losses: list[float] = []
        self.result: dict = {"files_during_training": set()}

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        from hookloop_deepspeed import memory

        # The hyper-parameters of the optimizer the engine really steps, before any step.
        base = memory.base_optimizer(trainer.optimizer)
        self.result["optimizer_groups"] = [
            {k: g.get(k) for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")} for g in base.param_groups
        ]
        self.result["adamw_mode"] = getattr(base, "adam_w_mode", None)
        # The timeout gloo really holds for every collective of the group DeepSpeed uses.
        import torch.distributed as dist

        gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
        self.result["group_timeout_s"] = gloo.options._timeout.total_seconds()

    @hookloop.hookimpl
    def on_train_batch_end(self, loss):
        self.losses.append(float(loss))
        if self.watch_dir:  # what an NVMe offload keeps on disk while it trains
            files = self.result["files_during_training"]
            files.update(str(p.relative_to(self.watch_dir)) for p in Path(self.watch_dir).rglob("*") if p.is_file())

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        from hookloop_deepspeed import memory

        engine = trainer.model
        module = trainer.module
        result = self.result
        result["strategy"] = getattr(trainer.strategy, "hookloop_name", None)
        result["world_size"] = trainer.world_size
        result["global_step"] = trainer.global_step
        result["optimizer_type"] = type(memory.base_optimizer(trainer.optimizer)).__name__
        result["memory"] = memory.memory_report(trainer)
        result["param_numel_local"] = [p.numel() for p in module.parameters()]
        result["param_ds_numel"] = [getattr(p, "ds_numel", p.numel()) for p in module.parameters()]
        result["param_partition_numel"] = [
            p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in module.parameters()
        ]
        result["param_dtypes"] = sorted({str(p.dtype) for p in module.parameters()})
        if hasattr(engine, "bfloat16_enabled"):
            result["bf16"] = bool(engine.bfloat16_enabled())
            result["zero_stage"] = int(engine.zero_optimization_stage())
            result["cpu_offload"] = bool(engine.zero_cpu_offload())
        if not any(hasattr(p, "ds_tensor") for p in module.parameters()):  # not partitioned
            result["state_dict"] = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
        # The engine's predictions on the whole validation set (every rank takes part:
        # ZeRO-3 gathers the parameters for this forward).
        engine.eval()
        with torch.no_grad():
            engine("validate", (self.val_x, self.val_y), 0)
        result["val_logits"] = module.last_logits.clone()
        result["checkpoint_backend"] = getattr(module, "checkpoint_backend", None)
        result["partitioned_at_creation"] = getattr(module, "partitioned_at_creation", None)


def run(scenario: dict, out: Path) -> None:
    hookloop.seed_everything(scenario.get("global_seed", 0))
    train, val = digits_datasets()
    module = MODULES[scenario.get("module", "digits")](
        seed=scenario.get("seed", 0), optimizer=scenario.get("optimizer", "sgd"), **scenario.get("module_kwargs", {})
    )
    recorder = Recorder(*val.tensors, watch_dir=scenario.get("watch_dir"))
    strategy = scenario["strategy"]
    if isinstance(strategy, dict):  # options for the configurable entry point
        strategy = hookloop.plugin(strategy.pop("name"), **strategy)
    plugins = [strategy, *scenario.get("extra_plugins", []), recorder]
    trainer = hookloop.Trainer(plugins=plugins, devices=2, **scenario.get("trainer", {}))
    batch = scenario.get("batch_size", 32)
    start = time.perf_counter()
    if scenario.get("validate"):
        # A fresh module validated from a checkpoint: the weights must come from the file.
        (metrics,) = trainer.validate(module, DataLoader(val, batch_size=128), ckpt_path=scenario["ckpt_path"])
        result = {"callback_metrics": dict(metrics), "rank": trainer.global_rank, "seconds": time.perf_counter() - start}
        torch.save(result, out / f"{scenario['name']}.rank{trainer.global_rank}.pt")
        return
    try:
        trainer.fit(
            module,
            DataLoader(train, batch_size=batch, shuffle=True),
            DataLoader(val, batch_size=128),
            ckpt_path=scenario.get("ckpt_path"),
        )
    except hookloop.ConfigurationError as exc:
        if not scenario.get("expect_error"):
            raise
        # Refused at set-up on every rank alike: record the message, go on to the next.
        torch.save({"error": f"{type(exc).__name__}: {exc}", "rank": trainer.global_rank},
                   out / f"{scenario['name']}.rank{trainer.global_rank}.pt")
        return
    result = dict(recorder.result)
    result.update(
        error=None,
        losses=recorder.losses,
        lrs=module.lrs,
        callback_metrics=dict(trainer.callback_metrics),
        seconds=time.perf_counter() - start,
        rank=trainer.global_rank,
    )
    torch.save(result, out / f"{scenario['name']}.rank{trainer.global_rank}.pt")


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for scenario in spec:
        run(scenario, out)


if __name__ == "__main__":
    main()
