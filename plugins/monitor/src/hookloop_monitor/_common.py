"""What both monitors share: the per-rank row and the ``every_n_steps`` check."""

from __future__ import annotations

import hookloop


def per_rank_row(gathered: list[dict]) -> dict[str, float]:
    """``[{name: value} of rank 0, of rank 1, ...]`` -> ``{"rank<R>/<name>": value}``."""
    return {f"rank{rank}/{name}": float(value) for rank, values in enumerate(gathered) for name, value in values.items()}


def check_every(plugin: str, every_n_steps) -> int:
    """``every_n_steps`` as a positive int, or a ConfigurationError naming the plugin."""
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
        raise hookloop.ConfigurationError(
            f"{plugin} every_n_steps={every_n_steps!r} must be a positive whole number of optimizer "
            f"steps, e.g. hookloop.plugin({plugin!r}, every_n_steps=50) or --plugin-option "
            f"{plugin}.every_n_steps=50"
        )
    return every_n_steps
