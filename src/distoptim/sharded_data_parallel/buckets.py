"""Which gradients share a bucket, where each sits in it, and who owns which range: arithmetic over a partition plan
(even: a bucket per region; greedy: consecutive parameters up to the cap). ``docs/guides/internals.md`` has more."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import cast

import torch

from distoptim.zero.partition import PartitionPlan

__all__ = ["BucketCaps", "BucketPlan", "Slot", "StorePlan", "gaps", "narrowed", "plan_buckets", "store_plan"]

Route = tuple[tuple[int, int, int], ...]  # (owner, start, end) in the bucket, neighbours of one owner merged


class BucketCaps(dict[Hashable, int]):
    """The most elements a bucket of each layout key ``(device, dtype)`` holds: ``cap_bytes`` of the reduce dtype,
    filled in for any key when first asked (``get`` too)."""

    def __init__(self, cap_bytes: int, reduce_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.cap_bytes, self.reduce_dtype = cap_bytes, reduce_dtype

    def __missing__(self, key: Hashable) -> int:
        _, dtype = cast(tuple[torch.device, torch.dtype], key)
        self[key] = cap = max(1, self.cap_bytes // (self.reduce_dtype or dtype).itemsize)
        return cap

    def get(self, key: Hashable, default: object = None) -> int:
        return self[key]

    def __bool__(self) -> bool:  # a cap for every key, asked for or not yet (``region_numel or {}`` must keep it)
        return True


@dataclass(frozen=True)
class Slot:
    """Parameter ``index`` (global) at ``position`` of its bucket, ``numel`` elements in its memory order."""

    index: int
    position: int
    numel: int


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: its parameters (in position order), its length, who owns which range, and ``(layout, region)``
    for an even one."""

    key: Hashable
    slots: tuple[Slot, ...]
    numel: int
    route: Route
    region: tuple[int, int] | None

    def owned(self, rank: int) -> list[tuple[int, int]]:
        """The ranges of this bucket that ``rank`` owns."""
        return [(start, end) for owner, start, end in self.route if owner == rank]

    def owned_by_rank(self, size: int) -> list[list[tuple[int, int]]]:
        """``[self.owned(rank) for rank in range(size)]``, in one pass over the route (the planner's thousands)."""
        ranges: list[list[tuple[int, int]]] = [[] for _ in range(size)]
        for owner, start, end in self.route:
            if 0 <= owner < size:
                ranges[owner].append((start, end))
        return ranges


def plan_buckets(
    plan: PartitionPlan, cap: Mapping[Hashable, int], previous: Sequence[BucketPlan] = ()
) -> list[BucketPlan]:
    """``plan``'s placed parameters' buckets in reduction order: ``previous``, then new ones, last parameters first."""
    bucketed = {slot.index for bucket in previous for slot in bucket.slots}
    new = _region_buckets(plan, bucketed) if plan.mode == "even" else _greedy_buckets(plan, cap, bucketed)
    new.sort(key=lambda bucket: -max(slot.index for slot in bucket.slots))
    return [*previous, *new]


def _region_buckets(plan: PartitionPlan, bucketed: set[int]) -> list[BucketPlan]:
    buckets = []
    for layout_number, layout in enumerate(plan.layouts):
        members = sorted(zip(layout.positions, layout.params))
        for region_number, bounds in enumerate(layout.bounds):
            start, end = bounds[0], bounds[-1]
            slots = tuple(
                Slot(index, position - start, plan.numels[index])
                for position, index in members
                if start <= position < end and index not in bucketed
            )
            if slots:
                route = tuple((rank, a - start, b - start) for rank, (a, b) in enumerate(pairwise(bounds)) if b > a)
                buckets.append(BucketPlan(layout.key, slots, end - start, route, (layout_number, region_number)))
    return buckets


def _greedy_buckets(plan: PartitionPlan, cap: Mapping[Hashable, int], bucketed: set[int]) -> list[BucketPlan]:
    """Consecutive parameters of a key, walking from the last, cut at ``cap`` elements (a larger one alone)."""
    runs: dict[Hashable, list[list[int]]] = {}
    filled: dict[Hashable, int] = {}
    for index in reversed(range(len(plan.numels))):
        if index in bucketed or not plan.fragments[index] or plan.numels[index] == 0:
            continue
        key, numel = plan.keys[index], plan.numels[index]
        open_runs = runs.setdefault(key, [])
        if not open_runs or filled[key] + numel > cap[key]:
            open_runs.append([])
            filled[key] = 0
        open_runs[-1].append(index)
        filled[key] += numel
    buckets = []
    for key, key_runs in runs.items():
        for run in key_runs:
            slots, pieces, position = [], [], 0
            for index in sorted(run):
                slots.append(Slot(index, position, plan.numels[index]))
                pieces += [(f.rank, position + f.offset, position + f.offset + f.length) for f in plan.fragments[index]]
                position += plan.numels[index]
            buckets.append(BucketPlan(key, tuple(slots), position, _merged(pieces), None))
    return buckets


def _merged(pieces: list[tuple[int, int, int]]) -> Route:
    merged: list[tuple[int, int, int]] = []
    for rank, start, end in sorted(pieces, key=lambda piece: piece[1]):
        if merged and merged[-1][0] == rank and merged[-1][2] == start:
            merged[-1] = (rank, merged[-1][1], end)
        else:
            merged.append((rank, start, end))
    return tuple(merged)


def gaps(plan: BucketPlan, filled: set[int]) -> list[tuple[int, int]]:
    """The ranges of ``plan``'s bucket that no gradient of ``filled`` (parameter indices) covers: padding, and
    parameters a backward did not reach (zeroed there rather than the whole buffer first)."""
    ranges, at = [], 0
    for slot in plan.slots:  # in position order
        if slot.index in filled:
            if slot.position > at:
                ranges.append((at, slot.position))
            at = slot.position + slot.numel
    return [*ranges, (at, plan.numel)] if at < plan.numel else ranges


@dataclass(frozen=True)
class StorePlan:
    """A rank's owned gradient: ``lengths[b]`` elements of bucket ``b``; (index, offset) -> (bucket, start, length),
    and each parameter's such pieces (``pieces[index]``)."""

    lengths: tuple[int, ...]
    fragments: Mapping[tuple[int, int], tuple[int, int, int]]
    pieces: Mapping[int, list[tuple[int, int, int]]]


def store_plan(buckets: Sequence[BucketPlan], rank: int, plan: PartitionPlan) -> StorePlan:
    """Lay out ``rank``'s owned ranges of each of ``buckets`` one after another."""
    lengths = []
    fragments: dict[tuple[int, int], tuple[int, int, int]] = {}
    pieces: dict[int, list[tuple[int, int, int]]] = {}
    for number, bucket in enumerate(buckets):
        owned = bucket.owned(rank)
        for slot in bucket.slots:
            for fragment in plan.fragments[slot.index]:
                if fragment.rank == rank and fragment.length:
                    at = _owned_offset(owned, slot.position + fragment.offset)
                    fragments[(slot.index, fragment.offset)] = (number, at, fragment.length)
                    pieces.setdefault(slot.index, []).append((number, at, fragment.length))
        lengths.append(sum(end - start for start, end in owned))
    return StorePlan(tuple(lengths), fragments, pieces)


def _owned_offset(owned: list[tuple[int, int]], element: int) -> int:
    """How far ``element`` (an owned element of a bucket) lies into the bucket's owned part."""
    skipped = 0
    for start, end in owned:
        if start <= element < end:
            return skipped + element - start
        skipped += end - start
    raise ValueError(f"element {element} is not in the owned ranges {owned}")


def narrowed(
    buckets: Sequence[BucketPlan],
    params: Sequence[torch.Tensor],
    stores: Mapping[Hashable, tuple[torch.device, torch.dtype]],
    master: torch.dtype | None,
) -> bool:
    """Whether the step reads some bucket's store (``stores``: by bucket key) cast to a narrower dtype (an fp32 store
    of fp16 parameters without an fp32 master copy): a finite sum there may become an inf only then."""
    for bucket in buckets:
        stepped = [torch.finfo(params[bucket.slots[0].index].dtype).max, torch.finfo(master).max if master else 0.0]
        if torch.finfo(stores[bucket.key][1]).max > max(stepped):
            return True
    return False
