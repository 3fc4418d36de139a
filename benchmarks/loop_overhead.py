"""Per-step overhead of the hookloop Trainer against a hand-written PyTorch loop.

One process, one run: the same tiny model (Linear 32->64->ReLU->Linear 2, batch 32,
SGD) and the same DataLoader go through

* a hand-written loop (the reference: ``raw``),
* ``hookloop.Trainer`` with no plugins (``hookloop``), with the default observers
  (``hl+observers``: a progress bar drawn on a terminal, the csv logger, checkpoints), and
  with those and a module that logs its loss every step (``hl+obs+log``),
* and, when installed, Lightning's ``Trainer``, Lightning ``Fabric`` and Accelerate
  (``make bench`` installs them).

Variants run in interleaved rounds so that drift of the machine hits them alike; the
median µs/step per variant is reported. Timings on shared cores move by a few per cent
between runs, so the work is also counted: Python function calls per step, traced with
``sys.setprofile`` over 2N steps minus N steps (which cancels set-up and teardown), a
deterministic number. The last line is ``hookloop/raw <ratio>``.

``--without plain-callers`` / ``--without plain-torch`` (repeatable) measure the loop
without one of its two shortcuts, to show what each earns (docs/decisions.md, issue 34):
the per-step events called through pluggy's dispatch instead of
:func:`hookloop.dispatch.event`'s plain callers; ``backward``/``optimizer_step``/
``zero_grad`` called as hooks even when only ``hookloop.defaults`` implements them
(``hookloop.engine.step.PLAIN_TORCH_DEFAULTS``).

    python benchmarks/loop_overhead.py [--steps 3000] [--rounds 5] [--without plain-torch]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import statistics
import sys
import time
import warnings

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop


def make_data(n: int = 32 * 500) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))


def loader(data):
    return DataLoader(data, batch_size=32, shuffle=True)


def run_raw(data, steps: int) -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = 0
    while done < steps:
        for x, y in loader(data):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                return


class HookloopModule(hookloop.Module):
    def __init__(self):
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LoggingModule(HookloopModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss


class Terminal(io.StringIO):
    """What the progress bar draws on when stdout is a terminal (it redraws there)."""

    def isatty(self):
        return True


#: How often the bar redraws (the default). Counting calls, redraws are turned off: under
#: the profiler a step is slow, so time-throttled redraws would land on a varying number
#: of steps; the timed rounds include them.
REDRAW = {"seconds": 0.5}


def bar():
    return hookloop.ProgressBar(file=Terminal(), refresh_seconds=REDRAW["seconds"])


def run_hookloop(data, steps: int) -> None:
    """No plugins at all: the core loop's own cost."""
    trainer = hookloop.Trainer(max_steps=steps, enable_checkpointing=False, enable_progress_bar=False, logger=False)
    trainer.fit(HookloopModule(), loader(data))


def run_hookloop_observers(data, steps: int) -> None:
    """The default observers on (progress bar on a terminal, csv, checkpoint), same module."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        trainer = hookloop.Trainer(max_steps=steps, default_root_dir=root,
                                   callbacks=[bar()])
        trainer.fit(HookloopModule(), loader(data))


def run_hookloop_logging(data, steps: int) -> None:
    """Defaults on and a module that logs its loss every step, shown in the bar and
    written to the CSV every log_every_n_steps: what a typical run pays."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        trainer = hookloop.Trainer(max_steps=steps, default_root_dir=root,
                                   callbacks=[bar()])
        trainer.fit(LoggingModule(), loader(data))


def lightning_runner():
    try:
        import lightning.pytorch as pl  # noqa: F401
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError:
            return None

    class LitModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def run(data, steps):
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )
        trainer.fit(LitModule(), loader(data))

    return run


def fabric_runner():
    try:
        from lightning.fabric import Fabric
    except ImportError:
        try:
            from lightning_fabric import Fabric
        except ImportError:
            return None

    def run(data, steps):
        fabric = Fabric(accelerator="cpu", devices=1)
        model = make_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt = fabric.setup(model, opt)
        dl = fabric.setup_dataloaders(loader(data))
        done = 0
        while done < steps:
            for x, y in dl:
                loss = F.cross_entropy(model(x), y)
                fabric.backward(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
                done += 1
                if done == steps:
                    return

    return run


def accelerate_runner():
    try:
        from accelerate import Accelerator
    except ImportError:
        return None

    def run(data, steps):
        acc = Accelerator(cpu=True)
        model = make_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt, dl = acc.prepare(model, opt, loader(data))
        done = 0
        while done < steps:
            for x, y in dl:
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
                done += 1
                if done == steps:
                    return

    return run


def calls_per_step(run, data, steps: int = 200) -> float:
    """Python calls (and C calls made from Python) per training step of ``run``."""

    def count(n: int) -> int:
        calls = 0

        def profile(frame, event, arg):
            nonlocal calls
            if event in ("call", "c_call"):
                calls += 1

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            sys.setprofile(profile)
            try:
                run(data, n)
            finally:
                sys.setprofile(None)
        return calls

    return (count(2 * steps) - count(steps)) / steps


def without(shortcut: str) -> None:
    """Turn one of the loop's shortcuts off, in this process (see the module's docstring)."""
    from hookloop import dispatch
    from hookloop.engine import step

    if shortcut == "plain-callers":
        dispatch._Observers.plain_dispatch = lambda self: False  # type: ignore[method-assign]
    elif shortcut == "plain-torch":
        step.only_default = lambda trainer, name: False  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--without", action="append", default=[],
                        choices=["plain-callers", "plain-torch"],
                        help="turn a shortcut of the loop off (repeatable)")
    args = parser.parse_args()
    for shortcut in args.without:
        without(shortcut)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ.pop("HOOKLOOP_TRAINER_DEFAULTS", None)

    data = make_data()
    variants = {"raw": run_raw, "hookloop": run_hookloop, "hl+observers": run_hookloop_observers,
                "hl+obs+log": run_hookloop_logging}
    for name, factory in (("lightning", lightning_runner), ("fabric", fabric_runner), ("accelerate", accelerate_runner)):
        runner = factory()
        if runner is not None:
            variants[name] = runner
    for run in variants.values():  # warm-up: imports, allocator, first-call paths
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            run(data, 200)

    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                start = time.perf_counter()
                run(data, args.steps)
                times[name].append((time.perf_counter() - start) / args.steps * 1e6)

    REDRAW["seconds"] = float("inf")
    calls = {name: calls_per_step(run, data) for name, run in variants.items()}
    raw = statistics.median(times["raw"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps x {args.rounds} rounds"
          + (f", without {', '.join(args.without)}" if args.without else ""))
    print(f"{'variant':<12}{'us/step':>10}{'x raw':>8}{'calls/step':>12}{'+ raw':>8}")
    for name, values in times.items():
        us = statistics.median(values)
        print(f"{name:<12}{us:>10.1f}{us / raw:>8.3f}{calls[name]:>12.1f}{calls[name] - calls['raw']:>+8.1f}")
    print(f"hookloop/raw {statistics.median(times['hookloop']) / raw:.3f}  "
          f"observers/raw {statistics.median(times['hl+observers']) / raw:.3f}")


if __name__ == "__main__":
    main()
