"""``make oracle``: compute pytorch-lightning 2.6.6's reference numbers and store them.

    python tests/store_references.py [--all] [--scripts-only] [--unit-only]

Writes tests/oracle/expected/lightning-{one,ddp}.json (every oracle case, one process and
ddp) and tests/lightning_scripts/expected/<case>-1p.json for the Lightning scripts that
``make test`` runs (``--all``: every runnable case in both modes, as ``make test-full``
compares them), and tests/lightning_unit/expected/<file>.json: the outcome of every test
of Lightning's own vendored unit tests under Lightning (minutes per file). Each file carries the digest of the sources its numbers depend on
(tests/stored.py); commit them with the change that moved them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "oracle"), str(HERE.parent)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="the ddp and slow Lightning scripts too")
    parser.add_argument("--scripts-only", action="store_true",
                        help="only the Lightning scripts' references (their harness or cases changed)")
    parser.add_argument("--unit-only", action="store_true",
                        help="only the outcomes of Lightning's unit tests (tests/lightning_unit)")
    args = parser.parse_args(argv)
    if args.unit_only:
        return store_unit()
    from test_lightning_oracle import store_lightning_observations  # tests/oracle

    from tests.lightning_scripts.cases import CASES
    from tests.lightning_scripts.table import reference_path, store_reference

    with tempfile.TemporaryDirectory(prefix="hookloop-oracle-") as tmp:
        base = Path(tmp)
        if not args.scripts_only:
            (base / "oracle").mkdir()
            store_lightning_observations(base / "oracle")
            print("stored tests/oracle/expected/lightning-{one,ddp}.json", flush=True)
        for case in CASES:
            if case.blocked or not (case.fast or args.all):
                continue
            modes = [False] + ([True] if args.all and case.ddp in ("env", "args") else [])
            for ddp in modes:
                store_reference(case, base / "scripts", ddp)
                print(f"stored {reference_path(case, 'ddp' if ddp else '1p').relative_to(HERE.parent)}", flush=True)
    return 0 if args.scripts_only else store_unit()


def store_unit() -> int:
    from tests.lightning_unit import table
    from tests.lightning_unit.vendor_tests import FILES

    with tempfile.TemporaryDirectory(prefix="hookloop-oracle-unit-") as tmp:
        for file in FILES:
            table.store_reference(file, Path(tmp))
            print(f"stored {table.reference_path(file).relative_to(HERE.parent)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
