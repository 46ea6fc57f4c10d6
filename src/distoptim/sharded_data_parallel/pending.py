"""Which forwards through the wrapper may have a backward that raised midway: when to compare the ranks.

A backward that raises never reaches its flush, and the ranks may have launched different numbers of bucket
reductions before the error (``OwnedGradients._line_up_unfinished`` lines them up through the store). That costs a
store round-trip, so it runs only where some forward with gradients is not yet *covered*: a backward that reached
its output (a hook on the output tensors) and finished. Which forwards are covered is the same on every rank, as
every rank runs the same forwards and backwards; what each rank's raised backward reached is not, and is not used.
A backward under ``no_sync()`` launches nothing, so whatever it raises leaves the ranks alike: reaching an output
there covers its forward at once (micro-batches accumulated under ``no_sync()`` cost no comparison; a second
backward of such a graph outside it, with ``retain_graph``, is not watched).

A forward stays uncovered while its graph lives (a second forward, an evaluation without gradients, the backward of
a first forward, then of the second: each may still raise), and counts once more after its graph died uncovered (a
backward that raised freed it, or none ran). Where the graph dies follows from reference counts, alike on every rank
of the same program; a graph kept in a reference cycle dies at a garbage collection, which may differ between ranks.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_leaves

__all__ = ["PendingForwards"]


class PendingForwards:
    """The forwards through one wrapper whose backward is not known to have finished on every rank."""

    def __init__(self, reduces: Callable[[], bool]) -> None:
        self._reduces = reduces  # whether a backward now would launch reductions (not under no_sync())
        self._ids = itertools.count()
        self._alive: set[int] = set()  # uncovered, their graph alive: a backward may still come
        self._died = 0  # uncovered when their graph died, since the last comparison
        self._reached: set[int] = set()  # outputs the running backward reached

    def serving(self, reduces: Callable[[], bool]) -> PendingForwards:
        """These forwards, now for a store rebuilt after the plan grew (whose ``no_sync`` ``reduces`` reads)."""
        self._reduces = reduces
        return self

    def note(self, output: Any) -> None:
        """A forward with gradients enabled returned ``output``."""
        tensors = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
        forward = next(self._ids)
        if not tensors:  # no output to watch (gradients through the module's side outputs): compare once
            self._died += 1
            return
        self._alive.add(forward)
        hook = _Reached(self, forward)
        for tensor in tensors:
            tensor.register_hook(hook)  # type: ignore[no-untyped-call]
        weakref.finalize(hook, _died, weakref.ref(self), forward)

    @property
    def due(self) -> bool:
        """Whether the ranks must compare their backwards before the next step, forward or clear."""
        return bool(self._alive or self._died)

    def finished(self) -> None:
        """A backward reached its flush: the forwards whose outputs it reached are covered."""
        self._alive -= self._reached
        self._reached.clear()

    def compared(self) -> None:
        """The ranks compared their backwards: the dead forwards are accounted for; the live ones may still raise."""
        self._died = 0
        self._reached.clear()


class _Reached:
    """A hook on a forward's output tensors, alive as long as the graph that holds them."""

    def __init__(self, pending: PendingForwards, forward: int) -> None:
        self._pending, self._forward = weakref.ref(pending), forward

    def __call__(self, grad: Tensor) -> None:
        pending = self._pending()
        if pending is not None:
            if pending._reduces():
                pending._reached.add(self._forward)
            else:  # under no_sync(): this backward launches nothing, whatever it raises
                pending._alive.discard(self._forward)


def _died(pending_ref: weakref.ref[PendingForwards], forward: int) -> None:
    pending = pending_ref()
    if pending is not None and forward in pending._alive:
        pending._alive.discard(forward)
        pending._died += 1
