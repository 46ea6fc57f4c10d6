"""A range of a dense tensor's elements in memory order as boxes of its logical (row-major) index space: memory
order is row-major over the dimensions sorted by stride, so the range is at most ``2 * ndim - 1`` boxes of that
permuted space, each a box of the logical one. Pure arithmetic; ``docs/guides/internals.md``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Box", "memory_range_boxes"]


@dataclass(frozen=True)
class Box:
    """Logical ``offsets`` and ``sizes`` of a box; ``start``: its first element's place in the range it was cut from."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int


def memory_range_boxes(
    shape: Sequence[int], strides: Sequence[int], offset: int, length: int, limit: int | None = None
) -> list[Box]:
    """The boxes that elements ``[offset, offset + length)`` in memory order of a dense tensor of ``shape`` and
    ``strides`` make up, in memory order (empty for an empty range), each of at most ``limit`` elements if given."""
    order = sorted(range(len(shape)), key=lambda d: (shape[d] > 1, -strides[d], d))  # outermost first
    permuted = [shape[d] for d in order]
    axis_of = [order.index(d) for d in range(len(shape))]  # each logical dimension's axis in the permuted space
    boxes = []
    whole = _row_major_boxes(offset, offset + length, permuted)
    for offsets, sizes in whole if limit is None else [cut for box in whole for cut in _cut(*box, max(1, limit))]:
        start = sum(o * math.prod(permuted[axis + 1 :]) for axis, o in enumerate(offsets)) - offset
        boxes.append(Box(tuple(offsets[a] for a in axis_of), tuple(sizes[a] for a in axis_of), start))
    return boxes


def _row_major_boxes(start: int, stop: int, shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Row-major ``[start, stop)`` of ``shape`` as ``(offsets, sizes)``: partial first row, whole rows, partial last."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = -(-start // inner), stop // inner  # the whole rows are [first, last)
    boxes = []
    if start < first * inner:  # the partial row before them (the only row where start and stop share one)
        boxes += _in_row(first - 1, start - (first - 1) * inner, min(stop - (first - 1) * inner, inner), shape)
    if first < last:
        boxes.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    if first <= last and last * inner < stop:
        boxes += _in_row(last, 0, stop - last * inner, shape)
    return boxes


def _cut(offsets: tuple[int, ...], sizes: tuple[int, ...], limit: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A box cut along its outermost axis longer than 1 into boxes of at most ``limit`` elements (recursively)."""
    if math.prod(sizes) <= limit:
        return [(offsets, sizes)]
    axis = next(a for a, size in enumerate(sizes) if size > 1)
    per_cut = max(1, limit // math.prod(sizes[axis + 1 :]))
    cuts = []
    for begin in range(0, sizes[axis], per_cut):
        at = (*offsets[:axis], offsets[axis] + begin, *offsets[axis + 1 :])
        cut = (*sizes[:axis], min(per_cut, sizes[axis] - begin), *sizes[axis + 1 :])
        cuts += _cut(at, cut, limit)
    return cuts


def _in_row(row: int, start: int, stop: int, shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [((row, *offsets), (1, *sizes)) for offsets, sizes in _row_major_boxes(start, stop, shape[1:])]
