"""The only ZeRO module that calls ``torch.distributed``: a few collectives, always given an explicit group.

Ranks are group ranks everywhere in distoptim; translation to the global ranks that ``torch.distributed``'s
point-to-point and rooted collectives expect happens here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from distoptim._groups import comm_device, default_group, group_size

__all__ = [
    "Group",
    "all_gather_objects",
    "all_reduce_max_async",
    "broadcast_slices",
    "comm_device",
    "default_group",
    "gather_from_owners",
    "group_rank",
    "group_size",
    "receive_object",
    "receive_tensor",
    "send_object",
    "send_tensor",
    "wait_all",
]

Group = dist.ProcessGroup


def group_rank(group: Group) -> int:
    return dist.get_rank(group)


def _global(group: Group, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def broadcast_slices(
    buffer: Tensor, slices: Sequence[tuple[int, int, int]], group: Group, wait: bool = True
) -> list[Any]:
    """Broadcast ``buffer[start:end]`` from group rank ``src`` for each ``(src, start, end)``, concurrently.

    On gloo N broadcasts of 1/N each beat one all-gather (see DESIGN.md's measurements); empty slices are skipped
    on every rank alike since every rank knows the layout. With ``wait=False`` the pending works are returned for
    ``wait_all``.
    """
    works = [
        dist.broadcast(buffer[start:end], src=_global(group, src), group=group, async_op=True)
        for src, start, end in slices
        if end > start
    ]
    if wait:
        wait_all(works)
    return works


def wait_all(works: Sequence[Any]) -> None:
    for work in works:
        work.wait()


def all_gather_objects(obj: Any, group: Group) -> list[Any]:
    """Every rank's ``obj`` (small, picklable), on every rank."""
    gathered: list[Any] = [None] * group_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def send_object(obj: Any, to: int, group: Group) -> None:
    dist.send_object_list([obj], dst=_global(group, to), group=group)


def receive_object(source: int, group: Group, device: torch.device | None = None) -> Any:
    received: list[Any] = [None]
    dist.recv_object_list(received, src=_global(group, source), group=group, device=device)
    return received[0]


def send_tensor(tensor: Tensor, to: int, group: Group) -> None:
    dist.send(tensor, dst=_global(group, to), group=group)


def receive_tensor(tensor: Tensor, source: int, group: Group) -> None:
    dist.recv(tensor, src=_global(group, source), group=group)


def gather_from_owners(buffer: Tensor, bounds: Sequence[Sequence[int]], group: Group) -> None:
    """Every rank's ranges of ``buffer`` (rank ``r`` owns ``[b[r], b[r+1])`` of each region ``b``) to every rank.

    NCCL: one ``all_gather_into_tensor`` per region whose ranges are equal (the even partition's); otherwise (gloo,
    or unequal ranges) concurrent broadcasts, which gloo runs faster than its all-gather (see DESIGN.md).
    """
    equal_chunks = dist.get_backend(group) == "nccl"
    works = []
    for region in bounds:
        sizes = {end - start for start, end in pairwise(region)}
        if equal_chunks and len(sizes) == 1 and sizes != {0}:
            (size,) = sizes
            mine = region[group_rank(group)]
            works.append(
                dist.all_gather_into_tensor(
                    buffer[region[0] : region[-1]], buffer[mine : mine + size], group=group, async_op=True
                )
            )
        else:
            slices = [(rank, start, end) for rank, (start, end) in enumerate(pairwise(region))]
            works.extend(broadcast_slices(buffer, slices, group, wait=False))
    wait_all(works)


def all_reduce_max_async(tensor: Tensor, group: Group) -> Any:
    """Start overwriting ``tensor`` with its elementwise maximum over the ranks; ``wait_all([work])`` finishes it."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
