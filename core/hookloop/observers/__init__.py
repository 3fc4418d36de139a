"""The core's own observers: what every Lightning user expects without asking.

:data:`hookloop.contract.registry.BUILTINS` is their one list (name, class, on by default or not),
which the core distribution's entry points follow: ``progress``, ``model_summary``,
``csv`` and ``checkpoint`` run by default (``no:NAME`` blocks one, as in pytest;
``enable_progress_bar=False``, ``enable_model_summary=False``, ``logger=False`` and
``enable_checkpointing=False`` too); ``early_stopping``, ``lr_monitor``, ``nan_guard``,
``ledger`` (where a step's time goes, per plugin and hook) and ``timer`` are enabled by
name or passed as objects (``callbacks=[hookloop.EarlyStopping(monitor="val_loss")]``).
They are ordinary plugins on the public hooks, like any third party's.
"""
