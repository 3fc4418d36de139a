"""hookloop-cp: context parallelism (ring attention) on the ``cp`` dimension of the mesh.

Each of the ``cp`` processes of a group holds ``1/cp`` of every sequence of the batch
(the batch's tensors sharded on their sequence dimension, with torch's head-tail load
balancing for causal attention) and computes attention over the whole sequence by
passing the keys and values around the group: torch's
``torch.distributed.tensor.experimental.context_parallel``, which replaces
``torch.nn.functional.scaled_dot_product_attention`` inside its context with ring
attention. Everything else in the model works position by position on the local part.

* **Where it runs.** torch (2.13) implements ring attention for the CUDA SDPA kernels
  only (flash, memory-efficient, cuDNN: the ops in
  ``torch.distributed.tensor.experimental._context_parallel._attention.custom_ops``).
  On the CPU, SDPA's kernel ``aten._scaled_dot_product_flash_attention_for_cpu`` has no
  context-parallel rule (DTensor raises ``NotImplementedError ... does not have a
  sharding strategy registered`` inside the step), so :class:`CP` refuses a CPU run at
  ``setup`` with a :class:`hookloop.ConfigurationError` saying so; it accepts the CPU
  the day torch registers that op.
* **The data.** The processes of a cp group are one data-parallel replica: the core's
  ``hookloop.data_parallel_rank`` splits the data by the mesh's ``dp_replicate`` and
  ``dp_shard`` dimensions only, so they all load the same batch; the plugin shards it.
* **The step.** ``on_train_batch_start`` enters ``context_parallel`` with the batch's
  tensors (sharded in place on ``seq_dim``) and the module buffers named in
  ``buffers`` (e.g. rotary frequencies; restored afterwards); ``on_train_batch_end``
  leaves it, so forward, backward and optimizer step run inside. Before the optimizer
  steps, the gradients are averaged over the cp group (each process's loss is the mean
  over its own positions, all shards are the same size: the average is the gradient of
  the mean over the whole sequence). Validation, test and predict run unsharded (every
  cp process computes the whole batch).
* **Composition.** An extension claiming ``cp`` (``hookloop_mesh_dims = ("cp",)``): it
  needs the strategy that starts the process group and owns the model, ddp, which keeps
  doing so on its own dimension: ``--plugins ddp,cp --mesh cp=2``. Beside tp, fsdp,
  compile or float8 it is refused at construction (``hookloop_refuses_beside``): no test
  checks those layouts yet.
"""

from __future__ import annotations

from typing import Any

import torch

import hookloop

__all__ = ["CP", "ROTATE_METHODS", "unsupported_reason"]

#: torch's ways of passing keys and values around the ring (``set_rotate_method``)
ROTATE_METHODS = ("allgather", "alltoall")


def _fail(message: str) -> hookloop.ConfigurationError:
    return hookloop.ConfigurationError(f"cp: {message}")


def _ring_attention_ops() -> set:
    """The aten SDPA ops torch's context parallelism handles (empty if it has none)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:  # another torch: the older module path
        try:
            from torch.distributed.tensor.experimental import _attention  # type: ignore[no-redef]
        except ImportError:
            return set()
    return set(getattr(_attention, "custom_ops", {}) or {})


def unsupported_reason(device: torch.device) -> str | None:
    """Why context parallelism cannot run on ``device`` with this torch, or ``None``."""
    if device.type == "cuda":
        return None
    ops = _ring_attention_ops()
    if device.type == "cpu":
        cpu_op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        if cpu_op is not None and cpu_op.default in ops:
            return None
        handled = ", ".join(sorted(str(op).split(".")[1] for op in ops if "backward" not in str(op))) or "none"
        return (f"torch {torch.__version__}'s ring attention (torch.distributed.tensor.experimental."
                f"context_parallel) handles the CUDA SDPA kernels only ({handled}); on the CPU, SDPA runs "
                f"aten._scaled_dot_product_flash_attention_for_cpu, which has no context-parallel rule. "
                f"Context parallelism runs on CUDA GPUs (NCCL): hookloop run --plugins ddp,cp --accelerator "
                f"gpu --devices k --mesh cp=k train.py")
    return (f"context parallelism runs on CUDA GPUs; this run's device is {device} "
            f"(torch {torch.__version__} has ring attention for the CUDA SDPA kernels only)")


class CP:
    """Context parallelism: each sequence split over the ``cp`` processes, attention by
    ring attention (torch's ``context_parallel``). CUDA only with torch 2.13 (see the
    module docstring).

    seq_dim: the sequence dimension of the batch's tensors (default 1: (batch, sequence, ...)); every tensor in the batch with more dimensions than seq_dim is sharded on it
    buffers: module buffers that depend on the position (e.g. rotary frequencies), by name ("rope.freqs" or "rope.freqs:0" with their sequence dimension, default 0), sharded with the batch and restored after each step
    rotate_method: how keys and values go around the ring: "allgather" (default) or "alltoall"
    """

    hookloop_name = "cp"
    hookloop_role = "extension"
    hookloop_requires = ">=2,<3"
    hookloop_mesh_dims = ("cp",)
    #: the layouts no test checks yet: refused at construction (hookloop.mesh.check_refusals;
    #: docs/configurations.md, "Every pair of mesh plugins"). ddp x cp is checked; pipeline x
    #: cp is refused by the pipeline at start (P08).
    hookloop_refuses_beside = {
        d: f"context parallelism is checked beside ddp only (tests/test_cp.py, tests/gpu/test_cp_gpu.py); "
           f"beside {what} no test checks it yet. Run --plugins ddp,cp --mesh dp_replicate=R,cp=C"
        for d, what in (("tp", "tp"), ("dp_shard", "fsdp"), ("compile", "compile"), ("float8", "float8"))}

    def __init__(self, seq_dim: int = 1, buffers: list[str] | str | None = None, rotate_method: str = "allgather"):
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
            raise _fail(f"option seq_dim={seq_dim!r} must be an integer >= 1 (dimension 0 is the batch)")
        if isinstance(buffers, str):
            buffers = [b.strip() for b in buffers.split(",") if b.strip()]
        if buffers is not None and (not isinstance(buffers, (list, tuple))
                                    or not all(isinstance(b, str) and b for b in buffers)):
            raise _fail(f"option buffers={buffers!r} must be module buffer names ('rope.freqs' or 'rope.freqs:0')")
        if rotate_method not in ROTATE_METHODS:
            raise _fail(f"option rotate_method={rotate_method!r} must be one of {', '.join(map(repr, ROTATE_METHODS))}")
        self.seq_dim, self.rotate_method = seq_dim, rotate_method
        self.buffers = [self._buffer_spec(b) for b in (buffers or [])]
        self.mesh: Any = None
        self._context: Any = None

    @staticmethod
    def _buffer_spec(text: str) -> tuple[str, int]:
        name, _, dim = text.partition(":")
        try:
            return name.strip(), int(dim) if dim.strip() else 0
        except ValueError:
            raise _fail(f"option buffers: {text!r} is not NAME or NAME:DIM (DIM an integer)") from None

    # -- the environment ------------------------------------------------------------------

    @hookloop.hookimpl
    def setup(self, trainer):
        """Refuse a device torch's ring attention does not run on, and a run without the
        ``cp`` dimension on a mesh (no strategy started a process group)."""
        self._check_device(trainer.root_device)
        self.mesh = hookloop.submesh(trainer, self)
        if self.mesh is None:
            raise _fail("no device mesh with a 'cp' dimension: add the strategy that starts the process group "
                        "and owns the model (ddp, fsdp or tp), e.g. --plugins ddp,cp --mesh cp=2")
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(self.rotate_method)
        if trainer.global_rank == 0:
            print(f"hookloop-cp: context parallel over {self.mesh.size()} processes "
                  f"(ring attention, {self.rotate_method})", flush=True)

    def _check_device(self, device: torch.device) -> None:
        reason = unsupported_reason(device)
        if reason is not None:
            raise _fail(reason)

    # -- the step -------------------------------------------------------------------------

    def _tensors(self, batch) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []

        def visit(x):
            if isinstance(x, torch.Tensor):
                if x.dim() > self.seq_dim:
                    found.append(x)
            elif isinstance(x, dict):
                for v in x.values():
                    visit(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    visit(v)

        visit(batch)
        return found

    @hookloop.hookimpl
    def on_train_batch_start(self, trainer, batch, batch_idx):
        """Shard the batch (in place) and the named buffers on the sequence dimension and
        enter ring attention for the step."""
        from torch.distributed.tensor.experimental import context_parallel

        self._leave()
        tensors = self._tensors(batch)
        if not tensors:
            raise _fail(f"the batch holds no tensor with a sequence dimension {self.seq_dim} to shard "
                        f"(option seq_dim)")
        lengths = {t.shape[self.seq_dim] for t in tensors}
        chunks = 2 * self.mesh.size()  # the head-tail load balancer's chunks
        if len(lengths) != 1 or next(iter(lengths)) % chunks:
            raise _fail(f"the batch's sequence lengths (dimension {self.seq_dim}) are {sorted(lengths)}: they must "
                        f"be one length, a multiple of 2 x cp = {chunks}")
        module = trainer.module
        buffers = [module.get_buffer(name) for name, _ in self.buffers]
        self._context = context_parallel(
            self.mesh, buffers=[*tensors, *buffers],
            buffer_seq_dims=[self.seq_dim] * len(tensors) + [d for _, d in self.buffers],
            no_restore_buffers=set(tensors))
        self._context.__enter__()

    @hookloop.hookimpl(tryfirst=True)
    def on_before_optimizer_step(self, trainer, optimizer):
        """The gradients averaged over the cp group (before monitors and clipping read them)."""
        import torch.distributed as dist

        group, size = self.mesh.get_group(), self.mesh.size()
        with torch.no_grad():
            for param_group in optimizer.param_groups:
                for p in param_group["params"]:
                    if p.grad is None:
                        continue
                    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a DTensor's shard
                    dist.all_reduce(grad, group=group)
                    grad.div_(size)

    @hookloop.hookimpl
    def on_train_batch_end(self, trainer, outputs, loss, batch, batch_idx):
        self._leave()

    @hookloop.hookimpl
    def on_exception(self, trainer):
        self._leave()

    @hookloop.hookimpl
    def teardown(self, trainer):
        self._leave()
        self.mesh = None

    def _leave(self) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)
