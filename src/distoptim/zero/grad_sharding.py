"""Gradient sharding (ZeRO-2): a DDP communication hook that gives each rank the averaged gradient of what it owns.

``ddp.register_comm_hook(zero, reduce_to_owners_hook)`` replaces DDP's all-reduce: each bucket's gradients are
reduced to the ranks that own them (the partition plan's fragments), so a rank receives 1/N of the gradient instead
of all of it, and the step plus the parameter sync communicate what one all-reduce does. The reduction runs inside
the backward (the hook returns a future chained on it), overlapping the rest of the backward as DDP's does.

After the backward only the owned fragments of ``.grad`` are averaged; the rest holds this rank's partial values
and must not be read (the library's own readers, ``zero.step()``, ``zero.clip_grad_norm_`` and the overlap hooks,
read owned fragments only). The hook is also the inner hook of the overlap wrappers:
``ddp.register_comm_hook(zero, hook_with_zero_step(reduce_to_owners_hook, ddp, zero))``.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against the real classes.
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.distributed import GradBucket
from torch.futures import Future

from distoptim.zero import comm

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["reduce_to_owners_hook"]


@dataclass(frozen=True)
class _Route:
    """Where a bucket's owned elements go: ``ranges[r]`` are rank ``r``'s ``(start, length)`` in the bucket, packed
    rank by rank into a staging tensor whose rank-``r`` segment starts at ``starts[r]`` and holds ``sizes[r]``."""

    ranges: tuple[tuple[tuple[int, int], ...], ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.starts[-1] + self.sizes[-1] if self.sizes else 0


_ROUTES: "weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], _Route]]" = weakref.WeakKeyDictionary()


def _route(zero: "ZeroRedundancyOptimizer", params: list[Tensor]) -> _Route:
    """The bucket's route, computed once per (partition plan, bucket) from the plan's fragments."""
    cache = _ROUTES.setdefault(zero, {})
    key = (id(zero.plan), *map(id, params))
    if key not in cache:
        ranges: list[list[tuple[int, int]]] = [[] for _ in range(zero.world_size)]
        offset, foreign = 0, []
        for param in params:
            fragments = zero.fragments_of(param)
            if fragments is None:
                if param.requires_grad:
                    foreign.append(tuple(param.shape))
            else:
                for fragment in fragments:
                    ranges[fragment.rank].append((offset + fragment.offset, fragment.length))
            offset += param.numel()
        if foreign:
            raise ValueError(
                f"reduce_to_owners_hook: the DDP model trains parameters of shapes {foreign[:3]} that this "
                "ZeroRedundancyOptimizer does not hold, so nobody would own their gradients; build ZeRO over all of "
                "the DDP model's trainable parameters, or keep the default all-reduce"
            )
        sizes = [sum(length for _, length in rank_ranges) for rank_ranges in ranges]
        starts = [sum(sizes[:rank]) for rank in range(len(sizes))]
        cache[key] = _Route(tuple(map(tuple, ranges)), tuple(starts), tuple(sizes))
    return cache[key]


def reduce_to_owners_hook(zero: "ZeroRedundancyOptimizer", bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket's gradients onto the ranks that own them (register with ``zero`` as the hook's state).

    The owned elements are packed rank by rank, reduced to their owner (``comm.reduce_to_owners``: N rooted reduces
    on gloo, one reduce-scatter on NCCL) and written back into the bucket, which DDP then copies into ``.grad``.
    """
    route = _route(zero, bucket.parameters())
    buffer = bucket.buffer()
    pieces = [buffer[start : start + length] for rank_ranges in route.ranges for start, length in rank_ranges]
    stage = torch.cat(pieces) if pieces else buffer.new_empty(0)
    stage.div_(zero.world_size)  # divide first, as DDP's all-reduce does
    mine = zero.rank

    def land(_: Any) -> Tensor:
        own, start = stage[route.starts[mine] : route.starts[mine] + route.sizes[mine]], 0
        for offset, length in route.ranges[mine]:
            buffer[offset : offset + length].copy_(own[start : start + length])
            start += length
        return buffer

    return comm.reduce_to_owners_async(stage, route.starts, route.sizes, zero.process_group).then(land)
