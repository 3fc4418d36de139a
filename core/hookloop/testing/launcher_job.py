"""The job a launcher's conformance tests run (:class:`hookloop.testing.LauncherConformance`).

    python launcher_job.py OUT SPEC.json             # function mode: fit returns here
    hookloop run ... launcher_job.py OUT SPEC.json   # script mode: every worker runs this

The calling process seeds with ``SEED`` (``hookloop.seed_everything``), then fits
:class:`~hookloop.testing.reference.TinyClassifier` under the spec's plugins (a strategy
and the launcher under test) with a checkpoint every step. In every worker an observer
writes ``OUT/identity.attempt<A>.rank<R>.json`` when ``fit`` starts (the process, what
its launcher told it, what the core made of it) and ``OUT/final.attempt<A>.rank<R>.pt``
when it ends; with ``crash_at``, global rank 1 of the first attempt ends itself
(``os._exit``, no cleanup, as a killed process) when that step begins. The process that
called ``fit`` writes ``OUT/caller.<pid>.pt`` afterwards (its module's weights, its
counters, its run directory), and ``OUT/caller.pid`` before.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import hookloop
from hookloop.distributed.ranks import ATTEMPT_ENV, LAUNCHER_ENV, attempt
from hookloop.resume.rundir import TOKEN_ENV
from hookloop.testing.reference import TinyClassifier, tiny_dataset, weights

#: the seed the caller sets; the workers' sampler seed must be this one (the launcher
#: forwards it: without it a two-node run was silently 0.188 off, issue 36)
SEED = 1234
#: what a worker is told by its launcher (docs/environment.md, "What a worker needs from
#: its launcher")
IDENTITY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "HOOKLOOP_WORKER", ATTEMPT_ENV, "TORCHELASTIC_RESTART_COUNT", TOKEN_ENV,
            "TORCHELASTIC_RUN_ID", LAUNCHER_ENV, "PL_GLOBAL_SEED")


def ancestors() -> list[int]:
    """The pids from this process's parent up to init (``/proc``; Linux)."""
    chain, pid = [], os.getppid()
    while pid > 1:
        chain.append(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return chain


class Identity:
    """Records, in every worker, who it is and what it trained."""

    hookloop_name, hookloop_role = "launcher_conformance", "observer"

    def __init__(self, out: str, crash_at: int | None):
        self.out, self.crash_at = out, crash_at

    def _name(self, trainer, kind: str, suffix: str) -> Path:
        return Path(self.out) / f"{kind}.attempt{attempt()[0]}.rank{trainer.global_rank}.{suffix}"

    @hookloop.hookimpl
    def on_train_start(self, trainer):
        record = {
            "pid": os.getpid(), "ppid": os.getppid(), "ancestors": ancestors(), "host": socket.gethostname(),
            "environ": {name: os.environ.get(name) for name in IDENTITY},
            "attempt": attempt()[0],
            "global_rank": trainer.global_rank, "world_size": trainer.world_size,
            "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
            "log_dir": str(trainer.log_dir), "start_step": trainer.global_step,
        }
        self._name(trainer, "identity", "json").write_text(json.dumps(record))

    @hookloop.hookimpl
    def on_train_batch_start(self, trainer, batch, batch_idx):
        if (self.crash_at is not None and trainer.global_step == self.crash_at
                and trainer.global_rank == 1 and attempt()[0] == 0):
            os._exit(3)

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        torch.save({"final": weights(trainer.module), "global_step": trainer.global_step},
                   self._name(trainer, "final", "pt"))


def main() -> None:
    out, spec = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    if not hookloop.in_worker():
        (out / "caller.pid").write_text(str(os.getpid()))
    hookloop.seed_everything(SEED)
    module = TinyClassifier(seed=10)
    checkpoint = hookloop.ModelCheckpoint(every_n_train_steps=1, save_last=True)
    trainer = hookloop.Trainer(
        plugins=[*spec["plugins"], Identity(str(out), spec.get("crash_at"))], callbacks=[checkpoint],
        devices=spec["devices"], nodes=spec.get("nodes", 1), max_epochs=spec["epochs"],
        max_restarts=spec.get("max_restarts", 0), plugin_options=spec.get("options", {}),
        default_root_dir=str(out / "run"), num_sanity_val_steps=0, enable_progress_bar=False,
        enable_model_summary=False)
    trainer.fit(module, DataLoader(tiny_dataset(spec["samples"]), batch_size=spec["batch_size"]))
    torch.save({"pid": os.getpid(), "final": weights(module), "global_step": trainer.global_step,
                "log_dir": str(trainer.log_dir), "global_rank": trainer.global_rank,
                "versions": sorted(p.name for p in (out / "run" / "logs").iterdir())},
               out / f"caller.{os.getpid()}.pt")


if __name__ == "__main__":
    main()
