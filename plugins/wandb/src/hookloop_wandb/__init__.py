"""``wandb``: a run's metrics, hyperparameters and (optionally) checkpoints, as one
Weights & Biases run, continued across elastic restarts and ``ckpt_path`` resumes.

Metrics: every ``on_log_metrics`` row, at its step (W&B's ``_step`` is
``trainer.global_step``; the row also carries ``trainer/global_step`` and ``epoch``).
Hyperparameters: ``hookloop.run_hparams(trainer)`` as the run's config (``trainer.*``, the
Trainer's settings; ``module.*``, the module's ``save_hyperparameters()``). Checkpoints
(``log_model``, Lightning's option): ``True`` logs the checkpoint observer's best and last
checkpoints at the end of ``fit``, ``"all"`` also every checkpoint as it appears, as a
``model`` artifact (``model-<run id>``). Global rank 0 only.

The same run: the run id is kept in the plugin's checkpoint state and in the run
directory (``<log_dir>/wandb-run.json``), and the next ``wandb.init`` uses it with
``resume="allow"``: a worker restarted by ``hookloop run --max-restarts`` (same run
directory) and a ``fit(ckpt_path=...)`` (the checkpoint's state) log into the run they
started. Rows at steps the run already has (the steps between the checkpoint and a
failure, trained again after the resume) are not logged twice.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import hookloop
import hookloop.lightning.loggers

__all__ = ["WandbLogger"]

_MODES = ("online", "offline", "disabled", "shared")
_RUN_FILE = "wandb-run.json"  # in the run directory: the run id and the last step logged


def _require_wandb() -> None:
    """Refuse, with the pip line, when wandb is missing: checked without importing it."""
    if importlib.util.find_spec("wandb") is None:
        raise hookloop.MissingDependencyError(
            "the 'wandb' plugin needs the wandb package, which is not installed: pip install wandb "
            "(or pip install hookloop-wandb, which depends on it)"
        )


class WandbLogger(hookloop.lightning.loggers.ConstructorOptions):
    """Log the run to Weights & Biases: metrics by step, the config, checkpoints (opt-in).

    Lightning's ``WandbLogger`` arguments (``Trainer(logger=WandbLogger(...))``, or
    ``plugins=["wandb"]`` with ``--plugin-option wandb.NAME=VALUE``):

    name: the run's display name (default: W&B's generated name)
    save_dir: where W&B writes its ``wandb/`` directory (default: the run directory,
        ``trainer.log_dir``); ``dir`` is the same option under W&B's name
    version: the run id to log into (``id`` is the same option under W&B's name; default:
        the id the run directory or the resumed checkpoint holds, else a new one)
    offline: ``True`` is ``mode="offline"``
    project: the W&B project (default: W&B's, ``WANDB_PROJECT`` or "uncategorized")
    log_model: ``False``; ``True`` logs the best and last checkpoints at the end of fit,
        ``"all"`` every checkpoint as it is written, as a ``model`` artifact
    prefix: put before every metric name (``prefix-name``)
    checkpoint_name: the artifact's name (default ``model-<run id>``, Lightning's)
    entity: the W&B entity (user or team)
    tags: a list of the run's tags
    mode: "online", "offline", "disabled" or "shared" (default: ``offline``, else the
        ``WANDB_MODE`` environment variable, else W&B's "online")
    kwargs: passed to ``wandb.init`` (``group``, ``job_type``, ``notes``, ``settings``...)

    ``experiment`` is the ``wandb`` Run (global rank 0 during a run; a stand-in
    elsewhere), ``version`` the run id.
    """

    hookloop_name = "wandb"
    hookloop_role = "observer"
    hookloop_requires = ">=2,<3"  # the plugin contract versions it is written for
    hookloop_autoload = False  # by name only (HOOKLOOP_AUTOLOAD_PLUGINS=1 leaves it out)

    def __init__(self, name: str | None = None, save_dir: str | os.PathLike | None = None, version: str | None = None,
                 offline: bool = False, dir: str | os.PathLike | None = None, id: str | None = None,  # noqa: A002
                 project: str | None = None, log_model: bool | str = False, prefix: str = "",
                 checkpoint_name: str | None = None, entity: str | None = None, tags: list | tuple | None = None,
                 mode: str | None = None, **kwargs: Any):
        self._init_args = hookloop.lightning.loggers.init_args(locals())
        _require_wandb()
        if log_model not in (True, False, "all"):
            raise hookloop.ConfigurationError(f"wandb log_model={log_model!r} must be True, False or 'all'")
        if not isinstance(offline, bool):
            raise hookloop.ConfigurationError(f"wandb offline={offline!r} must be true or false")
        if mode is not None and mode not in _MODES:
            raise hookloop.ConfigurationError(f"wandb mode={mode!r} must be one of {', '.join(_MODES)}")
        if offline and mode not in (None, "offline"):
            raise hookloop.ConfigurationError(f"wandb offline=True contradicts mode={mode!r}: give one of them")
        if version is not None and id is not None and str(version) != str(id):
            raise hookloop.ConfigurationError(f"wandb version={version!r} and id={id!r} differ: give one of them")
        if save_dir is not None and dir is not None and os.fspath(save_dir) != os.fspath(dir):
            raise hookloop.ConfigurationError(f"wandb save_dir={save_dir!r} and dir={dir!r} differ: give one of them")
        if isinstance(tags, str):
            tags = [t for t in tags.split(",") if t]  # --plugin-option wandb.tags=a,b
        if tags is not None and not isinstance(tags, (list, tuple)):
            raise hookloop.ConfigurationError(f"wandb tags={tags!r} must be a list of strings")
        self.name = None if name is None else str(name)
        self.save_dir = None if (save_dir if save_dir is not None else dir) is None else os.fspath(save_dir or dir)
        given = version if version is not None else id
        self._given_id = None if given is None else str(given)
        self.mode = "offline" if offline else mode
        self.project, self.entity = project, entity
        self.log_model, self.prefix = log_model, "" if prefix is None else str(prefix)
        self.checkpoint_name = checkpoint_name
        self.tags = None if tags is None else [str(t) for t in tags]
        self.kwargs = kwargs
        self.run = None
        self._run_id: str | None = self._given_id
        self._resumed: dict | None = None  # {"run_id", "last_step"} from a checkpoint
        self._last_step = -1  # the highest step this run has (in every attempt)
        self._skip_through = -1  # rows at steps up to this one were logged by an earlier attempt
        self._run_dir: Path | None = None
        self._logged_files: dict[str, float] = {}  # checkpoint path -> mtime, logged as artifacts
        self._failed = False

    # -- Lightning's logger properties and methods -----------------------------------------

    @property
    def experiment(self) -> Any:
        """The ``wandb`` Run (global rank 0, during a run); a stand-in that does nothing elsewhere."""
        if self.run is None or not hookloop.lightning.loggers.is_rank_zero():
            return hookloop.lightning.loggers.DummyExperiment()
        return self.run

    @property
    def version(self) -> str | None:
        """The W&B run id."""
        return self._run_id

    @property
    def log_dir(self) -> str | None:
        return None if self.run is None else str(Path(self.run.dir).parent)

    root_dir = None

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        """Log ``metrics`` (names with ``prefix``) at ``step``; rank 0, in a run. A row at a
        step an earlier attempt of the run already logged is left out."""
        if self.run is None or not hookloop.lightning.loggers.is_rank_zero():
            return
        if step is not None and step <= self._skip_through:
            return
        row = {k: v.item() if hasattr(v, "item") else v for k, v in hookloop.lightning.loggers.add_prefix(dict(metrics), self.prefix).items()}
        if step is None:
            self.run.log(row)
            return
        row["trainer/global_step"] = step
        self.run.log(row, step=step)
        if step > self._last_step:
            self._last_step = step

    def log_hyperparams(self, params: Any) -> None:
        """Add ``params`` to the run's config; rank 0, in a run."""
        if self.run is None or not hookloop.lightning.loggers.is_rank_zero():
            return
        params = vars(params) if hasattr(params, "__dict__") and not isinstance(params, dict) else dict(params or {})
        self.run.config.update(params, allow_val_change=True)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Lightning's ``log_graph``: nothing here (``wandb.watch`` through ``experiment``)."""

    def save(self) -> None:
        """W&B sends as it logs; the run id and the last step go to the run directory."""
        self._write_run_file()

    def finalize(self, status: str = "success") -> None:
        """Finish the run (exit code 1 for "failed")."""
        self._finish(failed=status == "failed")

    def __getstate__(self) -> dict:
        """Without the run (a spawned worker starts its own)."""
        return {**self.__dict__, "run": None}

    # -- the run ----------------------------------------------------------------------------

    def _start(self, trainer) -> None:
        """``wandb.init`` on global rank 0: the given id, else the resumed checkpoint's, else
        the run directory's (an elastic restart), else a new one; ``resume="allow"``."""
        if self.run is not None or not trainer.is_global_zero:
            return
        import wandb

        run_dir = Path(trainer.log_dir)
        self._skip_through = -1  # this object's own earlier stage (fit, then test): nothing to skip
        if run_dir != self._run_dir:  # a run this object has not logged yet: continue the one it names
            self._run_dir, self._run_id, self._last_step = run_dir, self._given_id, -1
            known = [s for s in (self._resumed, _read_run_file(run_dir)) if s and s.get("run_id")]
            if self._run_id is None and known:
                self._run_id = known[0]["run_id"]
            self._last_step = max([-1] + [int(s.get("last_step", -1)) for s in known if s["run_id"] == self._run_id])
            self._skip_through = self._last_step
        if self._run_id is None:
            self._run_id = _new_run_id()
        save_dir = Path(self.save_dir) if self.save_dir else run_dir
        save_dir.mkdir(parents=True, exist_ok=True)
        options = {k: v for k, v in (("project", self.project), ("entity", self.entity), ("name", self.name),
                                     ("tags", self.tags), ("mode", self.mode)) if v is not None}
        try:
            self.run = wandb.init(id=self._run_id, resume="allow", dir=str(save_dir), **options, **self.kwargs)
        except Exception as exc:  # noqa: BLE001 - W&B's errors (no login, no network) have many types
            raise hookloop.ConfigurationError(
                f"wandb.init failed ({type(exc).__name__}: {exc}): log in with `wandb login`, or run offline "
                f"(--plugin-option wandb.mode=offline or WANDB_MODE=offline; `wandb sync` uploads later)"
            ) from exc
        self.run.config.update(hookloop.run_hparams(trainer), allow_val_change=True)
        self.run.define_metric("trainer/global_step")
        self._write_run_file()

    def _finish(self, failed: bool) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        self._write_run_file()
        run.finish(exit_code=1 if failed else 0)

    def _write_run_file(self) -> None:
        if self.run is None or self._run_dir is None:
            return
        from hookloop.resume.checkpoint import atomic_write_text

        atomic_write_text(self._run_dir / _RUN_FILE,
                          json.dumps({"run_id": self._run_id, "last_step": self._last_step}))

    def _log_checkpoints(self, trainer, final: bool) -> None:
        """The checkpoints not logged yet: best and last at the end of fit (``log_model=True``);
        with ``"all"`` every checkpoint file of the checkpoint directory, as it appears."""
        callback = trainer.checkpoint_callback
        if self.run is None or not self.log_model or callback is None:
            return
        paths = [p for p in (callback.best_model_path, callback.last_model_path) if p]
        if self.log_model == "all":
            folder = getattr(callback, "dir", None)
            if folder is not None and Path(folder).is_dir():
                paths = sorted(str(p) for p in Path(folder).iterdir() if p.suffix == ".ckpt") + paths
        elif not final:
            return
        import wandb

        for path in dict.fromkeys(paths):
            if not os.path.exists(path):
                continue
            mtime = os.path.getmtime(path)
            if self._logged_files.get(path) == mtime:
                continue
            self._logged_files[path] = mtime
            aliases = ["latest"] + (["best"] if path == callback.best_model_path else [])
            artifact = wandb.Artifact(name=self.checkpoint_name or f"model-{self._run_id}", type="model",
                                      metadata={"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                                                "path": os.path.basename(path)})
            if os.path.isdir(path):
                artifact.add_dir(path, name=os.path.basename(path))
            else:
                artifact.add_file(path, name=os.path.basename(path))
            self.run.log_artifact(artifact, aliases=aliases)

    # -- hooks --------------------------------------------------------------------------------

    @hookloop.hookimpl
    def setup(self):
        self._failed, self._resumed = False, None  # on_load_checkpoint, after setup, sets it again

    @hookloop.hookimpl
    def on_load_checkpoint(self, checkpoint):
        state = (checkpoint.get("plugins") or {}).get("wandb")
        if isinstance(state, dict) and state.get("run_id"):
            self._resumed = {"run_id": str(state["run_id"]), "last_step": int(state.get("last_step", -1))}

    @hookloop.hookimpl
    def on_save_checkpoint(self, trainer, checkpoint):
        if self._run_id is not None and trainer.is_global_zero:
            checkpoint.setdefault("plugins", {})["wandb"] = {"run_id": self._run_id, "last_step": self._last_step}
            self._write_run_file()

    @hookloop.hookimpl
    def on_fit_start(self, trainer):
        self._start(trainer)

    @hookloop.hookimpl
    def on_test_start(self, trainer):
        self._start(trainer)

    @hookloop.hookimpl
    def on_log_metrics(self, trainer, metrics, step, epoch):
        if self.run is None and trainer.is_global_zero:
            self._start(trainer)  # validate()/predict(), or a row before on_fit_start
        if self.run is not None:
            self.log_metrics(metrics if epoch is None else {**metrics, "epoch": epoch}, step)

    @hookloop.hookimpl
    def on_train_epoch_end(self, trainer):
        if self.run is not None:
            self._write_run_file()
            self._log_checkpoints(trainer, final=False)

    @hookloop.hookimpl
    def on_exception(self):
        self._failed = True
        self._write_run_file()

    @hookloop.hookimpl
    def on_fit_end(self, trainer):
        self._log_checkpoints(trainer, final=True)

    @hookloop.hookimpl
    def teardown(self):
        self._finish(failed=self._failed)


def _new_run_id() -> str:
    """Eight lowercase letters and digits, as W&B's own run ids."""
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _read_run_file(run_dir: Path) -> dict | None:
    try:
        state = json.loads((run_dir / _RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None
