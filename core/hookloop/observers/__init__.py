"""The core's own observers: what every Lightning user expects without asking.

``progress``, ``csv`` and ``checkpoint`` run by default (``no:NAME`` blocks one, as in
pytest; ``enable_progress_bar=False``, ``logger=False`` and
``enable_checkpointing=False`` too); ``early_stopping``, ``lr_monitor`` and ``ledger`` (where a
step's time goes, per plugin and hook) are enabled by
name or passed as objects (``callbacks=[hookloop.EarlyStopping(monitor="val_loss")]``).
They are ordinary plugins on the public hooks, like any third party's.
"""
