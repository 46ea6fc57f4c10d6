"""ZeRO's collectives, always given a group (group ranks; global ones only here and in ``p2p.py``), in two styles
(``Collectives``) that ``DISTOPTIM_COLLECTIVES`` may override: ``docs/guides/internals.md``."""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from distoptim import _host
from distoptim.comm import p2p, relay
from distoptim.comm.groups import backends_of, comm_device, default_group, group_size
from distoptim.comm.objects import all_gather_objects, receive_object, release, send_object
from distoptim.comm.relay import relayed

__all__ = [
    "ENVIRONMENT",
    "EVERY",
    "Collectives",
    "Group",
    "all_gather_objects",
    "all_reduce_",
    "all_reduce_async",
    "broadcast_slices",
    "choose_collectives",
    "comm_device",
    "default_group",
    "gather_from_owners",
    "global_rank",
    "group_rank",
    "group_size",
    "receive_object",
    "receive_tensor",
    "reduce_to_owners_async",
    "relayed",
    "send_object",
    "send_tensor",
    "sum_flags",
    "sum_unread",
    "wait_all",
]

Group = dist.ProcessGroup


def _torch_collective(name: str, before_2_13: str) -> Any:
    """torch 2.13's name for an equal-chunk collective (the older name warns there), else the older one."""
    return getattr(dist, name, None) or getattr(dist, before_2_13)


ENVIRONMENT = "DISTOPTIM_COLLECTIVES"
EVERY = -1
"""The "owner" of a slice that every rank needs reduced (elements nobody owns yet): it is all-reduced."""


class Collectives(enum.Enum):
    """How gradients reach their owners and parameters leave them."""

    POINT_TO_POINT = "p2p"
    """Point to point between each rank and each owner (``p2p.py``, ``relay.py``); GPU tensors use rooted calls."""
    CHUNKED = "chunked"
    """``reduce_scatter_tensor`` / ``all_gather_into_tensor`` where the owners' shares are equal, else rooted calls."""


def choose_collectives(group: Group) -> Collectives:
    """The style for ``group``: ``$DISTOPTIM_COLLECTIVES``, ``auto`` (p2p on gloo, else chunked), p2p or chunked."""
    value = os.environ.get(ENVIRONMENT, "auto").strip().lower() or "auto"
    backends = set(backends_of(group).values())
    if value == "auto":
        return Collectives.POINT_TO_POINT if backends == {"gloo"} else Collectives.CHUNKED
    if value == "rooted":  # the gloo style before p2p
        raise ValueError(f"{ENVIRONMENT}=rooted is gone: gloo's style is now p2p (faster); use auto, p2p or chunked")
    try:
        collectives = Collectives(value)
    except ValueError:
        raise ValueError(
            f"{ENVIRONMENT}={value!r} is not a collective style: use auto (by backend), p2p or chunked"
        ) from None
    if backends != {"gloo"} and collectives is Collectives.POINT_TO_POINT:
        backend = "+".join(sorted(backends))
        raise ValueError(
            f"{ENVIRONMENT}=p2p is gloo's style: it pairs messages by tag, which {backend} need not do. Use chunked "
            f"({backend}'s default) or auto"
        )
    return collectives


def group_rank(group: Group) -> int:
    return dist.get_rank(group)


def global_rank(group: Group, rank: int) -> int:
    """The global rank of group rank ``rank`` (what torch.distributed's rooted and point-to-point calls take)."""
    return dist.get_global_rank(group, rank)


def broadcast_slices(
    buffer: Tensor,
    slices: Sequence[tuple[int, int, int]],
    group: Group,
    wait: bool = True,
    collectives: Collectives | None = None,
    relay_path: bool | None = None,
) -> list[Any]:
    """Broadcast ``buffer[start:end]`` from group rank ``src`` for each ``(src, start, end)``, concurrently (p2p:
    ``relay.send_from_owners``, ``relay_path`` as it takes it); ``wait=False`` returns the works for ``wait_all``."""
    if _point_to_point(collectives, buffer):
        works = relay.send_from_owners(buffer, slices, group, relay_path)
    else:
        works = [
            dist.broadcast(buffer[start:end], src=global_rank(group, src), group=group, async_op=True)
            for src, start, end in slices
            if end > start
        ]
    if wait:
        wait_all(works)
    return works


def _point_to_point(collectives: Collectives | None, buffer: Tensor) -> bool:
    return collectives is Collectives.POINT_TO_POINT and buffer.device.type == "cpu"


def wait_all(works: Sequence[Any]) -> None:
    for work in works:
        work.wait()


def send_tensor(tensor: Tensor, to: int, group: Group) -> None:
    dist.send(tensor, dst=global_rank(group, to), group=group)


def receive_tensor(tensor: Tensor, source: int, group: Group) -> None:
    dist.recv(tensor, src=global_rank(group, source), group=group)


def _equal_chunk(sizes: Sequence[int]) -> int | None:
    """The common size of the ranks' shares when they are equal and not empty, else None."""
    distinct = set(sizes)
    return distinct.pop() if len(distinct) == 1 and 0 not in distinct else None


def gather_from_owners(
    buffer: Tensor, bounds: Sequence[Sequence[int]], group: Group, collectives: Collectives, wait: bool = True
) -> list[Any]:
    """Every rank's ranges of ``buffer`` (rank ``r`` owns ``[b[r], b[r+1])`` of each region ``b``) to every rank;
    ``wait=False`` returns the pending works for ``wait_all``."""
    works = []
    for region in bounds:
        size = _equal_chunk([end - start for start, end in pairwise(region)])
        if collectives is Collectives.CHUNKED and size is not None:
            mine = region[group_rank(group)]
            output, piece = buffer[region[0] : region[-1]], buffer[mine : mine + size]
            all_gather = _torch_collective("all_gather_single", "all_gather_into_tensor")
            works.append(all_gather(output, piece, group=group, async_op=True))
        else:
            slices = [(rank, start, end) for rank, (start, end) in enumerate(pairwise(region))]
            works.extend(broadcast_slices(buffer, slices, group, wait=False, collectives=collectives))
    if wait:
        wait_all(works)
    return works


def reduce_to_owners_async(
    buffer: Tensor,
    slices: Sequence[tuple[int, int, int]],
    group: Group,
    collectives: Collectives,
    *,
    replicas: Group | None = None,
    max_rooted_calls_per_rank: int = 4,
) -> Future[Tensor]:
    """Sum ``buffer[start:end]`` over the ranks onto group rank ``owner`` for every ``(owner, start, end)`` (owner
    ``EVERY``: onto every rank), asynchronously; the future yields ``buffer``, its owned slices summed. ``replicas``
    (hybrid sharding): the sums are then summed over that group too."""
    everywhere = [buffer[start:end] for owner, start, end in slices if owner == EVERY and end > start]
    works = [dist.all_reduce(piece, group=group, async_op=True) for piece in everywhere]
    owned = [piece for piece in slices if piece[0] != EVERY]
    reduced, sums, moves = _start_reduction(buffer, owned, group, collectives, max_rooted_calls_per_rank)
    works += reduced
    if replicas is not None:  # the owned sums exist once the shard group's reduction is done (ordered, not blocking
        wait_all(works)  # the CPU, under NCCL); then they (and EVERY slices) are summed across the shard groups
        works = [dist.all_reduce(piece, group=replicas, async_op=True) for piece in [*sums, *everywhere]]

    def landed(done: Future[Any]) -> Tensor:
        done.wait()  # a work's error (a peer gone, a timeout) reaches the caller, never a partial sum
        for target, source in moves:
            target.copy_(source)
        return buffer

    on_host = buffer.device.type == "cpu"
    ran_on = replicas if replicas is not None else group  # the works still pending ran there
    result: Future[Tensor] = _when_done(works, ran_on, on_host).then(landed)
    return result


_Moves = list[tuple[Tensor, Tensor]]  # (target, source): where the owned sums are copied into the buffer once done


def _start_reduction(
    buffer: Tensor, owned: Sequence[tuple[int, int, int]], group: Group, collectives: Collectives, max_calls: int
) -> tuple[list[Any], list[Tensor], _Moves]:
    """The reduction's works, where the owned sums will be, and their moves into ``buffer``."""
    size, mine = group_size(group), group_rank(group)
    by_owner: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    for owner, start, end in owned:
        if end > start:
            by_owner[owner].append((start, end))
    shares = [sum(end - start for start, end in ranges) for ranges in by_owner]
    if _point_to_point(collectives, buffer):
        exchange = relay.reduction(buffer, by_owner, group)  # summed in place as the chunks arrive
        return [exchange], [buffer[start:end] for start, end in by_owner[mine]], []
    chunk = _equal_chunk(shares) if collectives is Collectives.CHUNKED else None
    if chunk is not None:
        stage = _rank_by_rank(buffer, by_owner, chunk)
        own = stage.new_empty(chunk)
        reduce_scatter = _torch_collective("reduce_scatter_single", "reduce_scatter_tensor")
        work = reduce_scatter(own, stage, group=group, async_op=True)
        return [work], [own], _scatter_moves(buffer, by_owner[mine], own)
    if sum(map(len, by_owner)) <= max_calls * size:  # in place, one reduce per slice
        works = [
            dist.reduce(buffer[start:end], dst=global_rank(group, owner), group=group, async_op=True)
            for owner, ranges in enumerate(by_owner)
            for start, end in ranges
        ]
        return works, [buffer[start:end] for start, end in by_owner[mine]], []
    starts = [sum(shares[:rank]) for rank in range(size)]
    stage = buffer.new_empty(sum(shares))
    for ranges, at in zip(by_owner, starts):
        p2p.pack_into(stage[at:], buffer, ranges)
    works = [
        dist.reduce(stage[at : at + n], dst=global_rank(group, rank), group=group, async_op=True)
        for rank, (at, n) in enumerate(zip(starts, shares))
        if n
    ]
    own = stage[starts[mine] : starts[mine] + shares[mine]]
    return works, [own], _scatter_moves(buffer, by_owner[mine], own)


def _rank_by_rank(buffer: Tensor, by_owner: list[list[tuple[int, int]]], chunk: int) -> Tensor:
    """The owners' ranges one rank after another: the buffer itself when it already is, else a packed copy."""
    first = by_owner[0][0][0]
    if all(ranges == [(first + rank * chunk, first + (rank + 1) * chunk)] for rank, ranges in enumerate(by_owner)):
        return buffer[first : first + chunk * len(by_owner)]
    stage = buffer.new_empty(chunk * len(by_owner))
    for rank, ranges in enumerate(by_owner):
        p2p.pack_into(stage[rank * chunk :], buffer, ranges)
    return stage


def _scatter_moves(buffer: Tensor, ranges: Sequence[tuple[int, int]], own: Tensor) -> _Moves:
    starts = [0, *accumulate(end - start for start, end in ranges)]
    return [(buffer[start:end], own[at : at + end - start]) for (start, end), at in zip(ranges, starts)]


def _when_done(works: Sequence[Any], group: Group, on_host: bool) -> Future[Any]:
    """A future that completes once every work has: NCCL's last (its works run in order on one stream), all of
    gloo's; works without a future are waited for on ``p2p``'s waiter thread (``on_host``), else here."""
    futures, futureless = [], []
    for work in works:
        try:
            futures.append(work.get_future())
        except (RuntimeError, AttributeError):  # "Work::getFuture not implemented"; a p2p.ReductionExchange
            futureless.append(work)
    if futureless and on_host:
        futures.append(p2p.future_of(futureless, group))
    else:
        wait_all(futureless)
    if futures and backends_of(group) == {"cuda": "nccl"}:
        last: Future[Any] = futures[-1]
        return last
    collected: Future[Any] = torch.futures.collect_all(futures)  # of none: already complete
    return collected


def all_reduce_(tensor: Tensor, group: Group, op: str = "sum") -> Tensor:
    """``tensor`` overwritten with its reduction over the ranks (``op``: "sum", "max" or "min"), and returned."""
    all_reduce_async(tensor, group, op).wait()
    return tensor


def sum_flags(
    flags: Sequence[bool], device: torch.device, groups: Sequence[Group], what: str, later: Sequence[Tensor] = ()
) -> list[int]:
    """How many ranks set each flag: an int32 all-reduce over each of ``groups`` in turn, read back once (``what``);
    ``later``: 0-d flags still on ``device`` (unread: no stall before the sum), after ``flags``."""
    counts = torch.tensor(list(flags), dtype=torch.int32, device=device)
    if later:
        counts = torch.cat([counts, torch.stack(list(later)).to(device, torch.int32)])
    return list(_host.read(sum_unread(counts, groups), what))


def sum_unread(flags: Tensor, groups: Sequence[Group]) -> Tensor:
    """``flags`` as int32, summed over each of ``groups`` in turn and left on their device unread (no stall)."""
    summed = flags.to(torch.int32)
    for group in groups:
        all_reduce_(summed, group)
    if summed.is_cpu:  # gloo's worker lets go of it now, not after the backward (as the agreements' tensors)
        release(summed)
    return summed


def all_reduce_async(tensor: Tensor, group: Group, op: str = "sum") -> Any:
    """Start overwriting ``tensor`` with its reduction over the ranks; ``wait_all([work])`` finishes it."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    return dist.all_reduce(tensor, op=ops[op], group=group, async_op=True)
