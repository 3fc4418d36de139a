"""Stored reference results: slow reference computations that depend only on their case.

pytorch-lightning 2.6.6's numbers for the oracle cases (tests/oracle) and for Lightning's
own scripts (tests/lightning_scripts) change only when a case changes. They are computed
by ``make oracle`` and kept as JSON beside the cases, each file with the digest of the
sources that produced it. ``make test`` compares hookloop against the stored numbers (and
fails, naming ``make oracle``, when a source changed since they were stored);
``make test-full`` computes them again and fails if they moved.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REGENERATE = "make oracle"


def reference_version() -> str:
    """The reference framework's version, part of every digest (another Lightning, other numbers)."""
    from importlib.metadata import version

    return version("pytorch-lightning")


def digest(sources: list[Path], extra: str = "") -> str:
    """sha256 over the sources' bytes (in the given order), their paths relative to the
    repository, ``extra`` and the reference's version."""
    h = hashlib.sha256()
    for path in sources:
        h.update(path.resolve().relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(extra.encode() + b"\0" + reference_version().encode())
    return h.hexdigest()


def save(path: Path, sources_digest: str, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"digest": sources_digest, "pytorch_lightning": reference_version(),
                                "data": data}, indent=1, sort_keys=True, default=float) + "\n")


class StaleReference(AssertionError):
    pass


def load(path: Path, sources_digest: str):
    """The stored data, or :class:`StaleReference` naming the command that stores it again."""
    if not path.is_file():
        raise StaleReference(f"no stored reference at {path.relative_to(REPO)}: run `{REGENERATE}`")
    stored = json.loads(path.read_text())
    if stored.get("digest") != sources_digest:
        raise StaleReference(
            f"{path.relative_to(REPO)} was stored from other sources (a case, its harness or the "
            f"reference's version changed since): run `{REGENERATE}` and commit the new file")
    return stored["data"]
