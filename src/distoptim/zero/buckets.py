"""Flat per-(device, dtype) layouts of the trainable parameters, ordered by owning rank, and the two ways to sync.

In a layout the parameters of rank 0 come first, then rank 1's, and so on, so each rank's shard is one contiguous
segment: syncing is one broadcast per (rank, layout), never one per parameter. Zero-sized parameters have nothing
to sync and are left out.

- ``BucketViewSync`` (``parameters_as_bucket_view=True``): parameters become views into the flat buffers, which are
  broadcast in place. No copies, no extra memory. A view keeps its parameter's strides (a channels_last convolution
  stays channels_last).
- ``StagedSync`` (default): parameters keep their own storage. Small parameters are packed into staging buffers
  (kept between steps; together the size of the small parameters only), broadcast and unpacked; a parameter of
  ``direct_bytes`` or more is broadcast in place, since copying it twice costs more than one more call.
  Collectives: one per large parameter plus one per (owner, stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from distoptim._flat import pack, unpack_
from distoptim.zero import comm

__all__ = ["BucketViewSync", "FlatLayout", "ParameterSync", "StagedSync", "build_layouts", "view_like"]

DEFAULT_STAGE_BYTES = 64 * 2**20
DEFAULT_DIRECT_BYTES = 2**20


@dataclass
class FlatLayout:
    """Parameters of one (device, dtype), in buffer order, with their offsets, owners and each rank's segment."""

    device: torch.device
    dtype: torch.dtype
    params: list[Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.segments[-1][1] if self.segments else 0

    def add(self, param: Tensor, offset: int, owner: int) -> None:
        self.params.append(param)
        self.offsets.append(offset)
        self.owners.append(owner)


def build_layouts(params_by_rank: Sequence[Sequence[Tensor]]) -> list[FlatLayout]:
    """One layout per (device, dtype) of non-empty parameters, each ordered rank by rank."""
    layouts: dict[tuple[torch.device, torch.dtype], FlatLayout] = {}
    for params in params_by_rank:
        for param in params:
            if param.numel() > 0:
                layouts.setdefault((param.device, param.dtype), FlatLayout(device=param.device, dtype=param.dtype))
    for layout in layouts.values():
        offset = 0
        for rank, params in enumerate(params_by_rank):
            start = offset
            for param in params:
                if (param.device, param.dtype) == (layout.device, layout.dtype) and param.numel() > 0:
                    layout.add(param, offset, rank)
                    offset += param.numel()
            layout.segments.append((start, offset))
    return list(layouts.values())


def view_like(buffer: Tensor, offset: int, param: Tensor) -> Tensor:
    """``param``'s elements at ``buffer[offset:]`` with ``param``'s shape and, when it is dense, its strides.

    This is how DDP lays parameters into its buckets too, so a bucket's memory order is its parameters'.
    """
    strides = torch.empty_like(param, device="meta").stride()  # param's strides when dense, else contiguous ones
    return buffer.as_strided(param.shape, strides, buffer.storage_offset() + offset)


class ParameterSync:
    """After the local step: every rank's updated shard reaches every rank of the group."""

    def __init__(self, layouts: list[FlatLayout], group: comm.Group) -> None:
        self.layouts = layouts
        self.group = group

    def sync_parameters(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        """Undo what construction did to the parameters (before a rebuild)."""


class BucketViewSync(ParameterSync):
    """Parameters are views into one flat buffer per layout; sync broadcasts each rank's segment in place."""

    def __init__(self, layouts: list[FlatLayout], group: comm.Group) -> None:
        super().__init__(layouts, group)
        self.buffers: list[Tensor] = []
        for layout in layouts:
            buffer = torch.empty(layout.numel, dtype=layout.dtype, device=layout.device)
            for param, offset in zip(layout.params, layout.offsets):
                view = view_like(buffer, offset, param)
                view.copy_(param.detach())
                param.data = view
            self.buffers.append(buffer)

    def sync_parameters(self) -> None:
        for layout, buffer in zip(self.layouts, self.buffers):
            slices = [(rank, start, end) for rank, (start, end) in enumerate(layout.segments)]
            comm.broadcast_slices(buffer, slices, self.group)

    def release(self) -> None:
        for layout in self.layouts:
            for param in layout.params:
                param.data = param.detach().clone()
        self.buffers = []


class StagedSync(ParameterSync):
    """Parameters keep their storage: large ones are broadcast in place, small ones travel through staging buffers.

    Small parameters are cut into chunks of whole parameters (per owner, at most ``stage_bytes`` each) and chunks
    are grouped into rounds of at most ``stage_bytes``; a round's broadcasts run concurrently, and so do the in-place
    broadcasts of the large parameters.
    """

    def __init__(
        self,
        layouts: list[FlatLayout],
        group: comm.Group,
        stage_bytes: int = DEFAULT_STAGE_BYTES,
        direct_bytes: int = DEFAULT_DIRECT_BYTES,
    ) -> None:
        super().__init__(layouts, group)
        self.rank = comm.group_rank(group)
        self.direct: list[tuple[int, Tensor]] = []
        self.rounds: list[_Round] = []
        for layout in layouts:
            staged = FlatLayout(layout.device, layout.dtype, segments=layout.segments)
            for param, offset, owner in zip(layout.params, layout.offsets, layout.owners):
                if param.numel() * param.element_size() >= direct_bytes and param.is_contiguous():
                    self.direct.append((owner, param))
                else:
                    staged.add(param, offset, owner)
            self.rounds.extend(_rounds(staged, max(1, stage_bytes // layout.params[0].element_size())))

    def sync_parameters(self) -> None:
        direct = self.launch_direct()
        for round_ in self.rounds:
            self.land(self.launch(round_))
        comm.wait_all(direct)

    def launch_direct(self) -> list[Any]:
        """Start the in-place broadcasts of the large parameters; ``comm.wait_all`` finishes them."""
        return [
            work
            for src, param in self.direct
            for work in comm.broadcast_slices(param.detach().view(-1), [(src, 0, param.numel())], self.group, False)
        ]

    def launch(self, round_: _Round) -> _InFlight:
        """Pack this rank's chunks of ``round_`` and start its broadcasts; ``land`` finishes them."""
        if round_.stage is None:  # kept: a fresh buffer each step costs page faults, not just bytes
            round_.stage = torch.empty(round_.numel, dtype=round_.dtype, device=round_.device)
        stage = round_.stage
        for chunk in round_.chunks:
            if chunk.src == self.rank:
                pack(chunk.params, out=stage[chunk.start : chunk.end])
        slices = [(chunk.src, chunk.start, chunk.end) for chunk in round_.chunks]
        return _InFlight(round_, stage, comm.broadcast_slices(stage, slices, self.group, wait=False))

    def land(self, flight: _InFlight) -> None:
        """Wait for a launched round and copy the other ranks' chunks into their parameters."""
        comm.wait_all(flight.works)
        for chunk in flight.round.chunks:
            if chunk.src != self.rank:
                unpack_(flight.stage[chunk.start : chunk.end], chunk.params)


@dataclass
class _Chunk:
    src: int
    params: list[Tensor]
    start: int = 0
    end: int = 0


@dataclass
class _Round:
    device: torch.device
    dtype: torch.dtype
    chunks: list[_Chunk] = field(default_factory=list)
    numel: int = 0
    stage: Tensor | None = None


@dataclass
class _InFlight:
    round: _Round
    stage: Tensor
    works: list[Any]


def _rounds(layout: FlatLayout, stage_numel: int) -> list[_Round]:
    """Cut each rank's segment of ``layout`` into chunks of about ``stage_numel`` and pack them into rounds."""
    chunks: list[_Chunk] = []
    for param, src in zip(layout.params, layout.owners):
        last = chunks[-1] if chunks else None
        if last is not None and last.src == src and last.end - last.start + param.numel() <= stage_numel:
            last.params.append(param)
            last.end += param.numel()
        else:
            chunks.append(_Chunk(src=src, params=[param], start=0, end=param.numel()))
    rounds: list[_Round] = []
    for chunk in chunks:
        size = chunk.end - chunk.start
        if not rounds or (rounds[-1].numel + size > stage_numel and rounds[-1].chunks):
            rounds.append(_Round(device=layout.device, dtype=layout.dtype))
        current = rounds[-1]
        chunk.start, chunk.end = current.numel, current.numel + size
        current.chunks.append(chunk)
        current.numel += size
    return rounds
