"""The acceptance table: every case under Lightning 2.6.6 and hookloop, one process and ddp.

    python -m tests.lightning_scripts.table [--1p-only] [CASE ...]

prints, per case: the source file, the one-process result, the ddp result and a status
(matches / documented difference / fails: error / blocked: reason). Work directories go
under ``$LIGHTNING_SCRIPTS_WORKDIR`` (default: a fresh temporary directory).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

from .cases import CASES, DOCUMENTED, Case, VENDOR
from .rewrite import missing_names
from .run_case import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stored  # noqa: E402  (tests/stored.py)

TOLERANCE = 2e-3
DECISIONS = Path(__file__).resolve().parents[2] / "docs" / "decisions.md"


def _close(a: float, b: float) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= TOLERANCE * max(1.0, abs(b))


def differences(ref: dict, got: dict) -> list[str]:
    """What hookloop's run (``got``, rank 0's JSON) computed differently from Lightning's."""
    out = []
    if (ref["error"] is None) != (got["error"] is None):
        return [f"Lightning {'raised ' + ref['error'] if ref['error'] else 'ran'}, "
                f"hookloop {'raised ' + got['error'] if got['error'] else 'ran'}"]
    if ref["error"] and ref["error"].split(":")[0] != got["error"].split(":")[0]:
        return [f"Lightning raised {ref['error']}, hookloop raised {got['error']}"]
    r_calls = [r["call"] for r in ref["records"]]
    g_calls = [r["call"] for r in got["records"]]
    if r_calls != g_calls:
        return [f"Trainer calls {g_calls} instead of {r_calls}"]
    for i, (r, g) in enumerate(zip(ref["records"], got["records"])):
        where = f"{r['call']}#{i}"
        for key in ("global_step", "current_epoch"):
            if r[key] != g[key]:
                out.append(f"{where} {key} {g[key]} instead of {r[key]}")
        if set(r["metrics"]) != set(g["metrics"]):
            out.append(f"{where} callback_metrics keys {sorted(g['metrics'])} instead of {sorted(r['metrics'])}")
        for k in sorted(set(r["metrics"]) & set(g["metrics"])):
            if not _close(g["metrics"][k], r["metrics"][k]):
                out.append(f"{where} {k} {g['metrics'][k]:.6g} instead of {r['metrics'][k]:.6g}")
        if (r["weights"] is None) != (g["weights"] is None) or (
                r["weights"] and not all(_close(a, b) for a, b in zip(g["weights"], r["weights"]))):
            out.append(f"{where} weights checksum {g['weights']} instead of {r['weights']}")
    return out


def documented(case: str, mode: str, found: list[str]) -> list[str] | None:
    """The decisions.md phrases that explain every finding, or None if one is unexplained."""
    text = DECISIONS.read_text() if DECISIONS.is_file() else ""
    phrases = []
    for finding in found:
        entry = next((d for d in DOCUMENTED if d.case == case and d.mode == mode and d.what in finding), None)
        if entry is None or entry.decision not in text:
            return None
        phrases.append(entry.decision)
    return phrases


def _first_line(error: str | None) -> str:
    return (error or "").strip().splitlines()[0][:160] if error else ""


HERE = Path(__file__).resolve().parent
STORE = HERE / "expected"


def reference_path(case: Case, mode: str) -> Path:
    return STORE / f"{case.name}-{mode}.json"


def reference_digest(case: Case) -> str:
    """What Lightning's numbers for ``case`` depend on: its vendored source, the demos it
    may import, the harness that runs and observes it, the local data, the case itself."""
    sources = [VENDOR / case.vendored, *sorted((VENDOR / "lightning_demos").glob("*.py")),
               HERE / "run_case.py", HERE / "rewrite.py", HERE / "data.py"]
    return stored.digest(sources, extra=repr(case))


def run_reference(case: Case, root: Path, ddp: bool) -> dict:
    """Lightning's run of ``case``: what ``make oracle`` stores (its output's tail only where
    the run wrote nothing: the error message needs it; progress bars would make every
    stored file differ)."""
    mode = "ddp" if ddp else "1p"
    run = launch(case, "lightning", root / f"{case.name}-{mode}-lightning", ddp, timeout=case.timeout)
    return {**run, "output": run["output"][-2000:] if run["ranks"][0] is None else ""}


def store_reference(case: Case, root: Path, ddp: bool) -> None:
    stored.save(reference_path(case, "ddp" if ddp else "1p"), reference_digest(case), run_reference(case, root, ddp))


def stored_reference(case: Case, ddp: bool) -> dict:
    return stored.load(reference_path(case, "ddp" if ddp else "1p"), reference_digest(case))


def run_mode(case: Case, root: Path, ddp: bool, reference: dict | None = None) -> tuple[str, str]:
    """(result, status) of one case in one mode: one process or ddp. ``reference``:
    Lightning's run (:func:`stored_reference`); without it Lightning runs too."""
    mode = "ddp" if ddp else "1p"
    if ddp and case.ddp not in ("env", "args"):
        return "n/a", f"one process only: {case.ddp}"
    runs = {"lightning": reference or run_reference(case, root, ddp),
            "hookloop": launch(case, "hookloop", root / f"{case.name}-{mode}-hookloop", ddp, timeout=case.timeout)}
    ref, got = runs["lightning"]["ranks"][0], runs["hookloop"]["ranks"][0]
    if ref is None:
        return "reference did not run", "fails: Lightning's run wrote nothing: " + \
            runs["lightning"]["output"].strip()[-300:]
    if got is None:
        return "hookloop did not run", "fails: hookloop's run wrote nothing (rc " \
            f"{runs['hookloop']['returncode']}): " + runs["hookloop"]["output"].strip()[-300:]
    last = (got["records"] or [{}])[-1]
    result = ", ".join(f"{k}={v:.4g}" for k, v in sorted(last.get("metrics", {}).items())
                       if not isinstance(v, str))[:120] or "-"
    found = differences(ref, got)
    if not found:
        return result, "matches" + (f" (both raise {ref['error'].split(':')[0]})" if ref["error"] else "")
    phrases = documented(case.name, mode, found)
    if got["error"] and not ref["error"] and phrases is None:
        return result, f"fails: {_first_line(got['error'])}"
    if phrases is not None:
        return result, "documented difference: " + "; ".join(dict.fromkeys(phrases))
    return result, "fails: differs: " + "; ".join(found)[:300]


def run_case(case: Case, root: Path, modes=("1p", "ddp")) -> dict:
    row = {"case": case.name, "source": case.source, "1p": ("", ""), "ddp": ("", ""), "missing": []}
    if case.vendored:
        row["missing"] = missing_names((VENDOR / case.vendored).read_text())
    if case.blocked:
        row["status"] = f"blocked: {case.blocked}"
        return row
    for mode in modes:
        row[mode] = run_mode(case, root, ddp=(mode == "ddp"))
    statuses = [row[m][1] for m in modes]
    if all(s.startswith("matches") or s.startswith("one process only") for s in statuses):
        row["status"] = "matches"
    elif all(s.startswith(("matches", "documented", "one process only")) for s in statuses):
        row["status"] = "documented difference"
    else:
        row["status"] = "fails"
    return row


def format_table(rows: list[dict]) -> str:
    out = ["| case | source | one process | ddp (2 procs, gloo) | status |", "|---|---|---|---|---|"]
    for r in rows:
        cell = lambda m: f"{r[m][1]}" + (f" ({r[m][0]})" if r[m][0] and r[m][0] not in ("-", "n/a") else "")  # noqa: E731
        status = r["status"] + (f"; hookloop lacks {', '.join(r['missing'])}" if r["missing"] else "")
        out.append(f"| {r['case']} | `{r['source']}` | {cell('1p')} | {cell('ddp')} | {status} |")
    counts = {}
    for r in rows:
        counts[r["status"].split(":")[0]] = counts.get(r["status"].split(":")[0], 0) + 1
    out.append("")
    out.append(", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f" of {len(rows)} cases")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--1p-only", dest="one", action="store_true", help="skip the ddp runs")
    args = parser.parse_args(argv)
    import os

    root = Path(os.environ.get("LIGHTNING_SCRIPTS_WORKDIR") or tempfile.mkdtemp(prefix="lightning_scripts-"))
    selected = [c for c in CASES if not args.cases or c.name in args.cases]
    rows = []
    for case in selected:
        rows.append(run_case(case, root, modes=("1p",) if args.one else ("1p", "ddp")))
        print(format_table(rows[-1:]).splitlines()[2], file=sys.stderr, flush=True)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
