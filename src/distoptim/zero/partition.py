"""Which rank owns which parameter: pure arithmetic, no process group, no tensors.

The plan is sorted-greedy by element count: the largest parameter goes to the least-loaded rank (ties to the
lowest rank), each parameter whole on one rank. Frozen parameters are owned by nobody (``UNOWNED``): they have no
optimizer state, take no part in the balance and are never communicated.

A plan can grow from a previous one (``add_param_group``, a frozen parameter made trainable): parameters that
already have an owner keep it, with their optimizer state, and only the newly trainable ones are placed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["UNOWNED", "PartitionPlan", "partition_parameters"]

UNOWNED = -1


@dataclass(frozen=True)
class PartitionPlan:
    """``owners[i]`` is the rank that owns global parameter ``i`` (``UNOWNED`` for frozen ones)."""

    world_size: int
    owners: tuple[int, ...]
    numels: tuple[int, ...]

    def params_of(self, rank: int) -> list[int]:
        """Global indices of the parameters ``rank`` owns, in global order."""
        return [index for index, owner in enumerate(self.owners) if owner == rank]

    def loads(self) -> list[int]:
        """Elements owned by each rank."""
        loads = [0] * self.world_size
        for owner, numel in zip(self.owners, self.numels):
            if owner != UNOWNED:
                loads[owner] += numel
        return loads


def partition_parameters(
    numels: Sequence[int],
    trainable: Sequence[bool],
    world_size: int,
    previous: PartitionPlan | None = None,
) -> PartitionPlan:
    """Assign every trainable parameter to one rank, balancing element counts (sorted greedy, a heap of loads).

    ``previous`` is the plan for a prefix of ``numels``: the owners it assigned stay put (also for parameters frozen
    since), and only trainable parameters without an owner are placed, onto the ranks left least loaded.
    O(P log P + P log N) for P parameters and N ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if len(numels) != len(trainable):
        raise ValueError(f"got {len(numels)} element counts but {len(trainable)} trainable flags")
    kept = previous.owners if previous is not None else ()
    if previous is not None and (previous.world_size != world_size or tuple(numels[: len(kept)]) != previous.numels):
        raise ValueError("previous plan does not describe a prefix of these parameters at this world size")
    owners = list(kept) + [UNOWNED] * (len(numels) - len(kept))
    loads = previous.loads() if previous is not None else [0] * world_size
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    new = [index for index, owner in enumerate(owners) if owner == UNOWNED and trainable[index]]
    for index in sorted(new, key=lambda i: (-numels[i], i)):
        load, rank = heap[0]
        owners[index] = rank
        heapq.heapreplace(heap, (load + numels[index], rank))
    return PartitionPlan(world_size=world_size, owners=tuple(owners), numels=tuple(numels))
