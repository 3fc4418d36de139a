"""The runs a strategy's conformance tests make, in the strategy's own processes.

    hookloop run --plugins NAME --devices N path/to/worker.py OUT SPEC.json

Started through the strategy's launcher (torchrun, horovodrun, or the spawning plugin's
own), it trains :class:`~hookloop.testing.reference.TinyClassifier` a few times; an
observer plugin records, in every rank, what the conformance tests check, and writes
``OUT/<run>.rank<R>.pt`` when the rank's run ends (after the strategy's teardown).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.testing.reference import TinyClassifier, tiny_dataset, weights


def launcher_rank() -> int:
    """The rank this process's launcher announced (0 in a process that spawns its own)."""
    for name in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


class Recorder:
    """Records what the conformance tests check, in the rank that observes it."""

    hookloop_name = "conformance_recorder"
    hookloop_role = "observer"

    def __init__(self, out: str, run: str, collectives: bool = False, checkpoint_dir: str | None = None):
        self.out, self.run, self.collectives, self.checkpoint_dir = out, run, collectives, checkpoint_dir
        self.record: dict = {}

    def weights(self, module) -> dict:
        """The module's weights; for the wide model (~34 MiB) a digest of each tensor's bytes."""
        found = weights(module)
        if not self.run.startswith("wide"):
            return found
        import hashlib

        return {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in found.items()}

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        self.record.update(rank=trainer.global_rank, world_size=trainer.world_size,
                           initial=self.weights(trainer.module))

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        module = trainer.module
        self.record.update(final=self.weights(module), seen_train=list(module.seen_train),
                           seen_val=list(module.seen_val), global_step=trainer.global_step,
                           metrics=dict(trainer.callback_metrics))
        if self.collectives:
            rank = trainer.global_rank
            value = torch.tensor([float(rank + 1), -float(rank)])
            self.record["reduce"] = {op: trainer.reduce(value.clone(), op).tolist() for op in ("mean", "sum", "max", "min")}
            last = trainer.world_size - 1
            self.record["broadcast"] = trainer.broadcast({"from": rank, "data": [rank] * 3}, src=last)
            self.record["broadcast_none"] = trainer.broadcast(None if rank == 0 else "x", src=0)
            trainer.barrier("conformance")
            self.record["gathered"] = trainer.all_gather_object(rank * 10)
        if self.checkpoint_dir is not None:
            path = Path(self.checkpoint_dir) / "saved.ckpt"
            trainer.save_checkpoint(path)
            # Every rank reads what one rank wrote: after save_checkpoint returns it is complete.
            self.record["checkpoint_is_dir"] = path.is_dir()
            if path.is_file():
                saved = torch.load(path, map_location="cpu", weights_only=True)
                self.record["checkpoint_keys"] = sorted(saved["state_dict"])
                self.record["checkpoint_weights"] = {k: v.float() for k, v in saved["state_dict"].items()}
            self.record["checkpoint_files"] = sorted(p.name for p in Path(self.checkpoint_dir).iterdir())

    @hookloop.hookimpl
    def on_train_end(self, trainer):
        """DDP's gradient buckets, if the strategy wraps in DistributedDataParallel."""
        logging_data = getattr(trainer.model, "_get_ddp_logging_data", None)
        if callable(logging_data):
            data = logging_data()  # the buckets DDP rebuilt after its first step, else its first ones
            sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
            self.record["ddp_buckets"] = len([s for s in sizes.split(",") if s.strip()])

    @hookloop.hookimpl(trylast=True)
    def teardown(self, trainer):
        """After every other plugin's teardown (trylast): what the strategy left behind."""
        import torch.distributed as dist

        self.record["process_group_left"] = dist.is_available() and dist.is_initialized()
        self.record["model_after"] = type(trainer.model).__name__
        self.record["module_is_model_or_inside_it"] = trainer.model is trainer.module or getattr(trainer.model, "module", None) is trainer.module
        rank = self.record.get("rank", trainer.global_rank)
        torch.save(self.record, Path(self.out) / f"{self.run}.rank{rank}.pt")


class WideClassifier(TinyClassifier):
    """TinyClassifier's task on a model of ~34 MiB (two 2048x2048 layers), more than
    DDP's 25 MiB bucket: its gradients are reduced in several buckets."""

    def __init__(self, seed: int = 0, lr: float = 0.01, momentum: float = 0.9):
        super().__init__(seed, lr, momentum)
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                       torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                       torch.nn.Linear(2048, 3))


def main() -> None:
    out, spec = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    batch, epochs = spec["batch_size"], spec["epochs"]
    train = tiny_dataset(spec["samples"])
    val = tiny_dataset(spec["samples"] // 2, seed=2)

    def trainer(run: str, **kw) -> hookloop.Trainer:
        recorder = Recorder(out, run, collectives=kw.pop("collectives", False), checkpoint_dir=kw.pop("checkpoint_dir", None))
        kw.setdefault("enable_checkpointing", False)
        kw.setdefault("num_sanity_val_steps", 0)
        kw.setdefault("max_epochs", epochs)
        return hookloop.Trainer(plugins=[recorder], devices=spec["devices"], plugin_options=spec["options"], **kw)

    def loaders():
        return DataLoader(train, batch_size=batch), DataLoader(val, batch_size=batch)

    seed = 10 + launcher_rank()  # different on every rank: the strategy must broadcast rank 0's
    root = Path(out)
    trainer("fit", collectives=True, checkpoint_dir=str(root / "checkpoint")).fit(TinyClassifier(seed=seed), *loaders())
    trainer("accumulate", accumulate_grad_batches=2, max_epochs=1).fit(TinyClassifier(seed=seed), *loaders())
    # Interrupted mid-epoch with a checkpoint, then resumed by a module with other weights.
    trainer("interrupted", max_steps=spec["resume_at"], enable_checkpointing=True,
            default_root_dir=str(root / "resume")).fit(TinyClassifier(seed=seed), *loaders())
    trainer("resumed", enable_checkpointing=True, default_root_dir=str(root / "resume")).fit(
        TinyClassifier(seed=seed + 100), *loaders(), ckpt_path="last")
    if spec.get("wide"):
        # The same interrupted/resumed pair on a model reduced in several DDP buckets: a
        # strategy whose ranks do different work per bucket, or whose resume is exact for
        # one bucket only, shows here and not on the tiny model.
        trainer("wide", max_epochs=1).fit(WideClassifier(seed=seed), *loaders())
        trainer("wide_interrupted", max_steps=spec["resume_at"] // 2, max_epochs=1, enable_checkpointing=True,
                default_root_dir=str(root / "wide")).fit(WideClassifier(seed=seed), *loaders())
        trainer("wide_resumed", max_epochs=1, enable_checkpointing=True, default_root_dir=str(root / "wide")).fit(
            WideClassifier(seed=seed + 100), *loaders(), ckpt_path="last")


if __name__ == "__main__":
    main()
