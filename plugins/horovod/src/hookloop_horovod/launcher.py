"""The ``horovodrun`` launcher: the command line that starts a hookloop script's workers.

A plugin of the ``launcher`` role (contract 2.6): the ``horovod`` strategy names it as its
launcher (``hookloop_launcher``), with its ``hosts`` and ``launcher_args``.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any, Callable

import hookloop

#: Hosts for the launcher when neither code nor options name them (``hookloop run``
#: has no plugin options): ``HOOKLOOP_HOROVOD_HOSTS=host1:4,host2:4``.
HOSTS_ENV = "HOOKLOOP_HOROVOD_HOSTS"


def parse_hosts(hosts: str, slots_per_host: int) -> list[tuple[str, int]]:
    """``"host1:4,host2"`` -> ``[("host1", 4), ("host2", slots_per_host)]``.

    The format is horovodrun's ``-H``; a host without ``:slots`` runs ``devices``
    processes, as every host of a ``--devices N`` run does.
    """
    if not isinstance(hosts, str) or not hosts.strip():
        raise hookloop.ConfigurationError(
            f"horovod hosts={hosts!r} must be a string like 'host1:4,host2:4' "
            f"(horovodrun's -H: each host and its number of processes)"
        )
    parsed: list[tuple[str, int]] = []
    for entry in hosts.split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, sep, slots = entry.rpartition(":")
        if not sep:
            name, slots = entry, str(slots_per_host)
        if not name or not slots.isdigit() or int(slots) < 1:
            raise hookloop.ConfigurationError(
                f"horovod hosts={hosts!r}: {entry!r} is not HOST or HOST:SLOTS with SLOTS >= 1 "
                f"(e.g. 'host1:4,host2:4')"
            )
        if any(name == seen for seen, _ in parsed):
            raise hookloop.ConfigurationError(f"horovod hosts={hosts!r} names {name!r} twice")
        parsed.append((name, int(slots)))
    if not parsed:
        raise hookloop.ConfigurationError(f"horovod hosts={hosts!r} names no host")
    return parsed


def horovodrun_command(
    config: hookloop.TrainerConfig,
    script: str,
    script_args: list[str],
    hosts: str | None,
    launcher_args: list[str] | str | None,
) -> list[str]:
    """``python -m horovod.runner.launch -np N -H ... --gloo python script args``.

    On one machine: ``devices`` processes on ``localhost``. With ``hosts``, each host
    runs its slots (``devices`` when a host names none) and ``-np`` is their sum. The
    launcher and the workers run this process's interpreter by absolute path: horovodrun
    starts each worker's command through the shell with the caller's ``PATH``, where a
    bare ``python`` may be another interpreter (one without Horovod). Every host must
    therefore have this interpreter at the same path (the usual shared or identical venv).
    """
    per_node = config.num_processes()
    hosts = hosts if hosts is not None else (os.environ.get(HOSTS_ENV) or None)
    if hosts is None:
        if config.nodes > 1:
            raise hookloop.ConfigurationError(
                f"nodes={config.nodes} under horovod needs the hosts to start the workers "
                f"on: plugin option hosts='host1:{per_node},host2:{per_node}' "
                f"(plugin_options={{'horovod': {{'hosts': ...}}}}) or "
                f"{HOSTS_ENV}=host1:{per_node},host2:{per_node}. horovodrun runs on one "
                f"machine and starts the others over ssh."
            )
        placement = [("localhost", per_node)]
    else:
        placement = parse_hosts(hosts, per_node)
        if config.nodes > 1 and len(placement) != config.nodes:
            raise hookloop.ConfigurationError(
                f"nodes={config.nodes} but horovod hosts={hosts!r} names {len(placement)} "
                f"host(s): name one host per node, or leave nodes at 1 and let the hosts "
                f"decide"
            )
    processes = sum(slots for _, slots in placement)
    extra = shlex.split(launcher_args) if isinstance(launcher_args, str) else list(launcher_args or [])
    host_arg = ",".join(f"{name}:{slots}" for name, slots in placement)
    return [
        sys.executable, "-m", "horovod.runner.launch",
        "-np", str(processes), "-H", host_arg, "--gloo", *extra,
        sys.executable, script, *script_args,
    ]


class Horovodrun:
    """Start the workers with ``horovodrun`` (``python -m horovod.runner.launch``).

    Options: ``hosts`` (horovodrun's ``-H``, ``"host1:4,host2:4"``; default ``devices``
    workers on ``localhost``, or ``$HOOKLOOP_HOROVOD_HOSTS``) and ``launcher_args`` (extra
    horovodrun arguments, a list or a string). ``check`` (given by the ``horovod``
    strategy) checks the strategy's options in the launching process, before any worker
    starts. horovodrun (not elastic) never restarts a worker: ``max_restarts`` is refused.
    """

    hookloop_name = "horovodrun"
    hookloop_role = "launcher"
    hookloop_requires = ">=2.6,<3"

    def __init__(self, hosts: str | None = None, launcher_args: list[str] | str | None = None,
                 check: Callable[[], Any] | None = None):
        self.hosts = hosts
        self.launcher_args = launcher_args
        self.check = check

    @hookloop.hookimpl
    def launch_command(self, config, script, script_args):
        """``python -m horovod.runner.launch -np N -H localhost:N --gloo python script ...``.

        Horovod is checked here, so a missing build fails before any worker starts.
        ``--max-restarts`` is refused: horovodrun (not elastic) never restarts a worker.
        """
        if self.check is not None:
            self.check()
        if getattr(config, "max_restarts", 0):
            raise hookloop.ConfigurationError(
                f"horovod cannot restart failed workers (max_restarts={config.max_restarts}): horovodrun "
                f"ends the job when a worker dies, and Horovod Elastic (horovodrun --min-np/"
                f"--host-discovery-script) is not supported by hookloop-horovod. Drop --max-restarts and "
                f"re-run the job with ckpt_path='last', or use --plugins ddp, whose launcher restarts workers")
        from .backend import check_launcher

        check_launcher()
        return horovodrun_command(config, script, list(script_args), self.hosts, self.launcher_args)

    @hookloop.hookimpl
    def spawn(self, trainer, function):
        """Run in place when horovodrun was started by hand (``horovodrun -np 4 python
        train.py``): the workers already exist, and re-launching would nest horovodruns.
        Otherwise defer (``None``): hookloop's launcher starts horovodrun."""
        from .backend import under_horovod_launcher

        if not under_horovod_launcher() or hookloop.in_worker():
            return None
        result = function(trainer)
        return True if result is None else result
