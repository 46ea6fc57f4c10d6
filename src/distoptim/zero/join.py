"""A ZeroRedundancyOptimizer under ``Join`` (uneven inputs): the hook a joined rank runs, and the modes refusing it."""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.algorithms.join import JoinHook

from distoptim.zero.repartitioning import ZeroParts

__all__ = ["JOIN_WITH_SDP", "ZeroJoinHook", "hook"]

JOIN_WITH_SDP = (
    "Join (uneven inputs) is not supported with ShardedDataParallel: a joined rank would have to shadow every "
    "bucket's reduction and the parameter sync; give every rank the same number of batches (drop the last, uneven "
    "one: DistributedSampler(drop_last=True)), or use DDP under Join([ddp, zero])"
)


def hook(zero: ZeroParts, joined_step: Callable[[], object]) -> ZeroJoinHook:
    """``zero``'s join hook, running ``joined_step``; refused under ``ShardedDataParallel`` or hybrid sharding."""
    if zero.gradient_source is not None:
        raise NotImplementedError(JOIN_WITH_SDP)
    if zero.replicate_group is not None:
        raise NotImplementedError(
            "Join (uneven inputs) is not supported with hybrid sharding (replicate_group): a joined rank and its "
            "still-training replica would step the same elements differently. Give every rank the same number of "
            "batches (DistributedSampler(drop_last=True))"
        )
    stepper = zero.overlap_stepper  # overlap mode: the step DDP's join hook deferred (Join([ddp, zero]))
    return ZeroJoinHook(joined_step if stepper is None else stepper.run_deferred)


class ZeroJoinHook(JoinHook):
    """A joined rank's step, as torch's: its shard stepped with its ``.grad`` inside the others' agreements, synced."""

    def __init__(self, step: Callable[[], object]) -> None:
        self.step = step
        self.open = True  # until its Join exits (post_hook)

    def main_hook(self) -> None:
        self.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.open = False
