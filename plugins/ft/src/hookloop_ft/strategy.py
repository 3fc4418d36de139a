"""The ``ft`` strategy: replica groups coordinated by torchft's Manager and Lighthouse.

Each replica group is a hookloop run started on its own: one process (``hookloop run
--plugins ft train.py``) or several on one launcher (``hookloop run --plugins ft --devices N
train.py``), which all-reduce within the group as ddp does. The groups never share a
launcher: they meet
through the Lighthouse (``lighthouse`` option or ``TORCHFT_LIGHTHOUSE``), which forms a
quorum of the live groups before every step. Per step, as torchft's own DDP example:

* ``zero_grad`` (the start of the step): ``Manager.start_quorum()``. A group that joins
  late, or restarted after it was killed, is told to heal: it copies the model, the
  optimizers, the schedulers and the step from a live peer (the Manager's
  ``state_dict``/``load_state_dict`` callbacks below), before its forward by default
  (``async_quorum=False``).
* ``backward``: torchft's ``DistributedDataParallel`` averages the gradients within the
  group (the default process group, when it has several processes), then over the groups
  of the quorum (``Manager.allreduce``, between the processes of equal group rank).
* ``optimizer_step``: the optimizer steps only when ``Manager.should_commit()`` says every
  group of the quorum finished the step; otherwise the step is skipped (``False``).

A group that dies only makes the others' next quorum smaller: they go on without a
restart. Every group must have the same number of processes.

**Sharded groups (HSDP)**: ``--plugins ft,fsdp``. ft is then a mesh plugin claiming no
dimension of the group's own mesh (its replicas are the groups, which are no processes of
the group's world: torchft's managed process group is the ``dp_replicate`` dimension), and
fsdp, the lifecycle's lead, shards the model over the group's processes (``dp_shard``) and
sets up the group's process group. ft then only adds, as torchft 0.2's own FSDP test does,
an all-reduce hook on every FSDP2 unit (``set_all_reduce_hook``): the gradient shard that
the group's reduce-scatter averaged is averaged over the quorum's groups by
``Manager.allreduce``, between the processes of equal group rank, which hold the same
shard. A recovering group's process copies its own shard (parameters, buffers, optimizer
state) from the process of equal rank in a live group.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import hookloop

#: torchft's own environment variable for the Lighthouse's address (its Manager reads it).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: How to start a Lighthouse, said by every error about a missing one.
START_LIGHTHOUSE = ("start one with `torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 "
                    "--join_timeout_ms 10000` (installed with torchft; it prints its address) and "
                    f"pass its address: --plugin-option ft.lighthouse=http://HOST:29510, or "
                    f"{LIGHTHOUSE_ENV}=http://HOST:29510")
INSTALL = "pip install hookloop-ft torchft==0.2.0 torch==<your torch> (make install does)"


def _torchft() -> Any:
    """Import torchft, or say how to install it."""
    try:
        import torchft
    except ImportError as exc:
        raise hookloop.MissingDependencyError(
            f"the ft plugin needs torchft, which is not installed ({exc}): {INSTALL}") from exc
    return torchft


def _ddp_class() -> type:
    """torchft's ``DistributedDataParallel`` with a communication hook that survives a peer
    dying in the all-reduce.

    torchft 0.2.0's own hook asserts on the future of a failed all-reduce (``assert
    fut._fut`` in ``torchft/ddp.py``), so the surviving group crashed when its peer was
    killed mid-backward. Here a failed all-reduce is left to the Manager, which recorded
    it (``report_error``): ``should_commit`` then says no and the step is skipped, as torchft
    means it to be; the bucket's contents do not matter then.
    """
    from torchft.ddp import DistributedDataParallel

    class FaultTolerantDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(manager, bucket):  # unannotated: DDP checks the annotations it finds
            buffer = bucket.buffer()
            if dist.is_initialized() and dist.get_world_size() > 1:  # the group's own processes
                dist.all_reduce(buffer)
                buffer.div_(dist.get_world_size())
            manager.allreduce(buffer).wait()  # averaged in place; False (reported) on a failure
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(buffer)
            return done

    return FaultTolerantDDP


def _check(name: str, ok: bool, rule: str, value: Any) -> None:
    if not ok:
        raise hookloop.ConfigurationError(f"ft option {name}={value!r}: {rule}")


def _seconds(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


class FT(hookloop.TorchDistributed):
    """Fault-tolerant data parallelism across replica groups with torchft.

    A group is one process, or several started by one launcher (``--devices N``): they
    share the group's data (distributed samplers over the group) and all-reduce within it
    before the groups do. Every group must have as many processes. Beside fsdp
    (``--plugins ft,fsdp``) the group's processes hold shards instead (HSDP; the module's
    docstring says how).

    Options (constructor arguments, or ``--plugin-option ft.NAME=VALUE``):

    ``lighthouse``
        the Lighthouse's address (``http://host:port``); ``None``: ``TORCHFT_LIGHTHOUSE``.
        A run with neither is refused at start, saying how to start a Lighthouse.
    ``replica_id``
        this group's name in the quorum (torchft appends a fresh uuid, so a restarted
        group is a new member); ``None``: ``REPLICA_GROUP_ID`` if set, else the uuid alone.
    ``min_replica_size``
        the fewest groups a step may commit with (default 1: a lone survivor trains on).
    ``async_quorum``
        ``False`` (default): the quorum (and a joining group's recovery) completes before
        the forward, so every group of the quorum contributes its batch to every step.
        ``True``: torchft's default, the quorum overlaps the forward; a group that heals
        (a restart, or every group but one at step 0) contributes zeros to that step.
    ``init_sync``
        at step 0 every group copies the first group's weights (default ``True``);
        ``False`` when every group builds identical weights itself (same seed).
    ``timeout``
        seconds a gradient all-reduce, ``should_commit`` or a recovery transfer may take
        before the step is abandoned (default 60).
    ``quorum_timeout``
        seconds to wait for a quorum (default 60): longer than a step, and than the time a
        restarted group takes to start.
    """

    hookloop_name = "ft"
    hookloop_role = "strategy"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    hookloop_autoload = False  # means nothing without a Lighthouse
    #: A mesh plugin claiming no dimension of the group's mesh: it composes with fsdp, which
    #: then leads (shards inside the group); the replicas across groups are torchft's.
    hookloop_mesh_dims: tuple[str, ...] = ()
    hookloop_refuses_beside = {
        what: (f"ft is checked alone (whole replicas, DDP inside a group) and beside fsdp's default sharding "
               f"(--plugins ft,fsdp: HSDP, fsdp shards inside each replica group); beside {why} no test checks it "
               f"yet: run --plugins ft or --plugins ft,fsdp")
        for what, why in (("dp_replicate", "a plugin claiming dp_replicate (ddp, fsdp's HYBRID_SHARD or NO_SHARD: "
                                            "ft's groups are the replicas)"),
                          ("tp", "tp"), ("pp", "the pipeline"), ("cp", "cp"), ("compile", "compile"),
                          ("float8", "float8"), ("fsdp_cpu_offload", "fsdp with cpu_offload"))
    }
    hookloop_environment = {
        LIGHTHOUSE_ENV: "the torchft Lighthouse the replica groups meet at",
        "REPLICA_GROUP_ID": "this replica group's name in torchft's quorum",
    }

    def __init__(
        self,
        lighthouse: str | None = None,
        replica_id: str | None = None,
        min_replica_size: int = 1,
        async_quorum: bool = False,
        init_sync: bool = True,
        timeout: float = 60.0,
        quorum_timeout: float = 60.0,
    ):
        _check("lighthouse", lighthouse is None or isinstance(lighthouse, str) and lighthouse.strip() != "",
               "must be the Lighthouse's address, http://HOST:PORT, or None for $" + LIGHTHOUSE_ENV, lighthouse)
        _check("replica_id", replica_id is None or isinstance(replica_id, (str, int)) and not isinstance(replica_id, bool),
               "must be a name (str or int) or None", replica_id)
        _check("min_replica_size", isinstance(min_replica_size, int) and not isinstance(min_replica_size, bool)
               and min_replica_size >= 1, "must be an integer >= 1", min_replica_size)
        for name, value in (("async_quorum", async_quorum), ("init_sync", init_sync)):
            _check(name, isinstance(value, bool), "must be True or False", value)
        for name, value in (("timeout", timeout), ("quorum_timeout", quorum_timeout)):
            _check(name, _seconds(value), "must be a number of seconds > 0", value)
        self.lighthouse, self.replica_id = lighthouse, replica_id
        self.min_replica_size, self.async_quorum, self.init_sync = min_replica_size, async_quorum, init_sync
        self.timeout, self.quorum_timeout = float(timeout), float(quorum_timeout)
        self.manager: Any = None
        #: steps this group committed, skipped (should_commit False), and its recoveries
        #: from a peer: ``(step recovered at, seconds from start_quorum to loaded)``
        self.committed = self.skipped = 0
        self.recoveries: list[tuple[int, float]] = []
        self._trainer: Any = None
        self._store: Any = None
        self._wrapped: tuple[nn.Module, nn.Module] | None = None
        self._quorum_started = 0.0

    # -- environment --------------------------------------------------------------------

    def lighthouse_address(self) -> str:
        """The option, else ``TORCHFT_LIGHTHOUSE``; refused when neither is set."""
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "").strip()
        if not address:
            raise hookloop.ConfigurationError(
                f"the ft plugin needs a torchft Lighthouse, and neither the option ft.lighthouse "
                f"nor {LIGHTHOUSE_ENV} names one: {START_LIGHTHOUSE}")
        return address

    def _leads(self, trainer) -> bool:
        """Whether ft owns the group's lifecycle (alone), or fsdp leads beside it (HSDP)."""
        return getattr(trainer, "strategy", self) is self

    @hookloop.hookimpl
    def setup_environment(self, trainer):
        """Alone: check torchft and the Lighthouse, set this process's place in its group and
        the group's process group, when it has several. Beside fsdp: ``None``, fsdp (the
        lead) does that. torchft's Manager starts in :meth:`setup`."""
        if not self._leads(trainer):
            return None
        _torchft()
        self.lighthouse_address()
        world = hookloop.env_int("WORLD_SIZE", default=1)
        rank = hookloop.env_int("RANK", default=0) if world > 1 else 0
        local_rank = hookloop.env_int("LOCAL_RANK", default=rank) if world > 1 else 0
        device = hookloop.local_rank_device(trainer, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        trainer.world_size, trainer.global_rank, trainer.local_rank = world, rank, local_rank
        trainer.node_rank = hookloop.env_int("GROUP_RANK", "NODE_RANK", default=0) if world > 1 else 0
        trainer.root_device = device
        if world > 1:
            self._launcher_store(world)
            self.start_process_group("nccl" if device.type == "cuda" else "gloo", rank, world,
                                     timeout=trainer.config.process_group_timeout)
        return True

    def _launcher_store(self, world: int) -> tuple[str, int]:
        """The store of a group of several processes: its launcher's (torchrun's agent at
        MASTER_ADDR:MASTER_PORT); the Manager keeps its keys there."""
        store_addr, store_port = os.environ.get("MASTER_ADDR"), hookloop.env_int("MASTER_PORT")
        if not (store_addr and store_port):
            raise hookloop.ConfigurationError(
                f"this replica group has {world} processes but MASTER_ADDR / MASTER_PORT are not "
                f"set: launch each group with `hookloop run --plugins ft --devices {world}` or torchrun")
        return store_addr, store_port

    def _start_manager(self, trainer) -> None:
        """Start torchft's Manager (it joins the Lighthouse; the quorum comes at the first
        step), once the group's process group exists (ft's own, or fsdp's beside it)."""
        torchft = _torchft()
        lighthouse = self.lighthouse_address()
        world, rank, device = trainer.world_size, trainer.global_rank, trainer.root_device
        self._trainer = trainer
        self.committed = self.skipped = 0
        self.recoveries = []
        if world > 1:
            store_addr, store_port = self._launcher_store(world)
        else:
            # A single process has no launcher's store: its own, at an address the other
            # groups can reach (the first group's store is where the groups' all-reduce meets).
            store_addr = socket.gethostname()
            self._store = dist.TCPStore(store_addr, 0, is_master=True, wait_for_workers=False)
            store_port = self._store.port
        replica_id = self.replica_id if self.replica_id is not None else os.environ.get("REPLICA_GROUP_ID")
        timeout = timedelta(seconds=self.timeout)
        pg = torchft.ProcessGroupNCCL(timeout) if device.type == "cuda" else torchft.ProcessGroupGloo(timeout)
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=self._load_state_dict, state_dict=self._state_dict,
            min_replica_size=self.min_replica_size, use_async_quorum=self.async_quorum,
            init_sync=self.init_sync, timeout=timeout,
            quorum_timeout=timedelta(seconds=self.quorum_timeout),
            rank=rank, world_size=world, store_addr=store_addr, store_port=store_port,
            lighthouse_addr=lighthouse, replica_id=None if replica_id is None else str(replica_id))

    @hookloop.hookimpl
    def setup(self, trainer):
        """Refuse manual optimization (the quorum and the commit ride the loop's own
        ``zero_grad`` and ``optimizer_step``), then start torchft's Manager."""
        if not trainer.automatic_optimization:
            raise hookloop.ConfigurationError(
                "the ft plugin needs automatic optimization (it starts torchft's quorum in "
                "zero_grad and asks should_commit in optimizer_step); set "
                "self.automatic_optimization = True, or call torchft's Manager yourself")
        self._start_manager(trainer)

    @hookloop.hookimpl
    def teardown(self, trainer):
        """Leave the quorum (the Manager's server and checkpoint transport) and unwrap the model."""
        wrapped, self._wrapped = self._wrapped, None
        if wrapped is not None and trainer.model is wrapped[1]:
            trainer.model = wrapped[0]
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.shutdown(wait=False)
        self._store = None
        self._trainer = None
        self.release_owned_process_group()
        if trainer.global_rank == 0 and (self.recoveries or self.committed or self.skipped):
            print(f"hookloop-ft: {self.committed} steps committed, {self.skipped} skipped, "
                  f"recoveries from a peer (step, seconds): {self.recoveries}", file=sys.stderr, flush=True)

    # -- model and optimizer ------------------------------------------------------------

    @hookloop.hookimpl(wrapper=True)
    def wrap_model(self, trainer, model):
        """Around the lead's wrapping. Alone: torchft's ``DistributedDataParallel`` on the
        model the default placed (gradients averaged within the group, then over the
        quorum's groups); a group of several processes starts from its rank 0's weights
        (torchft's wrapper does not broadcast them as torch's does). Beside fsdp: the
        model fsdp sharded, with :meth:`_average_over_groups` as the all-reduce hook of
        every FSDP2 unit."""
        placed = yield
        if not self._leads(trainer):
            from torch.distributed.fsdp import FSDPModule

            units = [m for m in placed.modules() if isinstance(m, FSDPModule)]
            if not units:
                raise hookloop.ConfigurationError(
                    f"the ft plugin beside {getattr(trainer.strategy, 'hookloop_name', trainer.strategy)!r} found no FSDP2 unit "
                    f"(fully_shard) in the wrapped model: sharded replica groups are --plugins ft,fsdp")
            for unit in units:
                unit.set_all_reduce_hook(self._average_over_groups)
            return placed
        if trainer.world_size > 1:
            for tensor in placed.state_dict().values():
                dist.broadcast(tensor, 0)
        wrapped = _ddp_class()(self.manager, placed)
        self._wrapped = (placed, wrapped)
        return wrapped

    def _average_over_groups(self, gradient: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: ``gradient`` is this process's shard, averaged over the
        group by its reduce-scatter; averaged in place over the quorum's groups (the
        processes of equal group rank). A failure is the Manager's: recorded, and
        ``should_commit`` then skips the step."""
        self.manager.allreduce(gradient).wait()

    @hookloop.hookimpl
    def accumulation_context(self, model):
        """No all-reduce on micro-batches that do not step: ``model.no_sync()`` (torchft's
        DDP); ``None`` beside fsdp, whose own context applies."""
        no_sync = getattr(model, "no_sync", None)
        return no_sync() if callable(no_sync) else None

    # -- the step -----------------------------------------------------------------------

    @hookloop.hookimpl(tryfirst=True)
    def zero_grad(self, trainer):
        """Start the step's quorum (and, with ``async_quorum=False``, finish a recovery
        before the forward); the gradients are zeroed by whoever comes next (the default).

        ``trainer.global_step`` follows the job's committed steps, so ``max_steps`` counts
        the steps of the job, not of this process: a restarted group stops with the others.
        """
        self._quorum_started = time.perf_counter()
        self.manager.start_quorum()
        trainer.global_step = self.manager.current_step()

    @hookloop.hookimpl(tryfirst=True)
    def optimizer_step(self, trainer):
        """Step only when the Manager says every group of the quorum finished the step.

        Stops at ``False`` (skipped) here; a healthy step returns ``None``, so the precision
        plugin or the default clips and steps as in any run.
        """
        if self.manager.should_commit():
            self.committed += 1
            return None
        self.skipped += 1
        return False

    # -- checkpoints --------------------------------------------------------------------

    @hookloop.hookimpl
    def on_save_checkpoint(self, checkpoint):
        """Save the Manager's step (torchft: a checkpoint must hold it, or a group resumed
        from it would count the job's steps from 0)."""
        if self.manager is not None:
            checkpoint["plugins"]["ft"] = self.manager.state_dict()

    @hookloop.hookimpl
    def on_load_checkpoint(self, checkpoint):
        """Restore the Manager's step saved by :meth:`on_save_checkpoint`."""
        saved = checkpoint.get("plugins", {}).get("ft")
        if saved is not None and self.manager is not None:
            self.manager.load_state_dict(saved)

    # -- what a recovering group copies from a live peer ---------------------------------

    def _state_dict(self) -> dict[str, Any]:
        """What a recovering peer copies: this process's own tensors (its shards beside
        fsdp: a DTensor's local tensor, never a gathered one, since this runs in torchft's
        threads, outside the group's collectives), its optimizers' state with the entries
        that were DTensors named, and the schedulers."""
        trainer = self._trainer
        module = trainer.module
        optimizers, sharded = [], []
        for optimizer in trainer.optimizers:
            saved = optimizer.state_dict()  # its per-parameter dicts are the optimizer's own
            saved["state"] = {index: {key: _local(value) if isinstance(value, DTensor) else value
                                      for key, value in entries.items()}
                              for index, entries in saved["state"].items()}
            optimizers.append(saved)
            sharded.append(sorted((index, key) for index, entries in optimizer.state_dict()["state"].items()
                                  for key, value in entries.items() if isinstance(value, DTensor)))
        return {
            "module": {name: _local(t) for name, t in (*module.named_parameters(), *module.named_buffers())},
            "optimizers": optimizers,
            "sharded_optimizer_state": sharded,
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a peer's :meth:`_state_dict` into this process's tensors in place, and
        its optimizer state, as DTensors again where they were (on this process's
        parameters' mesh and placements)."""
        trainer = self._trainer
        module = trainer.module
        with torch.no_grad():
            for name, tensor in (*module.named_parameters(), *module.named_buffers()):
                _local(tensor).copy_(state["module"][name])
        for optimizer, saved, sharded in zip(trainer.optimizers, state["optimizers"],
                                             state["sharded_optimizer_state"], strict=True):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for index, key in sharded:
                param, local = params[index], saved["state"][index][key]
                saved["state"][index][key] = DTensor.from_local(
                    local.to(_local(param).device), param.device_mesh, param.placements, run_check=False,
                    shape=param.shape, stride=param.stride())
            optimizer.load_state_dict(saved)
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        self.recoveries.append((self.manager.current_step(), round(time.perf_counter() - self._quorum_started, 3)))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or ``tensor`` itself, detached: the same storage (it may
    be called outside ``no_grad``, in torchft's threads)."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
