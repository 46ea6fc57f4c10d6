"""Temporary copies of ``src/``: one clean snapshot, and each mutant applied to a copy of it (never to the tree).

``tests/`` is copied beside them once too, so that every run of one score uses the same fuzzer, whatever is edited
in the working tree meanwhile: ``root/tests``, ``root/clean/src``, ``root/<mutant>/src``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.fuzz.mutants.catalog import Mutant

REPO = Path(__file__).resolve().parents[3]
SRC = REPO / "src"
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


class DriftedSource(AssertionError):
    """A mutant's old text no longer occurs exactly once: the source moved on, the mutant must be updated."""


def problems(mutant: Mutant, src: Path = SRC) -> list[str]:
    """What keeps ``mutant`` from applying to ``src`` (empty: it applies)."""
    found = []
    for edit in mutant.edits:
        path = src / edit.path
        if not path.exists():
            found.append(f"{mutant.name}: {edit.path} does not exist")
            continue
        count = path.read_text().count(edit.old)
        if count != 1:
            found.append(f"{mutant.name}: {edit.path} holds its old text {count} times, not once: {edit.old!r}")
    return found


def snapshot(root: Path, rev: str | None = None) -> Path:
    """A copy of ``src/`` (returned) and ``tests/`` under ``root``, taken once: of commit ``rev`` (a consistent
    library and fuzzer, whatever is half-edited in the tree), or of the working tree (None)."""
    target = root / "clean" / "src"
    if rev is None:
        shutil.copytree(SRC, target, ignore=_IGNORED)
        shutil.copytree(REPO / "tests", root / "tests", ignore=_IGNORED)
        return target
    unpacked = root / "archive"
    unpacked.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src", "tests"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(unpacked)], input=archive.stdout, check=True)
    target.parent.mkdir()
    (unpacked / "src").rename(target)
    (unpacked / "tests").rename(root / "tests")
    return target


def mutated(mutant: Mutant, clean: Path, root: Path) -> Path:
    """A copy of the ``clean`` snapshot with ``mutant`` applied; raises ``DriftedSource`` if it does not apply."""
    found = problems(mutant, clean)
    if found:
        raise DriftedSource("; ".join(found))
    target = root / mutant.name / "src"
    shutil.copytree(clean, target, ignore=_IGNORED)
    for edit in mutant.edits:
        path = target / edit.path
        path.write_text(path.read_text().replace(edit.old, edit.new))
    return target
