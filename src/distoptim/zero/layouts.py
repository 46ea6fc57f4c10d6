"""What the flat per-(device, dtype) buffers hold, built from a ``partition.LayoutPlan`` (pure: no communication);
``buckets`` syncs them and lays parameters into them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from distoptim._flat import flat_view, is_dense
from distoptim.zero.partition import Fragment, LayoutPlan

__all__ = ["FlatLayout", "Piece", "layouts_from_plan", "piece_view"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[offset, offset + length)`` of ``param``, owned by ``rank``, at ``position`` of the flat buffer."""

    param: Tensor
    offset: int
    length: int
    rank: int
    position: int

    @property
    def whole(self) -> bool:
        return self.offset == 0 and self.length == self.param.numel()


def piece_view(piece: Piece) -> Tensor:
    """The piece's elements of its parameter as a 1-D view (a whole non-dense parameter: a reshaped copy)."""
    if piece.whole and not is_dense(piece.param):
        return piece.param.detach().reshape(-1)
    return flat_view(piece.param)[piece.offset : piece.offset + piece.length]


@dataclass
class FlatLayout:
    """The pieces of one (device, dtype) in buffer order and the ranges each rank owns (per region)."""

    device: torch.device
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)
    bounds: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Length of the flat buffer, padding included."""
        return self.bounds[-1][-1] if self.bounds else 0

    @property
    def params(self) -> list[Tensor]:
        """The distinct parameters of the layout, in buffer order."""
        return list(dict.fromkeys(piece.param for piece in self.pieces))


def layouts_from_plan(
    layout_plans: Sequence[LayoutPlan], fragments: Sequence[Sequence[Fragment]], params: Sequence[Tensor]
) -> list[FlatLayout]:
    """The tensor side of a partition plan: ``params`` and ``fragments`` by global index, as the plan gives them."""
    layouts = []
    for plan in layout_plans:
        first = params[plan.params[0]]
        pieces = (Piece(params[i], f.offset, f.length, f.rank, f.position) for i in plan.params for f in fragments[i])
        layouts.append(FlatLayout(first.device, first.dtype, [p for p in pieces if p.length > 0], list(plan.bounds)))
    return layouts
