"""The hook contract: what a plugin author reads.

``hookspecs`` (every hook, typed), ``registry`` (finding, loading and options of plugins),
``pluginspec`` (what a plugin is), ``checks`` (a plugin checked against the contract before
it runs), ``sourcescan`` (a plugin's role read from its source), ``versioning`` and
``errors``.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # hookloop.contract was a module (now hookloop.contract.checks) until 0.10: its names,
    # deprecated for one minor contract version (hookloop/_moved.py)
    from hookloop._moved import forward

    return forward("contract", name)
