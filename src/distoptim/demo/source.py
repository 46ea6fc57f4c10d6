"""Where the demo's text comes from, checked without reading it: the command line validates this before spawning.

The default source is the Python standard library's own directory, which every Python installation has: its
top-level ``*.py`` files, in name order, are a few MB of real text, the same on every rank.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

__all__ = [
    "HELD_OUT_FRACTION",
    "MAX_BYTES",
    "TextSourceError",
    "check_text_source",
    "default_text_source",
    "find_text_files",
    "min_text_bytes",
]

MAX_BYTES = 8 * 2**20  # enough text for any demo run; reading a bigger tree whole would only cost time
HELD_OUT_FRACTION = 0.05  # the tail of the text, never trained on, for the held-out loss


def min_text_bytes(context: int) -> int:
    """The least text a run with windows of ``context`` tokens needs: a few windows in the held-out part."""
    return int(4 * (context + 1) / HELD_OUT_FRACTION)


class TextSourceError(ValueError):
    """The text source is missing, unreadable or too small; the message is one line for the user."""


def default_text_source() -> Path:
    """The standard library's directory (where ``os.py`` lives)."""
    return Path(sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__))


def find_text_files(source: Path) -> list[Path]:
    """``source`` itself if it is a file, else the ``*.py`` files directly in it, in name order (no recursion)."""
    if not source.exists():
        raise TextSourceError(f"text source {str(source)!r} does not exist")
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise TextSourceError(f"text source {str(source)!r} is neither a file nor a directory")
    files = sorted(path for path in source.glob("*.py") if path.is_file())
    if not files:
        raise TextSourceError(f"text source {str(source)!r} is a directory with no *.py files in it")
    return files


def check_text_source(source: Path, min_bytes: int) -> int:
    """The number of bytes the demo will read from ``source`` (at most ``MAX_BYTES``); raises if under ``min_bytes``.

    Files that cannot be opened raise too, so that no rank finds out later.
    """
    total = 0
    for path in find_text_files(source):
        try:
            with path.open("rb"):
                total += path.stat().st_size
        except OSError as error:
            raise TextSourceError(f"cannot read {str(path)!r}: {error.strerror or error}") from None
        if total >= MAX_BYTES:
            return MAX_BYTES
    if total < min_bytes:
        raise TextSourceError(f"text source {str(source)!r} holds {total} bytes; this run needs at least {min_bytes}")
    return total
