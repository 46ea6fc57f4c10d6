"""Which rank owns which elements of which parameter: pure arithmetic, no process group, no tensors. Each rank owns
ranges of one flat buffer per layout key ((device, dtype)), a parameter's share of a range being a ``Fragment``:
``greedy`` (torch's) places whole parameters, ``even`` cuts equal ranges (``docs/guides/internals.md``)."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "MODES",
    "SPLIT",
    "UNOWNED",
    "Fragment",
    "LayoutPlan",
    "PartitionPlan",
    "newton_schulz_cost",
    "partition_parameters",
]

UNOWNED = -1
SPLIT = -2  # ``owners`` of a parameter split between ranks (even mode)
MODES = ("greedy", "even")


@dataclass(frozen=True)
class Fragment:
    """``length`` elements of a parameter from ``offset``, owned by ``rank``, at ``position`` of its layout's buffer."""

    rank: int
    offset: int
    length: int
    position: int


@dataclass(frozen=True)
class LayoutPlan:
    """The flat buffer of one layout key: parameters in buffer order, where each starts, and who owns which range
    (``bounds``: per region, ``world_size + 1`` boundaries; rank ``r`` owns ``[b[r], b[r+1])``)."""

    key: Hashable
    params: tuple[int, ...]
    positions: tuple[int, ...]
    bounds: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        """Length of the flat buffer, padding included."""
        return self.bounds[-1][-1] if self.bounds else 0

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """The ``(start, end)`` ranges of the flat buffer that ``rank`` owns, one per region."""
        return [(bounds[rank], bounds[rank + 1]) for bounds in self.bounds]


@dataclass(frozen=True)
class PartitionPlan:
    """Fragments of every parameter (global index order) and the layouts they sit in."""

    world_size: int
    mode: str
    numels: tuple[int, ...]
    keys: tuple[Hashable, ...]
    fragments: tuple[tuple[Fragment, ...], ...]
    layouts: tuple[LayoutPlan, ...]
    owners: tuple[int, ...]
    """The rank holding each parameter whole; ``UNOWNED`` for frozen (or, even mode, zero-sized) ones, ``SPLIT``
    for one split between ranks."""

    def params_of(self, rank: int) -> list[int]:
        """Global indices of the parameters ``rank`` holds a fragment of, in global order."""
        return [index for index, pieces in enumerate(self.fragments) if any(f.rank == rank for f in pieces)]

    def loads(self) -> list[int]:
        """Elements owned by each rank (padding excluded)."""
        loads = [0] * self.world_size
        for pieces in self.fragments:
            for fragment in pieces:
                loads[fragment.rank] += fragment.length
        return loads


def partition_parameters(
    numels: Sequence[int],
    trainable: Sequence[bool],
    world_size: int,
    previous: PartitionPlan | None = None,
    *,
    mode: str = "greedy",
    keys: Sequence[Hashable] | None = None,
    region_numel: Mapping[Hashable, int] | None = None,
    whole: Sequence[bool] | None = None,
    costs: Sequence[int] | None = None,
    align: Sequence[int] | None = None,
) -> PartitionPlan:
    """Place every trainable parameter: whole on one rank (``greedy``) or cut evenly across ranks (``even``), what
    ``previous`` (a prefix's plan) placed staying; ``keys``, ``region_numel``, ``whole`` and ``costs``: see
    ``docs/guides/internals.md``. ``align`` (even): each parameter's block, which no range boundary cuts."""
    keys = tuple(keys) if keys is not None else (0,) * len(numels)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if mode not in MODES:
        raise ValueError(f"partition must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    whole = tuple(whole) if whole is not None else (False,) * len(numels)
    costs = tuple(costs) if costs is not None else tuple(numels)
    align = tuple(align) if align is not None else (1,) * len(numels)
    if not len(numels) == len(trainable) == len(keys) == len(whole) == len(costs) == len(align):
        raise ValueError(
            f"got {len(numels)} element counts, {len(trainable)} trainable flags, {len(keys)} keys, {len(whole)} "
            f"whole flags, {len(costs)} costs and {len(align)} alignments"
        )
    owners, placed = [UNOWNED] * len(numels), set[int]()
    if previous is not None:
        count = len(previous.numels)
        prefix = (world_size, mode, tuple(numels[:count]), keys[:count])
        if prefix != (previous.world_size, previous.mode, previous.numels, previous.keys):
            raise ValueError("previous plan does not describe a prefix of these parameters at this world size and mode")
        owners[:count] = previous.owners
        placed = {i for i, pieces in enumerate(previous.fragments) if pieces or owners[i] != UNOWNED}
    new = [index for index in range(len(numels)) if trainable[index] and index not in placed]
    _greedy_owners(owners, costs, new, whole, world_size)
    if mode == "greedy":  # every placed parameter has an owner
        _greedy_owners(owners, numels, new, [not kept for kept in whole], world_size)
        distinct = dict.fromkeys(key for key, owner in zip(keys, owners) if owner != UNOWNED)
        members = {key: [i for i in range(len(numels)) if keys[i] == key and owners[i] != UNOWNED] for key in distinct}
        layouts = [LayoutPlan(key, *_by_owner(members[key], numels, owners, world_size, 0)) for key in distinct]
    else:
        grown = _grown_even_layouts(numels, keys, new, world_size, previous, region_numel or {}, whole, owners)
        layouts = [_aligned(layout, numels, align, previous) for layout in grown]
    fragments: list[tuple[Fragment, ...]] = [()] * len(numels)
    for layout in layouts:
        for index, position in zip(layout.params, layout.positions):
            fragments[index] = _fragments(layout, numels[index], position, owners[index] if mode == "greedy" else None)
    if mode == "even":
        owners = [_single_owner(pieces) for pieces in fragments]
    return PartitionPlan(world_size, mode, tuple(numels), keys, tuple(fragments), tuple(layouts), tuple(owners))


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """What orthogonalizing an ``m x n`` matrix costs, up to a constant (the element count for any other shape)."""
    if len(shape) == 2:
        return shape[0] * shape[1] * min(shape[0], shape[1])
    return math.prod(shape)


def _single_owner(pieces: Sequence[Fragment]) -> int:
    ranks = {fragment.rank for fragment in pieces}
    return UNOWNED if not ranks else ranks.pop() if len(ranks) == 1 else SPLIT


def _greedy_owners(
    owners: list[int], weights: Sequence[int], new: Sequence[int], among: Sequence[bool], world_size: int
) -> None:
    """Fill in ``owners`` of the ``new`` parameters ``among`` selects: the heaviest to the least-loaded rank first."""
    loads = [0] * world_size
    for index, owner in enumerate(owners):
        if among[index] and owner >= 0:
            loads[owner] += weights[index]
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    for index in sorted((i for i in new if among[i]), key=lambda i: (-weights[i], i)):
        load, rank = heap[0]
        owners[index] = rank
        heapq.heapreplace(heap, (load + weights[index], rank))


def _by_owner(
    members: Sequence[int], numels: Sequence[int], owners: Sequence[int], world_size: int, start: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...]]]:
    """Whole parameters laid out from ``start``, rank 0's first, then rank 1's...: every rank's range is one
    contiguous stretch. The layout's parameters, their positions, and the region's bounds."""
    params, positions, bounds, position = [], [], [start], start
    for rank, index in sorted((owners[i], i) for i in members):
        while len(bounds) <= rank:
            bounds.append(position)
        params.append(index)
        positions.append(position)
        position += numels[index]
    bounds += [position] * (world_size + 1 - len(bounds))
    return tuple(params), tuple(positions), (tuple(bounds),)


def _grown_even_layouts(
    numels: Sequence[int],
    keys: Sequence[Hashable],
    new: Sequence[int],
    world_size: int,
    previous: PartitionPlan | None,
    region_numel: Mapping[Hashable, int],
    whole: Sequence[bool],
    owners: Sequence[int],
) -> list[LayoutPlan]:
    """Previous layouts as they were, the new parameters of each key appended in regions of their own."""
    layouts = {layout.key: layout for layout in (previous.layouts if previous is not None else ())}
    for key in dict.fromkeys(keys[index] for index in new):
        members = [index for index in new if keys[index] == key and numels[index] > 0 and not whole[index]]
        kept = [i for i in new if keys[i] == key and numels[i] > 0 and whole[i]]
        if not members and not kept:
            continue
        layout = layouts.get(key, LayoutPlan(key, (), (), ()))
        cap = region_numel.get(key)
        regions = [(run, True) for run in _regions(kept, numels, cap)]
        regions += [(run, False) for run in _regions(members, numels, cap)]
        for region, of_whole in regions:
            start = layout.numel
            if of_whole:  # whole parameters by owner, each owner's range theirs
                params, positions, bounds = _by_owner(region, numels, owners, world_size, start)
            else:
                chunk = -(-sum(numels[i] for i in region) // world_size)  # ceil: the last rank's range is padded
                params, bounds = region, (tuple(start + rank * chunk for rank in range(world_size + 1)),)
                positions = tuple(itertools.accumulate((numels[i] for i in region[:-1]), initial=start))
            layout = LayoutPlan(key, layout.params + params, layout.positions + positions, layout.bounds + bounds)
        layouts[key] = layout
    return list(layouts.values())


def _aligned(
    layout: LayoutPlan, numels: Sequence[int], align: Sequence[int], previous: PartitionPlan | None
) -> LayoutPlan:
    """``layout`` with each new region's inner boundaries moved down to a block boundary of the parameter they cut."""
    if all(block == 1 for block in align):
        return layout
    kept = {old.key: len(old.bounds) for old in previous.layouts} if previous is not None else {}
    starts = sorted(zip(layout.positions, layout.params))
    bounds = list(layout.bounds[: kept.get(layout.key, 0)])
    for region in layout.bounds[len(bounds) :]:
        moved = [region[0]]
        for bound in region[1:-1]:
            at = bisect.bisect_right(starts, (bound, len(numels))) - 1
            if at >= 0:
                position, index = starts[at]
                if position < bound < position + numels[index]:
                    bound = position + (bound - position) // align[index] * align[index]
            moved.append(max(bound, moved[-1]))
        bounds.append((*moved, region[-1]))
    return LayoutPlan(layout.key, layout.params, layout.positions, tuple(bounds))


def _regions(members: Sequence[int], numels: Sequence[int], cap: int | None) -> list[tuple[int, ...]]:
    """``members`` (in order) cut into runs of at most ``cap`` elements, from the last one; none of no members."""
    if cap is None:
        return [tuple(members)] if members else []
    runs: list[list[int]] = []
    filled = 0
    for index in reversed(members):
        if not runs or filled + numels[index] > cap:
            runs.append([])
            filled = 0
        runs[-1].append(index)
        filled += numels[index]
    return [tuple(reversed(run)) for run in reversed(runs)]


def _fragments(layout: LayoutPlan, numel: int, position: int, owner: int | None) -> tuple[Fragment, ...]:
    """The pieces of ``[position, position + numel)`` that fall into each rank's ranges of ``layout``."""
    if owner is not None:  # greedy: the parameter is whole on its owner (zero-sized ones too)
        return (Fragment(owner, 0, numel, position),)
    pieces = []
    region = layout.bounds[bisect.bisect_right([bounds[0] for bounds in layout.bounds], position) - 1]
    first = bisect.bisect_right(region, position) - 1  # the rank whose range holds the parameter's first element
    for rank in range(first, len(region) - 1):
        start, end = max(region[rank], position), min(region[rank + 1], position + numel)
        if region[rank] >= position + numel:
            break
        if start < end:  # an aligned cut may leave a rank's range empty (``_aligned``)
            pieces.append(Fragment(rank, start - position, end - start, start))
    return tuple(pieces)
