"""``reduce_to_owners_hook``, deprecated: it now averages every bucket over the optimizer's ranks, as DDP's default.

ZeRO-2 is ``distoptim.ShardedDataParallel(model, zero)``, which also keeps only the owned gradient in memory. The
hook stays so that programs registering it keep training (``.grad`` is DDP's full average: accumulation across
backwards, ``torch.nn.utils.clip_grad_norm_`` and every reader of ``.grad`` are right). The hook cannot see DDP's
group, so where the optimizer spans fewer ranks than the world it is refused (a DDP over more ranks would let the
shard groups drift apart silently); the overlap wrappers, which get the DDP model, check its group instead.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against the real classes.
import functools
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import GradBucket
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from distoptim.comm import collectives as comm
from distoptim.comm.groups import default_group, group_size

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["average_over_zero", "check_ddp_group", "reduce_to_owners_hook", "warn_deprecated"]

MIGRATION = (
    "reduce_to_owners_hook is deprecated: use distoptim.ShardedDataParallel(model, zero) instead of DDP + "
    "reduce_to_owners_hook for ZeRO-2; this hook now all-reduces, as DDP's default"
)


@functools.cache
def warn_deprecated() -> None:
    """The deprecation warning, once per process."""
    warnings.warn(MIGRATION, FutureWarning, stacklevel=3)


def reduce_to_owners_hook(zero: "ZeroRedundancyOptimizer", bucket: GradBucket) -> Future[Tensor]:
    """Deprecated: average the bucket over ``zero``'s ranks (its group, and ``replicate_group``), as DDP's default.

    Args:
        zero: the ``ZeroRedundancyOptimizer`` (the hook's state).
        bucket: the gradient bucket DDP hands the hook.

    Raises:
        TypeError: the hook's state is not a ``ZeroRedundancyOptimizer``.
        ValueError: on every rank, for sparse gradients, or where ``zero`` spans fewer ranks than the default group
            (DDP's group cannot be checked from here): drop the hook, DDP's default gives the same gradients.

    Example:
        ```python
        model = distoptim.ShardedDataParallel(model, zero)  # instead of ddp.register_comm_hook(zero, this hook)
        ```
    """
    _check_state(zero)
    spanned, world = zero.world_size * zero.replica_count, group_size(default_group(None))
    if spanned != world:
        raise ValueError(
            f"reduce_to_owners_hook averages over this ZeroRedundancyOptimizer's {spanned} ranks (its group and "
            f"replicate_group), fewer than the world's {world}, and cannot see DDP's group: a DDP over more ranks "
            "would let the shard groups drift apart silently. Drop the hook (DDP's default all-reduce leaves the "
            "same gradients), pass replicate_group= for hybrid sharding, or use distoptim.ShardedDataParallel"
        )
    return average_over_zero(zero, bucket)


def average_over_zero(zero: "ZeroRedundancyOptimizer", bucket: GradBucket) -> Future[Tensor]:
    """The hook without its group check (the overlap wrappers check DDP's group themselves)."""
    _check_state(zero)
    warn_deprecated()
    buffer = bucket.buffer()
    if buffer.layout != torch.strided:  # every rank's bucket alike: every rank raises here, before any collective
        raise ValueError("reduce_to_owners_hook reduces dense gradients only: build the embedding with sparse=False")
    buffer.div_(zero.world_size * zero.replica_count)
    everything = [(comm.EVERY, 0, buffer.numel())]
    return comm.reduce_to_owners_async(
        buffer, everything, zero.process_group, zero.collectives, replicas=zero.replicate_group
    )


def _check_state(zero: Any) -> None:
    if not hasattr(zero, "fragments_of"):  # duck-typed: this module does not import the optimizer at run time
        raise TypeError(
            "reduce_to_owners_hook needs the ZeroRedundancyOptimizer as its state: "
            f"ddp.register_comm_hook(zero, reduce_to_owners_hook), got {type(zero).__name__}"
        )


def check_ddp_group(zero: "ZeroRedundancyOptimizer", ddp: DistributedDataParallel) -> None:
    """Refuse (every rank of DDP's group sees the same groups) a DDP that averages over other ranks than ``zero``
    spans with its replicas: the hook's average would not be DDP's, and shard groups could drift apart."""
    ddp_ranks = sorted(dist.get_process_group_ranks(ddp.process_group))
    known, spanned = zero.all_ranks()
    if not set(known) <= set(ddp_ranks) or len(ddp_ranks) != spanned:
        raise ValueError(
            f"DDP averages gradients over ranks {_few(ddp_ranks)} but this ZeroRedundancyOptimizer spans ranks "
            f"{_few(known)} ({spanned} ranks with its replicas). For hybrid sharding (shard within a group, replicate "
            "across groups) pass replicate_group= to ZeroRedundancyOptimizer; otherwise build DDP and ZeRO over the "
            "same group, or use DDP's default all-reduce (allreduce_hook) inside the overlap hook"
        )


def _few(ranks: list[int], limit: int = 8) -> str:
    return str(ranks) if len(ranks) <= limit else f"[{', '.join(map(str, ranks[:limit]))}, ...] ({len(ranks)})"
