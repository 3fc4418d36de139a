"""What hookloop's logger objects share with Lightning's loggers.

``hookloop.CSVLogger``, ``hookloop_tensorboard.TensorBoardLogger`` and
``hookloop_mlflow.MLFlowLogger`` take Lightning 2.6's constructor arguments and are
passed as ``Trainer(logger=...)`` (one, or a list). They stay plugins (observers on the
public hooks); this module holds the parts they share: the version directories of
``save_dir/name/version_N`` (:class:`VersionedDirectory`), metric-name prefixes, the
hyperparameters Lightning logs, the experiment stand-in of the other ranks, and the
check of what ``Trainer(logger=...)`` was given.

The core reads logger objects by duck type only (it never imports a plugin): a logger
is a plugin with an ``on_log_metrics`` hook implementation; one that places its own
directories defines ``hookloop_run_root()`` (``(versions root, version or None)``, or
``None`` to write into the run directory) and ``hookloop_use_run_dir(path)``, which the
core calls on every rank with the directory global rank 0 claimed.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path
from typing import Any

from hookloop.contract.errors import ConfigurationError

_VERSION_DIR = re.compile(r"^version_(\d+)$")


def add_prefix(metrics: dict, prefix: str, separator: str = "-") -> dict:
    """``{"prefix-name": value}``, as Lightning's loggers prefix metric names."""
    if not prefix:
        return metrics
    return {f"{prefix}{separator}{k}": v for k, v in metrics.items()}


def check_version(version: Any, owner: str) -> None:
    if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))):
        raise ConfigurationError(
            f"{owner}(version={version!r}): the version is an int (the directory version_N), a string "
            f"(the directory's own name) or None (the next free version_N)"
        )


class ConstructorOptions:
    """Plugin options (``plugin_options=``, ``--plugin-option``) given to a logger object
    construct it again with them (``hookloop_set_option``): a logger's options are
    constructor arguments, some read-only properties (``save_dir``) or methods
    (``log_graph``) in Lightning's API. ``__init__`` keeps its arguments in
    ``self._init_args``."""

    _init_args: dict

    def hookloop_set_option(self, key: str, value: Any) -> None:
        keep = {k: v for k, v in self.__dict__.items() if k in ("hookloop_name",)}
        args = {**self._init_args, key: value}
        type(self).__init__(self, **args)
        self.__dict__.update(keep)


def init_args(values: dict) -> dict:
    """An ``__init__``'s ``locals()`` as its arguments (``**kwargs`` spread)."""
    args = {k: v for k, v in values.items() if k not in ("self", "kwargs", "__class__")}
    return {**args, **values.get("kwargs", {})}


class VersionedDirectory(ConstructorOptions):
    """Lightning's ``save_dir``/``name``/``version``/``root_dir``/``log_dir`` for a logger
    that writes files: ``log_dir`` is ``save_dir/name/version_N`` (``version`` an int, or
    the given string as the directory's name; ``None``: the next free ``version_N``,
    claimed by global rank 0 when the run starts). Without ``save_dir`` the logger writes
    into the run directory (``trainer.log_dir``, hookloop's ``logs/version_N``)."""

    _sub_dir: str | None = None

    def _init_directory(self, save_dir: Any, name: str | None, version: Any, sub_dir: Any = None) -> None:
        check_version(version, type(self).__name__)
        if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
            raise ConfigurationError(f"{type(self).__name__}(save_dir={save_dir!r}) must be a path (a str or os.PathLike)")
        from hookloop.resume.storage import is_url, local_root

        # a URL (s3://...): the logger writes in its staging directory, uploaded to the store
        # at each checkpoint and at the end of the run (docs/how-to/object-storage.md)
        self._save_dir = None if save_dir is None else os.fspath(local_root(save_dir) if is_url(save_dir) else save_dir)
        self._name = "" if name is None else str(name)
        self._version = version
        self._requested_version = version
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        self._run_dir: Path | None = None

    @property
    def name(self) -> str:
        if self._save_dir is None and self._run_dir is not None:
            return self._run_dir.parent.name
        return self._name

    @property
    def save_dir(self) -> str | None:
        if self._save_dir is None and self._run_dir is not None:
            return str(self._run_dir.parent.parent)
        return self._save_dir

    @property
    def root_dir(self) -> str | None:
        """The directory of the version directories (``save_dir/name``)."""
        if self._save_dir is None:
            return None if self._run_dir is None else str(self._run_dir.parent)
        return os.path.join(self._save_dir, self._name)

    @property
    def version(self) -> int | str | None:
        """The version: given, claimed by the run, or (before a run) the next free one."""
        if self._version is None:
            if self._run_dir is not None:
                match = _VERSION_DIR.match(self._run_dir.name)
                self._version = int(match.group(1)) if match else self._run_dir.name
            elif self._save_dir is not None:
                from hookloop.resume.rundir import next_version

                self._version = next_version(Path(self.root_dir))
        return self._version

    @property
    def log_dir(self) -> str | None:
        """``save_dir/name/version_N`` (then ``sub_dir``), or the run directory."""
        if self._save_dir is None and self._run_dir is None:
            return None
        if self._save_dir is None:
            path = str(self._run_dir)
        else:
            version = self.version
            path = os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")
        if self._sub_dir is not None:
            path = os.path.join(path, self._sub_dir)
        return os.path.expanduser(os.path.expandvars(path))

    def hookloop_run_root(self) -> tuple[Path, int | str | None] | None:
        """For the core: where this logger's version directories are, and the version it
        must have (``None``: the next free one); ``None`` without ``save_dir``."""
        if self._save_dir is None:
            return None
        if self._run_dir is not None:  # this object ran before (another Trainer): keep its version
            return self._run_dir.parent, self._run_dir.name
        return Path(self.root_dir), self._requested_version

    def hookloop_use_run_dir(self, path: Any) -> None:
        """The version directory the run claimed for this logger (every rank)."""
        self._run_dir = Path(path)
        self._version = None
        self._version = self.version

    def _adopt_run_dir(self, trainer: Any) -> None:
        """Without ``save_dir``: the run directory is this logger's."""
        if self._save_dir is None:
            self._run_dir = Path(trainer.log_dir)
            self._version = None


def lightning_hparams(trainer: Any) -> dict | None:
    """What Lightning's loggers get as hyperparameters: the module's ``hparams`` merged with
    the DataModule's (``None`` when the module turned it off with
    ``save_hyperparameters(logger=False)``)."""
    module = trainer.module
    if getattr(module, "_log_hyperparams", True) is False:
        return None
    params = dict(getattr(module, "hparams", None) or {})
    datamodule_params = getattr(trainer.datamodule, "hparams", None) if trainer.datamodule is not None else None
    if datamodule_params and getattr(trainer.datamodule, "_log_hyperparams", True) is not False:
        params.update(datamodule_params)
    return {k: v for k, v in params.items() if k != "_class_path"}


def save_hparams_yaml(path: Any, hparams: dict) -> None:
    """``hparams.yaml`` as Lightning writes it (``yaml.dump``, keys sorted; a value YAML
    cannot write is left out)."""
    import yaml

    allowed = {}
    for key, value in hparams.items():
        value = value.name if isinstance(value, Enum) else value
        try:
            yaml.dump(value)
        except (TypeError, ValueError):
            continue
        allowed[key] = value
    from hookloop.resume.checkpoint import atomic_write_text

    atomic_write_text(Path(path), yaml.dump(allowed))


def flatten_dict(params: dict, delimiter: str = "/", parent: str = "") -> dict:
    """Nested dicts joined with ``/`` (Lightning's ``_flatten_dict``)."""
    flat: dict = {}
    for key, value in params.items():
        name = f"{parent}{delimiter}{key}" if parent else str(key)
        if isinstance(value, dict):
            flat.update(flatten_dict(value, delimiter, name))
        else:
            flat[name] = value
    return flat


class DummyExperiment:
    """``logger.experiment`` on a rank other than global rank 0, as Lightning's: every
    method call does nothing (only rank 0 writes)."""

    def nop(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, _: str) -> Any:
        return self.nop

    def __getitem__(self, _: Any) -> "DummyExperiment":
        return self

    def __setitem__(self, *_: Any) -> None:
        pass


def is_rank_zero() -> bool:
    from hookloop.distributed.ranks import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


_IMPORT_FIXES = {
    "CSVLogger": "from hookloop import CSVLogger",
    "TensorBoardLogger": "from hookloop_tensorboard import TensorBoardLogger (pip install hookloop-tensorboard)",
    "MLFlowLogger": "from hookloop_mlflow import MLFlowLogger (pip install hookloop-mlflow)",
    "WandbLogger": "from hookloop_wandb import WandbLogger (pip install hookloop-wandb)",
}


def logger_objects(value: Any) -> list | None:
    """The logger objects ``Trainer(logger=...)`` was given (``None`` for ``True``/``False``/
    ``None``); anything that is not a hookloop logger is a ``ConfigurationError`` naming
    the import to change."""
    if value is None or isinstance(value, bool):
        return None
    objects = list(value) if isinstance(value, (list, tuple)) else [value]
    for obj in objects:
        if isinstance(obj, type) or not callable(getattr(obj, "on_log_metrics", None)) or not hasattr(obj, "hookloop_role"):
            kind = type(obj) if not isinstance(obj, type) else obj
            where = f"{kind.__module__}.{kind.__qualname__}"
            fix = _IMPORT_FIXES.get(kind.__name__)
            lightning = kind.__module__.split(".")[0] in ("pytorch_lightning", "lightning", "lightning_fabric")
            if isinstance(obj, type):
                hint = f"pass an instance: logger={kind.__name__}(...)"
            elif fix:
                hint = f"change the import to {fix}"
            else:
                hint = ("hookloop has CSVLogger (from hookloop import CSVLogger), TensorBoardLogger "
                        "(hookloop_tensorboard) and MLFlowLogger (hookloop_mlflow); a plugin with an "
                        "on_log_metrics hook is a logger too")
            raise ConfigurationError(
                f"Trainer(logger=...) got {where}, which is not a hookloop logger"
                + (" (Lightning's own: the import was not changed)" if lightning else "")
                + f": {hint}. logger= also takes True (the CSV logger), False or None, or a list of loggers"
            )
    return objects
