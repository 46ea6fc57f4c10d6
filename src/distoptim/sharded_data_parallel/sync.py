"""The parameter side of ``ShardedDataParallel``: after the step, each bucket gathered from its owners in forward
order; with ``overlap_param_sync`` a module-global forward pre-hook lands what each module reads, the owners'
checksums catching writes in flight. The window's rules: ``docs/guides/internals.md``."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_pre_hook

from distoptim import _host
from distoptim._flat import copy_each_
from distoptim.comm import collectives as comm
from distoptim.sharded_data_parallel.buckets import BucketPlan
from distoptim.zero.buckets import BucketViewSync, ParameterSync, StagedSync, staged_sync_of
from distoptim.zero.layouts import piece_view
from distoptim.zero.partition import PartitionPlan

__all__ = ["BucketedSync"]


_Storage = tuple[tuple[Any, int], ...]  # each parameter's storage (held: its address is not reused) and data pointer


class _LandBefore:
    """The module-global forward pre-hook while a sync is in flight: land the buckets a module reads."""

    def __init__(self, sync: BucketedSync) -> None:
        self.sync = weakref.ref(sync)  # a sync dropped in flight leaves no hook holding it
        self.hooks: Any = lambda: None  # torch's module-global pre-hooks, read through the handle it returned

    def __call__(self, module: nn.Module, args: Any) -> None:
        sync = self.sync()
        if sync is not None and self.foreign():  # one registered since the step may read anything
            sync.finish()
        elif sync is not None:
            sync.land_through(sync.landing.get(module, -1))

    def foreign(self) -> bool:
        """Whether torch's module-global pre-hooks hold one of the user's (it runs before ours or after it)."""
        hooks = self.hooks()
        return hooks is None or any(not isinstance(hook, _LandBefore) for hook in hooks.values())


class _InPlace:
    """One bucket's sync (``launch``, then ``land``): a region of a bucket-view buffer, gathered where it lies."""

    def __init__(self, buffer: Tensor, bounds: tuple[int, ...], group: comm.Group, collectives: comm.Collectives):
        self.buffer, self.bounds, self.group, self.collectives = buffer, bounds, group, collectives

    def launch(self) -> Any:
        return comm.gather_from_owners(self.buffer, [self.bounds], self.group, self.collectives, wait=False)

    def land(self, launched: Any) -> None:
        comm.wait_all(launched)

    def owned(self, landed: bool) -> list[Tensor]:
        """This rank's elements of the bucket as it sends them, 1-D."""
        rank = comm.group_rank(self.group)
        return [self.buffer[self.bounds[rank] : self.bounds[rank + 1]]]


class _Staged:
    """One bucket's sync: its pieces through a ``StagedSync`` of their own."""

    def __init__(self, sync: StagedSync) -> None:
        self.sync = sync

    def launch(self) -> Any:
        return self.sync.launch_direct(), [self.sync.launch(round_) for round_ in self.sync.rounds]

    def land(self, launched: Any) -> None:
        direct, flights = launched
        for flight in flights:
            self.sync.land(flight)
        comm.wait_all(direct)

    def owned(self, landed: bool) -> list[Tensor]:
        """The small pieces as packed into the stages (packed again once landed), the large ones where they lie."""
        sync, owned = self.sync, list[Tensor]()
        for round_ in sync.rounds:
            work = sync._work(round_)
            if landed:
                copy_each_(work.pack_into, work.pack_from)
            owned.extend(work.stage[start:end] for src, start, end in work.slices if src == sync.rank)
        return owned + [piece_view(piece) for piece in sync.direct if piece.rank == sync.rank]


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
        self.watches_writes = overlap and not self.alone
        forward = list(reversed(buckets))
        self.units = [self._unit(bucket, plan, params) for bucket in forward]
        self.unit_of = {id(params[slot.index]): number for number, b in enumerate(forward) for slot in b.slots}
        self.params_of = [[params[slot.index] for slot in bucket.slots] for bucket in forward]
        self._launched: list[Any] = []  # what each bucket's launch returned, in forward order, until landed
        self._landed = 0  # how many of them (from the first) have landed
        self._sums: list[Tensor | None] = []  # with overlap: each launched bucket's checksum of this rank's elements
        self._changed: list[Tensor] = []  # whether they changed before landing, for each landed bucket
        self._storage: list[_Storage] = []  # with overlap: each launched bucket's parameters' storages, held
        self.landing: dict[nn.Module, int] = {}  # the last bucket (forward order) each module reads: set by the wrapper
        self._hook: weakref.finalize[Any, Any] | None = None  # removes the landing pre-hook: held while in flight

    def _unit(self, bucket: BucketPlan, plan: PartitionPlan, params: Sequence[Tensor]) -> _InPlace | _Staged:
        if isinstance(self.inner, BucketViewSync) and bucket.region is not None:
            layout, region = bucket.region
            bounds = plan.layouts[layout].bounds[region]
            return _InPlace(self.inner.buffers[layout], bounds, self.group, self.collectives)
        chosen = [slot.index for slot in bucket.slots]
        return _Staged(staged_sync_of(plan, params, chosen, self.group, self.collectives))

    def last_unit(self, params: Iterable[Tensor]) -> int:
        """The last bucket, in forward order, holding any of ``params`` (-1: none)."""
        return max((self.unit_of[id(param)] for param in params if id(param) in self.unit_of), default=-1)

    def sync_parameters(self) -> None:
        self.finish()
        self._launched, self._landed = [unit.launch() for unit in self.units], 0
        if not self.overlap or self.alone:
            self.finish()
            return
        self._sums = [_checksum(unit.owned(landed=False)) for unit in self.units]
        self._storage = [_where(params) for params in self.params_of]
        lander = _LandBefore(self)
        handle = register_module_forward_pre_hook(lander)
        self._hook = weakref.finalize(self, handle.remove)  # removed when all landed, or when the sync is dropped
        lander.hooks = handle.hooks_dict_ref  # read through the handle torch returned (public), never reordered
        if lander.foreign():
            self.finish()  # a module-global pre-hook of the user's runs before ours and may read any parameter

    def land_through(self, last: int) -> None:
        """Land the buckets up to ``last`` (in forward order): local waiting and copying only."""
        while self._landed <= last and self._landed < len(self._launched):
            unit, before = self.units[self._landed], self._sums[self._landed] if self._sums else None
            if self._storage and not _same_storage(self._storage[self._landed], self.params_of[self._landed]):
                raise RuntimeError(  # every rank runs the same program: each sees the new storage, and raises
                    "ShardedDataParallel(overlap_param_sync=True): parameters were given new storage "
                    "(module.to(), param.data = ...) while their sync from the last step was still in flight: "
                    "the sync would land in the old storage and the ranks that do not own those elements would "
                    "keep the values before the step. Call model.sync_finished() before converting or replacing "
                    "parameters outside the forward, or build the wrapper with overlap_param_sync=False"
                )
            unit.land(self._launched[self._landed])
            if self.overlap:  # a read saved for the backward before landing fails on every rank (docstring)
                torch.autograd.graph.increment_version(self.params_of[self._landed])
            if before is not None:
                now = _checksum(unit.owned(landed=True))
                self._changed.append(before.new_ones((), dtype=torch.bool) if now is None else (now != before).any())
            self._launched[self._landed] = None
            if self._storage:
                self._storage[self._landed] = ()  # held until landed only
            self._landed += 1
        hook = self._hook
        if hook is not None and self._landed >= len(self._launched):
            self._hook = None
            hook()

    def in_flight(self, unit: int) -> bool:
        """Whether bucket ``unit``'s sync has been launched and not landed."""
        return self._landed <= unit < len(self._launched)

    def finish(self) -> None:
        self.land_through(len(self.units))

    def check_untouched(self) -> None:
        """Raise if this rank's elements of a bucket changed between launch and landing (inside an agreement)."""
        written, self._changed = self._written(), []
        if written:
            raise RuntimeError(_WRITTEN)

    def check_untouched_here(self) -> None:
        """Raise here if this rank saw such a write (``sync_finished()``, local; the next agreement raises it too)."""
        if self._written():
            raise RuntimeError(
                f"{_WRITTEN} (seen on rank {comm.group_rank(self.group)}, which owns some of the written elements; "
                "the next step, consolidate_state_dict() or sharded save raises it on every rank)"
            )

    def _written(self) -> bool:
        changed = self._changed
        if not changed:
            return False
        flags = torch.stack([flag.to(changed[0].device) for flag in changed])
        return bool(_host.read(flags.any(), "writes to parameters while their sync was in flight"))

    def allocations(self) -> dict[Any, Tensor]:
        return self.inner.allocations()


_WRITTEN = (
    "ShardedDataParallel(overlap_param_sync=True): parameters were written while their sync from the last step was "
    "still in flight (through model.module or a module reference, such as WGAN's p.data.clamp_ right after "
    "zero.step()); the sync overwrote the write on the ranks that do not own those elements, so the ranks' "
    "parameters differ. Call model.sync_finished() before writing parameters outside the forward "
    "(model.parameters() waits for it too), or build the wrapper with overlap_param_sync=False"
)


def _where(params: Sequence[Tensor]) -> _Storage:
    """``params``' storages (held: a freed address may be reused on some ranks only) and data pointers, undispatched."""
    with torch._C.DisableTorchFunction():
        return tuple((p.untyped_storage(), p.data_ptr()) for p in params)


def _same_storage(launched: _Storage, params: Sequence[Tensor]) -> bool:
    """Whether ``params`` still lie where they lay at launch."""
    return all(a is b and a_ptr == b_ptr for (a, a_ptr), (b, b_ptr) in zip(launched, _where(params), strict=True))


_WORDS = ((8, torch.int64), (4, torch.int32))  # summed in their own width (a wide accumulator is 10x slower)


def _checksum(tensors: Sequence[Tensor]) -> Tensor | None:
    """The sums of ``tensors``' raw bits in the widest words they allow, one per tensor (None without elements)."""
    sums = [_bit_sum(t) for t in tensors if t.numel()]
    return torch.stack(sums) if sums else None


def _bit_sum(tensor: Tensor) -> Tensor:
    size = tensor.element_size()
    for width, dtype in _WORDS:
        if (tensor.numel() * size) % width == 0 and (tensor.storage_offset() * size) % width == 0:
            return tensor.view(dtype).sum(dtype=dtype)
    return tensor.view(torch.int16 if size == 2 else torch.uint8).sum(dtype=torch.int64)
