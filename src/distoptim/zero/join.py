"""A ZeroRedundancyOptimizer under ``Join`` (uneven inputs): the hook a joined rank runs, and the modes refusing it."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from distoptim.zero.repartitioning import ZeroParts

__all__ = ["JOIN_WITH_SDP", "LISTED_FIRST", "Joins", "ZeroJoinHook", "hook"]

JOIN_WITH_SDP = (
    "Join (uneven inputs) is not supported with ShardedDataParallel: a joined rank would have to shadow every "
    "bucket's reduction and the parameter sync; give every rank the same number of batches (drop the last, uneven "
    "one: DistributedSampler(drop_last=True)), or use DDP under Join([ddp, zero])"
)

LISTED_FIRST = (
    "Join lists the ZeroRedundancyOptimizer first: list it after the model, Join([ddp, zero]), after whatever "
    "communicates before its step (torch's own test: Join([setter, zero])). A joined rank shadows each joinable's "
    "collectives in the order Join lists them, and only the first one's notice all-reduces, while the model's "
    "collectives (its forward's and backward's) run before the step's: listed first, the shadow of the step would "
    "meet the model's collectives on the ranks still training (a gloo abort; on NCCL a hang or wrong sums)"
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

    def main_hook(self) -> None:
        self.step()


class Joins:
    """The ``Join`` contexts built over one optimizer: whether one is open, and the refusal of one listing it first.
    A ``Join`` counts as open until it is gone (each hook held weakly, as its ``Join`` holds it): one kept may be
    entered again, and one that exited on an exception runs no post-hook."""

    def __init__(self) -> None:
        self.hooks: list[weakref.ref[ZeroJoinHook]] = []
        self.building = False  # from Join's call of join_hook to the optimizer's next step (or the refusal)

    def add(self, hook: ZeroJoinHook) -> ZeroJoinHook:
        self.hooks, self.building = [*(ref for ref in self.hooks if ref() is not None), weakref.ref(hook)], True
        return hook

    @property
    def open(self) -> bool:
        """Whether a ``Join`` built over the optimizer is still open (``ShardedDataParallel`` refuses it)."""
        return any(ref() is not None for ref in self.hooks)

    def check_not_first(self, joinable: Joinable) -> None:
        """Join's constructor marks the first joinable, then asks it for its device: asked then, listed first and
        enabled, the optimizer refuses, on every rank, before any collective (the refused Join's hook goes)."""
        config = joinable._join_config  # set by Join on each joinable; no public reader
        if self.building and config.is_first_joinable and config.enable:
            self.hooks, self.building = self.hooks[:-1], False
            Joinable.__init__(joinable)  # Join's mark undone: else each later step would send its notice
            raise ValueError(LISTED_FIRST)

    def notify(self, joinable: Joinable) -> None:
        """Join's notice, before the step's collectives (an all-reduce only from a first joinable)."""
        self.building = False
        Join.notify_join_context(joinable)
