"""The parameter side of ``ShardedDataParallel``: after the local step, each bucket's parameters are gathered from
their owners on their own, in the order the forward reads them (the reverse of the gradients'), so that with
``overlap_param_sync`` the next forward starts while later buckets are still in flight: each module's forward
pre-hook lands only what it reads (and what comes before it), as Megatron-Core's ``overlap_param_gather`` does.

A bucket that is one region of an even layout with bucket views is gathered in place (one all-gather in the chunked
style, a broadcast per owner in the rooted one). Any other bucket is gathered through a staging buffer laid out
as its gradient bucket, made when it is launched and dropped when it lands: at most ``MAX_STAGED`` of them are in
flight (the next is launched as one lands, in the same order on every rank), so the sync never holds more than two
buckets of parameters besides the parameters themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from distoptim._flat import copy_each_, flat_view
from distoptim.sharded.buckets import BucketPlan
from distoptim.zero import comm
from distoptim.zero.buckets import BucketViewSync, ParameterSync
from distoptim.zero.partition import PartitionPlan

__all__ = ["MAX_STAGED", "BucketedSync"]

MAX_STAGED = 2


class _Unit:
    """One bucket's sync: ``launch`` starts it, ``land`` finishes it."""

    def launch(self) -> Any:
        raise NotImplementedError

    def land(self, launched: Any) -> None:
        raise NotImplementedError


class _InPlace(_Unit):
    """A region of a bucket-view buffer, gathered from its owners where it lies."""

    def __init__(self, buffer: Tensor, bounds: tuple[int, ...], group: comm.Group, collectives: comm.Collectives):
        self.buffer, self.bounds, self.group, self.collectives = buffer, bounds, group, collectives

    def launch(self) -> Any:
        return comm.gather_from_owners(self.buffer, [self.bounds], self.group, self.collectives, wait=False)

    def land(self, launched: Any) -> None:
        comm.wait_all(launched)


class _Staged(_Unit):
    """A bucket gathered through a staging buffer laid out as its gradient bucket (this rank's owned pieces copied
    in, everything gathered, the others' pieces copied out), made at launch and dropped when landed."""

    def __init__(
        self, bucket: BucketPlan, plan: PartitionPlan, params: Sequence[Tensor], rank: int, sync: ParameterSync
    ) -> None:
        self.bucket, self.group, self.collectives = bucket, sync.group, sync.collectives
        first = params[bucket.slots[0].index]
        self.dtype, self.device = first.dtype, first.device
        self.bounds: tuple[int, ...] | None = None  # an even region's: equal shares, rank by rank
        if bucket.region is not None:
            region = plan.layouts[bucket.region[0]].bounds[bucket.region[1]]
            self.bounds = tuple(bound - region[0] for bound in region)
        self.mine: list[tuple[int, int, Tensor]] = []  # (start, length, the parameter's elements) owned here
        self.theirs: list[tuple[int, int, Tensor]] = []
        for slot in bucket.slots:
            param = params[slot.index]
            for fragment in plan.fragments[slot.index]:
                if fragment.length:
                    piece = flat_view(param)[fragment.offset : fragment.offset + fragment.length]
                    place = (slot.position + fragment.offset, fragment.length, piece)
                    (self.mine if fragment.rank == rank else self.theirs).append(place)

    def launch(self) -> Any:
        stage = torch.empty(self.bucket.numel, dtype=self.dtype, device=self.device)
        copy_each_([stage[at : at + n] for at, n, _ in self.mine], [piece for _, _, piece in self.mine])
        if self.bounds is not None:
            works = comm.gather_from_owners(stage, [self.bounds], self.group, self.collectives, wait=False)
        else:
            works = comm.broadcast_slices(stage, self.bucket.route, self.group, wait=False)
        return stage, works

    def land(self, launched: Any) -> None:
        stage, works = launched
        comm.wait_all(works)
        copy_each_([piece for _, _, piece in self.theirs], [stage[at : at + n] for at, n, _ in self.theirs])


class BucketedSync(ParameterSync):
    """ZeRO's parameter sync bucket by bucket, in forward order; with ``overlap``, ``sync_parameters`` only launches
    and ``land_for`` (each module's forward pre-hook) or ``finish`` lands."""

    def __init__(
        self,
        inner: ParameterSync,
        buckets: Sequence[BucketPlan],
        plan: PartitionPlan,
        params: Sequence[Tensor],
        overlap: bool,
    ) -> None:
        super().__init__(inner.layouts, inner.group, inner.collectives)
        self.inner, self.overlap = inner, overlap
        forward = list(reversed(buckets))
        self.units = [self._unit(bucket, plan, params) for bucket in forward]
        self.unit_of = {id(params[slot.index]): number for number, b in enumerate(forward) for slot in b.slots}
        self._launched: dict[int, Any] = {}
        self._next = len(self.units)  # the next bucket to launch (none before the first sync)

    def _unit(self, bucket: BucketPlan, plan: PartitionPlan, params: Sequence[Tensor]) -> _Unit:
        if isinstance(self.inner, BucketViewSync) and bucket.region is not None:
            layout, region = bucket.region
            return _InPlace(
                self.inner.buffers[layout], plan.layouts[layout].bounds[region], self.group, self.collectives
            )
        return _Staged(bucket, plan, params, comm.group_rank(self.group), self)

    def sync_parameters(self) -> None:
        self.finish()
        self._next = 0
        self._launch_more()
        if not self.overlap:
            self.finish()

    def _launch_more(self) -> None:
        """Launch, in order, every bucket up to ``MAX_STAGED`` staged ones in flight (in-place ones do not count)."""
        while self._next < len(self.units):
            staged = sum(isinstance(self.units[n], _Staged) for n in self._launched)
            if isinstance(self.units[self._next], _Staged) and staged >= MAX_STAGED:
                return
            self._launched[self._next] = self.units[self._next].launch()
            self._next += 1

    def land_for(self, params: Iterable[Tensor]) -> None:
        """Land the buckets holding ``params`` and every bucket before them (in forward order)."""
        needed = [self.unit_of[id(param)] for param in params if id(param) in self.unit_of]
        if needed and (self._launched or self._next < len(self.units)):
            self._land_through(max(needed))

    def _land_through(self, last: int) -> None:
        while self._launched and min(self._launched) <= last:
            number = min(self._launched)
            self.units[number].land(self._launched.pop(number))
            self._launch_more()

    def finish(self) -> None:
        self._land_through(len(self.units))

    def release(self) -> None:
        self.finish()
        self.inner.release()
