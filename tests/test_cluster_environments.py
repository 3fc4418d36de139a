"""Cluster environments (issue 36, item 3): mpirun, LSF's jsrun and Kubeflow's operator
start the processes; hookloop reads their variables (hookloop.distributed.environment)
and trains as ddp. ``hookloop env`` prints what it read.

Every detection rule and error is checked in-process on an environment given as a
mapping. The real runs (marked slow) train the same model under ``hookloop run --plugins
ddp --devices 2`` (the reference), under OpenMPI's ``mpirun -np 2``, and as two plain
``python`` processes with the environment exactly as the Kubeflow operator and jsrun set
it (neither runs here); the weights must equal the reference's bit for bit, and match a
one-process computation of the same steps to rounding.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import hookloop
from hookloop.distributed import launch
from hookloop.distributed.environment import ClusterEnvironment, launched_externally
from hookloop.tools import cli
from conftest import REPO, free_port, max_abs_diff, tiny_data

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from ddp_reference import concatenated_batches_run  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "cluster_env_train.py"
HOST = socket.gethostname()

#: What OpenMPI 4.1's mpirun sets for rank 1 of ``mpirun -np 2`` on one node (read from a
#: real run: ``mpirun -np 2 env``). NODE_RANK counts processes on the node, not nodes.
OPENMPI_RANK1 = dict(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1",
                     OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_COMM_WORLD_NODE_RANK="1",
                     OMPI_MCA_ess_base_jobid="995622913", PMIX_NAMESPACE="995622913", PMIX_RANK="1")


def detect(**env: str) -> ClusterEnvironment:
    return ClusterEnvironment.detect(env)


def refused(match: str, **env: str) -> str:
    with pytest.raises(hookloop.ConfigurationError, match=match) as info:
        ClusterEnvironment.detect(env)
    return str(info.value)


# ---------------------------------------------------------------------------------------
# mpirun
# ---------------------------------------------------------------------------------------

def test_openmpi_on_one_node_meets_on_localhost_at_a_port_from_the_job_id():
    cluster = detect(**OPENMPI_RANK1)
    assert cluster == ClusterEnvironment(2, 1, 1, 2, 0, "127.0.0.1", 10000 + 995622913 % 20000, "mpi")
    assert cluster.creates_processes_externally
    assert dict(cluster.variables)["OMPI_COMM_WORLD_RANK"] == "1"
    assert "OMPI_COMM_WORLD_NODE_RANK" not in dict(cluster.variables)  # not a node's index
    # rank 0 of the same job derives the same rendezvous
    rank0 = detect(**{**OPENMPI_RANK1, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (rank0.master_addr, rank0.master_port) == (cluster.master_addr, cluster.master_port)


def test_mpirun_honours_the_rendezvous_the_user_passed():
    cluster = detect(**OPENMPI_RANK1, MASTER_ADDR="10.1.2.3", MASTER_PORT="29511")
    assert (cluster.master_addr, cluster.master_port) == ("10.1.2.3", 29511)


def test_openmpi_5_namespace_gives_every_rank_the_same_port():
    env = {k: v for k, v in OPENMPI_RANK1.items() if k != "OMPI_MCA_ess_base_jobid"}
    env["PMIX_NAMESPACE"] = "prterun-vm-4242@1"
    port = detect(**env).master_port
    assert port == 10000 + zlib.crc32(b"prterun-vm-4242@1") % 20000


def test_mpirun_on_several_nodes_needs_master_addr():
    several = dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
                   OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_MCA_ess_base_jobid="77")
    message = refused(r"MASTER_ADDR is not set", **several)
    assert "mpirun -x MASTER_ADDR=" in message and "OMPI_COMM_WORLD_LOCAL_SIZE=2" in message
    cluster = detect(**several, MASTER_ADDR="node0")
    # the default placement (by slot) puts a node's ranks together: ranks 4 and 5 on node 2
    assert cluster == ClusterEnvironment(8, 5, 1, 2, 2, "node0", 10000 + 77, "mpi")
    assert detect(**several, MASTER_ADDR="node0", NODE_RANK="3").node_rank == 3  # --map-by node: say it


def test_mpich_and_intel_mpi_hydra_variables():
    cluster = detect(PMI_RANK="2", PMI_SIZE="4", MPI_LOCALRANKID="0", MPI_LOCALNRANKS="2",
                     MASTER_ADDR="head", MASTER_PORT="29500")
    assert cluster == ClusterEnvironment(4, 2, 0, 2, 1, "head", 29500, "mpi")
    refused(r"PMI_SIZE is set but PMI_RANK is not", PMI_SIZE="4")


def test_mpirun_rank_beyond_the_world_is_refused_naming_both_variables():
    message = refused(r"OMPI_COMM_WORLD_RANK=3 is not a rank of a world of OMPI_COMM_WORLD_SIZE=2",
                      **{**OPENMPI_RANK1, "OMPI_COMM_WORLD_RANK": "3"})
    assert "let mpirun set both" in message


def test_a_variable_that_is_not_a_number_is_named():
    refused(r"OMPI_COMM_WORLD_SIZE='two' is not a whole number", **{**OPENMPI_RANK1, "OMPI_COMM_WORLD_SIZE": "two"})


def test_rank_and_world_size_exported_to_every_mpi_rank_are_refused():
    """A job script's `export RANK=0 WORLD_SIZE=2` reaches every rank of mpirun: two
    processes would both be rank 0 and wait for each other for ever."""
    message = refused(r"mpi says this is rank 1 of 2 .* but RANK=0 and WORLD_SIZE=2",
                      **OPENMPI_RANK1, RANK="0", WORLD_SIZE="2")
    assert "unset RANK and WORLD_SIZE" in message
    assert detect(**OPENMPI_RANK1, RANK="1", WORLD_SIZE="2").source == "mpi"  # agreeing: fine


def test_the_innermost_launcher_wins():
    # torchrun started by mpirun (one agent per node): torchrun's variables are this process's
    torchrun = dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="1",
                    MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    assert detect(**OPENMPI_RANK1, **torchrun).source == "torchrun"
    # mpirun inside a SLURM allocation: every rank inherits the batch step's SLURM_PROCID=0
    slurm = dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="gpu01", SLURM_JOB_ID="9")
    assert detect(**OPENMPI_RANK1, **slurm).source == "mpi"


# ---------------------------------------------------------------------------------------
# LSF (jsrun)
# ---------------------------------------------------------------------------------------

def rank_file(tmp_path: Path, hosts: list[str]) -> str:
    """An LSF rank file: the launch node, then one line per slot."""
    path = tmp_path / "rankfile"
    path.write_text("launch01\n" + "".join(f"{host}\n" for host in hosts))
    return str(path)


def test_lsf_rendezvous_at_the_first_compute_host_port_from_the_job_id(tmp_path):
    env = dict(LSB_JOBID="123456", LSB_DJOB_RANKFILE=rank_file(tmp_path, ["c001", "c001", HOST, HOST]),
               JSM_NAMESPACE_RANK="3", JSM_NAMESPACE_SIZE="4", JSM_NAMESPACE_LOCAL_RANK="1")
    cluster = detect(**env)
    # the launch node excluded; this host is the second compute host: node 1
    assert cluster == ClusterEnvironment(4, 3, 1, 2, 1, "c001", 10000 + 123456 % 1000, "lsf")
    assert cluster.creates_processes_externally
    assert detect(**env, MASTER_PORT="29400").master_port == 29400
    # jsrun sets OpenMPI's variables too: agreeing ones are fine, others refused
    assert detect(**env, OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4").source == "lsf"
    refused(r"lsf says this is rank 3 of 4 .* OMPI_COMM_WORLD_RANK=0", **env, OMPI_COMM_WORLD_RANK="0",
            OMPI_COMM_WORLD_SIZE="4")


def test_lsf_rank_file_problems_are_named(tmp_path):
    jsm = dict(LSB_JOBID="1", JSM_NAMESPACE_RANK="0", JSM_NAMESPACE_SIZE="2", JSM_NAMESPACE_LOCAL_RANK="0")
    refused(r"LSB_DJOB_RANKFILE is not", **jsm)
    refused(r"LSB_DJOB_RANKFILE=.*missing cannot be read", **jsm, LSB_DJOB_RANKFILE=str(tmp_path / "missing"))
    refused(r"names no compute host", **jsm, LSB_DJOB_RANKFILE=rank_file(tmp_path, []))
    message = refused(r"this host \(.*\) is not among the compute hosts", **jsm,
                      LSB_DJOB_RANKFILE=rank_file(tmp_path, ["c001", "c002"]))
    assert "c001, c002" in message
    no_job = {k: v for k, v in jsm.items() if k != "LSB_JOBID"}
    refused(r"LSB_JOBID is not", **no_job, LSB_DJOB_RANKFILE=rank_file(tmp_path, [HOST]))


# ---------------------------------------------------------------------------------------
# Kubeflow (PyTorchJob, TrainJob)
# ---------------------------------------------------------------------------------------

#: What the training operator sets in the pod of worker 1 of a 2-pod PyTorchJob.
KUBEFLOW_POD1 = dict(MASTER_ADDR="job-master-0", MASTER_PORT="23456", WORLD_SIZE="2", RANK="1",
                     PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK="1",
                     PET_MASTER_ADDR="job-master-0", PET_MASTER_PORT="23456")


def test_kubeflow_pod_is_one_process_its_node_rank_the_rank():
    cluster = detect(**KUBEFLOW_POD1)
    assert cluster == ClusterEnvironment(2, 1, 0, 1, 1, "job-master-0", 23456, "kubeflow")
    assert cluster.creates_processes_externally


def test_trainjob_without_rank_reads_torchruns_pet_variables():
    env = {k: v for k, v in KUBEFLOW_POD1.items() if not k.startswith(("MASTER_", "RANK", "WORLD_"))}
    assert detect(**env) == ClusterEnvironment(2, 1, 0, 1, 1, "job-master-0", 23456, "kubeflow")


def test_kubeflow_with_torchrun_in_the_pod_is_torchrun():
    torchrun = dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="1")
    cluster = detect(**{**KUBEFLOW_POD1, "PET_NPROC_PER_NODE": "2", **torchrun})
    assert (cluster.source, cluster.global_rank, cluster.local_rank) == ("torchrun", 3, 1)


def test_kubeflow_several_processes_per_pod_need_torchrun():
    message = refused(r"PET_NPROC_PER_NODE=4 asks for 4 processes per pod, which torchrun starts",
                      **{**KUBEFLOW_POD1, "PET_NPROC_PER_NODE": "4"})
    assert "torchrun <script>" in message
    assert detect(**{**KUBEFLOW_POD1, "PET_NPROC_PER_NODE": "auto"}).source == "kubeflow"  # torchrun counts


def test_kubeflow_world_size_and_pet_nnodes_must_agree():
    refused(r"WORLD_SIZE=3 and PET_NNODES=2 disagree", **{**KUBEFLOW_POD1, "WORLD_SIZE": "3"})
    refused(r"RANK=2 is not a rank of a world of WORLD_SIZE=2", **{**KUBEFLOW_POD1, "RANK": "2"})


def test_no_launcher_is_a_world_of_one_launched_by_hookloop():
    cluster = detect()
    assert cluster == ClusterEnvironment(1, 0, 0, 1, 0, None, None, "single")
    assert not cluster.creates_processes_externally and cluster.variables == ()


def test_a_trainer_under_an_external_launcher_trains_in_its_process(monkeypatch):
    """``in_worker`` decides whether ``Trainer(devices=2)`` re-launches its script through
    torchrun: under mpirun, jsrun or the operator the processes exist already."""
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "HOOKLOOP_WORKER"):
        monkeypatch.delenv(key, raising=False)
    assert not launch.in_worker()
    for key, value in OPENMPI_RANK1.items():
        monkeypatch.setenv(key, value)
    assert launch.in_worker() and launched_externally()
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's worker: torchrun's, not mpirun's
    assert not launched_externally() and launch.in_worker()


# ---------------------------------------------------------------------------------------
# hookloop env
# ---------------------------------------------------------------------------------------

LAUNCHER_PREFIXES = ("OMPI_", "PMI", "MPI_", "JSM_", "LSB_", "PET_", "SLURM_", "TORCHELASTIC_")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                  "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def bare_env(monkeypatch):
    """This process's environment without any launcher's variables (pytest may itself run
    under one), for ``hookloop env`` to read what a test sets."""
    for key in list(os.environ):
        if key.startswith(LAUNCHER_PREFIXES) or key in LAUNCHER_NAMES:
            monkeypatch.delenv(key)
    return monkeypatch


def test_hookloop_env_prints_what_was_detected(bare_env, capsys):
    for key, value in OPENMPI_RANK1.items():
        bare_env.setenv(key, value)
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    port = 10000 + 995622913 % 20000
    for line in ("source:       mpi", "world size:   2", "global rank:  1", "local rank:   1 of 2 on this node",
                 "node rank:    0", f"rendezvous:   127.0.0.1:{port}", "  OMPI_COMM_WORLD_RANK=1",
                 "  OMPI_MCA_ess_base_jobid=995622913"):
        assert line in out.splitlines(), (line, out)


def test_hookloop_env_json(bare_env, capsys):
    for key, value in KUBEFLOW_POD1.items():
        bare_env.setenv(key, value)
    assert cli.main(["env", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {k: printed[k] for k in ("source", "world_size", "global_rank", "local_rank", "local_world_size",
                                    "node_rank", "master_addr", "master_port")} == dict(
        source="kubeflow", world_size=2, global_rank=1, local_rank=0, local_world_size=1, node_rank=1,
        master_addr="job-master-0", master_port=23456)
    assert printed["variables"]["RANK"] == "1" and printed["variables"]["MASTER_PORT"] == "23456"


def test_hookloop_env_without_a_launcher(bare_env, capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "source:       single" in out and "rendezvous:   none (a world of one)" in out
    assert "variables read: none" in out


def test_hookloop_env_reports_a_contradiction_and_exits_2(bare_env, capsys):
    for key, value in {**OPENMPI_RANK1, "OMPI_COMM_WORLD_RANK": "7"}.items():
        bare_env.setenv(key, value)
    assert cli.main(["env"]) == 2
    assert "hookloop: error: OMPI_COMM_WORLD_RANK=7 is not a rank" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------

def launch_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's or hookloop's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith((*LAUNCHER_PREFIXES, "HOOKLOOP_")) or k in LAUNCHER_NAMES)}
    env.update(extra)
    return env


def run_job(commands: list[list[str]], cwd: Path, envs: list[dict], timeout: float = 300) -> list[str]:
    """Start every command at once, each in a session of its own; wait for all. Each must
    exit 0, and no process of any of them may be left (every session is killed on a
    timeout and found empty afterwards)."""
    procs = [subprocess.Popen(c, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c, e in zip(commands, envs)]
    left = []
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # a session with a process in it
            except ProcessLookupError:
                continue  # empty: the launcher and all it started are gone
            left.append(proc.args)
            proc.wait()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
    assert not left, f"processes of {left} outlived their launcher: killed"
    return outputs


def assert_no_process_left(pids: list[int]) -> None:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone
        if state != "Z":
            alive.append(pid)
    assert not alive, f"worker processes outlived their launcher: {alive}"


def ranks_of(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory) -> list[dict]:
    """The same training under ``hookloop run --plugins ddp --devices 2`` (torchrun): the
    reference every launcher here must reproduce bit for bit."""
    out = tmp_path_factory.mktemp("torchrun")
    run_job([[sys.executable, "-m", "hookloop", "run", "--plugins", "ddp", "--devices", "2", str(SCRIPT), str(out)]],
            out, [launch_env()])
    ranks = ranks_of(out)
    assert [(r["source"], r["world_size"], r["global_rank"]) for r in ranks] == [("torchrun", 2, 0), ("torchrun", 2, 1)]
    reference = concatenated_batches_run(tiny_data(96), epochs=2, batch=8, seed=10)  # rank 0's seed
    assert max_abs_diff(ranks[0]["state"], reference) <= 1e-5
    return ranks


def assert_trains_as_the_reference(ranks: list[dict], reference: list[dict], source: str) -> None:
    assert [(r["source"], r["world_size"], r["global_rank"]) for r in ranks] == [(source, 2, 0), (source, 2, 1)]
    for mine, theirs in zip(ranks, reference):
        assert mine["state"].keys() == theirs["state"].keys()
        different = [k for k in mine["state"] if not torch.equal(mine["state"][k], theirs["state"][k])]
        assert not different, f"{source}: {different} differ from torchrun's by {max_abs_diff(mine['state'], theirs['state'])}"
    assert_no_process_left([r["pid"] for r in ranks])


@pytest.mark.slow
def test_mpirun_trains_as_ddp_bit_for_bit_with_torchrun(tmp_path, torchrun_reference):
    """Launches: OpenMPI's ``mpirun -np 2`` running the training script (and, once per
    module, the torchrun reference)."""
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun is not installed: `make install` installs Debian's openmpi-bin (apt-get install openmpi-bin)"
    run_job([[mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, str(SCRIPT), str(tmp_path),
              "2"]], tmp_path, [launch_env()])
    ranks = ranks_of(tmp_path)
    assert [(r["local_rank"], r["node_rank"]) for r in ranks] == [(0, 0), (1, 0)]
    assert_trains_as_the_reference(ranks, torchrun_reference, "mpi")


@pytest.mark.slow
def test_kubeflow_pods_train_as_ddp_bit_for_bit_with_torchrun(tmp_path, torchrun_reference):
    """Launches two plain ``python`` processes, each with the environment the training
    operator gives one pod of a 2-worker PyTorchJob (Kubernetes does not run here)."""
    port = str(free_port())
    envs = [launch_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(rank),
                       PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank),
                       PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port) for rank in (0, 1)]
    run_job([[sys.executable, str(SCRIPT), str(tmp_path)]] * 2, tmp_path, envs)
    ranks = ranks_of(tmp_path)
    assert [(r["local_rank"], r["node_rank"]) for r in ranks] == [(0, 0), (0, 1)]  # one pod per rank
    assert_trains_as_the_reference(ranks, torchrun_reference, "kubeflow")


def lsf_job_id() -> str:
    """An LSF job id whose port (10000 + id % 1000, the LSF rule) is free here now."""
    for _ in range(200):
        job = random.randrange(1000, 10**6)
        with socket.socket() as probe:
            try:
                probe.bind(("", 10000 + job % 1000))
            except OSError:
                continue
        return str(job)
    raise AssertionError("no free port in 10000-10999 for the LSF job")


@pytest.mark.slow
def test_lsf_jsrun_tasks_train_as_ddp_bit_for_bit_with_torchrun(tmp_path, torchrun_reference):
    """Launches two plain ``python`` processes with the environment jsrun gives the two
    tasks of an LSF job on this host (LSF does not run here): JSM_* and OpenMPI's variables
    (jsrun is Spectrum MPI's launcher), LSB_JOBID and a rank file naming this host."""
    rankfile = rank_file(tmp_path, [HOST, HOST])
    job = lsf_job_id()
    envs = [launch_env(LSB_JOBID=job, LSB_DJOB_RANKFILE=rankfile, JSM_NAMESPACE_RANK=str(rank),
                       JSM_NAMESPACE_SIZE="2", JSM_NAMESPACE_LOCAL_RANK=str(rank), JSM_NAMESPACE_LOCAL_SIZE="2",
                       OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2",
                       OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE="2") for rank in (0, 1)]
    run_job([[sys.executable, str(SCRIPT), str(tmp_path), "2"]] * 2, tmp_path, envs)
    ranks = ranks_of(tmp_path)
    assert [(r["local_rank"], r["node_rank"]) for r in ranks] == [(0, 0), (1, 0)]
    assert_trains_as_the_reference(ranks, torchrun_reference, "lsf")


def test_nodes_without_an_endpoint_are_fine_in_a_process_a_launcher_placed(monkeypatch):
    """``Trainer(nodes=2)`` in a worker of mpirun (or srun, torchrun, a plugin's launcher)
    needs no rendezvous endpoint: the launcher placed the ranks. Only a launch that starts
    torchrun for several nodes needs one (issue 36: the settings refused it before any
    plugin code ran)."""
    for name, value in {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    trainer = hookloop.Trainer(plugins=["ddp"], nodes=2, devices=1, logger=False)
    assert trainer.config.nodes == 2 and trainer.config.rdzv_endpoint is None
    with pytest.raises(hookloop.ConfigurationError, match="nodes=2 needs a rendezvous endpoint"):
        hookloop.elastic_command(hookloop.TrainerConfig(nodes=2), "train.py", [])
