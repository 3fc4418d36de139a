"""The training loop. Every technique that would clutter it lives in a plugin."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from . import checkpoint as ckpt
from . import plugins as plugin_registry
from .config import TrainerConfig, env_defaults
from .defaults import Defaults
from .errors import CheckpointError, ConfigurationError
from .helpers import move_to_device, rebuild_dataloader
from .launch import in_worker, run_command
from .module import Metrics

_UNSET: Any = object()
TRAIN, VALIDATE = "train", "validate"


class _StepModule(nn.Module):
    """Routes ``forward`` to the user's ``training_step``/``validation_step``.

    Strategy wrappers (DDP, DataParallel, DeepSpeed's engine) wrap this module, so their
    forward logic runs around every step exactly as it would around ``forward``.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, kind: str, batch: Any, batch_idx: int):
        if kind == TRAIN:
            return self.module.training_step(batch, batch_idx)
        return self.module.validation_step(batch, batch_idx)


class default:
    """Mark a ``Trainer`` argument as the script's fallback: ``hookloop run`` options win.

    ``Trainer(max_epochs=hookloop.default(20))`` trains 20 epochs, or as many as
    ``hookloop run --max-epochs N`` says. A plain ``Trainer(max_epochs=20)`` always wins.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"hookloop.default({self.value!r})"


class Trainer:
    """Runs a training module's steps; plugins supply every technique.

    Arguments not given in code fall back to the options of ``hookloop run`` (passed
    through the environment), then to the defaults of :class:`TrainerConfig`.

    Attributes plugins read (see :mod:`hookloop.hookspecs`): ``config``, ``module`` (the
    user's module), ``model`` (what the strategy wrapped), ``optimizer``,
    ``lr_scheduler``, ``world_size``, ``global_rank``, ``local_rank``, ``node_rank``,
    ``root_device``, ``precision``, ``current_epoch``, ``global_step``,
    ``callback_metrics``, ``plugin_manager``, ``strategy``.
    """

    def __init__(
        self,
        *,
        plugins: Any = _UNSET,
        devices: Any = _UNSET,
        accelerator: str = _UNSET,
        nodes: int = _UNSET,
        node_rank: int = _UNSET,
        rdzv_endpoint: str | None = _UNSET,
        max_restarts: int = _UNSET,
        max_epochs: int | None = _UNSET,
        max_steps: int | None = _UNSET,
        accumulate_grad_batches: int = _UNSET,
        gradient_clip_val: float | None = _UNSET,
        gradient_clip_algorithm: str = _UNSET,
        precision: Any = _UNSET,
        default_root_dir: str = _UNSET,
        enable_checkpointing: bool = _UNSET,
        limit_train_batches: int | None = _UNSET,
        limit_val_batches: int | None = _UNSET,
        check_val_every_n_epoch: int = _UNSET,
        use_distributed_sampler: bool = _UNSET,
        autoload_plugins: bool = _UNSET,
        plugin_options: dict = _UNSET,
    ):
        given = {k: v for k, v in locals().items() if k in _CONFIG_FIELDS and v is not _UNSET}
        # hookloop.default(x): the script's own fallback, which `hookloop run` options override.
        fallbacks = {k: v.value for k, v in given.items() if isinstance(v, default)}
        given = {k: v for k, v in given.items() if k not in fallbacks}
        from_env = env_defaults()
        settings = {**fallbacks, **from_env, **given}
        if isinstance(settings.get("plugins"), (str, type(None))) or not isinstance(settings.get("plugins", []), (list, tuple)):
            settings["plugins"] = [settings["plugins"]] if settings.get("plugins") else []
        settings["plugins"] = list(settings.get("plugins", []))
        if "autoload_plugins" not in settings:
            settings["autoload_plugins"] = os.environ.get("HOOKLOOP_AUTOLOAD_PLUGINS", "") in ("1", "true", "yes")
        self.config = TrainerConfig(**settings)
        self.config.validate()

        # Plugins named in code win over those named by the CLI / environment.
        requested = given.get("plugins", [])
        if isinstance(requested, (str,)) or not isinstance(requested, (list, tuple)):
            requested = [requested]
        defaults = list(from_env.get("plugins", [])) if "plugins" not in given else []
        defaults += plugin_registry.environment_plugins()
        options = self.config.plugin_options
        chosen = plugin_registry.collect(requested, defaults, autoload=self.config.autoload_plugins)
        chosen += plugin_registry.default_precision_plugin(chosen, self.config.precision)
        chosen = [_apply_options(p, options) for p in chosen]
        plugin_registry.check_composition(chosen)
        self.plugins = chosen
        self.plugin_manager = plugin_registry.make_plugin_manager(chosen, Defaults())
        self.hook = self.plugin_manager.hook
        self.strategy = next((p for p in chosen if plugin_registry.plugin_role(p) == "strategy"), None)

        # Run state: written by setup_environment (ranks, device) and by the loop.
        self.world_size, self.global_rank, self.local_rank, self.node_rank = 1, 0, 0, 0
        self.root_device = torch.device("cpu")
        self.module: nn.Module | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.lr_scheduler_interval = "epoch"
        self.current_epoch = 0
        self.global_step = 0
        self.batch_idx = 0
        self.train_dataloader: DataLoader | None = None
        self.val_dataloader: DataLoader | None = None
        self._metrics = Metrics(self)
        self._current_batch: Any = None
        self._epoch_rng: dict | None = None
        self._resume_batches = 0
        self.should_stop = False

    # -- plain attributes plugins read ---------------------------------------------------

    @property
    def precision(self) -> str:
        return self.config.precision

    @property
    def accumulate_grad_batches(self) -> int:
        return self.config.accumulate_grad_batches

    @property
    def gradient_clip_val(self) -> float | None:
        return self.config.gradient_clip_val

    @property
    def max_epochs(self) -> int | None:
        return self.config.max_epochs

    @property
    def max_steps(self) -> int | None:
        return self.config.max_steps

    @property
    def default_root_dir(self) -> Path:
        return Path(self.config.default_root_dir)

    @property
    def callback_metrics(self) -> dict[str, float]:
        return self._metrics.callback_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        return {k: v for k, v in self.callback_metrics.items() if k in self._metrics.prog_bar}

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def has_plugin(self, role: str) -> bool:
        """Whether a plugin of ``role`` (``"strategy"``, ``"precision"``...) is enabled."""
        return any(plugin_registry.plugin_role(p) == role for p in self.plugins)

    def strategy_owns(self, concern: str) -> bool:
        """Whether the strategy takes over ``concern`` (e.g. ``"precision"``) itself."""
        return self.strategy is not None and concern in plugin_registry.plugin_owns(self.strategy)

    # -- collectives, as plugins and modules call them ----------------------------------

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return self.hook.reduce(trainer=self, tensor=tensor, op=op)

    def barrier(self, name: str = "") -> None:
        self.hook.barrier(trainer=self, name=name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as global rank ``src`` holds it, on every rank (``None`` included:
        the object travels in a one-element list, so a firstresult hook never mistakes
        a broadcast ``None`` for "not handled")."""
        return self.hook.broadcast(trainer=self, obj=[obj], src=src)[0]

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    # -- pickling, for strategies that send the trainer to spawned workers ---------------

    def __getstate__(self) -> dict:
        # pluggy's hook callers hold the hook-spec module, which cannot be pickled: the
        # plugin manager is rebuilt from the (pickled) plugins on arrival.
        state = self.__dict__.copy()
        state.pop("plugin_manager", None)
        state.pop("hook", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.plugin_manager = plugin_registry.make_plugin_manager(self.plugins, Defaults())
        self.hook = self.plugin_manager.hook

    # -- entry points -------------------------------------------------------------------

    def fit(
        self,
        module: nn.Module,
        train_dataloaders: DataLoader,
        val_dataloaders: DataLoader | None = None,
        ckpt_path: str | os.PathLike | None = None,
    ) -> None:
        """Train ``module`` on ``train_dataloaders``; validate each epoch if given.

        ``ckpt_path`` resumes from a checkpoint file, or ``"last"`` for
        ``<default_root_dir>/checkpoints/last.ckpt``. With ``devices > 1`` and no launcher
        around this process, the script is re-launched through the strategy's launcher
        (torchrun by default) and this process exits with the workers' status.
        """
        _check_module(module, needs_training=True)
        _check_loader(train_dataloaders, "train_dataloaders")
        if val_dataloaders is not None:
            _check_loader(val_dataloaders, "val_dataloaders")
            if not callable(getattr(module, "validation_step", None)):
                raise ConfigurationError(
                    f"val_dataloaders were given but {type(module).__name__} has no "
                    f"validation_step(batch, batch_idx)"
                )
        self.module = module
        self.train_dataloader, self.val_dataloader = train_dataloaders, val_dataloaders
        self._ckpt_path = ckpt_path
        self._launch_or_run(self._run_fit)

    def validate(self, module: nn.Module, dataloaders: DataLoader, ckpt_path: str | None = None) -> dict:
        """Run ``validation_step`` over ``dataloaders``; return the logged metrics."""
        _check_module(module, needs_training=False)
        _check_loader(dataloaders, "dataloaders")
        self.module = module
        self.train_dataloader, self.val_dataloader = None, dataloaders
        self._ckpt_path = ckpt_path
        result = self._launch_or_run(self._run_validate)
        return result if isinstance(result, dict) else dict(self.callback_metrics)

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint of the whole run state to ``path`` (call on every rank)."""
        checkpoint = self._checkpoint_dict()
        return self.hook.save_checkpoint(trainer=self, checkpoint=checkpoint, path=Path(path))

    # -- launching ----------------------------------------------------------------------

    def _launch_or_run(self, function):
        self._check_devices()
        spawned = self.hook.spawn(trainer=self, function=function)
        if spawned is not None:
            return spawned
        world = self.config.num_processes() * self.config.nodes
        if world > 1 and not in_worker():
            script = sys.argv[0]
            if not script or not Path(script).is_file():
                raise ConfigurationError(
                    f"devices={self.config.devices} needs worker processes, and hookloop "
                    f"re-launches the running script to start them, but this process has no "
                    f"script file (an interactive session or notebook?). Use a spawn-based "
                    f"strategy (plugins=['ddp_spawn']) or run a script with `hookloop run`."
                )
            cmd = self.hook.launch_command(config=self.config, script=script, script_args=sys.argv[1:])
            raise SystemExit(run_command(cmd))
        return function(self)

    def _check_devices(self) -> None:
        # The devices plugin chooses first: it may narrow ``config.devices`` (gpus="3"
        # is GPU 3, one process), so the process count is read after its choice.
        self.device_ids = self.hook.select_devices(config=self.config)
        nproc = self.config.num_processes()
        if nproc * self.config.nodes > 1 and self.strategy is None:
            installed = sorted(plugin_registry.installed_plugins())
            raise ConfigurationError(
                f"devices={self.config.devices!r} x nodes={self.config.nodes} asks for "
                f"{nproc * self.config.nodes} processes, but no strategy plugin is enabled to "
                f"run them (the built-in default is one process). Enable one by name, e.g. "
                f"plugins=['ddp'] or --plugins ddp (pip install hookloop-ddp). Installed "
                f"plugins: {', '.join(installed) or 'none'}."
            )

    # -- one run ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self, stage: str):
        hook = self.hook
        self.module.__dict__["_hookloop_trainer"] = self
        set_up = False
        try:
            hook.setup_environment(trainer=self)
            hook.setup(trainer=self, stage=stage)
            set_up = True
            yield
        except BaseException as exc:
            if set_up and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
                hook.on_exception(trainer=self, exception=exc)
            raise
        finally:
            hook.teardown(trainer=self, stage=stage)
            self.module.__dict__.pop("_hookloop_trainer", None)

    def _build_model(self, stage: str) -> None:
        module = self.module
        if callable(getattr(module, "configure_model", None)):
            with self.hook.model_init_context(trainer=self):
                module.configure_model()
        optimizer = None
        if stage == "fit":
            optimizer, self.lr_scheduler, self.lr_scheduler_interval = _parse_optimizers(
                module.configure_optimizers(), type(module).__name__
            )
        self.model = self.hook.wrap_model(trainer=self, model=_StepModule(module), optimizer=optimizer)
        if optimizer is not None:
            replaced = self.hook.wrap_optimizer(trainer=self, model=self.model, optimizer=optimizer)
            optimizer = replaced if replaced is not None else optimizer
        self.optimizer = optimizer

    def _prepare_loader(self, loader: DataLoader | None, training: bool) -> DataLoader | None:
        if loader is None or not self.config.use_distributed_sampler:
            return loader
        sampler = self.hook.configure_sampler(trainer=self, dataloader=loader, training=training)
        return loader if sampler is None else rebuild_dataloader(loader, sampler)

    def _run_fit(self, _trainer=None) -> None:
        with self._session("fit"):
            self._build_model("fit")
            train_loader = self._prepare_loader(self.train_dataloader, training=True)
            val_loader = self._prepare_loader(self.val_dataloader, training=False)
            if self._ckpt_path is not None:
                self._restore(self._ckpt_path)
            self._print_effective_batch(train_loader)
            hook = self.hook
            hook.on_fit_start(trainer=self)
            max_epochs = self.config.max_epochs
            if max_epochs is None:
                max_epochs = 1000 if self.config.max_steps is None else sys.maxsize
            step = self._make_step()
            while self.current_epoch < max_epochs and not self._done():
                epoch = self.current_epoch
                sampler = getattr(train_loader, "sampler", None)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(epoch)
                self._metrics.start("train")
                self.model.train()
                hook.on_train_epoch_start(trainer=self, epoch=epoch)
                if not self._train_epoch(train_loader, step):
                    # Stopped inside the epoch (max_steps): keep the position, so a
                    # checkpoint resumes at the next batch of this epoch.
                    if self.config.enable_checkpointing:
                        self.save_checkpoint(self.default_root_dir / "checkpoints" / "last.ckpt")
                    break
                if val_loader is not None and (epoch + 1) % self.config.check_val_every_n_epoch == 0:
                    self._validation_loop(val_loader)
                if self.lr_scheduler is not None and self.lr_scheduler_interval == "epoch":
                    self.lr_scheduler.step()
                self._metrics.stage = "train"
                metrics = self._metrics.compute_epoch() if self._metrics.epoch_sums or self._metrics.step_values else {}
                hook.on_train_epoch_end(trainer=self, epoch=epoch, metrics=dict(self.callback_metrics, **metrics))
                self.current_epoch = epoch + 1
                self.batch_idx = 0
                if self.config.enable_checkpointing:
                    self.save_checkpoint(self.default_root_dir / "checkpoints" / "last.ckpt")
            hook.on_fit_end(trainer=self)

    def _run_validate(self, _trainer=None) -> dict:
        with self._session("validate"):
            self._build_model("validate")
            val_loader = self._prepare_loader(self.val_dataloader, training=False)
            if self._ckpt_path is not None:
                self._restore(self._ckpt_path)
            return self._validation_loop(val_loader)

    def _done(self) -> bool:
        return self.should_stop or (self.config.max_steps is not None and self.global_step >= self.config.max_steps)

    def _print_effective_batch(self, loader: DataLoader) -> None:
        if self.global_rank == 0 and self.world_size * self.accumulate_grad_batches > 1:
            per_device = loader.batch_size
            print(
                f"hookloop: effective batch size {per_device * self.world_size * self.accumulate_grad_batches} "
                f"= {per_device} per device x {self.world_size} processes x "
                f"{self.accumulate_grad_batches} accumulated batches",
                flush=True,
            )

    # -- the step -----------------------------------------------------------------------

    def _only_default(self, name: str) -> bool:
        """Whether only the built-in defaults implement hook ``name``."""
        impls = getattr(self.hook, name).get_hookimpls()
        return len(impls) == 1 and impls[0].plugin_name == "hookloop.defaults"

    def _step_functions(self, model, optimizer):
        """``backward(loss)``, ``optimizer_step()`` and ``zero_grad()`` for this run.

        Where only the built-in default implements a hook, the loop calls plain torch
        directly, so a run without plugins costs what a hand-written loop costs; otherwise
        each call goes through pluggy to the plugins' implementations.
        """
        hook = self.hook
        if self._only_default("backward"):
            backward = torch.Tensor.backward
        else:
            def backward(loss):
                hook.backward(trainer=self, loss=loss, model=model, optimizer=optimizer)
        if self._only_default("optimizer_step") and not self.gradient_clip_val:
            optimizer_step = optimizer.step
        else:
            def optimizer_step():
                hook.optimizer_step(trainer=self, optimizer=optimizer, model=model)
        if self._only_default("zero_grad"):
            def zero_grad():
                optimizer.zero_grad(set_to_none=True)
        else:
            def zero_grad():
                hook.zero_grad(trainer=self, optimizer=optimizer, model=model)
        return backward, optimizer_step, zero_grad

    def _make_step(self):
        """Build the per-micro-batch function once, with everything that can be decided
        before the first step decided."""
        model, module, optimizer = self.model, self.module, self.optimizer
        backward, optimizer_step, zero_grad = self._step_functions(model, optimizer)
        contexts = [c for c in self.hook.forward_context(trainer=self) if c is not None]
        forward = module.training_step if isinstance(model, _StepModule) else (lambda b, i: model(TRAIN, b, i))
        step_end_user = getattr(module, "training_step_end", None)
        step_end_plugins = self.hook.training_step_end if self.hook.training_step_end.get_hookimpls() else None
        batch_end = self.hook.on_train_batch_end if self.hook.on_train_batch_end.get_hookimpls() else None
        accumulate = self.accumulate_grad_batches
        accumulation_context = self.hook.accumulation_context
        scheduler = self.lr_scheduler if self.lr_scheduler_interval == "step" else None
        max_steps = self.config.max_steps
        device = self.root_device
        move = device.type != "cpu"

        def step(batch, batch_idx: int, boundary: bool) -> bool:
            """One micro-batch; returns True when training should stop (max_steps)."""
            if move:
                batch = move_to_device(batch, device)
            self._current_batch = batch  # for self.log's batch size, computed only if asked
            sync_ctx = None if boundary or accumulate == 1 else accumulation_context(trainer=self, model=model)
            if sync_ctx is not None:
                sync_ctx.__enter__()
            try:
                if contexts:
                    with contextlib.ExitStack() as stack:
                        for c in contexts:
                            stack.enter_context(c)
                        out = forward(batch, batch_idx)
                else:
                    out = forward(batch, batch_idx)
                if step_end_user is not None:
                    out = step_end_user(out)
                if step_end_plugins is not None:
                    for replaced in step_end_plugins(trainer=self, outputs=out):
                        if replaced is not None:
                            out = replaced
                loss = out if type(out) is torch.Tensor else _loss_from(out)
                if loss.ndim != 0:
                    raise TypeError(
                        f"training_step must return a scalar loss tensor (or a dict with a "
                        f"'loss' entry), got a tensor of shape {tuple(loss.shape)}: reduce it, "
                        f"e.g. with .mean()"
                    )
                backward(loss / accumulate if accumulate > 1 else loss)
            finally:
                if sync_ctx is not None:
                    sync_ctx.__exit__(None, None, None)
            stop = False
            if boundary:
                optimizer_step()
                zero_grad()
                self.global_step += 1
                if scheduler is not None:
                    scheduler.step()
                stop = max_steps is not None and self.global_step >= max_steps
            if batch_end is not None:
                batch_end(trainer=self, loss=loss.detach(), batch_idx=batch_idx)
            return stop

        return step

    def _train_epoch(self, loader: DataLoader, step) -> bool:
        """Train one epoch; False when training stopped before its end."""
        limit = self.config.limit_train_batches
        try:
            n_batches = len(loader)
        except TypeError:
            n_batches = None
        if limit is not None:
            n_batches = limit if n_batches is None else min(n_batches, limit)
        accumulate = self.accumulate_grad_batches
        skip = self._resume_batches
        self._resume_batches = 0
        if skip:
            # Resuming mid-epoch: replay this epoch's shuffle, skip what was trained.
            resume_rng = ckpt.rng_state()
            ckpt.set_rng_state(self._epoch_rng)
        else:
            self._epoch_rng = ckpt.rng_state() if self.config.enable_checkpointing else None
        iterator = iter(loader)
        if skip:
            for _ in range(skip):
                next(iterator)
            ckpt.set_rng_state(resume_rng)
        batch_idx = skip
        for batch in iterator:
            if n_batches is not None and batch_idx >= n_batches:
                break
            self.batch_idx = batch_idx
            boundary = (batch_idx + 1) % accumulate == 0 or (n_batches is not None and batch_idx + 1 == n_batches)
            if step(batch, batch_idx, boundary):
                self.batch_idx = batch_idx + 1
                return n_batches is not None and self.batch_idx >= n_batches
            batch_idx += 1
        self.batch_idx = batch_idx
        return True

    def _validation_loop(self, loader: DataLoader) -> dict:
        model, module = self.model, self.module
        was_training = model.training
        model.eval()
        metrics = self._metrics
        previous_stage = metrics.stage
        metrics.start("validate")
        contexts = [c for c in self.hook.forward_context(trainer=self) if c is not None]
        forward = module.validation_step if isinstance(model, _StepModule) else (lambda b, i: model(VALIDATE, b, i))
        limit = self.config.limit_val_batches
        move = self.root_device.type != "cpu"
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for c in contexts:
                stack.enter_context(c)
            for batch_idx, batch in enumerate(loader):
                if limit is not None and batch_idx >= limit:
                    break
                if move:
                    batch = move_to_device(batch, self.root_device)
                self._current_batch = batch
                forward(batch, batch_idx)
        result = metrics.compute_epoch()
        metrics.epoch_sums = {}
        metrics.stage = previous_stage
        self.hook.on_validation_end(trainer=self, metrics=dict(result))
        model.train(was_training)
        return result

    # -- checkpoints --------------------------------------------------------------------

    def _checkpoint_dict(self) -> dict:
        import hookloop

        checkpoint = {
            "hookloop": {"version": hookloop.__version__, "format": ckpt.FORMAT_VERSION},
            "state_dict": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loop": {
                "epoch": self.current_epoch,
                "global_step": self.global_step,
                "batch_idx": self.batch_idx,
            },
            "rng": ckpt.rng_state(),
            "epoch_rng": self._epoch_rng if self.batch_idx else None,
            "plugins": {},
        }
        self.hook.on_save_checkpoint(trainer=self, checkpoint=checkpoint)
        return checkpoint

    def _restore(self, ckpt_path: str | os.PathLike) -> None:
        path = Path(ckpt_path)
        if str(ckpt_path) == "last":
            path = self.default_root_dir / "checkpoints" / "last.ckpt"
            if not path.exists():
                raise CheckpointError(
                    f"ckpt_path='last' but no checkpoint was written under {path.parent}: "
                    f"train once with enable_checkpointing=True, or pass a checkpoint path"
                )
        checkpoint = self.hook.load_checkpoint(trainer=self, path=path)
        if not isinstance(checkpoint, dict) or "loop" not in checkpoint:
            raise CheckpointError(f"{str(path)!r} is not a hookloop checkpoint (no loop state)")
        self.hook.load_model_state(trainer=self, checkpoint=checkpoint)
        loop = checkpoint["loop"]
        self.current_epoch = int(loop["epoch"])
        self.global_step = int(loop["global_step"])
        self._resume_batches = int(loop.get("batch_idx", 0))
        self._epoch_rng = checkpoint.get("epoch_rng")
        if self._resume_batches and self._epoch_rng is None:
            raise CheckpointError(f"{str(path)!r} was saved mid-epoch without the epoch's RNG state")
        if checkpoint.get("rng") is not None:
            ckpt.set_rng_state(checkpoint["rng"])
        self.hook.on_load_checkpoint(trainer=self, checkpoint=checkpoint)


_CONFIG_FIELDS = {f.name for f in fields(TrainerConfig)}


def _apply_options(plugin: Any, options: dict) -> Any:
    name = plugin_registry.plugin_name(plugin)
    if name in options and not isinstance(plugin, type):
        for key, value in options[name].items():
            if not hasattr(plugin, key):
                raise ConfigurationError(f"plugin {name!r} has no option {key!r}")
            setattr(plugin, key, value)
    return plugin


def _loss_from(out: Any) -> torch.Tensor:
    if isinstance(out, dict) and "loss" in out:
        out = out["loss"]
    if isinstance(out, torch.Tensor):
        return out
    raise TypeError(
        f"training_step must return the loss as a scalar tensor (or a dict with a 'loss' "
        f"entry), got {type(out).__name__}: return e.g. F.cross_entropy(logits, y)"
    )


def _check_module(module: Any, needs_training: bool) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    needed = ["training_step", "configure_optimizers"] if needs_training else ["validation_step"]
    missing = [m for m in needed if not callable(getattr(module, m, None))]
    if missing:
        raise ConfigurationError(
            f"{type(module).__name__} must define {' and '.join(m + '()' for m in missing)}; "
            f"see hookloop.Module"
        )


def _check_loader(loader: Any, name: str) -> None:
    if not isinstance(loader, DataLoader):
        raise TypeError(f"{name} must be a torch.utils.data.DataLoader, got {type(loader).__name__}")


def _parse_optimizers(result: Any, owner: str):
    """Accept what Lightning users return from ``configure_optimizers``."""
    scheduler, interval = None, "epoch"
    if isinstance(result, torch.optim.Optimizer):
        return result, None, interval
    if isinstance(result, dict):
        optimizer = result.get("optimizer")
        scheduler = result.get("lr_scheduler")
    elif isinstance(result, (list, tuple)) and len(result) == 2:
        optimizer, scheduler = result
        if isinstance(optimizer, (list, tuple)):
            if len(optimizer) != 1:
                raise ConfigurationError(f"{owner}.configure_optimizers returned {len(optimizer)} optimizers; hookloop trains with one")
            optimizer = optimizer[0]
        if isinstance(scheduler, (list, tuple)):
            scheduler = scheduler[0] if scheduler else None
    elif isinstance(result, (list, tuple)) and len(result) == 1:
        optimizer = result[0]
    else:
        optimizer = None
    if isinstance(scheduler, dict):
        interval = scheduler.get("interval", "epoch")
        scheduler = scheduler.get("scheduler")
        if interval not in ("epoch", "step"):
            raise ConfigurationError(f"lr_scheduler interval={interval!r} must be 'epoch' or 'step'")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"{owner}.configure_optimizers must return an optimizer, (optimizer, scheduler), "
            f"or {{'optimizer': ..., 'lr_scheduler': ...}}; got {type(result).__name__}"
        )
    return optimizer, scheduler, interval
