"""When the ranks must compare their backwards through the store: a backward that raises never reaches its flush, and
the ranks may have launched different numbers of bucket reductions before the error
(``OwnedGradients._line_up_unfinished`` lines them up). The comparison costs a store round-trip, so it runs only
while some forward with gradients may still have a backward that raised; what decides it is only what every rank of
one program does alike. The rules and what is not watched: ``docs/guides/internals.md``.
"""

from __future__ import annotations

__all__ = ["PendingForwards"]


class PendingForwards:
    """The forwards through one wrapper whose backward may have raised on some rank."""

    def __init__(self) -> None:
        self._forwards = 0  # forwards with gradients since the last finished backward
        self._recheck = False  # the last finished backward came after several forwards

    def forward(self) -> None:
        """A forward with gradients ran through the wrapper."""
        self._forwards += 1

    @property
    def due(self) -> bool:
        """Whether the ranks must compare their backwards before the next step, forward or clear."""
        return self._forwards > 0 or self._recheck

    def finished(self) -> None:
        """A backward reached its flush."""
        self._recheck, self._forwards = self._forwards > 1, 0

    def compared(self) -> None:
        """The ranks compared their backwards; forwards not yet followed by a finished backward stay pending."""
        self._recheck = False
