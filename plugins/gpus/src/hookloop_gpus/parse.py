"""Reading a ``gpus`` / ``devices`` spec the way Lightning's "Select GPU devices" table does.

=========  =====  ==================  ====================
spec       type   parsed              meaning
=========  =====  ==================  ====================
None       None   None                CPU
0          int    None                CPU
3          int    [0, 1, 2]           first 3 GPUs
-1         int    [0, 1, 2, ...]      all available GPUs
[0]        list   [0]                 GPU 0
[1, 3]     list   [1, 3]              GPUs 1 and 3
"0"        str    [0]                 GPU 0
"3"        str    [3]                 GPU 3
"1, 3"     str    [1, 3]              GPUs 1 and 3
"-1"       str    [0, 1, 2, ...]      all available GPUs
=========  =====  ==================  ====================

An int counts GPUs, a list or a string names them: ``0`` is the CPU, ``[0]`` and ``"0"``
are GPU 0. Beyond the table: ``"auto"`` is ``-1``, ``"[1, 3]"`` is ``"1, 3"``, and an
empty list (or ``"[]"``) is the CPU, as in Lightning.
"""

from __future__ import annotations

from typing import Any

import hookloop

ALL = -1


def parse_gpus(spec: Any, available: int) -> list[int] | None:
    """The GPU indices ``spec`` names, or ``None`` for the CPU.

    :param spec: what the user wrote for ``gpus`` (or ``devices`` with this plugin).
    :param available: how many GPUs this machine has; only ``-1``/``"-1"``/``"auto"``
        ("all of them") need it. Whether named indices exist is checked by
        :func:`hookloop_gpus.select_gpus`, not here.
    :raises hookloop.ConfigurationError: for a spec that is none of the forms above.
    """
    if spec is None:
        return None
    if isinstance(spec, bool):
        raise _bad(spec, "a bool is not a GPU spec")
    if isinstance(spec, int):
        if spec == 0:
            return None
        if spec == ALL:
            return list(range(available))
        if spec < 0:
            raise _bad(spec, "a negative count other than -1 (all GPUs)")
        return list(range(spec))
    if isinstance(spec, str):
        text = spec.strip()
        if text in ("-1", "auto"):
            return list(range(available))
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
            if not text.strip():
                return None
        parts = [p.strip() for p in text.split(",")]
        if parts and parts[-1] == "":
            parts.pop()  # "0," is GPU 0, as in Lightning
        if not parts or not all(p.isdigit() for p in parts):
            raise _bad(spec, "a string must list GPU indices separated by commas")
        return _unique([int(p) for p in parts], spec)
    if isinstance(spec, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in spec):
            raise _bad(spec, "a list must hold non-negative GPU indices")
        return _unique(list(spec), spec) if spec else None
    raise _bad(spec, f"a {type(spec).__name__} is not a GPU spec")


def describe(spec: Any, parsed: list[int] | None) -> str:
    """The "meaning" column of the table for ``spec``."""
    if parsed is None:
        return "CPU"
    if (isinstance(spec, int) and spec == ALL) or (isinstance(spec, str) and spec.strip() in ("-1", "auto")):
        return f"all available GPUs ({len(parsed)})"
    if isinstance(spec, int):
        return f"first {spec} GPU{'s' if spec != 1 else ''}"
    if len(parsed) == 1:
        return f"GPU {parsed[0]}"
    return "GPUs " + ", ".join(str(i) for i in parsed[:-1]) + f" and {parsed[-1]}"


def _unique(ids: list[int], spec: Any) -> list[int]:
    if len(set(ids)) != len(ids):
        raise _bad(spec, "it names a GPU twice")
    return ids


def _bad(spec: Any, why: str) -> hookloop.ConfigurationError:
    return hookloop.ConfigurationError(
        f"gpus={spec!r} is not a GPU spec ({why}). Use None or 0 for the CPU, an int k for "
        f"the first k GPUs, -1 for all, or name GPUs with a list [1, 3] or a string '1, 3'"
    )
