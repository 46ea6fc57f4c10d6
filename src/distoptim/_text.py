"""Error-message helpers shared by the packages that name what a user got wrong."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["few"]


def few(items: Sequence[object], limit: int = 3) -> str:
    """The first ``limit`` of ``items``, comma-separated, and how many more there are."""
    shown = ", ".join(map(str, items[:limit]))
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"
