"""``reduce_to_owners_hook``, deprecated (ZeRO-2 is ``distoptim.ShardedDataParallel``): it averages every bucket
over ``zero``'s group times its ``replicate_group``, as DDP's default, so programs registering it keep training."""

# No `from __future__ import annotations`: DDP checks the hook's annotations against the real classes.
import functools
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import GradBucket
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from distoptim._text import few
from distoptim.comm import collectives as comm

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["check_ddp_group", "reduce_to_owners_hook", "warn_deprecated"]

MIGRATION = (
    "reduce_to_owners_hook is deprecated: use distoptim.ShardedDataParallel(model, zero) instead of DDP + "
    "reduce_to_owners_hook for ZeRO-2; this hook now all-reduces, as DDP's default"
)


@functools.cache
def warn_deprecated() -> None:
    """The deprecation warning, once per process."""
    warnings.warn(MIGRATION, FutureWarning, stacklevel=3)


def reduce_to_owners_hook(zero: "ZeroRedundancyOptimizer", bucket: GradBucket) -> Future[Tensor]:
    """Deprecated: average the bucket over ``zero``'s ranks (its group times ``replicate_group``), as DDP's default.

    Args:
        zero: the ``ZeroRedundancyOptimizer`` (the hook's state); its ranks are the ones averaged over.
        bucket: the gradient bucket DDP hands the hook.

    Raises:
        TypeError: the hook's state is not a ``ZeroRedundancyOptimizer``.
        ValueError: on every rank, for sparse gradients.

    Example:
        ```python
        model = distoptim.ShardedDataParallel(model, zero)  # instead of ddp.register_comm_hook(zero, this hook)
        ```
    """
    if not hasattr(zero, "fragments_of"):  # duck-typed: this module does not import the optimizer at run time
        raise TypeError(
            "reduce_to_owners_hook needs the ZeroRedundancyOptimizer as its state: "
            f"ddp.register_comm_hook(zero, reduce_to_owners_hook), got {type(zero).__name__}"
        )
    warn_deprecated()
    buffer = bucket.buffer()
    if buffer.layout != torch.strided:  # every rank's bucket alike: every rank raises here, before any collective
        raise ValueError("reduce_to_owners_hook reduces dense gradients only: build the embedding with sparse=False")
    buffer.div_(zero.world_size * zero.replica_count)
    everything = [(comm.EVERY, 0, buffer.numel())]
    return comm.reduce_to_owners_async(
        buffer, everything, zero.process_group, zero.collectives, replicas=zero.replicate_group
    )


def check_ddp_group(zero: "ZeroRedundancyOptimizer", ddp: DistributedDataParallel) -> None:
    """Refuse a DDP that averages over other ranks than ``zero`` spans with its replicas (the same on every rank)."""
    ddp_ranks = sorted(dist.get_process_group_ranks(ddp.process_group))
    known, spanned = zero.all_ranks()
    if not set(known) <= set(ddp_ranks) or len(ddp_ranks) != spanned:
        raise ValueError(
            f"DDP averages gradients over ranks [{few(ddp_ranks, 8)}] but this ZeroRedundancyOptimizer spans ranks "
            f"[{few(known, 8)}] ({spanned} ranks with its replicas). For hybrid sharding (shard within a group, "
            "replicate across groups) pass replicate_group= to ZeroRedundancyOptimizer; otherwise build DDP and "
            "ZeRO over the same group, or use DDP's default all-reduce (allreduce_hook) inside the overlap hook"
        )
