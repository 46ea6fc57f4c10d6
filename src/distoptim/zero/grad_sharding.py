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
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.distributed import GradBucket
from torch.futures import Future

from distoptim.zero import comm

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["reduce_to_owners_hook"]


_ROUTES: "weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], list[tuple[int, int, int]]]]" = (
    weakref.WeakKeyDictionary()
)


def _route(zero: "ZeroRedundancyOptimizer", params: list[Tensor]) -> list[tuple[int, int, int]]:
    """``(owner, start, end)`` of the bucket's owned ranges, neighbours of one owner merged; computed once per
    (partition plan, bucket) from the plan's fragments. Offsets count every parameter of the bucket."""
    cache = _ROUTES.setdefault(zero, {})
    key = (id(zero.plan), *map(id, params))
    if key not in cache:
        pieces, offset, foreign = [], 0, []
        for param in params:
            fragments = zero.fragments_of(param)
            if fragments is None:
                if param.requires_grad:
                    foreign.append(tuple(param.shape))
            else:
                pieces += [(f.rank, offset + f.offset, offset + f.offset + f.length) for f in fragments if f.length]
            offset += param.numel()
        if foreign:
            raise ValueError(
                f"reduce_to_owners_hook: the DDP model trains parameters of shapes {foreign[:3]} that this "
                "ZeroRedundancyOptimizer does not hold, so nobody would own their gradients; build ZeRO over all of "
                "the DDP model's trainable parameters, or keep the default all-reduce"
            )
        merged: list[tuple[int, int, int]] = []
        for rank, start, end in sorted(pieces, key=lambda piece: piece[1]):
            if merged and merged[-1][0] == rank and merged[-1][2] == start:
                merged[-1] = (rank, merged[-1][1], end)
            else:
                merged.append((rank, start, end))
        cache[key] = merged
    return cache[key]


def reduce_to_owners_hook(zero: "ZeroRedundancyOptimizer", bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket's gradients onto the ranks that own them (register with ``zero`` as the hook's state).

    The bucket is divided by the world size first (as DDP's all-reduce does) and its owned ranges are summed onto
    their owners by ``comm.reduce_to_owners_async``, which picks the collectives for the backend.
    """
    buffer = bucket.buffer()
    buffer.div_(zero.world_size)
    return comm.reduce_to_owners_async(buffer, _route(zero, bucket.parameters()), zero.process_group)
