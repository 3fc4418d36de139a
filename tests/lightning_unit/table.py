"""Lightning's unit tests under pytorch-lightning 2.6.6 and under hookloop: the per-file table.

    python -m tests.lightning_unit.table [--store] [--results DIR] [--draft-status] [FILE ...]

prints, per vendored test file (FILE: relative to tests_pytorch; default: all of them):
the tests pytest collected under Lightning, how many pass under Lightning, how many of
those pass under hookloop, and the others counted per status.toml category (``unlisted``:
a failure without an entry, which the harness test fails). Lightning's outcomes are read
from ``expected/`` (``--store``: run Lightning again and store them, what ``make oracle``
does); hookloop runs every time, one pytest process per file (``--results DIR``: keep its
outcomes there as JSON, and reuse the ones already there). ``--draft-status`` prints
status.toml entries for the unlisted failures, a category guessed from the message: a
draft to read and correct, never to paste unread.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import tomllib

from .run import HERE, VENDOR, run_files
from .vendor_tests import FILES

sys.path.insert(0, str(HERE.parent))
import stored  # noqa: E402  (tests/stored.py)

STORE = HERE / "expected"
STATUS = HERE / "status.toml"
CATEGORIES = {
    "behaviour": "hookloop runs the test's code and computes, logs, raises or calls something else",
    "unclaimed": "the test reads or patches an attribute or module hookloop does not claim",
    "missing": "a Lightning name or argument hookloop lacks",
    "documented": "a difference docs/decisions.md gives the reason for",
}


def reference_path(file: str) -> Path:
    return STORE / (file.removesuffix(".py").replace("/", "__") + ".json")


def reference_digest(file: str) -> str:
    """What Lightning's outcomes for ``file`` depend on: the file, the vendored helpers and
    harness (every vendored file that is not a test file), and the runner."""
    support = sorted(p for p in VENDOR.rglob("*.py") if not p.name.startswith("test_"))
    return stored.digest([VENDOR / file, *support, HERE / "run.py", HERE / "outcomes.py", HERE / "aliases.py"])


def run_reference(file: str, root: Path) -> dict:
    return run_files("lightning", [file], root / "lightning")[file]


def store_reference(file: str, root: Path) -> None:
    stored.save(reference_path(file), reference_digest(file), run_reference(file, root))


def stored_reference(file: str) -> dict:
    return stored.load(reference_path(file), reference_digest(file))


def load_status() -> dict[str, dict[str, tuple[str, str]]]:
    """{file: {test id: (category, reason)}} from status.toml (``"id" = "category: reason"``)."""
    raw = tomllib.loads(STATUS.read_text()) if STATUS.is_file() else {}
    out: dict = {}
    for file, entries in raw.items():
        for test, text in entries.items():
            category, _, reason = text.partition(":")
            out.setdefault(file, {})[test] = (category.strip(), reason.strip())
    return out


def hookloop_outcome(results: dict, test: str) -> dict:
    """hookloop's outcome of ``test``; a test its run did not report takes the file's
    collection or run error."""
    if test in results:
        return results[test]
    for key in ("<collection>", "<run>"):
        if key in results:
            return {"outcome": "error", "message": f"{key[1:-1]}: {results[key]['message']}"}
    return {"outcome": "error", "message": "not collected under hookloop (its test id differs)"}


def compare(reference: dict, results: dict, status: dict[str, tuple[str, str]]) -> dict:
    """Per test of the file that passes under Lightning: ``passed``, its status category,
    or ``unlisted``; plus ``stale``: the status entries whose test passes (or is not one
    that passes under Lightning), to be removed."""
    row: dict = {"tests": len([t for t in reference if not t.startswith("<")]),
                 "lightning": 0, "hookloop": 0, "categories": {}, "unlisted": {}, "stale": []}
    passing = [t for t, r in reference.items() if r["outcome"] == "passed"]
    row["lightning"] = len(passing)
    for test in passing:
        got = hookloop_outcome(results, test)
        if got["outcome"] == "passed":
            row["hookloop"] += 1
            if test in status:
                row["stale"].append(f"{test}: passes under hookloop now")
        elif test in status:
            category = status[test][0]
            row["categories"][category] = row["categories"].get(category, 0) + 1
        else:
            row["unlisted"][test] = got
    row["stale"] += [f"{t}: does not pass under Lightning" for t in status if t not in passing]
    return row


def guess(message: str) -> str:
    """A draft category from a failure's first line (--draft-status), to be read and corrected."""
    if "hookloop_lacks_" in message or "hookloop has no equivalent" in message or \
            "unexpected keyword argument" in message:
        return "missing"
    if "No module named 'lightning'" in message or "has no attribute" in message:
        return "unclaimed"
    return "behaviour"


def hookloop_results(files: list[str], results_dir: Path | None, root: Path) -> dict:
    out = {}
    for file in files:
        # the JSON `python -m tests.lightning_unit.run hookloop FILE` prints
        cached = results_dir / (file.replace("/", "_") + ".json") if results_dir else None
        if cached and cached.is_file():
            out[file] = json.loads(cached.read_text())[file]
            continue
        out[file] = run_files("hookloop", [file], root / "hookloop")[file]
        if cached:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps({file: out[file]}, indent=1, sort_keys=True))
    return out


def format_table(rows: dict[str, dict]) -> str:
    cats = [*CATEGORIES, "unlisted"]
    out = ["| file | tests | pass under Lightning | pass under hookloop | " + " | ".join(cats) + " |",
           "|---|---:|---:|---:|" + "---:|" * len(cats)]
    total = {"tests": 0, "lightning": 0, "hookloop": 0, **{c: 0 for c in cats}}
    for file, row in rows.items():
        counts = {**row["categories"], "unlisted": len(row["unlisted"])}
        out.append(f"| {file} | {row['tests']} | {row['lightning']} | {row['hookloop']} | "
                   + " | ".join(str(counts.get(c, 0)) for c in cats) + " |")
        for key in ("tests", "lightning", "hookloop"):
            total[key] += row[key]
        for c in cats:
            total[c] += counts.get(c, 0)
    out.append(f"| **total** | {total['tests']} | {total['lightning']} | {total['hookloop']} | "
               + " | ".join(str(total[c]) for c in cats) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="test files relative to tests_pytorch (default: all)")
    parser.add_argument("--store", action="store_true", help="run Lightning and store its outcomes")
    parser.add_argument("--results", type=Path, help="keep (and reuse) hookloop's outcomes in this folder")
    parser.add_argument("--draft-status", action="store_true", help="print draft entries for unlisted failures")
    args = parser.parse_args(argv)
    files = args.files or list(FILES)
    status = load_status()
    with tempfile.TemporaryDirectory(prefix="lightning-unit-") as tmp:
        root = Path(tmp)
        if args.store:
            for file in files:
                store_reference(file, root)
                print(f"stored {reference_path(file).relative_to(HERE.parents[1])}", file=sys.stderr, flush=True)
        references, unstored = {}, []
        for file in files:
            try:
                references[file] = stored_reference(file)
            except stored.StaleReference as exc:
                unstored.append(f"{file}: {exc}")
        results = hookloop_results(list(references), args.results, root)
    rows = {f: compare(references[f], results[f], status.get(f, {})) for f in references}
    print(format_table(rows))
    for line in unstored:
        print(f"not in the table, {line}")
    if args.draft_status:
        for file, row in rows.items():
            if row["unlisted"]:
                print(f'\n["{file}"]')
                for test, got in row["unlisted"].items():
                    print(json.dumps(test) + " = " + json.dumps(f"{guess(got['message'])}: {got['message'][:200]}"))
    for file, row in rows.items():
        for line in row["stale"]:
            print(f"stale status entry: {file}::{line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
