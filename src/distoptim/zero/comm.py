"""The only ZeRO module that calls ``torch.distributed``: a few collectives, always given an explicit group.

Ranks are group ranks everywhere in distoptim; translation to the global ranks that ``torch.distributed``'s
point-to-point and rooted collectives expect happens here and nowhere else.
"""

from __future__ import annotations

import pickle
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
    "all_reduce_",
    "all_reduce_async",
    "broadcast_slices",
    "comm_device",
    "default_group",
    "gather_from_owners",
    "global_rank",
    "group_rank",
    "group_size",
    "receive_object",
    "receive_tensor",
    "reduce_to_owners_async",
    "send_object",
    "send_tensor",
    "wait_all",
]

Group = dist.ProcessGroup


def group_rank(group: Group) -> int:
    return dist.get_rank(group)


def global_rank(group: Group, rank: int) -> int:
    """The global rank of group rank ``rank`` (what torch.distributed's rooted and point-to-point calls take)."""
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
        dist.broadcast(buffer[start:end], src=global_rank(group, src), group=group, async_op=True)
        for src, start, end in slices
        if end > start
    ]
    if wait:
        wait_all(works)
    return works


def wait_all(works: Sequence[Any]) -> None:
    for work in works:
        work.wait()


# Objects travel as pickled bytes in uint8 tensors on the communication device, length first: torch's own object
# collectives (all_gather_object, send_object_list, ...) need numpy, which distoptim does not depend on.


def all_gather_objects(obj: Any, group: Group, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``obj`` (small, picklable), on every rank: lengths first, then the bytes padded to the longest.

    ``device``: the communication device (``comm_device(group)`` when None).
    """
    device = comm_device(group) if device is None else device
    mine = _to_bytes(obj, device)
    lengths = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(group_size(group))]
    dist.all_gather(lengths, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    sizes = [int(length.item()) for length in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [_from_bytes(payload[:size]) for payload, size in zip(gathered, sizes)]


def send_object(obj: Any, to: int, group: Group, device: torch.device | None = None) -> None:
    """Send a picklable ``obj`` to group rank ``to``, which calls ``receive_object``; ``device`` as for receiving."""
    payload = _to_bytes(obj, comm_device(group) if device is None else device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    dist.send(length, dst=global_rank(group, to), group=group)
    dist.send(payload, dst=global_rank(group, to), group=group)


def receive_object(source: int, group: Group, device: torch.device | None = None) -> Any:
    """The object group rank ``source`` sends with ``send_object`` (``device``: the communication device)."""
    device = comm_device(group) if device is None else device
    length = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(length, src=global_rank(group, source), group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src=global_rank(group, source), group=group)
    return _from_bytes(payload)


def _to_bytes(obj: Any, device: torch.device) -> Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(payload: Tensor) -> Any:
    buffer = bytearray(payload.numel())
    torch.frombuffer(buffer, dtype=torch.uint8).copy_(payload)  # the tensor writes into the bytearray it wraps
    return pickle.loads(buffer)


def send_tensor(tensor: Tensor, to: int, group: Group) -> None:
    dist.send(tensor, dst=global_rank(group, to), group=group)


def receive_tensor(tensor: Tensor, source: int, group: Group) -> None:
    dist.recv(tensor, src=global_rank(group, source), group=group)


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


def reduce_to_owners_async(
    buffer: Tensor, slices: Sequence[tuple[int, int, int]], group: Group, max_rooted_calls_per_rank: int = 4
) -> torch.futures.Future[Tensor]:
    """Sum ``buffer[start:end]`` over the ranks onto group rank ``owner``, for every ``(owner, start, end)``,
    asynchronously; the future yields ``buffer``, whose owned slices then hold the sums (the rest is unspecified).

    gloo: one rooted reduce per slice, in place, concurrently (faster than its reduce-scatter, see DESIGN.md), or,
    when the slices are many (owners interleaved), packed owner by owner into one staging tensor first. NCCL: one
    ``reduce_scatter_tensor`` over the owners' slices packed into equal, padded chunks.
    """
    size = group_size(group)
    nccl = dist.get_backend(group) == "nccl"
    if not nccl and len(slices) <= max_rooted_calls_per_rank * size:
        works = [
            dist.reduce(buffer[start:end], dst=global_rank(group, owner), group=group, async_op=True)
            for owner, start, end in slices
        ]
        return _when_done(works, buffer)
    by_owner: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    for owner, start, end in slices:
        by_owner[owner].append((start, end))
    sizes = [sum(end - start for start, end in ranges) for ranges in by_owner]
    chunk = max(sizes) if nccl else 0
    starts = [rank * chunk for rank in range(size)] if nccl else [sum(sizes[:rank]) for rank in range(size)]
    stage = buffer.new_zeros(chunk * size if nccl else sum(sizes))
    for ranges, at in zip(by_owner, starts):
        for start, end in ranges:
            stage[at : at + end - start].copy_(buffer[start:end])
            at += end - start
    mine = group_rank(group)
    if nccl:
        own = stage.new_empty(chunk)
        works = [dist.reduce_scatter_tensor(own, stage, group=group, async_op=True)]
    else:
        own = stage[starts[mine] : starts[mine] + sizes[mine]]
        works = [
            dist.reduce(stage[at : at + n], dst=global_rank(group, rank), group=group, async_op=True)
            for rank, (at, n) in enumerate(zip(starts, sizes))
            if n
        ]

    def land(_: torch.futures.Future[Any]) -> Tensor:
        at = 0
        for start, end in by_owner[mine]:
            buffer[start:end].copy_(own[at : at + end - start])
            at += end - start
        return buffer

    landed: torch.futures.Future[Tensor] = torch.futures.collect_all([w.get_future() for w in works]).then(land)
    return landed


def _when_done(works: Sequence[Any], value: Tensor) -> torch.futures.Future[Tensor]:
    """A future that yields ``value`` once every work in ``works`` has completed."""
    done: torch.futures.Future[Tensor] = torch.futures.collect_all([w.get_future() for w in works]).then(
        lambda _: value
    )
    return done


def all_reduce_(tensor: Tensor, group: Group, op: str = "sum") -> Tensor:
    """``tensor`` overwritten with its reduction over the ranks (``op``: "sum", "max" or "min"), and returned."""
    all_reduce_async(tensor, group, op).wait()
    return tensor


def all_reduce_async(tensor: Tensor, group: Group, op: str = "sum") -> Any:
    """Start overwriting ``tensor`` with its reduction over the ranks; ``wait_all([work])`` finishes it."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    return dist.all_reduce(tensor, op=ops[op], group=group, async_op=True)
