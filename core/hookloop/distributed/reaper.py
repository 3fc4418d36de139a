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
the ``with`` block or dies (the kernel closes a dead process's files, so no signal is
needed). Meanwhile it notes, every :data:`WATCH_SECONDS`, the launcher's descendants
started after it (pid and start time): a daemon whose parent died first is no longer
anyone's descendant, and one that rewrote its command line (Ray's ``ray::DashboardAgent``)
may no longer show its environment. It then kills, with SIGKILL, every process whose
``/proc/PID/environ`` (the environment it was started with) holds both this job's token
and this launcher's pid, every noted process still alive (same pid, same start time),
and every descendant of those; it sweeps again until nothing is found three times in a
row (a daemon may be starting another), for at most :data:`SWEEP_SECONDS` after the
launcher died. After a normal exit the launcher waits for
the reaper, so a later launch with the same token is never swept by an earlier reaper.

The reaper runs in a session of its own and ignores SIGINT and SIGHUP, so a Ctrl-C or a
closed terminal that ends the launcher's process group does not end the reaper before it
has swept. Linux only (``/proc``); elsewhere :func:`start` returns ``None``.

Run as ``python -m hookloop.distributed.reaper TOKEN LAUNCHER_PID`` with the pipe as
stdin; :func:`start` does that.
"""

from __future__ import annotations

import os
import select
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
#: how often the reaper notes the launcher's descendants while the launcher lives
WATCH_SECONDS = 0.5


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


def _processes() -> dict[str, tuple[str, str]]:
    """pid -> (parent pid, start time) of every process /proc shows (zombies left out:
    they are dead). The start time tells a process from a later one given the same pid."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            found[stat.parent.name] = (fields[1], fields[19])
    return found


def _descendants(roots: set[str], processes: dict[str, tuple[str, str]], skip: set[str]) -> set[str]:
    children: dict[str, list[str]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    found: set[str] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in found or pid in skip:
            continue
        found.add(pid)
        todo += children.get(pid, [])
    return found


def launched(token: str, launcher: int, known: dict[str, str] | None = None) -> list[int]:
    """The live processes of the launch: those that carry ``token`` and ``launcher`` in the
    environment they were started with, those in ``known`` (pid -> start time: the
    launcher's descendants seen while it lived; a process that rewrote its command line,
    as Ray's ``ray::DashboardAgent`` does, may no longer show its environment, and its
    parent may be gone), and the descendants of all of these."""
    processes = _processes()
    me = str(os.getpid())
    marked = {pid for pid in processes if pid != me and _environ(pid).get(TOKEN_ENV) == token
              and _environ(pid).get(LAUNCHER_ENV) == str(launcher)}
    marked |= {pid for pid, start in (known or {}).items() if processes.get(pid, ("", ""))[1] == start}
    return sorted(int(p) for p in _descendants(marked, processes, {me, str(launcher)}))


def watch(launcher: int, known: dict[str, str]) -> None:
    """Add to ``known`` the launcher's descendants started after this reaper (so none the
    launcher had before the launch): pid -> start time."""
    processes = _processes()
    me = str(os.getpid())
    mine = processes.get(me, ("", "0"))[1]
    for pid in _descendants({str(launcher)}, processes, {me}) - {str(launcher)}:
        start = processes[pid][1]
        if int(start) >= int(mine):
            known[pid] = start


def _name(pid: int) -> str:
    try:
        return f"{Path(f'/proc/{pid}/comm').read_text().strip()} ({pid})"
    except OSError:
        return f"pid {pid}"


def sweep(token: str, launcher: int, seconds: float, known: dict[str, str] | None = None) -> list[str]:
    """Kill what :func:`launched` finds until it finds nothing three times in a row, or
    ``seconds`` passed; return the names of the processes killed."""
    deadline, empty, killed = time.monotonic() + seconds, 0, []
    while empty < 3 and time.monotonic() < deadline:
        found = launched(token, launcher, known)
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
    known: dict[str, str] = {}
    while True:  # the launcher never writes: its end of the pipe closes when it is done or dead
        ready, _, _ = select.select([0], [], [], WATCH_SECONDS)
        if ready and not os.read(0, 4096):
            break
        watch(int(launcher), known)
    # A dying process closes its files before its children are given to another parent:
    # wait a moment for that before telling a death from a normal end.
    deadline = time.monotonic() + 0.5
    while os.getppid() == int(launcher) and time.monotonic() < deadline:
        time.sleep(0.02)
    died = os.getppid() != int(launcher)
    killed = sweep(token, int(launcher), SWEEP_SECONDS if died else 2.0, known)
    if killed:
        why = "died" if died else "finished"
        print(f"hookloop: the launcher (pid {launcher}) {why}; ended the {len(killed)} process(es) of its "
              f"launch still running: {', '.join(killed)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
