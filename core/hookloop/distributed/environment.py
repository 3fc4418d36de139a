"""Where a worker learns its place in the job, from the variables its launcher set.

:meth:`ClusterEnvironment.detect` reads one launcher's variables, in this order (the
innermost launcher first: a torchrun inside an ``mpirun``, or an ``mpirun`` inside a SLURM
allocation, is the one that started this process):

``torchrun``
    torchrun (``hookloop run``, ``python -m torch.distributed.run``) and ``ddp_spawn``:
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the
    node), ``MASTER_ADDR``, ``MASTER_PORT``. ``LOCAL_RANK`` is what tells it apart.
``lsf``
    LSF's ``jsrun``: ``JSM_NAMESPACE_RANK``, ``JSM_NAMESPACE_SIZE``,
    ``JSM_NAMESPACE_LOCAL_RANK`` (``JSM_NAMESPACE_LOCAL_SIZE``), ``LSB_JOBID`` and the rank
    file ``LSB_DJOB_RANKFILE`` (one line per slot; its first line is the launch node,
    which runs no task). The rendezvous is the first compute host of the rank file, the
    port ``10000 + LSB_JOBID % 1000`` (Lightning's ``LSFEnvironment`` rules); the node rank
    is this host's position among the file's compute hosts.
``mpi``
    ``mpirun``: OpenMPI's ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``; MPICH's and Intel MPI's
    (Hydra) ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``. mpirun
    sets no rendezvous: ``MASTER_ADDR``/``MASTER_PORT`` when set; else, on one node,
    127.0.0.1 and a port every rank derives from the job's id (``OMPI_MCA_ess_base_jobid``,
    ``PMIX_NAMESPACE``, ``PMI_JOBID``); on several nodes ``MASTER_ADDR`` is required
    (docs/decisions.md, "The rendezvous of an mpirun job").
``kubeflow``
    Kubeflow's PyTorchJob/TrainJob, one process per pod: ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` without torchrun's ``LOCAL_RANK`` (or, without
    ``RANK``, torchrun's ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
    ``PET_MASTER_PORT`` with ``PET_NPROC_PER_NODE=1``). Local rank 0, node rank = rank.
``slurm``
    a SLURM job step (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
    ``SLURM_NODEID`` and the node list, from which the rendezvous address is derived (its
    first host, as ``scontrol show hostnames`` expands it, or :func:`expand_hostlist` where
    ``scontrol`` is not installed).
``single``
    none of these: a world of one.

A contradiction (a rank not below the world size, two launchers' variables naming other
ranks, a value that is not a number) is a :class:`~hookloop.ConfigurationError` naming the
variables and the fix. ``hookloop env`` prints what this module detects.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from hookloop.contract.errors import ConfigurationError

#: The sources :meth:`ClusterEnvironment.detect` can answer, innermost launcher first.
SOURCES = ("torchrun", "lsf", "mpi", "kubeflow", "slurm", "single")
#: The sources whose processes a launcher outside hookloop started (mpirun, jsrun, the
#: Kubeflow operator): a Trainer there trains in the process, it never starts workers.
EXTERNAL_SOURCES = ("lsf", "mpi", "kubeflow")
#: Who sets each source's variables, for errors.
LAUNCHERS = {"torchrun": "torchrun", "lsf": "jsrun", "mpi": "mpirun",
             "kubeflow": "the Kubeflow operator",
             "slurm": "srun", "single": "the launcher"}


@dataclass(frozen=True)
class ClusterEnvironment:
    """This process's ranks and the address of the rendezvous, as the launcher set them.

    ``source`` names the launcher whose variables were read (:data:`SOURCES`);
    ``variables`` the ``(name, value)`` pairs read that were set, in the order read
    (not compared: two environments with the same ranks are equal)."""

    world_size: int
    global_rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    source: str  # one of SOURCES
    variables: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def creates_processes_externally(self) -> bool:
        """Whether a launcher outside hookloop started this job's processes (mpirun,
        jsrun, the Kubeflow operator): a Trainer asking for several then trains here."""
        return self.source in EXTERNAL_SOURCES

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
        """Read ``environ`` (default: this process's environment): torchrun's variables
        first, then LSF's, MPI's, Kubeflow's, SLURM's, else a world of one.

        Raises :class:`~hookloop.ConfigurationError` for variables that contradict each
        other or are not numbers, naming them and the fix."""
        env = _Reader(os.environ if environ is None else environ)
        for detector in (_torchrun, _lsf, _mpi, _kubeflow, _slurm):
            found = detector(env)
            if found is not None:
                break
        else:
            found = _Found(1, 0, 0, 1, 0, env.get("MASTER_ADDR"), env.int("MASTER_PORT"), "single")
        found.check()
        return cls(found.world_size, found.global_rank, found.local_rank, found.local_world_size,
                   found.node_rank, found.master_addr, found.master_port, found.source,
                   tuple(env.read.items()))


def launched_externally(environ: Mapping[str, str] | None = None) -> bool:
    """Whether mpirun, LSF's jsrun or the Kubeflow operator started this process (see
    :attr:`ClusterEnvironment.creates_processes_externally`). Cheap: reads variables only,
    and raises nothing (a contradiction is reported where the ranks are read)."""
    env = os.environ if environ is None else environ
    if "LOCAL_RANK" in env:
        return False  # torchrun's worker
    keys = ("JSM_NAMESPACE_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE", "PET_NNODES")
    return any(env.get(key) not in (None, "") for key in keys)


# ---------------------------------------------------------------------------------------
# Reading variables
# ---------------------------------------------------------------------------------------

class _Reader:
    """The environment, remembering every variable read that was set (``hookloop env``
    prints them) and reading integers with an error that names the variable."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ
        self.read: dict[str, str] = {}

    def has(self, *names: str) -> bool:
        return all(self.environ.get(name) not in (None, "") for name in names)

    def get(self, *names: str) -> str | None:
        """The first of ``names`` that is set (and not empty)."""
        for name in names:
            value = self.environ.get(name)
            if value not in (None, ""):
                self.read[name] = value
                return value
        return None

    def named(self, *names: str) -> str | None:
        """Which of ``names`` :meth:`get` would read."""
        return next((name for name in names if self.environ.get(name) not in (None, "")), None)

    def int(self, *names: str, default: int | None = None) -> int | None:
        """The first of ``names`` that is set, as an int; ``default`` when none is."""
        name = self.named(*names)
        if name is None:
            return default
        text = self.get(name) or ""
        try:
            return int(text.strip())
        except ValueError:
            raise ConfigurationError(
                f"{name}={text!r} is not a whole number: the launcher (or your job script) set it; "
                "unset it or give it a number") from None


@dataclass(frozen=True)
class _Found(ClusterEnvironment):
    """One launcher's answer, with the variable each number came from (for errors)."""

    names: dict[str, str] = field(default_factory=dict, compare=False)  # field -> variable
    #: why the processes cannot meet (no rendezvous address or port), raised by
    #: :meth:`check` after the ranks themselves were found consistent
    problem: str | None = field(default=None, compare=False)

    def name(self, what: str) -> str:
        return self.names.get(what, what)

    def check(self) -> None:
        """Refuse numbers that cannot describe one process of one job."""
        world, rank = self.world_size, self.global_rank
        if world < 1:
            raise ConfigurationError(
                f"{self.name('world_size')}={world}: a job has at least one process; "
                f"{LAUNCHERS[self.source]}'s variables are wrong or were overwritten by your job "
                "script")
        if not 0 <= rank < world:
            raise ConfigurationError(
                f"{self.name('global_rank')}={rank} is not a rank of a world of "
                f"{self.name('world_size')}={world} (0 to {world - 1}): the variables of two jobs "
                "are mixed, or your job script sets one of them; unset what you set and let "
                f"{LAUNCHERS[self.source]} set both")
        if not 1 <= self.local_world_size <= world:
            raise ConfigurationError(
                f"{self.name('local_world_size')}={self.local_world_size} processes on this node "
                f"is not between 1 and {self.name('world_size')}={world}: unset it, or set it to "
                "the number of processes started on each node")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigurationError(
                f"{self.name('local_rank')}={self.local_rank} is not a local rank of the "
                f"{self.name('local_world_size')}={self.local_world_size} processes on this node "
                f"(0 to {self.local_world_size - 1})")
        if self.node_rank < 0:
            raise ConfigurationError(
                f"{self.name('node_rank')}={self.node_rank}: a node rank is >= 0")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigurationError(
                f"{self.name('master_port')}={self.master_port} is not a TCP port (1 to 65535): "
                "set MASTER_PORT to a free port that every process of the job can reach")
        if self.problem is not None:
            raise ConfigurationError(self.problem)


def _job_port(job_id: str | int, span: int = 20000) -> int:
    """A port every process of a job derives alike from the job's id (a number, or a
    namespace such as OpenMPI 5's ``prterun-host-1234@1``): ``10000 + id % span``."""
    text = str(job_id).strip()
    number = int(text) if text.isdigit() else zlib.crc32(text.encode())
    return 10000 + number % span


# ---------------------------------------------------------------------------------------
# The launchers, innermost first
# ---------------------------------------------------------------------------------------

def _torchrun(env: _Reader) -> _Found | None:
    if not env.has("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        return None
    world = env.int("WORLD_SIZE") or 0
    return _Found(world, env.int("RANK") or 0, env.int("LOCAL_RANK") or 0,
                  env.int("LOCAL_WORLD_SIZE", default=world) or 0,
                  env.int("GROUP_RANK", "NODE_RANK", default=0) or 0,
                  env.get("MASTER_ADDR"), env.int("MASTER_PORT"), "torchrun",
                  names={"world_size": "WORLD_SIZE", "global_rank": "RANK",
                         "local_rank": "LOCAL_RANK", "local_world_size": "LOCAL_WORLD_SIZE",
                         "node_rank": env.named("GROUP_RANK", "NODE_RANK") or "",
                         "master_port": "MASTER_PORT"})


def _lsf(env: _Reader) -> _Found | None:
    if not env.has("JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK"):
        return None
    world, rank = env.int("JSM_NAMESPACE_SIZE") or 0, env.int("JSM_NAMESPACE_RANK") or 0
    hosts = _rankfile_hosts(env)
    distinct = list(dict.fromkeys(hosts))
    here = socket.gethostname()
    if here not in distinct:
        raise ConfigurationError(
            f"this host ({here}) is not among the compute hosts of "
            f"LSB_DJOB_RANKFILE={env.get('LSB_DJOB_RANKFILE')} ({', '.join(distinct)}): the rank "
            "file belongs to another job, or the hosts are named differently there; start the job "
            "with jsrun inside its bsub allocation, or set MASTER_ADDR and NODE_RANK")
    port = env.int("MASTER_PORT")
    if port is None:
        job = env.get("LSB_JOBID")
        if job is None:
            raise ConfigurationError(
                "jsrun's JSM_NAMESPACE_* variables are set but LSB_JOBID is not, so the ranks "
                "cannot agree on a port: run inside an LSF job (bsub), or set MASTER_PORT")
        port = _job_port(job, span=1000)  # Lightning's LSFEnvironment: 10000 + id % 1000
    found = _Found(world, rank, env.int("JSM_NAMESPACE_LOCAL_RANK", default=0) or 0,
                   env.int("JSM_NAMESPACE_LOCAL_SIZE", default=max(1, world // len(distinct))) or 0,
                   env.int("NODE_RANK", default=distinct.index(here)) or 0,
                   env.get("MASTER_ADDR") or distinct[0], port, "lsf",
                   names={"world_size": "JSM_NAMESPACE_SIZE", "global_rank": "JSM_NAMESPACE_RANK",
                    "local_rank": "JSM_NAMESPACE_LOCAL_RANK",
                    "local_world_size": "JSM_NAMESPACE_LOCAL_SIZE",
                    "node_rank": "NODE_RANK", "master_port": "MASTER_PORT"})
    # jsrun (IBM Spectrum MPI) sets OpenMPI's variables too: they must name the same rank.
    _agree(env, found, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
    _agree(env, found, "RANK", "WORLD_SIZE")
    return found


def _rankfile_hosts(env: _Reader) -> list[str]:
    path = env.get("LSB_DJOB_RANKFILE")
    if path is None:
        raise ConfigurationError(
            "jsrun's JSM_NAMESPACE_* variables are set but LSB_DJOB_RANKFILE is not, so the "
            "rendezvous host is unknown: run inside an LSF job (bsub), or set MASTER_ADDR, "
            "MASTER_PORT and NODE_RANK")
    try:
        with open(path) as file:
            lines = [line.strip() for line in file if line.strip()]
    except OSError as exc:
        raise ConfigurationError(
            f"LSB_DJOB_RANKFILE={path} cannot be read ({exc.strerror}): the rendezvous host is its "
            "first compute host; run inside the LSF job that wrote it") from None
    hosts = lines[1:]  # the first line is the launch node, which runs no task
    if not hosts:
        raise ConfigurationError(
            f"LSB_DJOB_RANKFILE={path} names no compute host (a rank file lists the launch node, "
            "then one line per slot): run inside an LSF job, or set MASTER_ADDR")
    return hosts


def _mpi(env: _Reader) -> _Found | None:
    size_name = env.named("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if size_name is None:
        return None
    openmpi = size_name.startswith("OMPI_")
    names = {
        "world_size": size_name,
        "global_rank": "OMPI_COMM_WORLD_RANK" if openmpi else "PMI_RANK",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK" if openmpi else "MPI_LOCALRANKID",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE" if openmpi else "MPI_LOCALNRANKS",
        "node_rank": "NODE_RANK", "master_port": "MASTER_PORT",
    }
    world = env.int(size_name) or 0
    rank = env.int(names["global_rank"])
    if rank is None:
        raise ConfigurationError(
            f"{size_name} is set but {names['global_rank']} is not: start the job with mpirun (or "
            f"unset {size_name} if your job script set it)")
    local_world = env.int(names["local_world_size"], default=world) or 0
    local = env.int(names["local_rank"], default=rank if local_world == world else 0) or 0
    # OMPI_COMM_WORLD_NODE_RANK is *not* the node's index (it counts processes on the node
    # across jobs). With mpirun's default placement (by slot) a node's ranks are contiguous.
    node = env.int("NODE_RANK", default=(rank - local) // max(local_world, 1)) or 0
    addr, port = env.get("MASTER_ADDR"), env.int("MASTER_PORT")
    problem = None
    if local_world == world:
        addr = addr or "127.0.0.1"  # one node
    elif addr is None and world > 1:
        problem = (
            f"mpirun started {world} processes on several nodes "
            f"({names['local_world_size']}={local_world} on this one) but MASTER_ADDR is not set, "
            "and mpirun gives no rendezvous address: pass the first node's address to every rank, "
            "e.g. `mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...`")
    if port is None:
        job = env.get("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_JOBID")
        if job is None and world > 1:
            problem = problem or (
                f"mpirun started {world} processes but sets no job id to derive a port from, and "
                "MASTER_PORT is not set: pass one to every rank (`mpirun -x MASTER_PORT=29500 "
                "...`)")
        port = _job_port(job) if job is not None else None
    found = _Found(world, rank, local, local_world, node, addr, port, "mpi", names=names,
                   problem=problem)
    _agree(env, found, "RANK", "WORLD_SIZE")
    return found


def _kubeflow(env: _Reader) -> _Found | None:
    # torchrun's PET_* variables mean "start torchrun here"; one process per pod may skip it.
    # ("auto", "gpu" or "cpu" let torchrun count the devices: no count to check here.)
    per_pod = (env.get("PET_NPROC_PER_NODE") or "").strip()
    nproc = int(per_pod) if per_pod.isdigit() else None
    if env.has("RANK", "WORLD_SIZE"):
        world, rank = env.int("WORLD_SIZE") or 0, env.int("RANK") or 0
        names = {"world_size": "WORLD_SIZE", "global_rank": "RANK", "node_rank": "RANK"}
    elif env.has("PET_NNODES"):
        world, rank = env.int("PET_NNODES") or 0, env.int("PET_NODE_RANK", default=0) or 0
        names = {"world_size": "PET_NNODES", "global_rank": "PET_NODE_RANK",
                 "node_rank": "PET_NODE_RANK"}
    else:
        return None
    if nproc is not None and nproc > 1:
        raise ConfigurationError(
            f"PET_NPROC_PER_NODE={nproc} asks for {nproc} processes per pod, which torchrun "
            "starts, but this process was not started by torchrun (no LOCAL_RANK): make the "
            "container's command `torchrun <script>` (or `hookloop run --plugins ddp --devices "
            f"{nproc} <script>`), or set numProcPerNode to 1")
    if env.has("RANK", "PET_NNODES") and (nproc or 1) == 1:
        nnodes = env.int("PET_NNODES") or 0
        if nnodes != world:
            raise ConfigurationError(
                f"WORLD_SIZE={world} and PET_NNODES={nnodes} disagree on the number of pods of one "
                "process each: the operator sets both alike; unset the one your container's "
                "command or job script sets")
    names["master_port"] = env.named("MASTER_PORT", "PET_MASTER_PORT") or "MASTER_PORT"
    return _Found(world, rank, 0, 1, rank, env.get("MASTER_ADDR", "PET_MASTER_ADDR"),
                  env.int("MASTER_PORT", "PET_MASTER_PORT"), "kubeflow", names=names)


def _slurm(env: _Reader) -> _Found | None:
    ntasks = env.int("SLURM_NTASKS", default=1) or 1
    if not env.has("SLURM_PROCID") or ntasks <= 1:
        return None
    variable = "SLURM_JOB_NODELIST" if env.has("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    nodelist = env.get(variable) or "127.0.0.1"
    job_id = env.int("SLURM_JOB_ID", default=0) or 0
    addr = env.get("MASTER_ADDR")
    return _Found(
        ntasks, env.int("SLURM_PROCID") or 0, env.int("SLURM_LOCALID", default=0) or 0,
        _leading_int(env.get("SLURM_NTASKS_PER_NODE"), ntasks),
        env.int("SLURM_NODEID", default=0) or 0,
        addr or first_host(nodelist, variable),
        # Every task of a job derives the same port from the job id.
        env.int("MASTER_PORT", default=10000 + job_id % 20000), "slurm",
        names={"world_size": "SLURM_NTASKS", "global_rank": "SLURM_PROCID",
               "local_rank": "SLURM_LOCALID", "local_world_size": "SLURM_NTASKS_PER_NODE",
               "node_rank": "SLURM_NODEID", "master_port": "MASTER_PORT"})


def _agree(env: _Reader, found: _Found, rank_name: str, size_name: str) -> None:
    """Refuse a second launcher's rank and size (both set) that name another process."""
    if not env.has(rank_name, size_name):
        return
    rank, size = env.int(rank_name), env.int(size_name)
    if (rank, size) != (found.global_rank, found.world_size):
        raise ConfigurationError(
            f"{found.source} says this is rank {found.global_rank} of {found.world_size} "
            f"({found.name('global_rank')}, {found.name('world_size')}) but {rank_name}={rank} and "
            f"{size_name}={size} say rank {rank} of {size}: two launchers' variables are mixed (a "
            f"job script that exports {rank_name}/{size_name} to every rank, or a launch nested in "
            f"another job's); unset {rank_name} and {size_name} (or launch with torchrun, which "
            "sets LOCAL_RANK and wins)")


def _leading_int(text: str | None, default: int) -> int:
    # SLURM writes tasks per node as "2" or "2(x3)".
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match else default


def first_host(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> str:
    """The first host of a SLURM node list: ``"n[1-3]-ib,gpu1"`` -> ``"n1-ib"``.

    Asks ``scontrol show hostnames`` where it is installed, as SLURM's own expansion is the
    one every task of the job agrees on; otherwise (or if it fails) parses the list with
    :func:`expand_hostlist`. ``variable`` names where the list came from, for the error a
    malformed list raises.
    """
    host = _scontrol_first_host(nodelist)
    if host is not None:
        return host
    # The whole list is checked, so a typo later in it is reported, not silently ignored;
    # only the first host is generated, so a list of a million nodes costs nothing.
    return next(_iter_hosts(_parse_hostlist(nodelist, variable)))


def expand_hostlist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Every host of a SLURM node list, in SLURM's order, without asking SLURM.

    Understands SLURM's hostlist syntax: names separated by commas (``a,b,c``), bracket
    ranges and lists (``node[1-3,7]``), zero padding to the width of a range's lower bound
    (``node[007-010]``), text after the brackets (``n[1-3]-ib``) and several bracket groups
    in one name, expanded as their cartesian product with the last group varying fastest
    (``rack[1-2]-node[01-02]`` -> ``rack1-node01, rack1-node02, rack2-node01, ...``).
    Raises :class:`~hookloop.ConfigurationError`, naming ``variable`` and the list, for an
    empty list, unbalanced or nested brackets, and ranges that are empty, not numbers or
    going down.
    """
    return list(_iter_hosts(_parse_hostlist(nodelist, variable)))


def _scontrol_first_host(nodelist: str) -> str | None:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # scontrol on a machine without a reachable slurm.conf exits non-zero; the parser
    # still knows the syntax, so it answers instead.
    if done.returncode != 0:
        return None
    return next((line.strip() for line in done.stdout.splitlines() if line.strip()), None)


# One name of a node list: literal text and bracket groups, each group a list of
# (low, high, width) ranges.
_Name = list[str | list[tuple[int, int, int]]]


def _parse_hostlist(nodelist: str, variable: str) -> list[_Name]:
    def bad(why: str) -> ConfigurationError:
        return ConfigurationError(
            f"{variable}={nodelist!r} is not a SLURM node list: {why}. Expected names separated by "
            "commas such as 'node[01-04,7]-ib,gpu1'; `scontrol show hostnames` shows how SLURM "
            "reads the list, or set MASTER_ADDR to the rendezvous host to skip reading it.")

    names: list[_Name] = []
    name: _Name = []
    text, group, depth = "", "", 0
    for position, char in enumerate(nodelist):
        if char == "[":
            if depth:
                raise bad(f"'[' inside brackets at position {position}")
            depth, group = 1, ""
            if text:
                name.append(text)
                text = ""
        elif char == "]":
            if not depth:
                raise bad(f"unbalanced ']' at position {position}")
            depth = 0
            name.append(_parse_ranges(group, bad))
        elif depth:
            group += char
        elif char == "," or char.isspace():  # SLURM also separates names by whitespace
            if text:
                name.append(text)
                text = ""
            if name:
                names.append(name)
                name = []
        else:
            text += char
    if depth:
        raise bad("unbalanced '[', a ']' is missing")
    if text:
        name.append(text)
    if name:
        names.append(name)
    if not names:
        raise bad("no host in it")
    return names


def _parse_ranges(group: str, bad: Callable[[str], Exception]) -> list[tuple[int, int, int]]:
    ranges = []
    for item in group.split(","):
        if not item:
            raise bad(f"empty range in '[{group}]'")
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise bad(f"'{item}' in '[{group}]' is not a number or a range of numbers such as 1-4")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise bad(f"range '{item}' in '[{group}]' goes down")
        # SLURM pads every number of a range to the width of its written lower bound.
        ranges.append((first, last, len(low)))
    return ranges


def _iter_hosts(names: list[_Name]) -> Iterator[str]:
    for name in names:
        yield from _expand_name(name, 0, "")


def _expand_name(name: _Name, index: int, head: str) -> Iterator[str]:
    if index == len(name):
        yield head
        return
    part = name[index]
    if isinstance(part, str):
        yield from _expand_name(name, index + 1, head + part)
        return
    for first, last, width in part:
        for number in range(first, last + 1):
            yield from _expand_name(name, index + 1, f"{head}{number:0{width}d}")
