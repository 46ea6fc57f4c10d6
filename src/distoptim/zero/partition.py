"""Which rank owns which parameter: pure arithmetic, no process group, no tensors.

The plan is sorted-greedy by element count: the largest parameter goes to the least-loaded rank (ties to the
lowest rank), each parameter whole on one rank. Frozen parameters are owned by nobody (``UNOWNED``): they have no
optimizer state, take no part in the balance and are never communicated.
"""

from __future__ import annotations

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
    """Assign every trainable parameter to one rank, balancing element counts (sorted greedy).

    ``previous`` is the plan for a prefix of ``numels``: its assignments stay put and only the new parameters
    (those past the prefix) are placed, onto the ranks it left least loaded (``add_param_group``).
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
    new = [index for index in range(len(kept), len(numels)) if trainable[index]]
    for index in sorted(new, key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += numels[index]
    return PartitionPlan(world_size=world_size, owners=tuple(owners), numels=tuple(numels))
