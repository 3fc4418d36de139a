"""Every horovod check that needs real workers, in one launch (tests/test_horovod.py).

    python tests/scripts/horovod_checks.py OUT horovod   # re-launches itself through horovodrun
    python tests/scripts/horovod_checks.py OUT ddp       # the same runs under hookloop-ddp
    python tests/scripts/horovod_checks.py OUT rescale   # one process: resume OUT's checkpoint
    horovodrun -np 2 -H localhost:2 --gloo python tests/scripts/horovod_checks.py OUT byhand

The first ``fit`` with ``devices=2`` re-launches this script through the strategy's
launcher; the launching process exits there with the workers' status. Each worker runs
every scenario; rank 0 saves the trained weights as ``OUT/<strategy>_<scenario>.pt`` and
each rank writes what it observed to ``OUT/<strategy>_rank<r>.json``. The test compares
them with references it computes itself.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest
from conftest import TinyModule, tiny_data  # noqa: E402
from test_lightning_module import ManualTiny  # noqa: E402

import hookloop  # noqa: E402

OUT = Path(sys.argv[1])
STRATEGY = sys.argv[2]
EPOCHS, BATCH, SAMPLES = 2, 8, 96
observed: dict = {}


def loader() -> DataLoader:
    return DataLoader(tiny_data(SAMPLES), batch_size=BATCH, shuffle=True)


def trainer(strategy_options: dict | None = None, devices: int = 2, extra_plugins=(), **kw) -> hookloop.Trainer:
    options = {}
    if STRATEGY in ("horovod", "rescale", "byhand"):
        options["horovod"] = {"scale_lr": False, **(strategy_options or {})}
    if kw.get("precision") == "16-mixed":
        options["amp"] = {"allow_cpu_fp16": True}  # the GradScaler path, on CPU
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("max_epochs", EPOCHS)
    kw.setdefault("default_root_dir", str(OUT / "runs"))
    strategy = "horovod" if STRATEGY in ("rescale", "byhand") else STRATEGY
    return hookloop.Trainer(plugins=[strategy, *extra_plugins], devices=devices, plugin_options=options, **kw)


def save(name: str, t: hookloop.Trainer, module: TinyModule, every_rank: bool = False) -> None:
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if every_rank:
        torch.save(weights, OUT / f"{STRATEGY}_{name}_rank{t.global_rank}.pt")
    elif t.global_rank == 0:
        torch.save(weights, OUT / f"{STRATEGY}_{name}.pt")


def launcher_rank() -> int:
    """This worker's rank as its launcher announced it (0 in the launching process)."""
    return int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")))


class RankLogger(TinyModule):
    """Logs rank + 1 with every reduce op, to check sync_dist."""

    def validation_step(self, batch, batch_idx):
        value = torch.tensor(float(self.trainer.global_rank + 1))
        for op in ("mean", "sum", "max", "min"):
            self.log(f"rank_{op}", value, sync_dist=True, reduce_op=op)


def parity_scenarios() -> hookloop.Trainer:
    """Runs that hookloop-ddp must reproduce: scale_lr off, same seed, same data."""
    # plain momentum SGD, every rank initialised differently: the strategy must start
    # them all from rank 0's weights. This first fit re-launches the script.
    t = trainer()
    module = TinyModule(seed=launcher_rank())
    t.fit(module, loader())
    save("plain", t, module)
    save("plain", t, module, every_rank=True)
    observed.update(world_size=t.world_size, rank=t.global_rank, device=str(t.root_device),
                    optimizer=type(t.optimizer).__module__, model=type(t.model).__name__)

    # accumulation over 4 micro-batches (6 per epoch: an uneven last window), clipping
    # of the averaged gradients, and an epoch scheduler
    t = trainer(accumulate_grad_batches=4, gradient_clip_val=0.5)
    module = TinyModule(seed=0, scheduler=True)
    t.fit(module, loader())
    save("accum_clip", t, module)
    observed["accum_clip_steps"] = t.global_step

    # hookloop-amp: bf16 autocast, and fp16 with the GradScaler plus clipping
    t = trainer(precision="bf16-mixed")
    module = TinyModule(seed=0)
    t.fit(module, loader())
    save("bf16", t, module)
    t = trainer(precision="16-mixed", gradient_clip_val=0.5)
    module = TinyModule(seed=0)
    t.fit(module, loader())
    save("fp16_clip", t, module)
    observed["amp_plugins"] = sorted(getattr(p, "hookloop_name", type(p).__name__) for p in t.plugins
                                     if hookloop.contract.registry.plugin_role(p) != "observer")  # not the built-in ones

    # manual optimization: manual_backward and step() through the strategy (Horovod's
    # DistributedOptimizer / DDP's reducer) and the GradScaler must reproduce fp16_clip
    t = trainer(precision="16-mixed")
    module = ManualTiny(clip=0.5, seed=0)
    t.fit(module, loader())
    save("manual_fp16_clip", t, module)

    # the same module fitted twice (a new Trainer and optimizer each time): the first
    # run's optimizer must not interfere with the second one's
    module = TinyModule(seed=0)
    for _ in range(2):
        t = trainer(max_epochs=1)
        t.fit(module, loader())
    save("refit", t, module)
    return t


def horovod_scenarios() -> None:
    # lr scaling on (the default), with a scheduler whose base rate must scale too
    lrs = []

    class Recorder:
        hookloop_name = "lr_recorder"
        hookloop_role = "observer"

        @hookloop.hookimpl
        def on_train_epoch_start(self, trainer):
            lrs.append(trainer.optimizer.param_groups[0]["lr"])

    t = trainer({"scale_lr": True}, extra_plugins=[Recorder()])
    module = TinyModule(seed=0, scheduler=True)
    t.fit(module, loader())
    save("scaled", t, module)
    observed["scaled_epoch_lrs"] = lrs
    observed["scaled_base_lrs"] = list(t.lr_scheduler.base_lrs)

    # resume: stop mid-epoch at step 9 with a checkpoint, resume a differently
    # initialised module from it; it must end where the uninterrupted run ended
    t = trainer({"scale_lr": True}, max_steps=9, enable_checkpointing=True, default_root_dir=str(OUT / "resume"))
    t.fit(TinyModule(seed=0, scheduler=True), loader())
    t = trainer({"scale_lr": True}, enable_checkpointing=True, default_root_dir=str(OUT / "resumed"))
    module = TinyModule(seed=5, scheduler=True)
    t.fit(module, loader(), ckpt_path=str(OUT / "resume" / "logs" / "version_0" / "checkpoints" / "last.ckpt"))
    save("resumed", t, module)
    observed["resumed_step"] = t.global_step

    # fp16 gradient compression
    t = trainer({"compression": "fp16"})
    module = TinyModule(seed=0)
    t.fit(module, loader())
    save("compressed", t, module)

    # collectives through the hooks, and sync_dist through self.log
    (metrics,) = trainer().validate(RankLogger(), DataLoader(tiny_data(4), batch_size=2))
    observed["sync_dist"] = {k: v for k, v in metrics.items() if k.startswith("rank_")}
    rank = t.global_rank
    value = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    observed["reduce"] = {op: t.reduce(value, op).tolist() for op in ("mean", "sum", "max", "min")}
    observed["broadcast_from_0"] = t.broadcast({"from": rank} if rank == 0 else None, src=0)
    observed["broadcast_from_1"] = t.broadcast(["rank1"] if rank == 1 else None, src=1)
    t.barrier("end")


def rescale_scenario() -> None:
    """One worker resumes the two-worker checkpoint: its lr scaled by 2 becomes scaled by 1."""
    saved = torch.load(OUT / "resume" / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    t = trainer({"scale_lr": True}, devices=1, max_steps=9)  # stop right after restoring
    t.fit(TinyModule(seed=0, scheduler=True), loader(), ckpt_path=str(OUT / "resume" / "logs" / "version_0" / "checkpoints" / "last.ckpt"))
    observed.update(
        world_size=t.world_size,
        saved_lr=saved["optimizer_states"][0]["param_groups"][0]["lr"],
        saved_base_lrs=saved["lr_schedulers"][0]["base_lrs"],
        lr=t.optimizer.param_groups[0]["lr"],
        base_lrs=list(t.lr_scheduler.base_lrs),
    )


def byhand_scenario() -> None:
    """Under a horovodrun started by hand, devices=2 trains in place (no nested launch)."""
    t = trainer()
    module = TinyModule(seed=0)
    t.fit(module, loader())
    save("plain", t, module)
    observed.update(world_size=t.world_size, rank=t.global_rank)


if __name__ == "__main__":
    # A hung collective shows where it hung instead of running into the test's timeout.
    faulthandler.dump_traceback_later(int(os.environ.get("HOROVOD_CHECKS_WATCHDOG", 240)), exit=True)
    OUT.mkdir(parents=True, exist_ok=True)
    if STRATEGY == "rescale":
        rescale_scenario()
    elif STRATEGY == "byhand":
        byhand_scenario()
    else:
        parity_scenarios()
        if STRATEGY == "horovod":
            horovod_scenarios()
    rank = observed.get("rank", 0)
    (OUT / f"{STRATEGY}_rank{rank}.json").write_text(json.dumps(observed))
