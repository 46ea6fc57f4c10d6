"""When the ranks must compare their backwards through the store: a backward that raises never reaches its flush,
and the ranks may have launched different numbers of bucket reductions before the error
(``OwnedGradients._line_up_unfinished`` lines them up). The comparison costs a store round-trip, so it runs only
while some forward with gradients may still have a backward that raised.

What decides it is only what every rank of one program does alike: the forwards with gradients through the wrapper
(a recomputing checkpoint's inside the backward included) and the backwards that finished. Which outputs a
backward reached, or when a graph is freed, depend on the data or on the garbage collector and are not used: a
disagreement there would leave one rank waiting in the store.

- A forward is pending until a backward finishes after it; forwards without gradients (an evaluation) and further
  forwards leave it pending (its backward may still come).
- A backward that finishes after two or more forwards may not have been theirs all (two forwards, the first's
  backward, then the second's): one comparison more is due after it.
- Not counted: forwards under ``no_sync()`` (their backward launches nothing there; accumulating micro-batches
  costs no comparison).
- Not watched, then: a backward that raises after a ``no_sync()`` forward, run outside it; a second backward of a
  retained graph (``retain_graph=True``) after the first finished; a reentrant checkpoint's forward around the
  wrapper (it runs without gradients; its recompute inside the backward is counted).
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
