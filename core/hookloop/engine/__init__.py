"""The loop: read this first.

``trainer`` (the public ``Trainer``), ``settings`` (what the Trainer's arguments, the
command line and the environment resolve to), ``session`` (around every entry point:
plugins, processes, loaders, checkpoints), ``loop`` (epochs and validation), ``step`` (one
batch, from ``fit`` to ``optimizer.step()``), ``state``, ``metrics``, ``optim`` and
``defaults`` (the single-process defaults, a built-in plugin). Nothing here imports
``hookloop.lightning``, ``hookloop.tools`` or ``hookloop.testing`` (tests/test_layers.py).
"""
