"""A worker's failure, reported once (README "When a worker fails").

Two halves:

* in a worker that hookloop's launcher started (:data:`FAILURE_DIR_ENV` is set), an
  uncaught exception is not printed to the console: :func:`install_worker_hook` writes its
  traceback to ``<failure dir>/rank<R>.log`` and the elastic agent's error file
  (``TORCHELASTIC_ERROR_FILE``, torch's own format, plus the rank, host, time, type and
  message under ``extraInfo.hookloop``);
* the elastic agent runs as ``python -m hookloop.failures TORCHRUN_ARGS`` (what
  :func:`hookloop.distributed.launch.run_command` starts in place of ``python -m torch.distributed.run``):
  torch's agent, unchanged, whose ``ChildFailedError`` report is replaced by
  :func:`summary`: the first failing rank (by time) and host, the exception's type and
  message, where the tracebacks are, and one line for the ranks that the agent stopped
  after it.

Under the user's own ``torchrun`` (no :data:`FAILURE_DIR_ENV`), :func:`report_under_torchrun`
prints an error that every rank raises alike (a configuration error) from global rank 0
only, and writes the agent's error file so torchrun's report names the message.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from hookloop.distributed.ranks import ATTEMPT_ENV, attempt as worker_attempt

#: The folder where workers write their tracebacks (``rank<R>.log``); set by the launcher.
FAILURE_DIR_ENV = "HOOKLOOP_FAILURE_DIR"


def failure_dir(root: str | os.PathLike | None) -> Path:
    """A new folder for the failure logs of one launch: ``<root>/logs/failures/<time>-<pid>``
    (``root``: the Trainer's ``default_root_dir``, the working directory when ``None``).
    Created by the first worker that fails, so a run that succeeds leaves nothing."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    from hookloop.resume.storage import local_root

    # a root on a store: the failure logs stay in its local staging directory
    return local_root(root or os.getcwd()).absolute() / "logs" / "failures" / f"{stamp}-{os.getpid()}"


def _rank() -> str:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))


def record_failure(etype, value, tb) -> Path | None:
    """Write the exception's traceback to ``<failure dir>/rank<R>.log`` (appended: one
    section per elastic attempt) and to the agent's error file. Returns the log's path
    (``None`` when :data:`FAILURE_DIR_ENV` is not set)."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder:
        return None
    text = "".join(traceback.format_exception(etype, value, tb))
    rank, now = _rank(), time.time()
    attempt = worker_attempt()[0]
    path = Path(folder) / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as log:
        log.write(f"--- rank {rank}, attempt {attempt}, pid {os.getpid()}, "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}\n{text}\n")
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        data = {"message": {
            "message": f"{etype.__name__}: {value}",
            "extraInfo": {
                "py_callstack": text,
                "timestamp": str(int(now)),
                "hookloop": {"rank": rank, "host": socket.gethostname(), "time": now,
                             "type": etype.__name__, "text": str(value), "log": str(path),
                             "collective": _is_collective_failure(value)},
            },
        }}
        try:
            Path(error_file).parent.mkdir(parents=True, exist_ok=True)
            Path(error_file).write_text(json.dumps(data))
        except OSError:
            pass
    return path


#: Tests telling a failed collective from a cause; :mod:`hookloop.dist` (a layer above this
#: module) adds torch.distributed's when it is imported, as every training worker does.
COLLECTIVE_FAILURE_TESTS: list = []


def _is_collective_failure(value: BaseException) -> bool:
    """A collective that timed out or lost a peer: the consequence of another rank's
    failure (:func:`summary` names that rank first)."""
    try:
        from hookloop.contract.errors import CollectiveTimeoutError

        return isinstance(value, CollectiveTimeoutError) or any(test(value) for test in COLLECTIVE_FAILURE_TESTS)
    except Exception:  # noqa: BLE001 - never lose the error over its classification
        return False


def install_worker_hook() -> bool:
    """Replace ``sys.excepthook`` in a launched worker (``import hookloop`` calls it).

    * Started by hookloop's launcher (:data:`FAILURE_DIR_ENV` set): an uncaught exception
      is recorded by :func:`record_failure` and not printed (the launcher prints one
      summary for all ranks).
    * Started by another torch elastic agent (the user's own ``torchrun``:
      ``TORCHELASTIC_RUN_ID`` and ``LOCAL_RANK`` set): :func:`report_under_torchrun`.

    Returns whether a hook is installed. ``SystemExit`` (a preempted worker's 143) never
    reaches it."""
    if "LOCAL_RANK" not in os.environ:
        return False
    previous = sys.excepthook
    if os.environ.get(FAILURE_DIR_ENV):
        _terminal_streams()

        def hook(etype, value, tb):
            try:
                path = record_failure(etype, value, tb)
            except Exception:  # noqa: BLE001 - never lose the error: print it as Python would
                path = None
            if path is None:
                previous(etype, value, tb)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        def hook(etype, value, tb):
            report_under_torchrun(etype, value, tb, previous)
    else:
        return False
    sys.excepthook = hook
    return True


#: How long a rank other than 0 waits for global rank 0 to confirm that it raised the same
#: error (:func:`report_under_torchrun`) before it prints its own traceback after all.
SAME_ERROR_WAIT_S = 30.0


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _agent_store(timeout: float):
    """A client of the torch elastic agent's store (``MASTER_ADDR:MASTER_PORT``, hosted by
    the agent while its workers run: ``TORCHELASTIC_USE_AGENT_STORE``); ``None`` when
    the workers do not use one or it cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore

        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                        timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no store: every rank prints its own traceback
        return None


def _write_error_file(message: str, value: BaseException, now: float) -> None:
    """The agent's error file (``TORCHELASTIC_ERROR_FILE``) in torch's format, holding the
    exception's last line and no traceback: torchrun's ``ChildFailedError`` report then
    names the error instead of "To enable traceback see ...", and the traceback is not
    printed a second time. A file already there (``@record`` wrote one) is left as is."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or os.path.exists(error_file):
        return
    data = {"message": {"message": message, "extraInfo": {
        "timestamp": str(int(now)),
        "hookloop": {"rank": _rank(), "host": socket.gethostname(), "time": now,
                     "type": type(value).__name__, "text": str(value)},
    }}}
    try:
        Path(error_file).parent.mkdir(parents=True, exist_ok=True)
        Path(error_file).write_text(json.dumps(data))
    except OSError:
        pass


def report_under_torchrun(etype, value, tb, printer=sys.__excepthook__) -> None:
    """Print an uncaught exception of a worker that the user's own ``torchrun`` started.

    An error marked as raised alike by every rank (:func:`hookloop.contract.errors.same_on_every_rank`:
    a configuration error) is printed in full by global rank 0 alone: rank 0 prints it,
    then (at exit, once the traceback is out) confirms it in the agent's store; another
    rank waits for that confirmation (at most :data:`SAME_ERROR_WAIT_S`) and, when rank 0
    raised the same type and message, prints one line (``rank 1: the same
    ConfigurationError as rank 0 (printed there)``), else its own traceback. Any other error is printed by ``printer`` (Python's way) on
    every rank. Each rank writes the agent's error file (:func:`_write_error_file`).
    Nothing is swallowed: the process still exits 1."""
    from hookloop.contract.errors import same_on_every_rank

    now = time.time()
    message = traceback.format_exception_only(etype, value)[-1].strip()
    rank = _rank()
    note = None
    waited = False
    key = f"hookloop/same_error/{worker_attempt()[0]}"
    try:
        if same_on_every_rank(value) and _world_size() > 1 and rank != "0":
            store = _agent_store(SAME_ERROR_WAIT_S)
            if store is not None:
                waited = True
                try:
                    store.wait([key])
                    if store.get(key).decode() == message:
                        note = f"hookloop: rank {rank}: the same {etype.__name__} as rank 0 (printed there)"
                except Exception:  # noqa: BLE001 - rank 0 did not confirm in time: print ours
                    note = None
    except Exception:  # noqa: BLE001 - never lose the error
        note = None
    if note is None:
        printer(etype, value, tb)
    else:
        print(note, file=sys.stderr, flush=True)
    sys.stderr.flush()
    _write_error_file(message, value, now)
    if waited:
        _acknowledge(key)  # printed, the one line or its own traceback: rank 0 may exit
    if rank == "0" and same_on_every_rank(value) and _world_size() > 1:
        # at exit, after this hook returned: torch.distributed's own hook (around this one
        # once a process group exists) writes the traceback to stderr only then
        import atexit

        atexit.register(_confirm_same_error, key, message)


#: How long global rank 0 stays alive after confirming an error, for the other ranks to
#: print their one line (:func:`_confirm_same_error`): the agent stops the workers left
#: (SIGTERM) as soon as one exits, and on a loaded machine a rank woken by the
#: confirmation could be killed before its line was out.
SAME_ERROR_ACK_WAIT_S = 10.0


def _acknowledge(key: str) -> None:
    """A rank other than 0, its one line printed: count itself in rank 0's wait."""
    store = _agent_store(5.0)
    if store is not None:
        try:
            store.add(f"{key}/printed", 1)
        except Exception:  # noqa: BLE001 - rank 0 stops waiting at its timeout
            pass


def _confirm_same_error(key: str, message: str) -> None:
    """Global rank 0, its traceback printed: tell the other ranks
    (:func:`report_under_torchrun`), then wait (at most :data:`SAME_ERROR_ACK_WAIT_S`)
    until those that raised the same error have printed their line, so that rank 0's
    exit, which makes the agent stop the rest, does not cut them off."""
    store = _agent_store(5.0)
    if store is None:
        return
    try:
        store.set(key, message)
        deadline = time.monotonic() + SAME_ERROR_ACK_WAIT_S
        while store.add(f"{key}/printed", 0) < _world_size() - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - they print their own tracebacks after their wait
        pass


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


#: Set (True) by the agent on each ``ProcessFailure`` that was there before it began to
#: stop the other workers (:func:`_mark_failures_before_stopping`): a rank that failed by
#: itself. A failure without it, in a launch where some have it, is a rank the agent
#: stopped (SIGTERM, then SIGKILL after its grace period).
FAILED_BY_ITSELF = "hookloop_failed_by_itself"


def summary(failures: dict, name: str = "", output: str | os.PathLike | None = None) -> tuple[list[str], int]:
    """The lines that report a failed launch, and its exit status, from torch's
    ``ChildFailedError.failures`` (global rank -> ``ProcessFailure``).

    The headline names the cause, the same rank whatever the timing: a recorded Python
    exception (:func:`record_failure`; the earliest) other than a collective's failure,
    else a rank that died by itself without one (an exit status, else a signal: SIGKILL,
    a segfault), else a collective that failed (timed out, lost a peer: the failure of a
    rank that hung), else the earliest. A collective's failure after the cause is reported
    as its consequence; ranks the agent stopped are one line. Then where the tracebacks
    are (and, with ``output``, the folder of every rank's stdout and stderr:
    :func:`capture_worker_output`)."""
    def info(failure) -> dict:
        data = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
        extra = data.get("extraInfo", {}) if isinstance(data, dict) else {}
        return extra.get("hookloop") or {}

    # Whether the agent said which failures came before it stopped anyone (agent_main).
    known = any(getattr(f, FAILED_BY_ITSELF, False) for f in failures.values())

    def by_itself(failure) -> bool:
        if known:
            return bool(getattr(failure, FAILED_BY_ITSELF, False))
        return failure.exitcode != -signal.SIGTERM  # SIGTERM is what the agent sends the others

    def order(item):
        rank, failure = item
        found = info(failure)
        if found and not found.get("collective"):
            return (0, found.get("time", 0.0), rank)
        if not found and by_itself(failure):
            # The errors' times are whole seconds, alike for all: an exit status first.
            return (1 if failure.exitcode > 0 else 2, failure.timestamp, rank)
        if found:
            return (3, found.get("time", 0.0), rank)
        return (4, failure.timestamp, rank)

    ranked = sorted(failures.items(), key=order)
    rank, first = ranked[0]
    found = info(first)
    host = found.get("host") or socket.gethostname()
    what = f" of {Path(name).name}" if name else ""
    lines, same = [], []
    if found:
        lines.append(f"hookloop: rank {rank}{what} failed first (host {host}): {found['type']}: {found['text']}")
        same = [r for r, f in ranked[1:] if (i := info(f)) and (i.get("type"), i.get("text")) == (found["type"], found["text"])]
        if same:
            lines.append(f"hookloop: rank{'s' if len(same) > 1 else ''} {', '.join(map(str, same))} raised the same error")
    else:
        how = (f"was stopped by {_signal_name(first.exitcode)}" if first.exitcode < 0
               else f"exited with status {first.exitcode}")
        lines.append(f"hookloop: rank {rank}{what} failed first (host {host}): it {how} (no Python exception was recorded)")
    recorded = [(r, info(f)) for r, f in ranked[1:] if r not in same and info(f)]
    consequences = [(r, i) for r, i in recorded if i.get("collective") and not found.get("collective")]
    for r, i in consequences:
        lines.append(f"hookloop: then rank {r} failed in a collective, a consequence: {i['type']}: {i['text']}")
    logs = sorted({str(Path(i["log"])) for _, f in ranked if (i := info(f)).get("log")})
    for log in logs:
        lines.append(f"hookloop: traceback: {log}")
    rest = [(r, f) for r, f in ranked[1:] if r not in same and not info(f)]
    if rest:
        parts = [f"{r} ({_signal_name(f.exitcode) if f.exitcode < 0 else f'status {f.exitcode}'})" for r, f in rest]
        lines.append(f"hookloop: then stopped: rank{'s' if len(parts) > 1 else ''} {', '.join(parts)}")
    for r, i in recorded:
        if (r, i) not in consequences:
            lines.append(f"hookloop: rank {r} also failed: {i['type']}: {i['text']}")
    if output is not None:
        lines.append(f"hookloop: every rank's output: {output} (attempt_<N>/rank<R>/stdout.log, stderr.log)")
    # A recorded exception exits 1 (Python's status for it), even where the agent's SIGTERM
    # reached that rank after it recorded the error and before it had exited (seen: 143).
    code = 1 if found else first.exitcode if first.exitcode > 0 else 128 - first.exitcode
    return lines, code


def _mark_failures_before_stopping() -> None:
    """Make torch's process context mark (:data:`FAILED_BY_ITSELF`) the failures it has
    when it begins to stop the other workers: they failed by themselves; those it records
    after are the workers it stopped. :func:`summary` then names the cause, not a rank
    whose collective failed because the cause had died. Without torch's ``PContext.close``
    (another torch), nothing is marked and :func:`summary` goes by the signals."""
    try:
        from torch.distributed.elastic.multiprocessing.api import PContext
    except ImportError:
        return
    close = getattr(PContext, "close", None)
    if close is None or getattr(close, "_hookloop_marking", False):
        return

    def closing(self, *args, **kwargs):
        # close() runs again later (the agent's _stop_workers): what appeared after the
        # first one was stopped by it.
        stopping_first = not getattr(self, "_hookloop_stopped", False)
        for failure in (getattr(self, "_failures", None) or {}).values():
            if not hasattr(failure, FAILED_BY_ITSELF):
                try:
                    setattr(failure, FAILED_BY_ITSELF, stopping_first)
                except AttributeError:
                    pass
        self._hookloop_stopped = True
        return close(self, *args, **kwargs)

    closing._hookloop_marking = True  # type: ignore[attr-defined]
    PContext.close = closing


def _report_restarted_failures() -> None:
    """Print :func:`summary` for a failed attempt that the agent restarts too (its
    workers' tracebacks are in the logs, not on the console)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def reporting(self, worker_group):
        result = monitor(self, worker_group)
        left = getattr(self, "_remaining_restarts", 0)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures and left > 0:
            spec = worker_group.spec
            script = next((str(a) for a in spec.args if str(a).endswith(".py")), spec.get_entrypoint_name() or "")
            if _CONSOLE is not None:
                _CONSOLE.drain()  # the workers' last lines before the summary
            lines, _ = summary(result.failures, script, _CONSOLE.folder if _CONSOLE is not None else None)
            lines.append(f"hookloop: restarting the workers ({left} restart{'s' if left > 1 else ''} left)")
            print("\n".join(lines), file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = reporting


def _elastic_range(nnodes: str) -> bool:
    low, _, high = str(nnodes).partition(":")
    return bool(high) and low.strip() != high.strip()


def _export_rendezvous_round() -> None:
    """In an elastic job (``--nnodes=MIN:MAX``), give the workers the rendezvous round as
    their attempt (``HOOKLOOP_ATTEMPT``). torch's ``TORCHELASTIC_RESTART_COUNT`` counts
    this agent's restarts after failures only: a membership change (a node joins) restarts
    the workers with the count as it was, and the node that joined counts from 0, so the
    workers of one round would disagree on their attempt (and on their process group's
    keys in the store). The round is the same on every node of a rendezvous and grows with
    every new one: 0 for the job's first, more for every restart, whatever caused it."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    rendezvous = SimpleElasticAgent._rendezvous
    if getattr(rendezvous, "_hookloop_round", False):
        return

    def joining(self, worker_group):
        result = rendezvous(self, worker_group)
        # the handler's state after the round completed (no public accessor in torch 2.13)
        state = getattr(getattr(worker_group.spec.rdzv_handler, "_state_holder", None), "state", None)
        if isinstance(getattr(state, "round", None), int):
            os.environ[ATTEMPT_ENV] = str(state.round)  # the workers' environment copies this one's
        return result

    global _ROUNDS
    joining._hookloop_round = True  # type: ignore[attr-defined]
    SimpleElasticAgent._rendezvous = joining
    _ROUNDS = True


#: whether this agent gives its workers the rendezvous round as their attempt
_ROUNDS = False


def agent_main(argv: list[str]) -> int:
    """torch's elastic agent (``torch.distributed.run``) with ``argv``; a failure of its
    workers is printed as :func:`summary`'s lines instead of torch's report. With
    :data:`FAILURE_DIR_ENV` set (hookloop's launcher sets it), every worker's stdout and
    stderr are kept in that folder and copied to this console (:func:`capture_worker_output`)."""
    global _CONSOLE
    import logging

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Its "failed (exitcode...)" and "Sending process ... SIGTERM" lines say what the
    # summary says; restarts (the agent's own logger) are still reported.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    _report_restarted_failures()
    _mark_failures_before_stopping()
    args = torchrun.parse_args(argv)
    if _elastic_range(args.nnodes):
        _export_rendezvous_round()
        # torch 2.13's shared TCP store: the group's rank 0 publishes the store's address
        # in the first round only, so a node that joins a later round (the job growing
        # back) waits for it until the rendezvous times out ("wait timeout ...
        # torch.rendezvous.<id>.<round>/MASTER_ADDR"). Unshared, rank 0 publishes a
        # store of its own in every round (docs/decisions.md, "Elastic membership").
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    folder = os.environ.get(FAILURE_DIR_ENV)
    if folder:
        _CONSOLE = capture_worker_output(Path(folder), torchrun)
    failed = False
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        failed = True
        if _CONSOLE is not None:
            _CONSOLE.stop()
        lines, code = summary(exc.failures, exc.name, _CONSOLE.folder if _CONSOLE is not None else None)
        print("\n".join(lines), file=sys.stderr, flush=True)
        return code
    except BaseException:
        failed = True
        raise
    finally:
        if _CONSOLE is not None:
            _CONSOLE.stop()
            if not failed:
                _CONSOLE.remove_if_clean()
    return 0


#: The copier of the workers' output in this agent (:func:`capture_worker_output`).
_CONSOLE = None
#: Set in a worker's environment: its stdout/stderr (redirected to a log file) end on a
#: terminal (the launcher's), as a comma-separated list (``stdout,stderr``).
CONSOLE_TTY_ENV = "HOOKLOOP_CONSOLE_TTY"


class _Console:
    """Copy the workers' log files to this process's stdout and stderr as they grow:
    the bytes as written (no rank prefix, ``\\r`` kept: a progress bar redraws as before),
    in order within each file, polled every ``interval`` seconds by one thread."""

    def __init__(self, folder: Path, interval: float = 0.05):
        import threading

        self.folder = folder
        self.interval = interval
        self._files: list[list] = []  # [path, destination (binary), open file or None]
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hookloop-worker-output", daemon=True)
        self._thread.start()

    def add(self, path: str, destination) -> None:
        with self._lock:
            self._files.append([path, destination, None])

    def drain(self) -> None:
        with self._lock:
            for entry in self._files:
                path, destination, handle = entry
                if handle is False:
                    continue
                if handle is None:
                    try:
                        handle = entry[2] = open(path, "rb")
                    except OSError:
                        continue
                data = handle.read()
                if data:
                    try:
                        destination.write(data)
                        destination.flush()
                    except (OSError, ValueError):
                        pass

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            self.drain()

    def stop(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._thread.join()
        self.drain()
        with self._lock:
            for entry in self._files:
                if entry[2]:
                    entry[2].close()
                entry[2] = False  # copied: never again

    def remove_if_clean(self) -> None:
        """After a run that succeeded at its first attempt, remove the folder (the output
        was on the console): only a failed or restarted launch leaves one."""
        import shutil

        if not any(self.folder.glob("rank*.log")) and not any(
                p.name != "attempt_0" for p in self.folder.glob("attempt_*")):
            shutil.rmtree(self.folder, ignore_errors=True)
            try:  # and logs/failures when it is left empty
                self.folder.parent.rmdir()
                self.folder.parent.parent.rmdir()
            except OSError:
                pass


def capture_worker_output(folder: Path, torchrun) -> _Console:
    """Make the agent that ``torchrun.run`` starts write each worker's stdout and stderr to
    ``<folder>/attempt_<N>/rank<R>/stdout.log`` and ``stderr.log`` (``R`` the global rank;
    its ``error.json`` beside them) and copy them, as they grow, to this console
    (:class:`_Console`). The workers run with ``PYTHONUNBUFFERED=1`` (a print reaches the
    file, and the console, at once, as on a terminal) and, where this process's streams
    are terminals, :data:`CONSOLE_TTY_ENV` (their ``isatty()`` says so, as before:
    progress bars draw; ``COLUMNS``/``LINES`` give the terminal's size). Returns the
    copier; :func:`agent_main` stops it before printing the summary."""
    import shutil

    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    console = _Console(folder)
    terminals = [name for name in ("stdout", "stderr") if getattr(getattr(sys, name), "isatty", lambda: False)()]
    size = shutil.get_terminal_size() if terminals else None

    class WorkerLogs(LogsSpecs):
        def __init__(self):
            super().__init__(log_dir=str(folder))

        @property
        def root_log_dir(self) -> str:
            return str(folder)

        def reify(self, envs):
            stdouts, stderrs, errors = {}, {}, {}
            for local_rank, env in envs.items():
                # an elastic job's attempt is its rendezvous round (_export_rendezvous_round)
                restart = (os.environ.get(ATTEMPT_ENV) if _ROUNDS else None) or env.get("TORCHELASTIC_RESTART_COUNT", "0")
                where = folder / f"attempt_{restart}" / f"rank{env.get('RANK', local_rank)}"
                shutil.rmtree(where, ignore_errors=True)
                where.mkdir(parents=True)
                stdouts[local_rank] = str(where / "stdout.log")
                stderrs[local_rank] = str(where / "stderr.log")
                errors[local_rank] = str(where / "error.json")
                env["TORCHELASTIC_ERROR_FILE"] = errors[local_rank]
                env.setdefault("PYTHONUNBUFFERED", "1")
                if terminals:
                    env[CONSOLE_TTY_ENV] = ",".join(terminals)
                    env.setdefault("COLUMNS", str(size.columns))
                    env.setdefault("LINES", str(size.lines))
                console.add(stdouts[local_rank], sys.stdout.buffer)
                console.add(stderrs[local_rank], sys.stderr.buffer)
            return LogsDest(stdouts, stderrs, {}, {}, errors)

    configure = torchrun.config_from_args

    def config_from_args(args):
        config, cmd, cmd_args = configure(args)
        config.logs_specs = WorkerLogs()
        return config, cmd, cmd_args

    torchrun.config_from_args = config_from_args
    return console


class _TerminalStream:
    """A worker's stdout or stderr that goes to a log file which the launcher copies to its
    terminal (:data:`CONSOLE_TTY_ENV`): ``isatty()`` is True, as for the console it ends
    on; everything else is the stream's."""

    def __init__(self, stream):
        self._stream = stream

    def isatty(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _terminal_streams() -> None:
    for name in os.environ.get(CONSOLE_TTY_ENV, "").split(","):
        stream = getattr(sys, name, None) if name in ("stdout", "stderr") else None
        if stream is not None and not stream.isatty():
            setattr(sys, name, _TerminalStream(stream))


if __name__ == "__main__":
    raise SystemExit(agent_main(sys.argv[1:]))
