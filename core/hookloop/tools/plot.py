"""``hookloop plot [RUN_DIR] [-o report.png]``: the curves of a run's ``metrics.csv``.

Reads the file the built-in ``csv`` observer writes (columns ``step``, ``epoch``, then one
per metric; one row per logging event, a cell left empty where that metric was not
logged) and draws every metric against the step, one panel per metric *family*, so that
the train, validation and test values of one quantity share axes. The family of a column
is its name with, in this order:

1. a trailing ``/dataloader_idx_N`` (several validation loaders) or ``/pgN`` (the
   ``lr_monitor``'s parameter groups) removed;
2. a trailing ``_step`` or ``_epoch`` removed (``self.log(on_step=True, on_epoch=True)``);
3. a leading ``train_``, ``val_``, ``valid_``, ``validation_`` or ``test_`` (or the same
   followed by ``/`` instead of ``_``) removed.

So ``train_loss``, ``val_loss``, ``loss_step``, ``loss_epoch`` and
``val_loss/dataloader_idx_1`` are all drawn in the panel ``loss``; ``val_acc`` and
``train_acc`` in ``acc``. Epoch-level rows are drawn at the step they were logged at.

matplotlib is an optional dependency (``pip install 'hookloop[plot]'``); it is imported
only when a figure is drawn, with the Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

from hookloop.contract.errors import ConfigurationError, MissingDependencyError
from hookloop.resume.rundir import versions

FILENAME = "metrics.csv"
_SUFFIX = re.compile(r"/(dataloader_idx|pg)_?\d+$")
_STAGE = re.compile(r"_(step|epoch)$")
_PREFIX = re.compile(r"^(train|val|valid|validation|test)[_/]")


def family(column: str) -> str:
    """The panel a metric column is drawn in (the rule is in the module docstring)."""
    name = _STAGE.sub("", _SUFFIX.sub("", column))
    return _PREFIX.sub("", name) or column


def find_run_dir(run_dir: str | Path | None = None) -> Path:
    """The run directory to plot: ``run_dir`` itself when it holds ``metrics.csv``, else
    the newest ``logs/version_N`` under it (``run_dir`` may be a ``default_root_dir``);
    with no ``run_dir``, the newest under ``./logs``. A clear error when there is none."""
    root = Path(run_dir) if run_dir is not None else Path(".")
    if run_dir is not None:
        if not root.is_dir():
            raise ConfigurationError(f"run directory {str(root)!r} does not exist")
        if (root / FILENAME).is_file():
            return root
    found = versions(root / "logs")
    if found:
        return found[-1][1]
    if run_dir is None:
        raise ConfigurationError(
            f"no run directory under {str(root.resolve() / 'logs')!r} (runs write logs/version_N "
            f"under their default_root_dir): pass one, e.g. `hookloop plot path/to/logs/version_0`"
        )
    raise ConfigurationError(
        f"{str(root)!r} has no {FILENAME} and no logs/version_N run directory: pass a run "
        f"directory written with the csv logger enabled (it is on unless `no:csv` or logger=False)"
    )


def read_series(csv_path: str | Path) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """``{family: {column: (steps, values)}}`` of a ``metrics.csv``, the rows where the
    column has a value, in file order; families and columns in order of first appearance."""
    path = Path(csv_path)
    if not path.is_file():
        raise ConfigurationError(f"{str(path)!r} does not exist: the csv logger writes it during a run")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is not None and "step" not in reader.fieldnames:
            raise ConfigurationError(f"{str(path)!r} is not a hookloop metrics file (no 'step' column)")
        columns = [c for c in (reader.fieldnames or []) if c not in ("step", "epoch")]
        rows = list(reader)
    series: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for column in columns:
        points = [(float(r["step"]), float(r[column])) for r in rows if r.get(column) not in (None, "")]
        if points:
            steps, values = (list(t) for t in zip(*points))
            series.setdefault(family(column), {})[column] = (steps, values)
    if not series:
        raise ConfigurationError(f"{str(path)!r} has no logged metric values yet: nothing to plot")
    return series


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError(
            "hookloop plot draws with matplotlib, which is not installed: "
            "pip install 'hookloop[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure(run_dir: str | Path | None = None):
    """The matplotlib ``Figure`` of a run: one axes per family (titled by it), one line
    per column (labelled by it) with x = step and y = the logged values."""
    run = find_run_dir(run_dir)
    series = read_series(run / FILENAME)
    plt = _pyplot()
    cols = min(3, len(series))
    rows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax, (name, lines) in zip(axes.flat, series.items()):
        for column, (steps, values) in lines.items():
            ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, label=column)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(series):]:
        ax.remove()
    fig.suptitle(str(run))
    fig.tight_layout()
    return fig


def plot(run_dir: str | Path | None = None, output: str | Path | None = None) -> Path:
    """Write the report PNG (default ``<run dir>/report.png``) and return its path."""
    run = find_run_dir(run_dir)
    fig = figure(run)
    out = Path(output) if output is not None else run / "report.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, dpi=100)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return out


def add_parser(sub) -> None:
    """Register ``hookloop plot`` on the CLI's sub-parsers."""
    p = sub.add_parser(
        "plot",
        help="draw a run's logged metrics (metrics.csv) into a PNG",
        description=(
            "Draw every metric of RUN_DIR/metrics.csv against the step, one panel per metric "
            "family (train_loss, val_loss, loss_epoch ... share the panel 'loss'). RUN_DIR "
            "defaults to the newest ./logs/version_N; a default_root_dir is accepted too. "
            "Needs matplotlib: pip install 'hookloop[plot]'."
        ),
    )
    p.add_argument("run_dir", nargs="?", default=None, metavar="RUN_DIR", help="a run directory (default: newest under ./logs)")
    p.add_argument("-o", "--output", default=None, metavar="PNG", help="where to write the image (default: RUN_DIR/report.png)")


def command(args) -> int:
    print(plot(args.run_dir, args.output))
    return 0
