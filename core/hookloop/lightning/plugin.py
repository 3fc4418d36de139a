"""The ``lightning`` built-in: Lightning's ``Trainer`` arguments translated for the engine.

``callbacks=`` (plugins and Lightning-style :class:`hookloop.Callback` objects, the latter
run in list order by one adapter plugin), ``strategy=`` (Lightning's strategy strings,
or a strategy plugin's name or object), ``logger=`` objects (plugins first in the run) and
``hookloop tune``'s entry into ``fit`` (``HOOKLOOP_TUNE``). The engine never imports this
module: the facade registers :data:`LIGHTNING` in :mod:`hookloop.contract.translators`,
and the settings resolution hands it those arguments. On by default;
``plugins=["no:lightning"]`` (``-p no:lightning``) turns it off, and then each of them is
refused at start, naming it (docs/lightning.md, "Turning compatibility off").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hookloop.contract.pluginspec import plugin_name
from hookloop.contract.translators import Translation, as_list
from hookloop.distributed.ranks import rank_zero_info
from hookloop.lightning import callbacks as callbacks_module
from hookloop.lightning import loggers as loggers_module
from hookloop.lightning import optimization, strategies, tuner


class LightningCompatibility:
    """The translator of Lightning's ``Trainer`` arguments (an
    :class:`hookloop.contract.translators.ArgumentTranslator`)."""

    name = "lightning"
    variables: tuple[str, ...] = (tuner.TUNE_ENV,)

    def owns(self, argument: str, value: Any) -> bool:
        if argument in ("strategy", "callbacks"):
            return value is not None
        if argument == "logger":  # True/False/None are the engine's own switch
            return not (value is None or isinstance(value, bool))
        return False

    def translate(self, arguments: Mapping[str, Any]) -> Translation:
        given = dict(arguments)
        say_batch_limits(given)
        # logger objects become plugins, first in the run (trainer.logger is the first)
        loggers = loggers_module.logger_objects(given.get("logger"))
        if loggers is not None:
            given["logger"] = bool(loggers)
        # strategy="auto" is Lightning's default: the built-in single process, or hookloop
        # run's; Lightning's other strategy strings are plugins with options (strategies.py)
        strategy = given.pop("strategy", None)
        if isinstance(strategy, str):
            strategy = strategies.resolve_string(strategy)
        in_code = list(loggers or []) + as_list(given.get("plugins")) + as_list(strategy)
        given_callbacks = as_list(given.pop("callbacks", None))
        callbacks_module.check_callbacks_argument(given_callbacks)
        # Lightning runs every callback given: two EarlyStopping are two plugins
        # (a second progress bar stays an error, as Lightning's)
        _name_apart([c for c in given_callbacks if not isinstance(c, (str, type))
                     and hasattr(c, "hookloop_role") and plugin_name(c) in SEVERAL_ALLOWED])
        in_code += given_callbacks
        # Lightning-style Callback objects become one observer that calls them in list order
        in_code, adapter = callbacks_module.callback_hooks(in_code, given_callbacks)
        if in_code or "plugins" in given:
            given["plugins"] = in_code
        _name_apart(loggers or [])
        replaces = frozenset({"csv"}) if loggers is not None else frozenset()
        return Translation(arguments=given, adapter=adapter, replaces_builtin=replaces)

    def before_fit(self, trainer: Any, model: Any, train_dataloaders: Any, datamodule: Any) -> None:
        """The module's ``optimizer_step``/``optimizer_zero_grad``/``lr_scheduler_step``
        overrides join the run (:mod:`hookloop.lightning.optimization`); ``hookloop tune``:
        the script's first ``fit`` runs the finder and ends."""
        optimization.attach(trainer, model)
        if os.environ.get(tuner.TUNE_ENV) and not trainer.__dict__.get("_hookloop_tuning"):
            tuner.tune_from_environment(trainer, model, train_dataloaders, datamodule)


#: the one instance the facade registers
LIGHTNING = LightningCompatibility()

#: the callbacks Lightning runs several of (each acts); a second of any other kind given in
#: ``callbacks=`` is the registry's conflict error, as Lightning refuses two progress bars
SEVERAL_ALLOWED = frozenset({"early_stopping", "checkpoint"})


#: Lightning's words for a limit of 1 / 1.0, which a reader may take for the other form
_ONE = {"limit_train_batches": ("1 batch per epoch will be used.",
                                "100% of the batches per epoch will be used."),
        "val_check_interval": ("validation will run after every batch.",
                               "validation will run at the end of the training epoch.")}


def say_batch_limits(given: Mapping[str, Any]) -> None:
    """Lightning's info line for a batch limit given as ``1`` or ``1.0`` (one batch, or the
    whole loader: the type decides, which is easy to get wrong), for the arguments Lightning
    reads in that run: with ``fast_dev_run`` only ``overfit_batches``, and with
    ``overfit_batches`` not the train and validation limits it replaces."""
    names = ["overfit_batches"]
    if not given.get("fast_dev_run"):
        if not given.get("overfit_batches"):
            names += ["limit_train_batches", "limit_val_batches"]
        names += ["limit_test_batches", "limit_predict_batches", "val_check_interval"]
    for name in names:
        value = given.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != 1:
            continue
        batch, percent = _ONE.get(name, ("1 batch will be used.", "100% of the batches will be used."))
        said = percent if isinstance(value, float) else batch
        rank_zero_info(f"`Trainer({name}={value!r})` was configured so {said}")


def _name_apart(objects: list) -> None:
    """Two objects of one kind in ``logger=[...]`` (two CSVLoggers) or ``callbacks=[...]``
    (two EarlyStopping) are two plugins: the second and later get ``<name>-2``,
    ``<name>-3`` as their plugin names (the first keeps its name, and so its place in a
    checkpoint's ``plugins`` state)."""
    seen: dict[str, int] = {}
    for obj in {id(obj): obj for obj in objects}.values():  # one object given twice: once
        name = plugin_name(obj)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            obj.hookloop_name = f"{name}-{seen[name]}"
