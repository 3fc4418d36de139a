"""Many fsdp checks in one 2-process run (process start-up is the expensive part).

Run by tests/test_fsdp.py as ``hookloop run --plugins fsdp --devices 2 fsdp_battery.py
OUT``. Every rank writes ``OUT/rank<R>.pt`` with what it observed; the test compares
those records with references: hookloop's ddp run in the same workers, the same model
built whole in one process, a collated checkpoint loaded into the plain model, numbers
worked out by hand.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hookloop  # noqa: E402
from clip_models import TinyGPT, tokens  # noqa: E402
from fsdp_models import Net, data  # noqa: E402
from hookloop_ddp import DDP  # noqa: E402
from hookloop_fsdp import memory_report  # noqa: E402

faulthandler.enable()
faulthandler.dump_traceback_later(400, exit=True)  # a hang fails with the stacks
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
record: dict = {}


def fsdp(**options):
    return hookloop.plugin("fsdp", **options)


def full(module) -> dict:
    """The module's weights as plain tensors: gathered by state_dict() under
    state_dict_type="full", plain already under ddp or after a full fit."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
            for k, v in module.state_dict().items()}


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def peak_rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1])
    return 0


def rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1])
    return 0


class Probe:
    """Records, in this rank, what the tests check while the run is on."""

    hookloop_name, hookloop_role = "probe", "observer"

    def __init__(self, memory: bool = False):
        self.memory = memory
        self.seen: dict = {"grad_kinds": []}

    @hookloop.hookimpl
    def setup(self, trainer):
        if self.memory:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak resident size restarts from the current one
            self.seen["rss_before"] = rss_kib()

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        if self.memory:
            self.seen["setup_peak_kib"] = peak_rss_kib() - self.seen["rss_before"]
            return  # and keep no copies of the weights
        self.seen["initial"] = full(trainer.module)
        self.seen["model_type"] = type(trainer.model).__name__
        self.seen["placements"] = {n: str(getattr(p, "placements", None)) for n, p in trainer.module.named_parameters()}
        self.seen["local_dtype"] = {n: str(local(p).dtype) for n, p in trainer.module.named_parameters()}

    @hookloop.hookimpl
    def on_after_backward(self, trainer):
        if self.memory:
            return
        if trainer.global_step == 0 and len(self.seen["grad_kinds"]) < 2:
            p = trainer.module.head.weight
            grad = p.grad
            self.seen["grad_kinds"].append((type(grad).__name__, None if grad is None else tuple(local(grad).shape)))

    @hookloop.hookimpl
    def on_before_optimizer_step(self, trainer):
        if self.memory:
            return
        if "grads" not in self.seen:
            self.seen["grads"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                                  for n, p in trainer.module.named_parameters()}
            self.seen["memory_step"] = memory_report(trainer)
        self.seen.setdefault("lrs", []).append(trainer.optimizers[0].param_groups[0]["lr"])

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        if self.memory:
            return
        self.seen["memory_end"] = memory_report(trainer)
        self.seen["local_shapes"] = {n: tuple(local(p).shape)
                                     for n, p in trainer.module.named_parameters()}
        self.seen["metrics"] = dict(trainer.callback_metrics)
        self.seen["final"] = full(trainer.module)


class SaveAtEnd:
    """Writes a checkpoint (every rank) when training ends."""

    hookloop_name, hookloop_role = "save_at_end", "observer"

    def __init__(self, path):
        self.path = path

    @hookloop.hookimpl
    def on_train_end(self, trainer):
        trainer.save_checkpoint(self.path)


def fit(strategy, module, probe=None, loader=None, val=None, ckpt_path=None, extra=(), **kwargs):
    kwargs.setdefault("max_epochs", 2)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("num_sanity_val_steps", 0)
    plugins = [strategy] + ([probe] if probe is not None else []) + list(extra)
    trainer = hookloop.Trainer(plugins=plugins, **kwargs)
    loader = loader or DataLoader(data(), batch_size=8, shuffle=True)
    trainer.fit(module, loader, val, ckpt_path=ckpt_path)
    assert not dist.is_initialized(), "the strategy must destroy the process group it made"
    return trainer, module


# ---------------------------------------------------------------------------------------
# Parity with ddp: SGD and Adam, accumulation, clipping, a step LR schedule
# ---------------------------------------------------------------------------------------

PARITY = dict(accumulate_grad_batches=2, gradient_clip_val=0.3)
VAL = DataLoader(data(32, seed=2), batch_size=8)
record["parity"] = {}
for optimizer in ("sgd", "adam"):
    runs = {"ddp": DDP()}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        runs[strategy] = fsdp(sharding_strategy=strategy, auto_wrap_policy={"Block"})
    runs["FULL_SHARD+offload"] = fsdp(cpu_offload=True, auto_wrap_policy=100)  # size-based units
    for name, strategy in runs.items():
        probe = Probe()
        trainer, module = fit(strategy, Net(seed=RANK, optimizer=optimizer), probe, val=VAL, **PARITY)
        record["parity"][(optimizer, name)] = {
            "final": full(module), "lrs": probe.seen["lrs"], "metrics": probe.seen["metrics"],
            "grad_kinds": probe.seen["grad_kinds"], "placements": probe.seen["placements"],
            "param_types": {k: type(v).__name__ for k, v in module.state_dict().items()},
            "model_after": type(trainer.model).__name__, "model_during": probe.seen["model_type"],
        }

# Clipping (issue 33): nanoGPT's optimizer (two groups), torch's clip_grad_norm_ over the
# DTensor gradients in the module's order; the test compares one process's loop.
trainer, module = fit(fsdp(auto_wrap_policy={"Block"}), TinyGPT(seed=RANK, optimizer="sgd"), max_epochs=1,
                      gradient_clip_val=0.5, loader=DataLoader(tokens(32), batch_size=2, shuffle=True))
record["clipped"] = full(module)

# state_dict_type="full": hookloop's file, written in the run and after it (the module and
# optimizer gathered at teardown), with optimizer.state_dict()'s form.
trainer = hookloop.Trainer(plugins=[fsdp(auto_wrap_policy={"Block"}), SaveAtEnd(OUT / "full_in_run.ckpt")],
                           max_epochs=1, enable_checkpointing=False, num_sanity_val_steps=0)
module = Net(seed=RANK, optimizer="adam")
trainer.fit(module, DataLoader(data(), batch_size=8, shuffle=True))
trainer.save_checkpoint(OUT / "full_after_fit.ckpt")
record["full_final"] = full(module)

# ---------------------------------------------------------------------------------------
# What each rank holds: FULL_SHARD vs NO_SHARD (Adam, a wider model)
# ---------------------------------------------------------------------------------------

record["memory"] = {}
for strategy in ("FULL_SHARD", "NO_SHARD"):
    probe = Probe()
    fit(fsdp(sharding_strategy=strategy, auto_wrap_policy={"Block"}), Net(optimizer="adam", width=64), probe,
        max_epochs=1)
    record["memory"][strategy] = {k: probe.seen[k] for k in ("memory_step", "memory_end", "local_shapes")}

# ---------------------------------------------------------------------------------------
# Meta-device creation: the same weights as normal construction, less memory on rank 0
# ---------------------------------------------------------------------------------------

probe = Probe()
fit(fsdp(auto_wrap_policy={"Block"}), Net(seed=7 + RANK, lazy=True), probe, max_steps=1)
record["meta_initial"] = probe.seen["initial"]
record["meta_local_shapes"] = probe.seen["local_shapes"]
record["setup_peak_kib"] = {}
BIG = dict(width=1024, layers=8, lazy=True)  # ~7.4 M parameters: 29 MB whole, 15 MB per rank
for label, meta in (("normal", False), ("meta", True)):
    probe = trainer = module = None
    gc.collect()  # what earlier runs left must not be freed during this one's set-up
    probe = Probe(memory=True)
    fit(fsdp(auto_wrap_policy={"Block"}, meta_init=meta), Net(**BIG), probe, max_steps=1,
        loader=DataLoader(data(32), batch_size=8))
    record["setup_peak_kib"][label] = probe.seen["setup_peak_kib"]

# ---------------------------------------------------------------------------------------
# Sharded checkpoints: straight run, interrupted run, resume on 2 processes
# ---------------------------------------------------------------------------------------


def unshuffled():
    # In order: the loader's own DistributedSampler (a training loader is otherwise shuffled
    # under several processes, as in Lightning), so one process on batches of 16 is the same run
    sampler = DistributedSampler(data(), num_replicas=int(os.environ["WORLD_SIZE"]), rank=RANK, shuffle=False)
    return DataLoader(data(), batch_size=8, sampler=sampler)


class Weights:
    """The one-liner of the README: a plain state dict while a run is on (here in
    ``validate`` after ``fit``, which re-attaches the shards the module kept)."""

    hookloop_name, hookloop_role = "weights", "observer"

    @hookloop.hookimpl
    def on_validation_end(self, trainer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(trainer.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        record["weights_in_run"] = {k: v.clone() for k, v in state.items()}  # rank 0 only; others {}


SHARDED = dict(state_dict_type="sharded", auto_wrap_policy={"Block"})
probe = Probe()
trainer = hookloop.Trainer(plugins=[fsdp(**SHARDED), SaveAtEnd(OUT / "final.ckpt"), Weights(), probe], max_epochs=2,
                           enable_checkpointing=False, num_sanity_val_steps=0)
module = Net(seed=RANK, optimizer="adam")
trainer.fit(module, unshuffled())
record["straight"] = probe.seen["final"]
record["straight_step"] = trainer.global_step
record["after_fit_types"] = {k: type(v).__name__ for k, v in module.state_dict().items()}
record["after_fit_local_shapes"] = {k: tuple(v.to_local().shape) for k, v in module.state_dict().items()}
trainer.save_checkpoint(OUT / "after_fit.ckpt")  # after fit: no process group; every rank calls it
assert not dist.is_initialized()
record["predictions"] = torch.cat(trainer.predict(module, DataLoader(data(16, seed=3), batch_size=4)))
record["validate_after_fit"] = trainer.validate(module, VAL, verbose=False)

trainer = hookloop.Trainer(plugins=[fsdp(**SHARDED), SaveAtEnd(OUT / "mid.ckpt")], max_steps=6, max_epochs=2,
                           enable_checkpointing=False, num_sanity_val_steps=0)
trainer.fit(Net(seed=RANK, optimizer="adam"), unshuffled())
record["interrupted_step"] = trainer.global_step
probe = Probe()
trainer, module = fit(fsdp(**SHARDED), Net(seed=50 + RANK, optimizer="adam"), probe, loader=unshuffled(),
                      ckpt_path=OUT / "mid.ckpt")
record["resumed_2"] = probe.seen["final"]
record["resumed_2_step"] = trainer.global_step
# A state_dict_type="full" run resumes from the sharded directory too.
probe = Probe()
trainer, module = fit(fsdp(auto_wrap_policy={"Block"}), Net(seed=50 + RANK, optimizer="adam"), probe,
                      loader=unshuffled(), ckpt_path=OUT / "mid.ckpt", default_root_dir=str(OUT / "full"))
record["resumed_full_from_sharded"] = full(module)

# ---------------------------------------------------------------------------------------
# Activation checkpointing: the same gradients with and without it
# ---------------------------------------------------------------------------------------

record["ac"] = {}
for label, policy in (("plain", None), ("checkpointed", {"Block"})):
    probe = Probe()
    trainer, module = fit(fsdp(auto_wrap_policy={"Block"}, activation_checkpointing_policy=policy),
                          Net(seed=3, optimizer="adam"), probe, max_epochs=1)
    record["ac"][label] = {"grads": probe.seen["grads"], "final": full(module),
                           "calls": [b.calls for b in module.blocks]}

# ---------------------------------------------------------------------------------------
# Precision handed over to the strategy
# ---------------------------------------------------------------------------------------

record["precision"] = {}
for precision, extra in (("32", {}), ("bf16-mixed", {}), ("bf16-true", {}), ("16-mixed", {"allow_cpu_fp16": True})):
    probe = Probe()
    trainer, module = fit(fsdp(auto_wrap_policy={"Block"}, **extra), Net(seed=3), probe, precision=precision,
                          max_epochs=1, extra=[SaveAtEnd(OUT / f"precision-{precision}.ckpt")])
    record["precision"][precision] = {
        "final": full(module), "compute_dtypes": sorted({str(d) for d in module.dtypes}),
        "local_dtype": probe.seen["local_dtype"], "metrics": probe.seen["metrics"],
    }

# ---------------------------------------------------------------------------------------
# Manual optimization: parity with ddp
# ---------------------------------------------------------------------------------------


class ManualNet(Net):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        for _ in range(2):  # two steps on the batch: the second forward sees the first step
            loss = torch.nn.functional.cross_entropy(self(x), y)
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return loss


record["manual"] = {}
for name, strategy in (("ddp", DDP()), ("fsdp", fsdp(auto_wrap_policy={"Block"}))):
    _, module = fit(strategy, ManualNet(seed=RANK), max_epochs=1)
    record["manual"][name] = full(module)

torch.save(record, OUT / f"rank{RANK}.pt")
