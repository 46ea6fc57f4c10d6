"""The two ways to sync the flat per-(device, dtype) layouts of the owned elements, worked out at construction:
``BucketViewSync`` and ``StagedSync`` (``docs/guides/internals.md``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from distoptim._flat import copy_each_, flat_view, is_dense, view_like
from distoptim.comm import collectives as comm
from distoptim.zero.layouts import FlatLayout, Piece, layouts_from_plan, piece_view
from distoptim.zero.partition import PartitionPlan

__all__ = ["BucketViewSync", "ParameterSync", "StagedSync", "owned_bytes", "staged_sync_of"]

DEFAULT_STAGE_BYTES = 64 * 2**20
DEFAULT_DIRECT_BYTES = 2**20


class ParameterSync:
    """After the local step: every rank's updated shard reaches every rank of the group."""

    def __init__(self, layouts: list[FlatLayout], group: comm.Group, collectives: comm.Collectives) -> None:
        self.layouts, self.group, self.collectives = layouts, group, collectives
        self.alone = comm.group_size(group) == 1  # this rank's shard is every shard: nothing to send or receive
        self.watches_writes = False  # whether ``check_untouched`` can raise (a sync left in flight)

    def sync_parameters(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Land whatever ``sync_parameters`` left in flight (before anything touches the parameters)."""

    def check_untouched(self) -> None:
        """Raise if a write to the parameters while ``finish`` was pending was lost (inside the step's agreement)."""

    def check_untouched_here(self) -> None:
        """Raise, on this rank alone, if it saw such a write (the explicit waits outside a step)."""

    def allocations(self) -> dict[tuple[torch.device, torch.dtype], Tensor]:
        """The flat allocations the parameters are views into, by (device, dtype) (none here)."""
        return {}


class BucketViewSync(ParameterSync):
    """Parameters are views into one flat buffer per layout, gathered in place. Each buffer has room for a finer even
    cut's padding: ``ShardedDataParallel``'s re-cut moves the parameters within ``move_within``'s buffers."""

    def __init__(
        self,
        layouts: list[FlatLayout],
        group: comm.Group,
        collectives: comm.Collectives,
        move_within: ParameterSync | None = None,
    ) -> None:
        super().__init__(layouts, group, collectives)
        spare: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        if move_within is not None:
            spare = move_within.allocations()
            release_leavers(move_within.layouts, layouts, spare)
        room = comm.group_size(group) - 1
        self._allocations: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self.buffers: list[Tensor] = []
        for layout in layouts:
            key = (layout.device, layout.dtype)
            allocation = spare.pop(key, None)
            if allocation is None or not movable_within(layout, allocation):
                allocation = torch.empty(
                    layout.numel + room * len(layout.params), dtype=layout.dtype, device=layout.device
                )
            self._allocations[key] = allocation
            self.buffers.append(place(layout, allocation))

    def allocations(self) -> dict[tuple[torch.device, torch.dtype], Tensor]:
        return dict(self._allocations)

    def sync_parameters(self) -> None:
        if self.alone:  # the buffers hold every shard already
            return
        for layout, buffer in zip(self.layouts, self.buffers):
            comm.gather_from_owners(buffer, layout.bounds, self.group, self.collectives)


def staged_sync_of(
    plan: PartitionPlan,
    params: Sequence[Tensor],
    chosen: Iterable[int],
    group: comm.Group,
    collectives: comm.Collectives,
    relay: bool | None = None,
) -> StagedSync:
    """The staged sync of the parameters ``params[i]``, ``i`` in ``chosen``, alone (one bucket of a backward)."""
    inside = set(chosen)
    fragments = [pieces if index in inside else () for index, pieces in enumerate(plan.fragments)]
    stage_bytes = sum(params[index].numel() * params[index].element_size() for index in inside)
    layouts = [layout for layout in layouts_from_plan(plan.layouts, fragments, params) if layout.pieces]
    return StagedSync(layouts, group, collectives, stage_bytes=max(1, stage_bytes), relay=relay)


class StagedSync(ParameterSync):
    """Parameters keep their storage: large pieces are broadcast in place, small ones staged in rounds of at most
    ``stage_bytes``. ``relay``: whether the p2p style goes through aggregators (None: each round decides)."""

    def __init__(
        self,
        layouts: list[FlatLayout],
        group: comm.Group,
        collectives: comm.Collectives,
        stage_bytes: int = DEFAULT_STAGE_BYTES,
        direct_bytes: int = DEFAULT_DIRECT_BYTES,
        relay: bool | None = None,
    ) -> None:
        super().__init__(layouts, group, collectives)
        self.rank = comm.group_rank(group)
        self.relay = relay
        self.direct: list[Piece] = []
        self.rounds: list[_Round] = []
        for layout in layouts:
            staged = []
            for piece in layout.pieces:
                if piece.length * piece.param.element_size() >= direct_bytes and is_dense(piece.param):
                    self.direct.append(piece)
                else:
                    staged.append(piece)
            self.rounds.extend(_rounds(staged, layout, max(1, stage_bytes // layout.dtype.itemsize)))
        # the large pieces, one owner's each, travel as one layout
        self.relay_direct = comm.relayed(owned_bytes(self.direct, comm.group_size(group))) if relay is None else relay

    def sync_parameters(self) -> None:
        direct = self.launch_direct()
        for round_ in self.rounds:
            self.land(self.launch(round_))
        comm.wait_all(direct)

    def launch_direct(self) -> list[Any]:
        """Start the in-place broadcasts of the large pieces; ``comm.wait_all`` finishes them."""
        works: list[Any] = []
        for piece in [] if self.alone else self.direct:
            owned = [(piece.rank, 0, piece.length)]
            works += comm.broadcast_slices(
                piece_view(piece), owned, self.group, False, self.collectives, self.relay_direct
            )
        return works

    def launch(self, round_: _Round) -> tuple[_Round, list[Any]]:
        """Pack this rank's chunks of ``round_`` and start its broadcasts; ``land`` finishes them."""
        work = self._work(round_)
        copy_each_(work.pack_into, work.pack_from)
        return round_, comm.broadcast_slices(
            work.stage, work.slices, self.group, wait=False, collectives=self.collectives, relay_path=self.relay
        )

    def land(self, flight: tuple[_Round, list[Any]]) -> None:
        """Wait for a launched round (``launch``'s return) and copy the other ranks' chunks into their parameters."""
        round_, works = flight
        comm.wait_all(works)
        work = self._work(round_)
        copy_each_(work.unpack_into, work.unpack_from)

    def _work(self, round_: _Round) -> _RoundWork:
        """What ``round_`` does at every step, worked out at its first launch (nothing when alone)."""
        if round_.work is not None:
            return round_.work
        work = round_.work = _RoundWork(round_.dtype, round_.device, 0 if self.alone else round_.numel)
        if self.alone:
            return work
        work.slices = [(chunk.src, chunk.start, chunk.end) for chunk in round_.chunks]
        for chunk in round_.chunks:
            start = chunk.start
            for piece in chunk.pieces:  # a whole parameter as it is, a partial one as a 1-D view, staged alike
                if piece.whole:
                    staged, own = view_like(work.stage, start, piece.param), piece.param
                else:
                    staged = work.stage[start : start + piece.length]
                    own = flat_view(piece.param)[piece.offset : piece.offset + piece.length]
                if chunk.src == self.rank:
                    work.pack_into.append(staged)
                    work.pack_from.append(own)
                else:
                    work.unpack_into.append(own)
                    work.unpack_from.append(staged)
                start += piece.length
        return work


def owned_bytes(pieces: Iterable[Piece], world_size: int) -> list[int]:
    shares = [0] * world_size
    for piece in pieces:
        shares[piece.rank] += piece.length * piece.param.element_size()
    return shares


@dataclass
class _Chunk:
    src: int
    pieces: list[Piece]
    start: int = 0
    end: int = 0


class _RoundWork:
    """A round's packing, broadcasts and unpacking (its stage kept: a fresh one each step costs page faults)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, numel: int = 0) -> None:
        self.stage = torch.empty(numel, dtype=dtype, device=device)
        self.slices: list[tuple[int, int, int]] = []
        self.pack_into: list[Tensor] = []
        self.pack_from: list[Tensor] = []
        self.unpack_into: list[Tensor] = []
        self.unpack_from: list[Tensor] = []


@dataclass
class _Round:
    device: torch.device
    dtype: torch.dtype
    chunks: list[_Chunk] = field(default_factory=list)
    numel: int = 0
    work: _RoundWork | None = None


def _rounds(pieces: Sequence[Piece], layout: FlatLayout, stage_numel: int) -> list[_Round]:
    """Cut the pieces, owner by owner, into chunks of about ``stage_numel`` and pack the chunks into rounds."""
    chunks: list[_Chunk] = []
    for piece in sorted(pieces, key=lambda p: (p.rank, p.position)):
        if chunks and chunks[-1].src == piece.rank and chunks[-1].end + piece.length <= stage_numel:  # start 0 here
            chunks[-1].pieces.append(piece)
            chunks[-1].end += piece.length
        else:
            chunks.append(_Chunk(src=piece.rank, pieces=[piece], end=piece.length))
    rounds: list[_Round] = []
    for chunk in chunks:
        size = chunk.end - chunk.start
        if not rounds or rounds[-1].numel + size > stage_numel:
            rounds.append(_Round(device=layout.device, dtype=layout.dtype))
        current = rounds[-1]
        chunk.start, chunk.end = current.numel, current.numel + size
        current.chunks.append(chunk)
        current.numel += size
    return rounds


def release_leavers(before: Sequence[FlatLayout], after: Sequence[FlatLayout], spare: dict[Any, Tensor]) -> None:
    """Parameters the ``after`` layouts leave out get their own storage back: their buffer is about to be rewritten."""
    staying = {param for layout in after for param in layout.params}
    reused = {_storage(allocation) for allocation in spare.values()}
    for layout in before:
        for param in layout.params:
            if param not in staying and _storage(param) in reused:
                param.data = param.detach().clone()
                torch.autograd.graph.increment_version(param)  # its old memory is about to be overwritten


def _starts(layout: FlatLayout) -> list[tuple[int, Tensor]]:
    return [(piece.position, piece.param) for piece in layout.pieces if piece.offset == 0]


def movable_within(layout: FlatLayout, allocation: Tensor) -> bool:
    """Whether ``layout`` fits ``allocation``, the parameters already viewing it in order (moved in place)."""
    storage = _storage(allocation)
    inside = [p.storage_offset() for _, p in _starts(layout) if _storage(p) == storage]
    return layout.numel <= allocation.numel() and inside == sorted(inside)


def place(layout: FlatLayout, allocation: Tensor) -> Tensor:
    """Make ``layout``'s parameters views into ``allocation``, zero the padding, and return the layout's buffer.
    Parameters already in it move: backward moves first to last, forward ones last to first (none overwritten)."""
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
    """``flat[target:target + numel] = flat[source:source + numel]``, ranges possibly overlapping, chunk by chunk."""
    starts = range(0, numel, chunk)
    for start in reversed(starts) if target > source else starts:
        end = min(numel, start + chunk)
        flat[target + start : target + end].copy_(flat[source + start : source + end].clone())


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
