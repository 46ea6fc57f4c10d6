"""Laying a ``FlatLayout``'s parameters into a flat allocation: each becomes a view at its position, copied there
from wherever it lies, or moved within the allocation when it is already in it (``BucketViewSync`` re-cutting its
buffers at ``ShardedDataParallel``'s wrapping), without a second copy of the layout at any moment."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from distoptim._flat import view_like

if TYPE_CHECKING:
    from distoptim.zero.layouts import FlatLayout

__all__ = ["movable_within", "place", "release_leavers"]


def release_leavers(before: Sequence[FlatLayout], after: Sequence[FlatLayout], spare: dict[Any, Tensor]) -> None:
    """Parameters of the ``before`` layouts that the ``after`` ones leave out (a re-cut from scratch places frozen
    parameters nowhere) get their own storage back: the buffer they view is about to be rewritten."""
    staying = {param for layout in after for param in layout.params}
    reused = {_storage(allocation) for allocation in spare.values()}
    for layout in before:
        for param in layout.params:
            if param not in staying and _storage(param) in reused:
                param.data = param.detach().clone()
                torch.autograd.graph.increment_version(param)  # its old memory is about to be overwritten


def _starts(layout: FlatLayout) -> list[tuple[int, Tensor]]:
    """Each parameter's position in the layout's buffer, in buffer order."""
    return [(piece.position, piece.param) for piece in layout.pieces if piece.offset == 0]


def movable_within(layout: FlatLayout, allocation: Tensor) -> bool:
    """Whether ``layout`` can be laid out in ``allocation`` by moving its parameters in place: it fits, and the
    parameters already viewing ``allocation`` keep their order."""
    storage = _storage(allocation)
    inside = [p.storage_offset() for _, p in _starts(layout) if _storage(p) == storage]
    return layout.numel <= allocation.numel() and inside == sorted(inside)


def place(layout: FlatLayout, allocation: Tensor) -> Tensor:
    """Make ``layout``'s parameters views into ``allocation`` at their positions, zero what no parameter covers (the
    padding) and return the layout's buffer, its first ``layout.numel`` elements. Parameters already in it move there
    (order kept; a parameter may lie beyond the new end, when the layout shrank): the ones moving back first to last,
    then the ones moving forward last to first, so that no move overwrites a parameter that has not moved yet."""
    buffer = allocation[: layout.numel]
    storage = _storage(allocation)
    starts = _starts(layout)
    inside = [
        (int(param.storage_offset()), position, param) for position, param in starts if _storage(param) == storage
    ]
    backward = [move for move in inside if move[1] < move[0]]
    forward = [move for move in reversed(inside) if move[1] > move[0]]
    for source, target, param in backward + forward:
        _move(allocation, source, target, param.numel())
        param.data = view_like(buffer, target, param)
        # a graph recorded before the move (a forward whose backward is pending) saved views of the old memory: its
        # backward now raises torch's "modified by an inplace operation" instead of reading other parameters' values
        torch.autograd.graph.increment_version(param)
    for position, param in starts:
        if _storage(param) != storage:  # its elements are elsewhere (a new parameter, a first layout): copy them
            view = view_like(buffer, position, param)
            view.copy_(param.detach())
            param.data = view  # its old storage is freed here, unless something else holds it
    covered = 0
    for position, param in starts:
        buffer[covered:position].zero_()  # empty where the parameters touch
        covered = max(covered, position + param.numel())
    buffer[covered:].zero_()
    return buffer


def _move(flat: Tensor, source: int, target: int, numel: int, chunk: int = 2**20) -> None:
    """``flat[target:target + numel] = flat[source:source + numel]``, the ranges possibly overlapping: a chunk at a
    time, from the end moving forward and from the start moving back, so that what it holds at once beyond ``flat``
    is one chunk."""
    starts = range(0, numel, chunk)
    for start in reversed(starts) if target > source else starts:
        end = min(numel, start + chunk)
        flat[target + start : target + end].copy_(flat[source + start : source + end].clone())


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
