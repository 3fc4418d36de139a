"""The job :class:`~hookloop.testing.ResumeConformance` runs, and the faults it injects.

    hookloop run [--plugins NAME] --devices N --max-restarts K path/to/resume_job.py OUT SPEC.json

A run with everything a resume must bring back: dropout, a random augmentation drawn in
``__getitem__`` by the loader's workers (``num_workers=2, persistent_workers=True``, a
shuffled loader), every rank seeded differently, gradient accumulation, gradient
clipping, a per-step LR scheduler and ``ModelCheckpoint(every_n_train_steps=...)``.

Attempt ``a`` of the job (``TORCHELASTIC_RESTART_COUNT`` under the elastic agent;
``HOOKLOOP_RESUME_ATTEMPT`` where the kit re-runs the whole job itself) SIGKILLs one of
its ranks at the ``a``-th kill point of the spec, one of

* ``step``: after the backward, before the optimizer step that makes ``global_step == at``;
* ``save``: in the middle of writing the checkpoint of step ``at`` (``torch.save`` is
  wrapped in this process: half the bytes reach the file, then the kill);
* ``validation``: in ``validation_step`` of batch ``batch`` of the validation at the end
  of epoch ``epoch``;
* ``accumulation``: at the start of micro-batch ``batch`` of epoch ``epoch``, the last of
  its accumulation window (the window's earlier micro-batches are accumulated, no step yet);
* ``upload``: with a root on an object store (the spec's ``root``, a URL), in the middle of
  the upload of the ``last.ckpt`` of step ``at`` to the store (half its bytes sent in an
  unfinished upload, then the kill); for a strategy that writes checkpoint directories, in
  the middle of the upload of step ``at``'s directory (half its files sent).

The fault injection lives here, in the job, not in hookloop. Every rank writes
``OUT/final.rank<R>.pt`` at the end of the attempt that finishes (its weights, its
optimizer's local state and parameters, its schedulers' states), and the killed rank
``OUT/killed.attempt<A>.json`` just before it dies.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import hookloop

from hookloop.testing import streaming
from hookloop.testing.reference import TinyClassifier, local_tensor, tiny_dataset, weights

ATTEMPT_ENV = "HOOKLOOP_RESUME_ATTEMPT"
_REAL_SAVE = torch.save


def attempt() -> int:
    """Which attempt of the job this process belongs to (0: the first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(ATTEMPT_ENV) or 0)


class AugmentedDataset(Dataset):
    """:func:`tiny_dataset` with Gaussian noise added in ``__getitem__``: drawn from the
    loader worker's RNG, so a resume must give every worker its seed back."""

    def __init__(self, n: int, seed: int = 1, noise: float = 0.1):
        self.data, self.noise = tiny_dataset(n, seed=seed), noise

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x, y, index = self.data[i]
        return (x + self.noise * torch.randn(x.shape) if self.noise else x), y, index


class ResumeJob(TinyClassifier):
    """TinyClassifier with dropout, a per-step scheduler, per-rank seeds and the kills."""

    def __init__(self, spec: dict, out: str):
        super().__init__(seed=10)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(spec.get("dropout", 0.25)), nn.Linear(16, 3))
        self.spec, self.out, self.attempt = spec, Path(out), attempt()
        kills = spec["kills"]
        self.kill = kills[self.attempt] if self.attempt < len(kills) else None

    # -- the run ---------------------------------------------------------------------

    def setup(self, stage):
        _wrap_torch_save(self, self.trainer)  # in this process (a spawned rank is another one)
        if self.kill is not None and self.kill["kind"] == "upload":
            _wrap_commit(self, self.trainer)
        # Every rank its own random streams (dropout, augmentation seeds, sampler draws):
        # a resume that hands one rank another rank's states shows.
        rank = self.trainer.global_rank
        torch.manual_seed(1000 + rank)
        random.seed(2000 + rank)
        try:
            import numpy

            numpy.random.seed(3000 + rank)
        except ImportError:  # pragma: no cover
            pass

    def train_dataloader(self):
        """The training loader of the spec's ``loader`` kind other than ``"map"``, built
        here, once the process group is up (LitData reads the rank when it is built)."""
        spec, (replicas, rank) = self.spec, hookloop.data_parallel_rank(self.trainer)
        return streaming.train_loader(
            spec["loader"], n=spec["micro_batches"] * spec["batch_size"] * spec["world_size"],
            batch_size=spec["batch_size"], rank=rank, world_size=replicas,
            noise=0.1 if spec.get("augment", True) else 0.0, persistent_workers=spec.get("persistent_workers", True),
            data_dir=self.out / "data")

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self._maybe_kill("validation", epoch=self.trainer.current_epoch, batch=batch_idx)
        x, y, _ = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer):
        self._maybe_kill("step", at=self.trainer.global_step + 1)

    def on_train_batch_start(self, batch, batch_idx):
        self._maybe_kill("accumulation", epoch=self.trainer.current_epoch, batch=batch_idx)

    def on_fit_end(self):
        trainer = self.trainer
        record = {"rank": trainer.global_rank, "attempt": self.attempt, "global_step": trainer.global_step,
                  "weights": weights(self), "optimizers": [optimizer_state(o) for o in trainer.optimizers],
                  "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]}
        _REAL_SAVE(record, self.out / f"final.rank{trainer.global_rank}.pt")

    # -- the faults ------------------------------------------------------------------

    def _maybe_kill(self, kind: str, **where) -> None:
        kill = self.kill
        if kill is None or kill["kind"] != kind or self.trainer.global_rank != kill["rank"]:
            return
        if kind == "validation" and self.trainer.sanity_checking:
            return
        if all(kill[k] == v for k, v in where.items()):
            die(self.out, kill, self.attempt)


def die(out: Path, kill: dict, attempt_: int) -> None:
    """Say where, then SIGKILL this process (no cleanup, no atexit, no flush of anything)."""
    (out / f"killed.attempt{attempt_}.json").write_text(json.dumps(kill))
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def optimizer_state(optimizer) -> dict:
    """This rank's optimizer state and parameters, whatever wraps the torch optimizer
    (DeepSpeed's ZeRO optimizer, fairscale's OSS, ...): the innermost
    ``torch.optim.Optimizer``'s ``state_dict()`` and the values of its parameters (a
    sharded optimizer's local shard, master weights included)."""
    seen = set()
    while not isinstance(optimizer, torch.optim.Optimizer) and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "optim", None)
        if inner is None:
            break
        optimizer = inner
    if isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer):  # fairscale OSS: the local one
        optimizer = optimizer.optim
    # Not state_dict(): under ZeRO-3 the state is keyed by tensors its param_groups do not list.
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    known = {id(p) for p in ordered}
    state = [_cpu(optimizer.state[p]) if p in optimizer.state else None for p in ordered]
    state += [_cpu(v) for k, v in optimizer.state.items() if id(k) not in known]
    params = [[local_tensor(p).detach().float().cpu().clone() for p in group["params"]]
              for group in optimizer.param_groups]
    return {"type": type(optimizer).__name__, "state": state,
            "groups": [{k: _cpu(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "params": params}


def _cpu(value):
    if isinstance(value, torch.Tensor):
        return local_tensor(value).detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


def _wrap_torch_save(job: ResumeJob, trainer: hookloop.Trainer) -> None:
    """Kill a checkpoint write half-way: this process's ``torch.save`` writes the first
    half of the bytes, flushes them, and the process dies (what a SIGKILL in the middle of
    a large write leaves). Only during the armed ``save`` kill point's step."""
    real = _REAL_SAVE

    def save(obj, f, *args, **kwargs):
        kill = job.kill
        if (kill is None or kill["kind"] != "save" or trainer.global_rank != kill["rank"]
                or trainer.global_step != kill["at"] or getattr(trainer, "sanity_checking", False)):
            return real(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()[: max(1, len(buffer.getvalue()) // 2)]
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        else:
            f.write(data)
            if hasattr(f, "flush"):
                f.flush()
        die(job.out, kill, job.attempt)

    torch.save = save
    if job.kill is not None and job.kill["kind"] == "save":
        _wrap_dcp_writes(job, trainer)


def _wrap_dcp_writes(job: ResumeJob, trainer: hookloop.Trainer) -> None:
    """The same for ``torch.distributed.checkpoint``'s file writer (FSDP's sharded
    checkpoints), which writes tensors' bytes without ``torch.save``: the armed rank
    writes part of its first item into its shard file, flushes, and dies."""
    try:
        from torch.distributed.checkpoint import filesystem
    except ImportError:  # pragma: no cover - no torch.distributed
        return
    real = getattr(filesystem, "_write_item", None)
    if real is None or getattr(real, "_hookloop_kill", False):
        return
    kill = job.kill

    def write_item(*args, **kwargs):
        if trainer.global_rank != kill["rank"] or trainer.global_step != kill["at"]:
            return real(*args, **kwargs)
        stream = kwargs.get("stream", args[1] if len(args) > 1 else None)
        stream.write(b"\0" * 64)  # a torn shard
        stream.flush()
        die(job.out, kill, job.attempt)

    write_item._hookloop_kill = True
    filesystem._write_item = write_item


def _wrap_commit(job: ResumeJob, trainer: hookloop.Trainer) -> None:
    """Kill the upload of ``last.ckpt`` to the store half-way (the ``upload`` kill point):
    the armed rank streams half of the file's bytes into the commit's new tag, then dies
    before the upload completes and before the ``latest`` marker moves."""
    from hookloop.resume import storage

    real = storage.commit_file

    def commit_file(source, url, step=None):
        kill = job.kill
        if (kill is None or kill["kind"] != "upload" or trainer.global_rank != kill["rank"]
                or trainer.global_step != kill["at"] or storage.name_of(url) != "last.ckpt"):
            return real(source, url, step)
        data = Path(source).read_bytes()

        def half(f):
            f.write(data[: len(data) // 2])
            f.flush()
            die(job.out, kill, job.attempt)

        return real(half, url, step)

    storage.commit_file = commit_file

    from hookloop.resume import sharded_store

    real_tree = sharded_store.upload_committed

    def upload_committed(path, tag_url):
        """A sharded checkpoint (a directory): half its files reach the new tag, then the kill."""
        kill = job.kill
        if (kill is None or kill["kind"] != "upload" or trainer.global_rank != kill["rank"]
                or trainer.global_step != kill["at"]):
            return real_tree(path, tag_url)
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        fs, root = storage.filesystem(tag_url)
        for file in files[: max(1, len(files) // 2)]:
            fs.put_file(str(file), storage.join(root, file.relative_to(path).as_posix()))
        die(job.out, kill, job.attempt)

    sharded_store.upload_committed = upload_committed


def main(out: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    b, w = spec["batch_size"], spec["world_size"]
    noise = 0.1 if spec.get("augment", True) else 0.0
    train = AugmentedDataset(spec["micro_batches"] * b * w, noise=noise)
    val = AugmentedDataset(spec["val_batches"] * b * w, seed=2, noise=noise)
    loader_options = dict(num_workers=2, persistent_workers=spec.get("persistent_workers", True), batch_size=b)
    kind = spec.get("loader", "map")  # any other kind: ResumeJob.train_dataloader
    train_loader = DataLoader(train, shuffle=True, **loader_options) if kind == "map" else None
    val_loader = DataLoader(val, **loader_options)
    job = ResumeJob(spec, out)
    trainer = hookloop.Trainer(
        max_epochs=spec["epochs"], accumulate_grad_batches=spec["accumulate"], gradient_clip_val=0.5,
        log_every_n_steps=1, num_sanity_val_steps=0, default_root_dir=spec.get("root") or str(Path(out) / "root"),
        plugin_options=spec["options"], enable_progress_bar=False,
        callbacks=[hookloop.ModelCheckpoint(every_n_train_steps=spec["every_n_train_steps"],
                                            async_save=spec.get("async_save", False))],
        **({"stateful_dataloader": True} if kind == "stateful_trainer" else {}),
    )
    resume = spec["restarts"] == "rerun" and job.attempt > 0
    trainer.fit(job, train_loader, val_loader, ckpt_path="last" if resume else None)
