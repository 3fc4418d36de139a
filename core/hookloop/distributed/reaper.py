"""A watchdog that ends what a launch started, also when the launching process is SIGKILLed.

:func:`hookloop.as_launcher` makes the processes a launcher starts carry its job's id
(``HOOKLOOP_RUN_TOKEN``) and its pid (``HOOKLOOP_LAUNCHER_PID``), and a process that
imports hookloop dies with its parent (:func:`hookloop.distributed.launch.die_with_launcher`).
That covers the workers, not the daemons an engine starts beside them, which import no
hookloop and outlive their parent: a local Ray cluster's ``DashboardAgent`` and
``RuntimeEnvAgent`` survive a SIGKILLed driver (measured with ray 2.60.0; its
``gcs_server`` and ``raylet`` die with it).

``as_launcher(reap=True)`` therefore starts one small process, the reaper (this module,
stdlib only), before it sets the two variables, so the reaper does not carry them. The
reaper waits on a pipe from the launcher; the pipe's end comes when the launcher leaves
the ``with`` block or dies (the kernel closes a dead process's files, so no polling and
no signal is needed). It then kills, with SIGKILL, every process of this user whose
``/proc/PID/environ`` (the environment it was started with) holds both this job's token
and this launcher's pid, and every descendant of those; it sweeps again until nothing is
found three times in a row (a daemon may be starting another), for at most
:data:`SWEEP_SECONDS` after the launcher died. After a normal exit the launcher waits for
the reaper, so a later launch with the same token is never swept by an earlier reaper.

The reaper runs in a session of its own and ignores SIGINT and SIGHUP, so a Ctrl-C or a
closed terminal that ends the launcher's process group does not end the reaper before it
has swept. Linux only (``/proc``); elsewhere :func:`start` returns ``None``.

Run as ``python -m hookloop.distributed.reaper TOKEN LAUNCHER_PID`` with the pipe as
stdin; :func:`start` does that.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: the variables a launched process carries (:mod:`hookloop.distributed.launch`); repeated
#: here so that the reaper imports nothing of hookloop (it must start fast and stay small)
TOKEN_ENV = "HOOKLOOP_RUN_TOKEN"
LAUNCHER_ENV = "HOOKLOOP_LAUNCHER_PID"
#: how long the reaper goes on sweeping after its launcher died
SWEEP_SECONDS = 30.0
#: how long a launcher that exits normally waits for its reaper's last sweep
WAIT_SECONDS = 10.0


class Reaper:
    """The launcher's side: the reaper process and the write end of its pipe."""

    def __init__(self, process: subprocess.Popen, pipe: int):
        self.process, self._pipe = process, pipe

    def finish(self, timeout: float = WAIT_SECONDS) -> None:
        """Tell the reaper the launch is over (it sweeps once more) and wait for it."""
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start(token: str, launcher: int | None = None) -> Reaper | None:
    """Start the reaper for the processes that will carry ``token`` and ``launcher`` (this
    process's pid by default); ``None`` off Linux. Call it before setting the variables."""
    if not Path("/proc/self/environ").exists():
        return None
    launcher = os.getpid() if launcher is None else launcher
    read_end, write_end = os.pipe()  # not inheritable (PEP 446): only the reaper gets read_end
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, LAUNCHER_ENV)}
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "hookloop.distributed.reaper", token, str(launcher)],
            stdin=read_end, env=env, start_new_session=True, close_fds=True,
        )
    finally:
        os.close(read_end)
    return Reaper(process, write_end)


def _environ(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _parents() -> dict[str, str]:
    """pid -> parent pid of every process /proc shows (zombies left out: they are dead)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            found[stat.parent.name] = fields[1]
    return found


def launched(token: str, launcher: int) -> list[int]:
    """The live processes that carry ``token`` and ``launcher`` in the environment they
    were started with, and their descendants (a process may have cleared its own)."""
    parents = _parents()
    me = str(os.getpid())
    marked = {pid for pid in parents if pid != me and _environ(pid).get(TOKEN_ENV) == token
              and _environ(pid).get(LAUNCHER_ENV) == str(launcher)}
    children: dict[str, list[str]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), list(marked)
    while todo:
        pid = todo.pop()
        if pid in found or pid == me or pid == str(launcher):
            continue
        found.add(pid)
        todo += children.get(pid, [])
    return sorted(int(p) for p in found)


def _name(pid: int) -> str:
    try:
        return f"{Path(f'/proc/{pid}/comm').read_text().strip()} ({pid})"
    except OSError:
        return f"pid {pid}"


def sweep(token: str, launcher: int, seconds: float) -> list[str]:
    """Kill what :func:`launched` finds until it finds nothing three times in a row, or
    ``seconds`` passed; return the names of the processes killed."""
    deadline, empty, killed = time.monotonic() + seconds, 0, []
    while empty < 3 and time.monotonic() < deadline:
        found = launched(token, launcher)
        for pid in found:
            name = _name(pid)
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(name)
            except (ProcessLookupError, PermissionError):
                pass
        empty = 0 if found else empty + 1
        time.sleep(0.1)
    return killed


def main(argv: list[str] | None = None) -> int:
    token, launcher = (argv or sys.argv[1:])[:2]
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while os.read(0, 4096):  # the launcher never writes: this returns b"" when it is done or dead
        pass
    # A dying process closes its files before its children are given to another parent:
    # wait a moment for that before telling a death from a normal end.
    deadline = time.monotonic() + 0.5
    while os.getppid() == int(launcher) and time.monotonic() < deadline:
        time.sleep(0.02)
    died = os.getppid() != int(launcher)
    killed = sweep(token, int(launcher), SWEEP_SECONDS if died else 2.0)
    if killed:
        why = "died" if died else "finished"
        print(f"hookloop: the launcher (pid {launcher}) {why}; ended the {len(killed)} process(es) of its "
              f"launch still running: {', '.join(killed)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
