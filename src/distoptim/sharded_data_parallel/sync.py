"""The parameter side of ``ShardedDataParallel``: after the local step, each bucket's parameters are gathered from
their owners on their own, in the order the forward reads them (the reverse of the gradients'), so that with
``overlap_param_sync`` the next forward starts while later buckets are still in flight: each module's forward
pre-hook lands what its parameters need (and every bucket before), as Megatron-Core's ``overlap_param_gather`` does.

Every bucket's sync is launched by ``step()`` itself, on every rank in the same order; landing one afterwards only
waits and copies, locally. So whatever runs on some ranks only between two steps (a branch, an evaluation, a
``state_dict()`` on rank 0) cannot put the ranks' collectives out of order.

A bucket that is one region of an even layout with bucket views is gathered in place (one all-gather in the chunked
style, each owner sending its share to every rank in the point-to-point one). Any other bucket goes through a
``StagedSync`` of its own pieces: large pieces sent in place, small ones (under ``buckets.DEFAULT_DIRECT_BYTES``)
packed through staging kept between steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor

from distoptim.comm import collectives as comm
from distoptim.sharded_data_parallel.buckets import BucketPlan
from distoptim.zero.buckets import BucketViewSync, ParameterSync, StagedSync
from distoptim.zero.layouts import layouts_from_plan
from distoptim.zero.partition import PartitionPlan

__all__ = ["BucketedSync"]


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
    """A bucket's pieces through a ``StagedSync`` of their own."""

    def __init__(self, sync: StagedSync) -> None:
        self.sync = sync

    def launch(self) -> Any:
        return self.sync.launch_direct(), [self.sync.launch(round_) for round_ in self.sync.rounds]

    def land(self, launched: Any) -> None:
        direct, flights = launched
        for flight in flights:
            self.sync.land(flight)
        comm.wait_all(direct)


class BucketedSync(ParameterSync):
    """ZeRO's parameter sync bucket by bucket, in forward order; with ``overlap``, ``sync_parameters`` only launches
    and ``land_through`` (the forward pre-hooks) or ``finish`` lands."""

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
        self._launched: list[Any] = []  # what each bucket's launch returned, in forward order, until landed
        self._landed = 0  # how many of them (from the first) have landed

    def _unit(self, bucket: BucketPlan, plan: PartitionPlan, params: Sequence[Tensor]) -> _Unit:
        if isinstance(self.inner, BucketViewSync) and bucket.region is not None:
            layout, region = bucket.region
            return _InPlace(
                self.inner.buffers[layout], plan.layouts[layout].bounds[region], self.group, self.collectives
            )
        inside = {slot.index for slot in bucket.slots}
        fragments = [pieces if index in inside else () for index, pieces in enumerate(plan.fragments)]
        stage_bytes = sum(params[slot.index].numel() * params[slot.index].element_size() for slot in bucket.slots)
        layouts = [layout for layout in layouts_from_plan(plan.layouts, fragments, params) if layout.pieces]
        return _Staged(StagedSync(layouts, self.group, self.collectives, stage_bytes=max(1, stage_bytes)))

    def last_unit(self, params: Iterable[Tensor]) -> int:
        """The last bucket, in forward order, holding any of ``params`` (-1: none)."""
        return max((self.unit_of[id(param)] for param in params if id(param) in self.unit_of), default=-1)

    def sync_parameters(self) -> None:
        self.finish()
        self._launched, self._landed = [unit.launch() for unit in self.units], 0
        if not self.overlap:
            self.finish()

    def land_through(self, last: int) -> None:
        """Land the buckets up to ``last`` (in forward order): local waiting and copying only."""
        while self._landed <= last and self._landed < len(self._launched):
            self.units[self._landed].land(self._launched[self._landed])
            self._launched[self._landed] = None
            self._landed += 1

    def in_flight(self, unit: int) -> bool:
        """Whether bucket ``unit``'s sync has been launched and not landed."""
        return self._landed <= unit < len(self._launched)

    def finish(self) -> None:
        self.land_through(len(self.units))

    def allocations(self) -> dict[Any, Tensor]:
        return self.inner.allocations()
