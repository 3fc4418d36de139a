"""DDP communication hooks by name, and the state PowerSGD and post-localSGD keep.

``comm_hook`` names one of torch's own hooks (``torch.distributed.algorithms.
ddp_comm_hooks``): ``"fp16"`` and ``"bf16"`` compress each gradient bucket before the
all-reduce; ``"powersgd"`` sends a low-rank approximation with error feedback;
``"post_localsgd"`` all-reduces globally for ``localsgd_start_iter`` steps, then only
within subgroups, while a periodic model averager (run after every optimizer step)
averages the parameters of all ranks every ``model_averaging_period`` steps.

Everything here is imported when a run asks for a hook, not when the plugin is loaded.
"""

from __future__ import annotations

from typing import Any

import torch

import hookloop

COMM_HOOKS = ("fp16", "bf16", "powersgd", "post_localsgd")


def register(plugin: Any, trainer: Any, model: torch.nn.Module, local_world_size: int) -> Any:
    """Register ``plugin.comm_hook`` on the DDP ``model``; return what holds its state."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = plugin.comm_hook
    if callable(hook):
        model.register_comm_hook(plugin.comm_state, hook)
        return plugin.comm_state
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if hook == "bf16":
        # torch's bf16 hook refuses to register without NCCL (it checks the hook's name);
        # gloo all-reduces bfloat16 fine, so other backends get the same algorithm here.
        if dist.get_backend() == "nccl":
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        else:
            model.register_comm_hook(None, bf16_compress)
        return None
    if hook == "powersgd":
        powersgd = ResumablePowerSGD(plugin, trainer.module, model)
        model.register_comm_hook(powersgd.state, powersgd.hook)
        return powersgd
    if hook == "post_localsgd":
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as localsgd

        size = plugin.localsgd_group_size or local_world_size
        world = dist.get_world_size()
        if world % size:
            raise hookloop.ConfigurationError(
                f"localsgd_group_size={size} must divide the world size {world}: the ranks "
                f"are split into subgroups of that many processes"
            )
        # torch's default subgroup is "one per node, sized by the GPUs it has", which
        # does not exist on CPU: build the subgroups from the launcher's layout instead.
        subgroup, _ = dist.new_subgroups(group_size=size)
        state = localsgd.PostLocalSGDState(
            process_group=None,
            subgroup=subgroup,
            start_localSGD_iter=plugin.localsgd_start_iter,
            post_local_gradient_allreduce=plugin.localsgd_gradient_allreduce,
        )
        model.register_comm_hook(state, localsgd.post_localSGD_hook)
        return state
    raise hookloop.ConfigurationError(f"unknown comm_hook {hook!r}")  # options are validated


def bf16_compress(process_group, bucket):
    """torch's ``bf16_compress_hook`` for any backend: cast the bucket to bfloat16, divide
    by the world size, all-reduce, and copy the sum back into the float bucket."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(future):
        return buffer.copy_(future.value()[0])

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def model_averaging_optimizer(plugin: Any, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so every step is followed by the periodic model averager.

    torch's ``PostLocalSGDOptimizer`` shares ``param_groups`` with the wrapped optimizer
    (so schedulers keep working) and saves the averager's step in its ``state_dict``.
    """
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    averager = PeriodicModelAverager(period=plugin.model_averaging_period, warmup_steps=plugin.localsgd_start_iter)
    return PostLocalSGDOptimizer(optim=optimizer, averager=averager)


# ---------------------------------------------------------------------------------------
# PowerSGD whose state survives a checkpoint
# ---------------------------------------------------------------------------------------


class ResumablePowerSGD:
    """torch's ``powerSGD_hook`` and ``PowerSGDState``, with state that can be resumed.

    PowerSGD keeps, per gradient bucket, an error-feedback vector and the warm-start
    ``Q`` matrices, laid out in the order of the bucket's parameters. A new DDP wrapper (a
    resumed run) orders its buckets by parameter order for its first step and by
    gradient-ready order from its second, so the state is saved per parameter name and
    laid out again for the buckets each time DDP may have rebuilt them (the first two
    steps of every wrapper). Afterwards the hook is torch's, untouched.

    The layout itself changes the numbers, though (each gradient's offset in the bucket
    buffer decides how the matrix products round: 1.5e-8 after one step): a resumed
    wrapper's first step, on the initial layout, would round otherwise than the
    uninterrupted run's, on the rebuilt one. So the rebuilt order is saved too, and a
    resume rebuilds the new wrapper's buckets in that order before its first step
    (:meth:`_rebuild_buckets`).
    """

    def __init__(self, plugin: Any, module: torch.nn.Module, model: Any = None):
        try:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        except ImportError as exc:  # PowerSGDState keeps a numpy RandomState
            raise hookloop.MissingDependencyError(
                f"comm_hook='powersgd' needs numpy ({exc}): pip install 'hookloop-ddp[powersgd]'"
            ) from None
        try:
            self.state = powersgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=plugin.powersgd_rank,
                start_powerSGD_iter=plugin.powersgd_start_iter,
                min_compression_rate=plugin.powersgd_min_compression_rate,
            )
        except ModuleNotFoundError as exc:
            raise hookloop.MissingDependencyError(
                f"comm_hook='powersgd' needs numpy ({exc}): pip install 'hookloop-ddp[powersgd]'"
            ) from None
        self._powersgd_hook = powersgd.powerSGD_hook
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.layouts: dict[int, tuple] = {}  # bucket index -> its parameters, in state order
        self.pending: dict[str, dict] = {}  # parameter name -> {"error": ..., "q": ...}
        self._iterations_to_check = 2  # DDP rebuilds its buckets once, after its first step
        self._new_iteration = True
        self.model = model  # the DistributedDataParallel wrapper
        self._warming_up = False  # a backward that only orders the buckets: no communication
        import torch.distributed as dist

        # One bucket at a time on every backend but NCCL (see ``hook``).
        self.serial = not (dist.is_initialized() and dist.get_backend() == "nccl")

    # DDP requires a function whose second argument is named ``bucket``.
    def hook(self, state, bucket):
        """The communication hook: torch's PowerSGD, after aligning state with the bucket."""
        if self._warming_up:
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        if self._iterations_to_check:
            if self._new_iteration:
                # The previous step's futures are complete: its state is final.
                self._new_iteration = False
                self.pending.update(self._per_parameter())
                for table in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                    table.clear()
                self.layouts.clear()
            self._assemble(bucket)
            if bucket.is_last():
                self._iterations_to_check -= 1
                self._new_iteration = True
        future = self._powersgd_hook(state, bucket)
        if self.serial:
            # torch's hook chains its all-reduces in ``then`` callbacks that each start one
            # and block on it; gloo runs a callback on one of its 2 worker threads, so with
            # two buckets in flight both threads block, the all-reduces they wait for are
            # never run, and no timeout applies (they never started). Finishing each
            # bucket here, in the backward's thread, keeps one chain in flight, in bucket
            # order on every rank; a peer that stops now fails the waiting all-reduce at
            # the process group's timeout.
            done = torch.futures.Future()
            done.set_result(future.wait())
            return done
        return future

    def _matrices(self, params: list) -> tuple[list, int]:
        """PowerSGD's layout of ``Q`` (and ``P``) for a bucket holding ``params``: the
        compressed parameters grouped by matrix shape, in first-seen order."""
        groups: dict[tuple, list] = {}
        for p in params:
            n = p.shape[0] if p.ndim else 1
            m = p.numel() // max(n, 1)
            rank = min(n, m, self.state.matrix_approximation_rank)
            if (n + m) * rank * self.state.min_compression_rate < n * m:
                groups.setdefault((n, m), []).append((p, n, m, rank))
        ordered = [item for group in groups.values() for item in group]
        return ordered, sum(n * rank for _, n, _, rank in ordered)

    def _assemble(self, bucket) -> None:
        """Lay the pending per-parameter state out for ``bucket``'s current layout."""
        params = bucket.parameters()
        index = bucket.index()
        self.layouts[index] = tuple(params)
        names = [self.names[id(p)] for p in params]
        if not any(n in self.pending for n in names):
            return
        device, dtype = params[0].device, bucket.buffer().dtype
        state = self.state
        error = [self.pending.get(n, {}).get("error") for n in names]
        if state.use_error_feedback and all(e is not None for e in error):
            state.error_dict[index] = torch.cat([e.reshape(-1) for e in error]).to(device, dtype)
        matrices, p_size = self._matrices(params)
        qs = [self.pending.get(self.names[id(p)], {}).get("q") for p, *_ in matrices]
        if state.warm_start and matrices and all(q is not None for q in qs):
            state.q_memory_dict[index] = torch.cat([q.reshape(-1) for q in qs]).to(device, dtype)
            state.p_memory_dict[index] = torch.empty(p_size, device=device, dtype=dtype)
        for n in names:
            self.pending.pop(n, None)

    def _per_parameter(self) -> dict[str, dict]:
        """The live per-bucket state, cut into per-parameter pieces."""
        pieces: dict[str, dict] = {}
        state = self.state
        for index, params in self.layouts.items():
            error = state.error_dict.get(index)
            if error is not None:
                offset = 0
                for p in params:
                    pieces.setdefault(self.names[id(p)], {})["error"] = error[offset : offset + p.numel()].detach().clone()
                    offset += p.numel()
            q = state.q_memory_dict.get(index)
            if q is not None:
                offset = 0
                for p, _, m, rank in self._matrices(list(params))[0]:
                    pieces.setdefault(self.names[id(p)], {})["q"] = q[offset : offset + m * rank].detach().clone()
                    offset += m * rank
        return pieces

    def state_dict(self) -> dict:
        """The state of every rank (error feedback is each rank's own residual), gathered
        on global rank 0, which writes the checkpoint. Call on every rank.

        Tensors, numbers and strings only: loadable with ``weights_only=True``.
        """
        import torch.distributed as dist

        kind, keys, pos, has_gauss, gauss = self.state.rng.get_state()
        params = {**self.pending, **self._per_parameter()}
        mine = {name: {k: v.cpu() for k, v in piece.items()} for name, piece in params.items()}
        ranks = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(mine, ranks, dst=0)
        return {
            "hook": "powersgd",
            "iter": int(self.state.iter),
            "bucket_order": self.bucket_order(),
            "ranks": ranks,  # None except on rank 0, which is the one that writes
            "rng": {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(gauss),
            },
        }

    def load_state_dict(self, saved: dict) -> None:
        """Restore this rank's part of :meth:`state_dict` (by global rank)."""
        import warnings

        import torch.distributed as dist

        state = self.state
        ranks = saved["ranks"]
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if len(ranks) == world:
            mine = ranks[rank]
        else:
            # Another world size: the residuals belong to ranks that no longer exist.
            # The Q matrices are the same on every rank and carry over.
            warnings.warn(
                f"the checkpoint's PowerSGD state comes from {len(ranks)} processes, this run "
                f"has {world}: the error feedback starts again from zero"
            )
            mine = {name: {"q": piece["q"]} for name, piece in ranks[0].items() if "q" in piece}
        state.iter = saved["iter"]
        self.pending = {name: dict(piece) for name, piece in mine.items()}
        for table in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            table.clear()
        self.layouts.clear()
        rng = saved["rng"]
        state.rng.set_state(
            (rng["kind"], rng["keys"].numpy().astype("uint32"), rng["pos"], rng["has_gauss"], rng["gauss"])
        )
        if saved.get("bucket_order"):
            self._rebuild_buckets(saved["bucket_order"])

    def bucket_order(self) -> list[str] | None:
        """The parameters' names in the order of DDP's rebuilt buckets (bucket 0 first,
        each bucket's parameters in its order); ``None`` before DDP rebuilt them."""
        if self._iterations_to_check or not self.layouts:
            return None
        return [self.names[id(p)] for index in sorted(self.layouts) for p in self.layouts[index]]

    def _rebuild_buckets(self, order: list[str]) -> None:
        """Give the wrapper, before its first step, the buckets that the saved run had
        rebuilt: DDP rebuilds its buckets in the order in which a backward made the
        gradients ready, so one backward through ``sum(0 * p)``, built so that the
        parameters' gradients become ready in ``order``, with this hook passing the
        buckets through untouched (no communication, no PowerSGD state), then DDP's own
        rebuild (a collective: every rank loads the checkpoint). Each parameter's
        ``.grad`` is put back afterwards. Left to DDP (it rebuilds after the first step,
        which then rounds differently) where the parameters changed, or where DDP does
        not rebuild (``static_graph``, ``find_unused_parameters``) or the gradients are
        views of the buckets."""
        model = self.model
        if model is None or model.static_graph or model.find_unused_parameters or model.gradient_as_bucket_view:
            return
        named = {name: p for p in model.parameters() if (name := self.names.get(id(p))) is not None}
        wanted = {name for name, p in named.items() if p.requires_grad}
        if len(set(order)) != len(order) or set(order) != wanted or len(wanted) != sum(p.requires_grad for p in model.parameters()):
            return
        params = [named[name] for name in order]
        grads = [p.grad for p in params]
        self._warming_up = True
        try:
            with torch.enable_grad():
                total = None
                # The autograd engine runs the newest branch first: build in reverse.
                for p in reversed(params):
                    term = (p * 0).sum()
                    total = term if total is None else total + term
                model.reducer.prepare_for_backward([])
                total.backward()
        finally:
            self._warming_up = False
            for p, grad in zip(params, grads):
                p.grad = grad
        model.reducer._rebuild_buckets()


def state_to_checkpoint(hook: Any, state: Any) -> dict | None:
    """The part of a comm hook's state that must survive a resume, or ``None``."""
    if isinstance(state, ResumablePowerSGD):
        return state.state_dict()
    if hook == "post_localsgd" and state is not None:
        return {"hook": "post_localsgd", "iter": int(state.iter)}
    return None


def state_from_checkpoint(hook: Any, state: Any, saved: dict) -> None:
    """Restore what :func:`state_to_checkpoint` saved into the live ``state``."""
    if saved.get("hook") != hook or state is None:
        return
    if isinstance(state, ResumablePowerSGD):
        state.load_state_dict(saved)
    else:
        state.iter = saved["iter"]
