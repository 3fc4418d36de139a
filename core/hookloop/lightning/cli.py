"""``hookloop.LightningCLI``: Lightning's ``LightningCLI`` on hookloop's Trainer.

A script that ends with ``LightningCLI(MyModel, MyDataModule)`` gets a command line built
with jsonargparse from the signatures of the Trainer, the module and the data module::

    python train.py fit --trainer.max_epochs 3 --model.lr 0.01 --data.batch_size 32
    python train.py fit --config config.yaml --print_config
    python train.py test --ckpt_path last
    hookloop run --devices 2 --plugins ddp train.py fit --trainer.max_epochs 1

As Lightning's: the ``fit``/``validate``/``test``/``predict`` sub-commands (``run=True``),
or only the objects (``run=False``: ``cli.model``, ``cli.datamodule``, ``cli.trainer``,
``cli.config``); ``--config`` (repeatable), ``--print_config``, ``--seed_everything``;
``--model``/``--data`` arguments from the classes' ``__init__`` (a class path with
``subclass_mode_*``); ``--optimizer``/``--lr_scheduler`` (``auto_configure_optimizers``);
``trainer_defaults``; ``args=`` (a list or a dict); ``config.yaml`` saved in the run
directory by :class:`SaveConfigCallback`; ``add_arguments_to_parser`` with
``parser.link_arguments``; ``before_<subcommand>``/``after_<subcommand>`` and
``before_instantiate_classes``/``instantiate_classes``/``after_instantiate_classes``.

The ``trainer`` section is hookloop's Trainer's (``--trainer.plugins ddp,amp``,
``--trainer.devices 2``...), not Lightning's; its defaults are, from weakest to strongest,
those of :class:`hookloop.TrainerConfig`, ``trainer_defaults``, the options of
``hookloop run`` around the script (docs/decisions.md), then config files and the
command line. Needs jsonargparse: ``pip install 'hookloop[cli]'``.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from dataclasses import MISSING, fields
from functools import partial, update_wrapper
from types import MethodType
from typing import Any, Callable, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hookloop.contract import registry
from hookloop.engine.settings import TrainerConfig, env_defaults
from hookloop.lightning.callbacks import Callback
from hookloop.lightning.datamodule import DataModule
from hookloop.contract.errors import ConfigurationError, MissingDependencyError
from hookloop.helpers import GLOBAL_SEED_ENV, seed_everything
from hookloop.contract.hookspecs import hookimpl
from hookloop.lightning.module import Module
from hookloop.engine.trainer import Trainer

try:
    from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, class_from_function
except ImportError as exc:  # an optional dependency: the extra "cli"
    raise MissingDependencyError(
        f"hookloop.LightningCLI needs jsonargparse with its signatures extra, which is not "
        f"installed ({exc}): pip install 'hookloop[cli]' (or pip install 'jsonargparse[signatures]')"
    ) from exc

try:  # torch's classes name modules that cannot be imported by their __module__
    from jsonargparse import register_unresolvable_import_paths

    register_unresolvable_import_paths(torch)
except ImportError:  # pragma: no cover - older jsonargparse
    pass

__all__ = [
    "ArgsType",
    "LRSchedulerCallable",
    "LightningArgumentParser",
    "LightningCLI",
    "OptimizerCallable",
    "ReduceLROnPlateau",
    "SaveConfigCallback",
    "instantiate_class",
]


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ``ReduceLROnPlateau`` with the ``monitor`` it steps on (Lightning's
    ``cli.ReduceLROnPlateau``): ``--lr_scheduler ReduceLROnPlateau --lr_scheduler.monitor val_loss``."""

    def __init__(self, optimizer: Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


LRSchedulerTypeTuple = (LRScheduler, ReduceLROnPlateau)
LRSchedulerTypeUnion = Union[LRScheduler, ReduceLROnPlateau]
ArgsType = Optional[Union[list, dict, Namespace]]
OptimizerCallable = Callable[[Any], Optimizer]
LRSchedulerCallable = Callable[[Optimizer], LRSchedulerTypeUnion]

_UNSET: Any = object()


def _trainer_base_defaults() -> dict[str, Any]:
    """What the Trainer uses for an argument not given: TrainerConfig's defaults, with
    Lightning's ``strategy="auto"`` and ``callbacks=None``."""
    out: dict[str, Any] = {"strategy": "auto", "callbacks": None}
    for f in fields(TrainerConfig):
        out[f.name] = f.default_factory() if f.default is MISSING else f.default
    # As Trainer.__init__ decides it when not given.
    out["autoload_plugins"] = registry.environment_autoload()
    return out


class LightningArgumentParser(ArgumentParser):
    """jsonargparse's ``ArgumentParser`` with Lightning's methods to add a Trainer, a
    module, a data module, an optimizer and an LR scheduler (Lightning's
    ``cli.LightningArgumentParser``)."""

    def __init__(self, *args: Any, description: str = "hookloop Trainer command line tool",
                 env_prefix: str = "PL", default_env: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, description=description, env_prefix=env_prefix, default_env=default_env, **kwargs)
        self.callback_keys: list[str] = []
        self._optimizers: dict[str, tuple[Any, str]] = {}
        self._lr_schedulers: dict[str, tuple[Any, str]] = {}
        #: the trainer's defaults this parser was given (see LightningCLI)
        self.trainer_defaults: dict[str, Any] = {}

    def add_lightning_class_args(self, lightning_class: Any, nested_key: str, subclass_mode: bool = False,
                                 required: bool = True) -> list[str]:
        """Add the ``__init__`` arguments of ``lightning_class`` (a Trainer, a module, a
        data module, a Callback or plugin class, or a function returning one) under
        ``nested_key``; ``subclass_mode`` takes a ``class_path`` of any subclass."""
        if callable(lightning_class) and not isinstance(lightning_class, type):
            lightning_class = class_from_function(lightning_class)
        if not isinstance(lightning_class, type):
            raise ConfigurationError(
                f"cannot add arguments from {lightning_class!r}: give a class (a Trainer, a module, a data "
                f"module, a plugin class) or a function that returns one"
            )
        is_trainer = issubclass(lightning_class, Trainer)
        if not is_trainer and (issubclass(lightning_class, Callback)
                               or getattr(lightning_class, "hookloop_role", None) is not None):
            # a Callback (Lightning's rule) or a plugin class: added to the Trainer's callbacks
            self.callback_keys.append(nested_key)
        if subclass_mode:
            return self.add_subclass_arguments(lightning_class, nested_key, fail_untyped=False, required=required)
        added = self.add_class_arguments(lightning_class, nested_key, fail_untyped=False,
                                         instantiate=not is_trainer, sub_configs=True)
        if is_trainer:
            # hookloop's Trainer marks "not given" with a sentinel; the parser shows (and
            # passes) what the Trainer would use instead.
            base = _trainer_base_defaults()
            keys = {k.split(".")[-1] for k in (added or [])} or set(base)
            self.set_defaults({f"{nested_key}.{k}": v for k, v in base.items() if k in keys})
        return added

    def add_optimizer_args(self, optimizer_class: Any = (Optimizer,), nested_key: str = "optimizer",
                           link_to: str = "AUTOMATIC") -> None:
        """Add the arguments of an optimizer class (a tuple: any subclass, chosen by
        class path) under ``nested_key``."""
        if not all(issubclass(o, Optimizer) for o in _as_tuple(optimizer_class)):
            raise ConfigurationError(f"add_optimizer_args({optimizer_class!r}): expected torch.optim.Optimizer classes")
        kwargs: dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": {"params"}}
        if isinstance(optimizer_class, tuple):
            self.add_subclass_arguments(optimizer_class, nested_key, **kwargs)
        else:
            self.add_class_arguments(optimizer_class, nested_key, sub_configs=True, **kwargs)
        self._optimizers[nested_key] = (optimizer_class, link_to)

    def add_lr_scheduler_args(self, lr_scheduler_class: Any = LRSchedulerTypeTuple, nested_key: str = "lr_scheduler",
                              link_to: str = "AUTOMATIC") -> None:
        """Add the arguments of an LR scheduler class (a tuple: any subclass) under
        ``nested_key``."""
        if not all(issubclass(o, LRSchedulerTypeTuple) for o in _as_tuple(lr_scheduler_class)):
            raise ConfigurationError(
                f"add_lr_scheduler_args({lr_scheduler_class!r}): expected LRScheduler classes or "
                f"hookloop.lightning.cli.ReduceLROnPlateau"
            )
        kwargs: dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": {"optimizer"}}
        if isinstance(lr_scheduler_class, tuple):
            self.add_subclass_arguments(lr_scheduler_class, nested_key, **kwargs)
        else:
            self.add_class_arguments(lr_scheduler_class, nested_key, sub_configs=True, **kwargs)
        self._lr_schedulers[nested_key] = (lr_scheduler_class, link_to)


class SaveConfigCallback:
    """An observer plugin that writes the parsed configuration to ``config.yaml`` in the
    run directory (``trainer.log_dir``) when a run starts, on global rank 0, as
    Lightning's ``cli.SaveConfigCallback`` does. An existing file is an error unless
    ``overwrite=True``; override :meth:`save_config` to save it somewhere else too."""

    hookloop_name = "save_config"
    hookloop_role = "observer"

    def __init__(self, parser: LightningArgumentParser, config: Namespace, config_filename: str = "config.yaml",
                 overwrite: bool = False, multifile: bool = False, save_to_log_dir: bool = True) -> None:
        self.parser, self.config = parser, config
        self.config_filename, self.overwrite, self.multifile = config_filename, overwrite, multifile
        self.save_to_log_dir = save_to_log_dir
        self.already_saved = False
        if not save_to_log_dir and type(self).save_config is SaveConfigCallback.save_config:
            raise ValueError(
                "`save_to_log_dir=False` only makes sense when subclassing SaveConfigCallback to implement "
                "`save_config` and it is desired to disable the standard behavior of saving to log_dir."
            )

    @hookimpl
    def setup(self, trainer: Any, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            log_dir = trainer.log_dir  # the same directory on every rank
            config_path = os.path.join(log_dir, self.config_filename)
            if not self.overwrite:
                exists = trainer.broadcast(os.path.isfile(config_path) if trainer.is_global_zero else False)
                if exists:
                    raise RuntimeError(
                        f"{type(self).__name__} expected {config_path} to NOT exist. Aborting to avoid overwriting"
                        " results of a previous run. You can delete the previous config file,"
                        " set `LightningCLI(save_config_callback=None)` to disable config saving,"
                        ' or set `LightningCLI(save_config_kwargs={"overwrite": True})` to overwrite the config file.'
                    )
            if trainer.is_global_zero:
                os.makedirs(log_dir, exist_ok=True)
                self.parser.save(self.config, config_path, skip_none=False, overwrite=self.overwrite,
                                 multifile=self.multifile)
        if trainer.is_global_zero:
            self.save_config(trainer, trainer.module, stage)
            self.already_saved = True
        self.already_saved = trainer.broadcast(self.already_saved)

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Override to save the config somewhere else too; runs on global rank 0 only
        (so no collective calls here)."""


class LightningCLI:
    """Lightning's ``LightningCLI`` (2.6.6's constructor) running hookloop's Trainer.

    ``model_class``/``datamodule_class``: classes (or functions returning an instance)
    whose ``__init__`` arguments become ``--model.*``/``--data.*``; ``None`` (or
    ``subclass_mode_*=True``) takes a class path (``--model mymodule.Net``).
    ``trainer_defaults``: the Trainer's defaults (its ``callbacks`` are always added, not
    configurable). ``seed_everything_default``: an int, ``True`` (``PL_GLOBAL_SEED`` when
    set, else 0, as Lightning 2.6), or ``False`` (no seeding). ``args``: a list parsed as a
    command line, or a dict parsed as a config (default: ``sys.argv[1:]``). ``run=False``:
    build ``cli.model``/``cli.datamodule``/``cli.trainer`` and run nothing.
    ``load_from_checkpoint_support`` is accepted and ignored: hookloop's
    ``save_hyperparameters`` already keeps what ``__init__`` received.
    """

    def __init__(
        self,
        model_class: Any = None,
        datamodule_class: Any = None,
        save_config_callback: Optional[type] = SaveConfigCallback,
        save_config_kwargs: Optional[dict[str, Any]] = None,
        trainer_class: Any = Trainer,
        trainer_defaults: Optional[dict[str, Any]] = None,
        seed_everything_default: Union[bool, int] = True,
        parser_kwargs: Optional[dict[str, Any]] = None,
        parser_class: type = LightningArgumentParser,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: ArgsType = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
        load_from_checkpoint_support: bool = True,
    ) -> None:
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class = trainer_class
        self.trainer_defaults = trainer_defaults or {}
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs = parser_kwargs or {}
        self.parser_class = parser_class
        self.auto_configure_optimizers = auto_configure_optimizers

        self.model_class = model_class
        self._model_class = model_class or Module
        self.subclass_mode_model = (model_class is None) or subclass_mode_model
        self.datamodule_class = datamodule_class
        self._datamodule_class = datamodule_class or DataModule
        self.subclass_mode_data = (datamodule_class is None) or subclass_mode_data

        main_kwargs, subparser_kwargs = self._setup_parser_kwargs(self.parser_kwargs)
        self.setup_parser(run, main_kwargs, subparser_kwargs)
        self.parse_arguments(self.parser, args)
        self._parse_ckpt_path()

        self.subcommand = self.config["subcommand"] if run else None
        self._set_seed()

        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()

        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # -- the parser ---------------------------------------------------------------------

    def _setup_parser_kwargs(self, parser_kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        names = self.subcommands().keys()
        main_kwargs = {k: v for k, v in parser_kwargs.items() if k not in names}
        subparser_kwargs = {k: v for k, v in parser_kwargs.items() if k in names}
        return main_kwargs, subparser_kwargs

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """Make the argument parser (with ``-c/--config``)."""
        from hookloop._version import __version__

        kwargs.setdefault("dump_header", [f"hookloop=={__version__}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile,
                            help="Path to a configuration file in json or yaml format.")
        return parser

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]) -> None:
        """Make the parser, its sub-commands and their arguments."""
        self.parser = self.init_parser(**main_kwargs)
        if add_subcommands:
            self._subcommand_method_arguments: dict[str, list[str]] = {}
            self._add_subcommands(self.parser, **subparser_kwargs)
        else:
            self._add_arguments(self.parser)

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add ``--seed_everything``."""
        parser.add_argument(
            "--seed_everything", type=Union[bool, int], default=self.seed_everything_default,
            help="Set to an int to run seed_everything with this value before classes instantiation."
                 " Set to True to use PL_GLOBAL_SEED, or 0 without it (as Lightning 2.6).",
        )

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add the Trainer's, the module's and the data module's arguments."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.trainer_defaults = self._effective_trainer_defaults(parser)
        parser.set_defaults({"trainer." + k: v for k, v in parser.trainer_defaults.items()})
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data,
                                        required=self.datamodule_class is not None)

    def _effective_trainer_defaults(self, parser: LightningArgumentParser) -> dict[str, Any]:
        """``trainer_defaults`` (less its callbacks, which are always added), then the
        options of ``hookloop run`` around this script, which win as they win over a
        ``hookloop.default(...)`` in code. Plugins and plugin options from ``hookloop
        run`` are not copied: the Trainer adds them to those it is given."""
        given = {k: v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        known = {a.dest.split(".", 1)[1] for a in parser._actions if getattr(a, "dest", "").startswith("trainer.")}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigurationError(
                f"trainer_defaults names {unknown}, which {getattr(self.trainer_class, '__name__', 'the Trainer')} "
                f"does not take; its arguments: {', '.join(sorted(known))}"
            )
        from_run = {k: v for k, v in env_defaults().items() if k in known and k not in ("plugins", "plugin_options")}
        return {**given, **from_run}

    def _add_arguments(self, parser: LightningArgumentParser) -> None:
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            if not parser._optimizers:
                parser.add_optimizer_args((Optimizer,))
            if not parser._lr_schedulers:
                parser.add_lr_scheduler_args(LRSchedulerTypeTuple)
        self.link_optimizers_and_lr_schedulers(parser)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Override to add arguments or ``parser.link_arguments(source, target)``."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The sub-commands and the Trainer method arguments they do not expose."""
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "test": {"model", "dataloaders", "datamodule"},
            "predict": {"model", "dataloaders", "datamodule"},
        }

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        self._subcommand_parsers: dict[str, LightningArgumentParser] = {}
        parser_subcommands = parser.add_subcommands()
        trainer_class = self.trainer_class if isinstance(self.trainer_class, type) else class_from_function(self.trainer_class)
        for subcommand in self.subcommands():
            fn = getattr(trainer_class, subcommand)
            description = _short_description(fn)
            subparser_kwargs = kwargs.get(subcommand, {})
            subparser_kwargs.setdefault("description", description)
            subcommand_parser = self._prepare_subcommand_parser(trainer_class, subcommand, **subparser_kwargs)
            self._subcommand_parsers[subcommand] = subcommand_parser
            parser_subcommands.add_subcommand(subcommand, subcommand_parser, help=description)

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = self.init_parser(**kwargs)
        self._add_arguments(parser)
        skip: set = set(self.subcommands()[subcommand])
        added = parser.add_method_arguments(klass, subcommand, skip=skip, fail_untyped=False)
        self._subcommand_method_arguments[subcommand] = added
        return parser

    @staticmethod
    def link_optimizers_and_lr_schedulers(parser: LightningArgumentParser) -> None:
        """Link the optimizer/scheduler groups added with a ``link_to``."""
        for key, (class_type, link_to) in {**parser._optimizers, **parser._lr_schedulers}.items():
            if link_to == "AUTOMATIC":
                continue
            if isinstance(class_type, tuple):
                parser.link_arguments(key, link_to)
            else:
                parser.link_arguments(key, link_to, compute_fn=partial(_global_add_class_path, class_type))

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse ``args`` (or ``sys.argv[1:]``) into ``self.config``."""
        if args is not None and len(sys.argv) > 1:
            from hookloop.distributed.ranks import rank_zero_warn

            rank_zero_warn(
                "LightningCLI's args parameter is intended to run from within Python like if it were from the command "
                "line. To prevent mistakes it is not recommended to provide both args and command line arguments, got: "
                f"sys.argv[1:]={sys.argv[1:]}, args={args}."
            )
        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
        else:
            self.config = parser.parse_args(args)

    def _parse_ckpt_path(self) -> None:
        """With ``--ckpt_path FILE``, the module's hyperparameters saved in that checkpoint
        (``save_hyperparameters``) go into the ``model`` section, as Lightning does, so the
        module is built to fit the weights; arguments given explicitly are overridden."""
        if not self.config.get("subcommand"):
            return
        ckpt_path = self.config[self.config.subcommand].get("ckpt_path")
        if not ckpt_path or not os.path.isfile(ckpt_path):
            return
        from hookloop.resume.checkpoint import safe_load

        hparams = dict(safe_load(ckpt_path).get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({self.config.subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    # -- building the objects -----------------------------------------------------------

    def before_instantiate_classes(self) -> None:
        """Override to run code before the classes are instantiated."""

    def instantiate_classes(self) -> None:
        """Instantiate the module, the data module and the Trainer from ``self.config``."""
        # jsonargparse >= 4.49 names it instantiate (instantiate_classes is deprecated there)
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        # The Trainer's plugins/callbacks/strategy are typed Any: their {class_path, ...}
        # entries are made here (_plugin_specs), not by jsonargparse, which deprecates
        # instantiating specs given for Any.
        prefix = f"{self.subcommand}.trainer." if self.subcommand else "trainer."
        config, held = self.config.clone(), {}
        for key in ("plugins", "callbacks", "strategy"):
            if config.get(prefix + key) is not None:
                held[key], config[prefix + key] = config[prefix + key], None
        self.config_init = instantiate(config)
        for key, value in held.items():
            self.config_init[prefix + key] = value
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self._add_configure_optimizers_method_to_model(self.subcommand)
        self.trainer = self.instantiate_trainer()

    def after_instantiate_classes(self) -> None:
        """Override to run code after the classes are instantiated."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Instantiate the Trainer from the ``trainer`` section; ``kwargs`` win."""
        extra_callbacks = [self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys]
        section = self._get(self.config_init, "trainer", default={})
        config = {**(section.as_dict() if isinstance(section, Namespace) else dict(section)), **kwargs}
        return self._instantiate_trainer(config, extra_callbacks)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> Trainer:
        for key in ("plugins", "callbacks", "strategy"):
            if key in config:
                config[key] = _plugin_specs(config[key], key)
        if "plugins" in config and not config["plugins"]:
            config.pop("plugins")  # none from the command line: the Trainer's own default
        key = "callbacks"
        if key in config:
            value = config[key]
            config[key] = [] if value is None else list(value) if isinstance(value, list) else [value]
            config[key].extend(callbacks)
            if key in self.trainer_defaults:
                value = self.trainer_defaults[key]
                config[key] += value if isinstance(value, list) else [value]
            if self.save_config_callback and not config.get("fast_dev_run", False):
                config[key].append(self.save_config_callback(
                    self._parser(self.subcommand), self.config.get(str(self.subcommand), self.config),
                    **self.save_config_kwargs))
        else:
            warnings.warn(f"The `{getattr(self.trainer_class, '__qualname__', self.trainer_class)}` class does not "
                          f"expose the `{key}` argument so they will not be included.")
        return self.trainer_class(**config)

    def _parser(self, subcommand: Optional[str]) -> LightningArgumentParser:
        return self.parser if subcommand is None else self._subcommand_parsers[subcommand]

    @staticmethod
    def configure_optimizers(lightning_module: Any, optimizer: Optimizer, lr_scheduler: Any = None) -> Any:
        """What the module's ``configure_optimizers`` returns when ``--optimizer`` (and
        ``--lr_scheduler``) are given; override to change it."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor}}
        return [optimizer], [lr_scheduler]

    def _add_configure_optimizers_method_to_model(self, subcommand: Optional[str]) -> None:
        """Replace the module's ``configure_optimizers`` when one optimizer (and at most
        one scheduler) group is "AUTOMATIC" and the optimizer was given."""
        if not self.auto_configure_optimizers:
            return
        parser = self._parser(subcommand)

        def automatic(class_type: Any, register: dict) -> list[str]:
            return [key for key, (base, link_to) in register.items()
                    if link_to == "AUTOMATIC" and any(issubclass(c, class_type) for c in _as_tuple(base))]

        optimizers = automatic(Optimizer, parser._optimizers)
        lr_schedulers = automatic(LRSchedulerTypeTuple, parser._lr_schedulers)
        if not optimizers:
            return
        if len(optimizers) > 1 or len(lr_schedulers) > 1:
            raise ConfigurationError(
                f"`{type(self).__name__}.add_configure_optimizers_method_to_model` expects at most one optimizer "
                f"and one lr_scheduler to be 'AUTOMATIC', but found {optimizers + lr_schedulers}. Link the "
                f"argument groups (link_to=...) and implement `configure_optimizers` yourself."
            )
        optimizer_class = parser._optimizers[optimizers[0]][0]
        optimizer_init = self._get(self.config_init, optimizers[0])
        if not isinstance(optimizer_class, tuple):
            optimizer_init = _global_add_class_path(optimizer_class, optimizer_init)
        if not optimizer_init:
            return  # no --optimizer given: the module's own configure_optimizers
        lr_scheduler_init = None
        if lr_schedulers:
            lr_scheduler_class = parser._lr_schedulers[lr_schedulers[0]][0]
            lr_scheduler_init = self._get(self.config_init, lr_schedulers[0])
            if not isinstance(lr_scheduler_class, tuple):
                lr_scheduler_init = _global_add_class_path(lr_scheduler_class, lr_scheduler_init)
        if callable(getattr(self.model, "configure_optimizers", None)):
            warnings.warn(f"`{type(self.model).__name__}.configure_optimizers` will be overridden by "
                          f"`{type(self).__name__}.configure_optimizers`.")
        optimizer = instantiate_class(self.model.parameters(), optimizer_init)
        lr_scheduler = instantiate_class(optimizer, lr_scheduler_init) if lr_scheduler_init else None
        fn = partial(self.configure_optimizers, optimizer=optimizer, lr_scheduler=lr_scheduler)
        update_wrapper(fn, self.configure_optimizers)
        self.model.configure_optimizers = MethodType(fn, self.model)

    def _get(self, config: Namespace, key: str, default: Any = None) -> Any:
        """A config value, inside the sub-command's section when there is one."""
        return config.get(str(self.subcommand), config).get(key, default)

    # -- running ------------------------------------------------------------------------

    def _run_subcommand(self, subcommand: str) -> None:
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        fn = getattr(self, subcommand, getattr(self.trainer, subcommand))
        fn(**self._prepare_subcommand_kwargs(subcommand))
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        kwargs = {k: v for k, v in self.config_init[subcommand].items() if k in self._subcommand_method_arguments[subcommand]}
        kwargs["model"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        return kwargs

    def _set_seed(self) -> None:
        seed = self._get(self.config, "seed_everything")
        if seed is False:
            return
        if seed is True:
            # As Lightning 2.6's seed_everything(None): the seed a parent process chose
            # (PL_GLOBAL_SEED, so every worker of a run gets the same one), else 0.
            env = os.environ.get(GLOBAL_SEED_ENV)
            try:
                seed = int(env) if env else 0
            except ValueError:
                raise ConfigurationError(f"Invalid seed specified via {GLOBAL_SEED_ENV}: {env!r}") from None
        if not 0 <= int(seed) <= 2**32 - 1:
            raise ConfigurationError(
                f"--seed_everything {seed} is not in bounds: numpy accepts seeds from 0 to {2**32 - 1}; "
                f"give one in that range, true (PL_GLOBAL_SEED or 0) or false (no seeding)"
            )
        seed = seed_everything(int(seed))
        if self.subcommand:
            self.config[self.subcommand]["seed_everything"] = seed
        else:
            self.config["seed_everything"] = seed


# -- helpers ------------------------------------------------------------------------------

def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _short_description(component: Any) -> Optional[str]:
    doc = inspect.getdoc(component)
    if not doc:
        return None
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def _global_add_class_path(class_type: type, init_args: Any = None) -> dict[str, Any]:
    if isinstance(init_args, Namespace):
        init_args = init_args.as_dict()
    return {"class_path": f"{class_type.__module__}.{class_type.__name__}", "init_args": init_args or {}}


def instantiate_class(args: Any, init: dict[str, Any]) -> Any:
    """``init["class_path"]`` called with ``args`` (one, or a tuple) and
    ``init["init_args"]``, as Lightning's ``cli.instantiate_class``."""
    kwargs = init.get("init_args", {})
    if not isinstance(args, tuple):
        args = (args,)
    module_name, _, class_name = init["class_path"].rpartition(".")
    module = __import__(module_name, fromlist=[class_name])
    return getattr(module, class_name)(*args, **kwargs)


def _plugin_specs(value: Any, key: str) -> Any:
    """The Trainer's ``plugins``/``callbacks``/``strategy`` from a config: a comma-separated
    string of names becomes a list, a ``{class_path, init_args}`` entry an object."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, str) and key != "strategy":
        return registry.split_names(value)
    if isinstance(value, dict):
        if "class_path" not in value:
            raise ConfigurationError(
                f"trainer.{key}: {value!r} is neither a plugin name nor a class with its arguments "
                f"({{class_path: module.Class, init_args: {{...}}}})"
            )
        return instantiate_class((), value)
    if isinstance(value, (list, tuple)):
        out: list = []
        for item in value:
            item = _plugin_specs(item, key)
            out += item if isinstance(item, list) else [item]
        return out
    return value
