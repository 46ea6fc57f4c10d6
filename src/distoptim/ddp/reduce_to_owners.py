"""Gradient sharding (ZeRO-2): a DDP communication hook that gives each rank the averaged gradient of what it owns.

``ddp.register_comm_hook(zero, reduce_to_owners_hook)`` replaces DDP's all-reduce: each bucket's gradients are
reduced to the ranks that own them (the partition plan's fragments), so a rank receives 1/N of the gradient instead
of all of it, and the step plus the parameter sync communicate what one all-reduce does. The reduction runs inside
the backward (the hook returns a future chained on it), overlapping the rest of the backward as DDP's does.

After the backward only the owned fragments of ``.grad`` are averaged; the rest holds this rank's partial values
and must not be read (the library's own readers, ``zero.step()``, ``zero.clip_grad_norm_`` and the overlap hooks,
read owned fragments only; ``torch.nn.utils.clip_grad_norm_`` would read partial values) nor added onto: ``step()``
refuses gradients a backward added onto them (``accumulation.py``; ``no_sync()`` accumulates right). The hook is
also the inner hook of the overlap wrappers: ``ddp.register_comm_hook(zero, hook_with_zero_step(reduce_to_owners_hook,
ddp, zero))``.

Each bucket is handled on its own: nothing depends on DDP's bucket numbering or on which bucket comes last (DDP's
static-graph first iteration hands every bucket over as index 0, none as the last). Elements of a parameter that
has become trainable since the plan was made (gradual unfreezing) have no owner yet: they are all-reduced, so that
the owner ``step()`` then gives them sees the average. A GradScaler's inf/nan verdict is agreed in ``step()``
(``zero/amp.py``), not here.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against the real classes.
import gc
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import GradBucket
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from distoptim.comm import collectives as comm
from distoptim.zero import validation

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["check_ddp_group", "reduce_to_owners_hook", "route"]

Route = list[tuple[int, int, int]]  # (owner, start, end) in a bucket's buffer; owner comm.EVERY: all-reduced


def route(zero: "ZeroRedundancyOptimizer", params: list[Tensor]) -> Route:
    """``(owner, start, end)`` of the bucket's ranges, neighbours of one owner merged, from the plan's fragments
    (cached on ``zero`` per plan, bucket and trainability). Offsets count every parameter of the bucket."""
    key = (*map(id, params), *(p.requires_grad for p in params))
    cached: Route | None = zero._routes.get(key)
    if cached is not None:
        return cached
    pieces, offset, foreign = [], 0, []
    for param in params:
        fragments = zero.fragments_of(param)
        if fragments is None:
            if param.requires_grad:
                foreign.append(tuple(param.shape))
        elif fragments:
            pieces += [(f.rank, offset + f.offset, offset + f.offset + f.length) for f in fragments if f.length]
        elif param.requires_grad and param.numel():  # trainable since the plan was made: owned from the next step
            pieces.append((comm.EVERY, offset, offset + param.numel()))
        offset += param.numel()
    if foreign:
        raise ValueError(
            f"reduce_to_owners_hook: the DDP model trains parameters of shapes {foreign[:3]} that this "
            "ZeroRedundancyOptimizer does not hold, so nobody would own their gradients; build ZeRO over all of "
            "the DDP model's trainable parameters, or keep the default all-reduce"
        )
    merged: Route = []
    for rank, start, end in sorted(pieces, key=lambda piece: piece[1]):
        if merged and merged[-1][0] == rank and merged[-1][2] == start:
            merged[-1] = (rank, merged[-1][1], end)
        else:
            merged.append((rank, start, end))
    zero._routes[key] = merged
    return merged


def reduce_to_owners_hook(zero: "ZeroRedundancyOptimizer", bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket's gradients onto the ranks that own them (register with ``zero`` as the hook's state).

    The bucket is divided by the number of ranks DDP averages over (as DDP's all-reduce does) and its owned ranges
    are summed onto their owners by ``comm.reduce_to_owners_async``, in ``zero``'s style of collectives.

    Args:
        zero: the ``ZeroRedundancyOptimizer`` over the DDP model's trainable parameters (the hook's state).
        bucket: the gradient bucket DDP hands the hook.

    Raises:
        TypeError: the hook's state is not a ``ZeroRedundancyOptimizer``.
        ValueError: on every rank, when the DDP model trains parameters ``zero`` does not hold, or when DDP
            averages over other ranks than ``zero`` shards over (hybrid sharding needs ``replicate_group``).

    Example:
        ```python
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, partition="even", lr=1e-3)
        ddp.register_comm_hook(zero, reduce_to_owners_hook)
        ```
    """
    if not hasattr(zero, "fragments_of"):  # duck-typed: this module does not import the optimizer at run time
        raise TypeError(
            "reduce_to_owners_hook needs the ZeroRedundancyOptimizer as its state: "
            f"ddp.register_comm_hook(zero, reduce_to_owners_hook), got {type(zero).__name__}"
        )
    if not zero._ddp_group_checked:
        check_ddp_group(zero, _running_ddp(zero))
    zero._accumulation.saw_bucket(bucket.parameters())
    buffer = bucket.buffer()
    if buffer.layout != torch.strided:  # every rank's bucket alike: every rank raises here, before any collective
        raise ValueError("reduce_to_owners_hook reduces dense gradients only: build the embedding with sparse=False")
    buffer.div_(zero.world_size * zero.replica_count)
    bucket_route = route(zero, bucket.parameters())
    return comm.reduce_to_owners_async(
        buffer, bucket_route, zero.process_group, zero.collectives, replicas=zero.replicate_group
    )


def _running_ddp(zero: "ZeroRedundancyOptimizer") -> DistributedDataParallel | None:
    """The DDP model whose comm hook has ``zero`` as its state (searched once: DDP does not hand it to the hook)."""
    for candidate in gc.get_objects():
        if isinstance(candidate, DistributedDataParallel):
            hooks: list[tuple[Any, Any]] = getattr(candidate, "_comm_hooks", [])
            if any(state is zero for _, state in hooks):
                return candidate
    return None


def check_ddp_group(zero: "ZeroRedundancyOptimizer", ddp: DistributedDataParallel | None) -> None:
    """Refuse (on every rank of DDP's group: each sees the same groups) a DDP that averages over other ranks than
    ``zero`` shards over (with its replicas): gradients reduced over ZeRO's group only would differ between the
    shard groups, and the replicas would drift apart silently."""
    zero._ddp_group_checked = True
    if ddp is None:
        return
    validation.refuse_sparse_gradients(ddp.module, "reduce_to_owners_hook")
    ddp_ranks = sorted(dist.get_process_group_ranks(ddp.process_group))
    known, spanned = zero.all_ranks()
    if not set(known) <= set(ddp_ranks) or len(ddp_ranks) != spanned:
        raise ValueError(
            f"DDP averages gradients over ranks {_few(ddp_ranks)} but this ZeroRedundancyOptimizer shards over "
            f"ranks {_few(sorted(dist.get_process_group_ranks(zero.process_group)))}"
            + ("" if zero.replicate_group is None else f" with {zero.replica_count} replicas")
            + f" ({spanned} ranks in all). For hybrid "
            "sharding (shard within a group, replicate across groups) pass replicate_group= (the ranks holding the "
            "same shard in the other shard groups) to ZeroRedundancyOptimizer; otherwise build DDP and ZeRO over "
            "the same group"
        )
    _follow_bucket_rebuild(zero, ddp)


def _follow_bucket_rebuild(zero: "ZeroRedundancyOptimizer", ddp: DistributedDataParallel) -> None:
    """With ``gradient_as_bucket_view``, DDP's bucket rebuild (in its second forward) re-creates each ``.grad`` as a
    copy in a view of its new buckets: the accumulation guard notes the copies of what the hook left as left, or an
    accumulation onto them goes unnoticed. The forward hooks go once DDP has rebuilt."""
    rebuilds = ddp.static_graph or not ddp.find_unused_parameters  # DDP's own condition for rebuilding once
    if not ddp.gradient_as_bucket_view or not rebuilds or ddp._has_rebuilt_buckets:
        return
    left: list[int] = []

    def before(*_: Any) -> None:
        left[:] = zero._accumulation.still_left()

    def after(*_: Any) -> None:
        if ddp._has_rebuilt_buckets:
            zero._accumulation.renote(left)
            for handle in handles:
                handle.remove()

    handles = [ddp.register_forward_pre_hook(before), ddp.register_forward_hook(after)]


def _few(ranks: list[int], limit: int = 8) -> str:
    return str(ranks) if len(ranks) <= limit else f"[{', '.join(map(str, ranks[:limit]))}, ...] ({len(ranks)})"
