"""Shared fixtures: tiny models, data, a hand-written reference loop, installed plugins."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The tiers (--tier=check|test|full), the launch guard and the per-file report.
from tiers import (pytest_addoption, pytest_collection_modifyitems, pytest_configure,  # noqa: E402,F401
                   pytest_runtest_logreport, pytest_runtest_makereport, pytest_runtest_protocol,
                   pytest_terminal_summary, pytest_unconfigure)


class TinyModule(hookloop.Module):
    """Linear 8 -> 16 -> ReLU -> 3 with SGD; deterministic from a seed."""

    def __init__(self, seed: int = 0, lr: float = 0.1, momentum: float = 0.9, scheduler: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.lr, self.momentum, self.use_scheduler = lr, momentum, scheduler

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        if self.use_scheduler:
            return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return opt


@pytest.fixture
def quiet_lightning():
    """Lightning's info lines off for one test, and its loggers' levels back as they were
    after it (a level set at import time would silence them for every later test file)."""
    loggers = [logging.getLogger(n) for n in ("pytorch_lightning", "lightning.pytorch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


def tiny_data(n: int = 96, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(x, y)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit_profiled(trainer, module, loader, profile) -> None:
    """``trainer.fit(module, loader)`` under ``sys.setprofile(profile)``, with the garbage
    collector off: a collection inside a count runs finalizers of earlier objects (seen:
    +9 calls/step on a fresh CI clone), so collect first and none while counting."""
    import gc

    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        trainer.fit(module, loader)
    finally:
        sys.setprofile(None)
        gc.enable()


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def reference_loop(module: TinyModule, loader: DataLoader, epochs: int, accumulate: int = 1, clip: float | None = None) -> None:
    """The hand-written PyTorch loop hookloop must reproduce."""
    opt = module.configure_optimizers()
    sched = None
    if isinstance(opt, tuple):
        opt, sched = opt
    n = len(loader)
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(module(x), y)
            (loss / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == n:
                if clip:
                    torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()


def install_fake_distribution(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str], requires: list[str] = ()) -> None:
    """Lay out an installed distribution (``*.dist-info`` + modules) under ``root``.

    This is exactly what pip leaves in site-packages, so ``importlib.metadata`` finds it
    once ``root`` is on ``sys.path``.
    """
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    meta = ["Metadata-Version: 2.1", f"Name: {dist}", "Version: 0.1"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    lines = ["[hookloop.plugins]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fresh directory on sys.path that behaves like a site-packages."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    import importlib

    importlib.invalidate_caches()
    return root


def run_python(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    for key in ("HOOKLOOP_TRAINER_DEFAULTS", "HOOKLOOP_WORKER", "LOCAL_RANK", "HOOKLOOP_PLUGINS"):
        full_env.pop(key, None)
    full_env.update(env or {})
    proc = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def start_hookloop_run(args: list, cwd: Path) -> subprocess.Popen:
    """``python -m hookloop run ARGS`` in ``cwd`` as a new job, output captured: no launcher
    or hookloop variable of this process (a test may have set some) reaches it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    env.pop("LOCAL_RANK", None)
    return subprocess.Popen([sys.executable, "-m", "hookloop", "run", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_job(proc: subprocess.Popen, timeout: float, succeed: bool = True) -> tuple[str, str]:
    """Wait for a job of :func:`start_hookloop_run`; its (stdout, stderr). A job that hangs
    past ``timeout`` is killed and fails the test, as does an exit status of the other kind
    than ``succeed`` asks (0, or any failure)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the job hung:\n{stdout}\n{stderr}") from None
    assert (proc.returncode == 0) == succeed, f"exit status {proc.returncode}:\n{stdout}\n{stderr}"
    return stdout, stderr


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a rendezvous endpoint for a test's nodes)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(commands: list[list[str]], cwd: Path, env: dict, timeout: float = 300) -> list[str]:
    """Start the nodes of one multi-node job at once (each in its own session, so a hang is
    killed with every agent and worker under it), wait for all of them, and return each
    node's output (stdout and stderr together); every node must exit 0."""
    import signal

    nodes = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in commands]
    try:
        outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output
    return outputs


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for key in ("HOOKLOOP_TRAINER_DEFAULTS", "HOOKLOOP_WORKER", "LOCAL_RANK", "HOOKLOOP_PLUGINS", "HOOKLOOP_AUTOLOAD_PLUGINS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _seed_environment_per_test():
    """``seed_everything`` records its seed in the environment (``PL_GLOBAL_SEED``); the
    processes a later test starts would inherit it (their distributed samplers' seed, the
    strategies' ``reset_seed``), and a test may set a job id (``HOOKLOOP_RUN_ID``) or hand
    one (``HOOKLOOP_RUN_TOKEN``): each test starts with the environment it found,
    whichever test ran before it (in another order under pytest-xdist too)."""
    keys = ("PL_GLOBAL_SEED", "HOOKLOOP_RUN_TOKEN", "HOOKLOOP_RUN_ID")
    before = {key: os.environ.get(key) for key in keys}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def jobs(tmp_path_factory):
    """The shared launched jobs of tests/jobs.py, each run at most once per session."""
    from jobs import Registry

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, shared by its xdist workers
    return Registry(base / "jobs")


@pytest.fixture(scope="session")
def _s3_server_process():
    """One moto server on 127.0.0.1 for the session (hookloop.testing.s3)."""
    from hookloop.testing.s3 import start_s3_server, stop_s3_server

    server = start_s3_server()
    yield server
    stop_s3_server(server)


@pytest.fixture
def s3(_s3_server_process, monkeypatch):
    """A real S3-compatible server (moto, in a process of its own) with a fresh bucket for
    this test; ``AWS_ENDPOINT_URL`` and the credentials are set in the environment, as a
    user points s3fs at a non-AWS store, so worker processes reach it too. A test that
    uses it launches a process: mark it ``slow`` or ``full``."""
    import dataclasses
    import uuid

    from hookloop.testing.s3 import clear_fsspec_cache

    for key, value in _s3_server_process.env.items():
        monkeypatch.setenv(key, value)
    clear_fsspec_cache()
    server = dataclasses.replace(_s3_server_process, bucket=f"hookloop-{uuid.uuid4().hex[:12]}")
    server.filesystem().mkdir(server.bucket)
    yield server
    clear_fsspec_cache()
