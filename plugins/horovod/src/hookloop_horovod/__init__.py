"""hookloop-horovod: the ``horovod`` strategy.

``hookloop run --plugins horovod --devices N script.py`` starts N workers through
``horovodrun -np N -H localhost:N --gloo``; ``Trainer(plugins=["horovod"], devices=N)``
in ``python script.py`` re-launches the script the same way. Horovod itself is imported
only inside the workers' hooks (and checked at launch), never when this module is
imported. See the README for building Horovod, options and several hosts.
"""

from __future__ import annotations

from .strategy import Horovod

__all__ = ["Horovod"]
