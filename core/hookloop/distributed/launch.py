"""Starting worker processes through PyTorch's elastic agent (``torch.distributed.run``).

hookloop does not spawn processes itself: the default ``launch_command`` is torchrun's,
which restarts failed workers (``--max-restarts``) and joins several machines through a
c10d rendezvous (``--nodes``, ``--node-rank``, ``--rdzv-endpoint``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import warnings
from typing import Callable, Iterator

from hookloop.contract.errors import ConfigurationError
from hookloop.engine.settings import DEFAULTS_ENV, TrainerConfig
from hookloop.distributed.elastic import is_elastic, rendezvous_options
from hookloop.distributed.environment import launched_externally
from hookloop.distributed.failures import FAILURE_DIR_ENV, failure_dir
from hookloop.resume.rundir import TOKEN_ENV, run_token
# LAUNCHER_ENV: the pid of the hookloop process that started this job's processes
# (``hookloop run``, a Trainer that re-launches its script, ``ddp_spawn``'s ``fit``): a
# process that has it dies with its parent, and exits at once when the chain up to it
# is already broken.
from hookloop.distributed.ranks import LAUNCHER_ENV, descends_from as _descends_from, launcher_pid

WORKER_ENV = "HOOKLOOP_WORKER"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl():
    """libc's ``prctl``, resolved ahead (a ``preexec_fn`` must not load a library between
    fork and exec); ``None`` off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_launcher() -> bool:
    """Make this process end when the process that started it ends (even by SIGKILL), in
    a process that a hookloop launcher started (:data:`LAUNCHER_ENV` is set): Linux's
    parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), then a check that the
    chain of parents up to the launcher still stands. When it does not and the process
    is orphaned (its parent is init: a parent died before the ``prctl``, so no signal
    will ever come), the process exits at once, naming the variable. When it does not and
    the process has a living parent, the variable is left over from another job (a
    shell that exported it): it is ignored with a warning naming it, and removed from
    this process's environment (the launcher's other private variables are then
    ignored too, :func:`hookloop.distributed.ranks.launched_by_hookloop`).

    ``import hookloop`` calls it, so every worker (torchrun's, ``ddp_spawn``'s, any
    launcher's that runs a script importing hookloop) has it from its first line; a
    launcher plugin whose workers are forked (they import nothing) calls it in the
    child, and again where something else set another signal (``torch.multiprocessing``
    gives its workers SIGINT, which a training loop may survive). Each process dies with
    its own parent, so a SIGKILL to ``hookloop run`` ends the elastic agent (see
    :func:`run_command`), whose death ends the workers. Returns whether the signal is set
    (False off Linux, or outside a launched process)."""
    launcher = launcher_pid()
    if launcher is None or launcher == os.getpid():
        return False  # outside a launched process, or the launcher itself (its own environment names it)
    prctl = _prctl()
    if prctl is None or prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if _descends_from(launcher) is not False:
        return True
    if os.getppid() == 1:  # orphaned: the parent died before the prctl, no signal will come
        print(f"hookloop: process {os.getpid()} exits: the launcher that started it (pid {launcher}, "
              f"{LAUNCHER_ENV}) or a process between them is gone", file=sys.stderr, flush=True)
        os._exit(1)
    # Not started by that launcher, and not orphaned: the variable is left over from
    # another job (a shell that exported it, a worker's own child). This process lives on.
    prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
    os.environ.pop(LAUNCHER_ENV, None)  # nor do the processes it starts inherit it
    warnings.warn(
        f"{LAUNCHER_ENV}={launcher} is set, but process {launcher} did not start this one (pid "
        f"{os.getpid()}, parent {os.getppid()}): a variable left over from a hookloop launcher (a shell "
        f"that exported it?), ignored, with the launcher's other private variables. Unset it: "
        f"`unset {LAUNCHER_ENV}` (docs/environment.md)",
        stacklevel=2,
    )
    return False


@contextlib.contextmanager
def as_launcher(reap: bool = False) -> Iterator[None]:
    """Within it, processes started from this one (a plugin's own launcher:
    ``torch.multiprocessing``, a subprocess) carry :data:`LAUNCHER_ENV` naming this
    process, so when they import hookloop they die with their parent
    (:func:`die_with_launcher`) instead of training on, orphaned, after it was killed;
    and this job's id (:data:`hookloop.resume.rundir.TOKEN_ENV`, honoured only in them), so they
    take part in the same run. This process's own environment is as before afterwards:
    a process it starts later is a job of its own.

    ``reap=True`` also covers processes that import no hookloop and outlive their parent
    (the daemons of a local Ray cluster): a watchdog process (:mod:`hookloop.distributed.reaper`)
    kills every process started with these two variables when the block ends or this
    process dies, even by SIGKILL."""
    previous = {name: os.environ.get(name) for name in (LAUNCHER_ENV, TOKEN_ENV)}
    token = run_token()
    watchdog = None
    if reap:
        from hookloop.distributed import reaper

        watchdog = reaper.start(token)  # before the variables are set: it must not carry them
    os.environ[TOKEN_ENV] = token
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.finish()
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def in_worker() -> bool:
    """True inside a process that a launcher started (hookloop's, torchrun, a plugin's, or
    one outside hookloop: mpirun, LSF's jsrun, the Kubeflow operator)."""
    return os.environ.get(WORKER_ENV) == "1" or "LOCAL_RANK" in os.environ or launched_externally()


def rendezvous_id() -> str:
    """torchrun's ``--rdzv-id`` for a job of several nodes, the same on every node without
    any communication between them: the user's ``HOOKLOOP_RUN_ID`` (``hookloop run
    --run-id``), else the scheduler's job id, else ``hookloop``. Unrelated jobs that share
    the last do not share a run directory: a first attempt always claims a new one
    (:mod:`hookloop.rundir`; docs/decisions.md, "Run identity")."""
    from hookloop.resume.rundir import RUN_ID_ENV, scheduler_job_id

    return os.environ.get(RUN_ID_ENV) or scheduler_job_id() or "hookloop"


def elastic_command(config: TrainerConfig, script: str, script_args: list[str]) -> list[str]:
    """The torchrun command line for ``config``; the plain interpreter for one process.

    Several nodes need the rendezvous endpoint here, where torchrun is about to start, and
    only here: a process that a launcher already placed (torchrun, srun, mpirun, a
    plugin's launcher that places its workers itself) gives ``nodes`` without one. An
    elastic job (``nodes="MIN:MAX"``, :mod:`hookloop.distributed.elastic`) is torchrun's
    ``--nnodes=MIN:MAX`` with the same c10d rendezvous."""
    elastic = is_elastic(config)
    nnodes = f"{config.min_nodes}:{config.nodes}" if elastic else str(config.nodes)
    if config.nodes > 1 and not config.rdzv_endpoint:
        raise ConfigurationError(
            f"nodes={nnodes} needs a rendezvous endpoint that every node can reach: "
            "--rdzv-endpoint HOST:PORT or Trainer(rdzv_endpoint='HOST:PORT'), the address of "
            "node 0"
        )
    nproc = config.num_processes()
    restarts = config.max_restarts or 0
    if nproc == 1 and config.nodes == 1 and restarts == 0:
        return [sys.executable, script, *script_args]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if config.nodes > 1:
        # node 0 hosts the rendezvous store, so two agents on one host agree; an elastic
        # job lives as long as node 0 does (the store is there)
        conf = {"is_host": "1" if config.node_rank == 0 else "0", **rendezvous_options(config)}
        cmd += [
            f"--nnodes={nnodes}",
            f"--node-rank={config.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={config.rdzv_endpoint}",
            f"--rdzv-id={rendezvous_id()}",
            "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
        ]
    else:
        cmd += ["--standalone", "--nnodes=1"]
    if restarts:
        cmd.append(f"--max-restarts={restarts}")
    return [*cmd, script, *script_args]


def is_plain_interpreter(cmd: list[str], script: str) -> bool:
    """Whether ``cmd`` runs ``script`` in one plain interpreter (no launcher around it)."""
    return len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1] == script


#: Runs torch's elastic agent with hookloop's failure summary (:mod:`hookloop.failures`).
_AGENT = "import sys; from hookloop.distributed.failures import agent_main; raise SystemExit(agent_main(sys.argv[1:]))"


def run_command(cmd: list[str], defaults: dict | None = None, workers: bool = True,
                root: str | os.PathLike | None = None) -> int:
    """Run a launch command and return its exit code.

    ``defaults`` (the options given to ``hookloop run``) become the Trainer defaults of
    the workers; without them the workers inherit this process's environment as is.
    ``workers=False`` for a plain interpreter: that process is not a launched worker, so
    a ``Trainer`` in it that asks for several processes starts them (through the
    strategy's launcher) instead of silently training alone.

    The launched process dies with this one, even when this one is SIGKILLed (a test's
    or a scheduler's timeout): on Linux it gets a parent-death signal before it runs
    ``cmd`` (kept across exec; so torchrun's agent, which imports no hookloop, has it
    too), and its children get theirs when they import hookloop (:func:`die_with_launcher`).

    torchrun's command (``python -m torch.distributed.run ...``) runs through
    :func:`hookloop.distributed.failures.agent_main`: when a worker fails, one summary is printed
    instead of every rank's traceback and torch's report, and the tracebacks go to
    ``<root>/logs/failures/<time>-<pid>/rank<R>.log`` (``root``: the Trainer's
    ``default_root_dir``; else ``defaults``'s, else the working directory), every rank's
    stdout and stderr to ``attempt_<N>/rank<R>/`` beside them (copied to this console as
    they are written; the folder is removed when the launch succeeds at once).
    """
    env = dict(os.environ)
    if workers:
        env[WORKER_ENV] = "1"
    else:
        env.pop(WORKER_ENV, None)
    if defaults is not None:
        env[DEFAULTS_ENV] = json.dumps(defaults)
    env[LAUNCHER_ENV] = str(os.getpid())
    if cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        cmd = [sys.executable, "-c", _AGENT, *cmd[3:]]
        if root is None and defaults:
            root = defaults.get("default_root_dir")
        env[FAILURE_DIR_ENV] = str(failure_dir(root))
        # torchrun sets OMP_NUM_THREADS=1 for several processes per node with a 4-line
        # warning; hookloop sets it itself beforehand and says so in one line.
        if "OMP_NUM_THREADS" not in env and "--nproc-per-node=1" not in cmd:
            env["OMP_NUM_THREADS"] = "1"
            print("hookloop: OMP_NUM_THREADS=1 per process (set it to override)",
                  file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_parent_death_signal())
    forwarding = _forward_sigterm(proc)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    finally:
        forwarding()


def _parent_death_signal() -> Callable[[], None] | None:
    """The ``preexec_fn`` that gives a child SIGKILL when this process ends; the child
    kills itself at once if this process already ended before the ``prctl``."""
    prctl, parent = _prctl(), os.getpid()
    if prctl is None:
        return None

    def set_signal() -> None:  # in the child, between fork and exec: no allocation, no import
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return set_signal


def _forward_sigterm(proc: subprocess.Popen) -> Callable[[], None]:
    """Pass a SIGTERM this process receives on to the launched process (torchrun's agent,
    which passes it to every worker: each checkpoints at its next step boundary and exits
    143; README "Faults"), and keep waiting for it. Without this, a SIGTERM sent to
    ``hookloop run`` alone (a container's PID 1, a scheduler that signals the main process)
    would end it and leave the agent and the workers running unsupervised. Returns the
    function that restores the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set handlers; nothing to restore

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    return lambda: signal.signal(signal.SIGTERM, previous)
