"""Many ddp checks in one 2-process run (process start-up is the expensive part).

Run by tests/test_ddp.py as ``hookloop run --plugins ddp --devices 2 ddp_battery.py OUT``.
Every rank writes ``OUT/rank<R>.pt`` with what it observed; the test compares those
records with references computed by hand (here with torch's own DDP, or in the test).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, WeightedRandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hookloop  # noqa: E402
from conftest import TinyModule, tiny_data  # noqa: E402
from clip_models import TinyGPT, nanogpt_optimizer, tokens  # noqa: E402
from hookloop_ddp import DDP  # noqa: E402

# A hang must fail the test with the stacks, not leave orphaned workers behind.
faulthandler.enable()  # a crash (SIGABRT, SIGSEGV) prints every thread's stack
faulthandler.dump_traceback_later(240, exit=True)
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
DATA = tiny_data(96)
EPOCHS, BATCH = 2, 8  # 96 / 2 ranks / 8 = 6 steps per epoch
record: dict = {}


def state(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------------------------
# References: hand-written torch DDP loops, in a process group of their own
# ---------------------------------------------------------------------------------------


def bf16_allreduce(_, bucket):
    """torch's bf16_compress_hook, which only registers with NCCL, written out for gloo."""
    grads = bucket.buffer()
    half = grads.to(torch.bfloat16) / WORLD
    return dist.all_reduce(half, async_op=True).get_future().then(lambda f: grads.copy_(f.value()[0]))


def raw_ddp(comm_hook: str | None = None, epochs: int = EPOCHS) -> dict:
    module = TinyModule(seed=0)
    model = DistributedDataParallel(module)
    optimizer = module.configure_optimizers()
    if comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif comm_hook == "bf16":
        model.register_comm_hook(None, bf16_allreduce)
    elif comm_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        model.register_comm_hook(powersgd.PowerSGDState(None, start_powerSGD_iter=2), powersgd.powerSGD_hook)
    elif comm_hook == "post_localsgd":
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as localsgd
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        subgroup, _ = dist.new_subgroups(group_size=1)
        model.register_comm_hook(localsgd.PostLocalSGDState(None, subgroup, start_localSGD_iter=4), localsgd.post_localSGD_hook)
        averager = PeriodicModelAverager(period=3, warmup_steps=4)
    sampler = DistributedSampler(DATA, num_replicas=WORLD, rank=RANK, shuffle=True, seed=0)
    loader = DataLoader(DATA, batch_size=BATCH, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            if comm_hook == "post_localsgd":  # after the step, while the gradients exist
                averager.average_parameters(model.parameters())
            optimizer.zero_grad(set_to_none=True)
    return state(module)


def raw_ddp_clipped(clip: float) -> dict:
    """nanoGPT's loop under torch's DDP: clip_grad_norm_(model.parameters(), clip) after
    the all-reduce, AdamW over nanoGPT's two groups (tests/scripts/clip_models.py)."""
    module = TinyGPT(seed=0)
    model, optimizer = DistributedDataParallel(module), nanogpt_optimizer(module)
    sampler = DistributedSampler(CLIP_DATA, num_replicas=WORLD, rank=RANK, shuffle=True, seed=0)  # hookloop's
    for x, y in DataLoader(CLIP_DATA, batch_size=2, sampler=sampler):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return state(module)


CLIP_DATA = tokens(64)
dist.init_process_group("gloo")
record["raw"] = {hook: raw_ddp(hook) for hook in (None, "fp16", "bf16", "powersgd", "post_localsgd")}
record["raw_clipped"] = raw_ddp_clipped(0.5)
# The wrappers' C++ reducers hold the group: collect them while the registry still does,
# so the group is not destroyed later, with the GIL held, under a gloo thread that needs it
# (what hookloop_ddp.strategy._retire guards against for the plugin's own groups).
gc.collect()
dist.destroy_process_group()
assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------
# hookloop runs; every Trainer makes (and destroys) its own process group
# ---------------------------------------------------------------------------------------


def fit(module=None, loader=None, val=None, plugin=None, ckpt_path=None, **kwargs):
    kwargs.setdefault("max_epochs", EPOCHS)
    kwargs.setdefault("enable_checkpointing", False)
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    module = TinyModule(seed=RANK) if module is None else module  # DDP must broadcast rank 0's
    loader = DataLoader(DATA, batch_size=BATCH, shuffle=True) if loader is None else loader
    trainer = hookloop.Trainer(**kwargs)
    trainer.fit(module, loader, val, ckpt_path=ckpt_path)
    assert not dist.is_initialized(), "the plugin must destroy the process group it made"
    return trainer, module


class Ranks:
    """Records what the loop trains while it trains (teardown unwraps the model)."""

    hookloop_name, hookloop_role = "ranks", "observer"

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        record["ranks"] = dict(
            world_size=trainer.world_size, global_rank=trainer.global_rank, local_rank=trainer.local_rank,
            node_rank=trainer.node_rank, root_device=str(trainer.root_device), model_type=type(trainer.model).__name__,
        )


# Parity, ranks and devices.
trainer, module = fit(plugins=["ddp", Ranks()])
record["hookloop"] = state(module)
record["unwrapped_after_fit"] = type(trainer.model).__name__

# Checkpoints: rank 0 writes, no rank reads early, keys are the plain module's.
root = OUT / "ckpt"
trainer, module = fit(default_root_dir=str(root), enable_checkpointing=True)
saved = torch.load(root / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)  # right after fit, every rank
record["ckpt_read_diff"] = max(float((saved["state_dict"][k] - v).abs().max()) for k, v in module.state_dict().items())
record["ckpt_state"] = state(module)

# Resume under ddp: 1 epoch, then a new Trainer and module resume for the second.
root = OUT / "resume"
fit(max_epochs=1, default_root_dir=str(root), enable_checkpointing=True)
trainer, module = fit(module=TinyModule(seed=7 + RANK), max_epochs=2, default_root_dir=str(root),
                      ckpt_path=str(root / "logs" / "version_0" / "checkpoints" / "last.ckpt"))
record["resumed"] = state(module)
record["resumed_step"] = trainer.global_step


# Gradient accumulation: no_sync on the first micro-batch of each window, so the
# (counting) communication hook runs once per optimizer step.
def counting_allreduce(counter, bucket):
    counter["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


counter = {"calls": 0}
accumulate_data = tiny_data(32)
module = TinyModule(seed=0, momentum=0.0)
trainer, module = fit(
    module=module, loader=DataLoader(accumulate_data, batch_size=4, shuffle=True), max_epochs=1,
    accumulate_grad_batches=2, plugin=DDP(comm_hook=counting_allreduce, comm_state=counter),
)
record["accumulated"] = state(module)
record["accumulate_calls"], record["accumulate_steps"] = counter["calls"], trainer.global_step

# Clipping (issue 33): in the module's order, as the hand-written DDP loop above.
record["clipped"] = state(fit(module=TinyGPT(seed=RANK), loader=DataLoader(CLIP_DATA, batch_size=2), max_epochs=1,
                              gradient_clip_val=0.5)[1])

# global_batch_size (issue 33): 16 samples a step = 4 per batch x 2 processes x 2 accumulated.
trainer, module = fit(loader=DataLoader(tiny_data(32), batch_size=4), global_batch_size=16)
record["global_batch"] = {"state": state(module), "accumulate": trainer.accumulate_grad_batches,
                          "steps": trainer.global_step}

# Communication hooks.
for hook in ("fp16", "bf16"):
    record[hook] = state(fit(plugin=DDP(comm_hook=hook))[1])
record["post_localsgd"] = state(fit(plugin=DDP(
    comm_hook="post_localsgd", localsgd_start_iter=4, model_averaging_period=3, localsgd_group_size=1))[1])
# PowerSGD: 2 epochs straight, and 1 epoch + save + resume; the state must survive.
record["powersgd"] = state(fit(plugin=DDP(comm_hook="powersgd", powersgd_start_iter=2))[1])
root = OUT / "powersgd"
fit(plugin=DDP(comm_hook="powersgd", powersgd_start_iter=2), max_epochs=1,
    default_root_dir=str(root), enable_checkpointing=True)
powersgd_ckpt = torch.load(root / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
saved = powersgd_ckpt["plugins"]["ddp"]["comm_hook"]
record["powersgd_saved"] = {"hook": saved["hook"], "iter": saved["iter"], "ranks": len(saved["ranks"]),
                            "residuals_differ": not torch.equal(*(r["net.0.weight"]["error"] for r in saved["ranks"]))}
record["powersgd_resumed"] = state(fit(plugin=DDP(comm_hook="powersgd", powersgd_start_iter=2), default_root_dir=str(root),
                                       ckpt_path=str(root / "logs" / "version_0" / "checkpoints" / "last.ckpt"))[1])


# Extension points: a subclass with its own rendezvous (a file store) and wrapper.
class CountingDDP(DistributedDataParallel):
    forwards = 0

    def forward(self, *args, **kwargs):
        CountingDDP.forwards += 1
        return super().forward(*args, **kwargs)


class FileStoreDDP(DDP):
    calls: list = []

    def init_process_group(self, trainer):
        self.calls.append(("init", trainer.global_rank, trainer.world_size))
        store = dist.FileStore(str(OUT / "filestore"), trainer.world_size)
        dist.init_process_group("gloo", store=store, rank=trainer.global_rank, world_size=trainer.world_size)

    def configure_ddp(self, trainer, model):
        self.calls.append(("wrap", type(model).__name__))
        return CountingDDP(model)


trainer, module = fit(plugin=FileStoreDDP())
record["subclass"] = state(module)
record["subclass_calls"] = FileStoreDDP.calls
record["subclass_forwards"] = CountingDDP.forwards


# Samplers and sync_dist, observed from inside the steps.
class IndexData(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class IndexStream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(10.0).unsqueeze(1))


class Probe(hookloop.Module):
    """Records the sample indices every step sees; logs rank-dependent metrics."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen = {"train": {}, "val": []}

    def training_step(self, x, batch_idx):
        self.seen["train"].setdefault(self.trainer.current_epoch, []).extend(int(i) for i in x.flatten())
        self.log("step_max", RANK + 1.0, sync_dist=True, reduce_op="max")
        return self.layer(x).mean()

    def validation_step(self, x, batch_idx):
        self.seen["val"].extend(int(i) for i in x.flatten())
        r = RANK + 1.0
        self.log("x_mean", x.mean(), sync_dist=True)
        self.log("x_mean_local", x.mean())
        self.log("r_mean", r, sync_dist=True)
        self.log("r_sum", r, sync_dist=True, reduce_op="sum")
        self.log("r_max", r, sync_dist=True, reduce_op="max")
        self.log("r_min", r, sync_dist=True, reduce_op="min")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Collectives:
    """An observer plugin using the trainer's collectives while the group is up."""

    hookloop_name, hookloop_role = "collectives", "observer"

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        record["broadcast"] = trainer.broadcast(f"from rank {trainer.global_rank}", src=0)
        record["broadcast_none"] = trainer.broadcast(None if trainer.global_rank == 0 else "x", src=0)
        record["broadcast_src1"] = trainer.broadcast(f"from rank {trainer.global_rank}", src=1)
        trainer.barrier("probe")
        record["reduce"] = {op: trainer.reduce(torch.tensor(RANK + 1.0), op).item() for op in ("mean", "sum", "max", "min")}
        record["reduce_int_mean"] = trainer.reduce(torch.tensor(RANK + 2), "mean").item()


probe = Probe()
trainer = hookloop.Trainer(max_epochs=2, enable_checkpointing=False, plugins=["ddp", Collectives()])
trainer.fit(probe, DataLoader(IndexData(20), batch_size=3, shuffle=True), DataLoader(IndexData(20), batch_size=3))
record["shuffled"] = probe.seen
record["metrics"] = dict(trainer.callback_metrics)

weights = torch.zeros(20)
weights[::2] = 1.0  # odd indices can never be drawn
probe = Probe()
trainer = hookloop.Trainer(max_epochs=1, enable_checkpointing=False)
trainer.fit(probe, DataLoader(IndexData(20), batch_size=4, sampler=WeightedRandomSampler(weights, 16)),
            DataLoader(IndexStream(), batch_size=4))
record["weighted"] = probe.seen

probe = Probe()
trainer = hookloop.Trainer(max_epochs=1, enable_checkpointing=False, use_distributed_sampler=False)
trainer.fit(probe, DataLoader(IndexData(20), batch_size=5))
record["opt_out"] = probe.seen

# Bad input inside the workers: more processes than devices name.
errors = {}
for devices in ([0], 3):
    try:
        hookloop.Trainer(devices=devices, max_epochs=1, enable_checkpointing=False).fit(TinyModule(), DataLoader(DATA, batch_size=8))
    except hookloop.ConfigurationError as exc:
        errors[str(devices)] = str(exc)
record["errors"] = errors

torch.save(record, OUT / f"rank{RANK}.pt")
