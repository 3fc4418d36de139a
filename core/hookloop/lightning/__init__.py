"""Lightning compatibility: what a Lightning user's code finds under its own names.

``module`` (``hookloop.Module``, Lightning's ``LightningModule`` API), ``datamodule``,
``callbacks``, ``loggers``, ``strategies`` (Lightning's strategy strings), ``tuner``,
``cli`` (``LightningCLI``) and ``types``; ``plugin``, the ``lightning`` built-in that
translates Lightning's ``Trainer`` arguments (``callbacks=``, ``strategy=``, ``logger=``
objects, ``hookloop tune``), registered by the facade in ``hookloop.contract.translators``
and blocked with ``no:lightning``. The engine never imports this package
(tests/test_layers.py), as pytest keeps its unittest support beside its core.
"""
