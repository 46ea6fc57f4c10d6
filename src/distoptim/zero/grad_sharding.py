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

import torch
from torch import Tensor
from torch.distributed import GradBucket
from torch.futures import Future

from distoptim.zero import comm

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["reduce_to_owners_hook"]


_Reduction = tuple[Future[Tensor], Tensor, list[tuple[int, int]]]  # a bucket's reduction, its buffer, its owned ranges
_PENDING: "weakref.WeakKeyDictionary[Any, list[_Reduction]]" = weakref.WeakKeyDictionary()  # this backward's so far

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
    if not hasattr(zero, "fragments_of"):  # duck-typed: this module does not import the optimizer at run time
        raise TypeError(
            "reduce_to_owners_hook needs the ZeroRedundancyOptimizer as its state: "
            f"ddp.register_comm_hook(zero, reduce_to_owners_hook), got {type(zero).__name__}"
        )
    buffer = bucket.buffer()
    buffer.div_(zero.world_size)
    route = _route(zero, bucket.parameters())
    reduced = comm.reduce_to_owners_async(buffer, route, zero.process_group)
    if zero.overlap_stepper is not None:  # the step runs in the hook, where no GradScaler can take part
        return reduced
    mine = [(start, end) for owner, start, end in route if owner == zero.rank]
    pending = _PENDING[zero] = [] if bucket.index() == 0 else _PENDING.get(zero, [])
    pending.append((reduced, buffer, mine))
    if not bucket.is_last():
        return reduced
    del _PENDING[zero]
    return _agree_on_finiteness(zero, pending)


def _agree_on_finiteness(zero: "ZeroRedundancyOptimizer", pending: list[_Reduction]) -> Future[Tensor]:
    """At the end of the backward: if any owner's averaged gradient holds inf/nan, make every rank see one (a NaN in
    the last bucket), so that checks of the local ``.grad`` (``GradScaler``'s) reach the same verdict everywhere.

    Without one no rank sees any: a non-owned range holds partial sums of the world-size-divided local gradients,
    which cannot overflow, and is non-finite only where some rank's gradient is, which its owner then sees too.
    """
    nonfinite = False
    for reduced, buffer, mine in pending:
        reduced.wait()
        nonfinite = nonfinite or any(_has_nonfinite(buffer[start:end]) for start, end in mine)
    verdict = torch.tensor([float(nonfinite)], device=pending[-1][1].device)
    comm.all_reduce_(verdict, zero.process_group, "max")
    last = pending[-1][1]
    if bool(verdict.item()) and last.numel():
        last[0] = float("nan")
    done: Future[Tensor] = Future()
    done.set_result(last)
    return done


def _has_nonfinite(piece: Tensor) -> bool:
    """Whether ``piece`` holds an inf or a nan. A sum says it fast (inf and nan propagate; 25x cheaper than
    ``isfinite`` on a CPU core); only a sum that is not finite, which an overflow could also cause, is checked
    element by element."""
    total = piece.sum(dtype=torch.float32) if piece.dtype in (torch.float16, torch.bfloat16) else piece.sum()
    return not bool(torch.isfinite(total)) and not bool(piece.isfinite().all())
