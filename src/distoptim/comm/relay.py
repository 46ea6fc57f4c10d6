"""gloo's transfers where the owners' shares are unequal: each rank aggregates ``T/N`` of a layout's elements, so
every rank moves an all-reduce's bytes (``relayed`` chooses this or ``p2p.py``); ``docs/guides/internals.md``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from distoptim.comm import p2p
from distoptim.comm.groups import group_size

__all__ = ["Piece", "RelayedReduction", "aggregators", "received", "reduction", "relayed", "send_from_owners"]

SLACK = 0.05
"""How much more than the relay (as a fraction of an all-reduce's bytes) the direct path may move and be chosen."""


def receive_buffer(numel: int, like: Tensor) -> Tensor:
    """A receive buffer of ``numel`` elements shaped like ``like``'s dtype and device (one place to count them)."""
    return like.new_empty(numel)


class Piece(NamedTuple):
    """Elements ``[start, end)`` of a buffer, owned by ``owner`` and aggregated by ``aggregator``."""

    start: int
    end: int
    owner: int
    aggregator: int


def relayed(shares: Sequence[int], pieces: int = 0) -> bool:
    """Whether a layout whose ranks own ``shares`` elements goes through aggregators: direct while its busiest rank
    moves at most ``SLACK`` more than the relay, or when ``pieces`` exceed ``p2p.CHUNKS``."""
    size, total = len(shares), sum(shares)
    if size <= 2 or total == 0 or pieces > p2p.CHUNKS:
        return False
    return (size - 2) * (size * max(shares) - total) > SLACK * 2 * (size - 1) * total


def aggregators(by_owner: Sequence[Sequence[tuple[int, int]]]) -> list[Piece]:
    """Who aggregates each owned range (``by_owner[r]``: rank ``r``'s ranges): each rank ``T/N`` elements (the first
    ``T mod N`` ranks one more), its own first (its ranges in order), then the larger shares' surplus, in buffer
    order, to the ranks that are short, in rank order. Pure, so every rank cuts the same pieces."""
    size = len(by_owner)
    total = sum(end - start for ranges in by_owner for start, end in ranges)
    room = [total // size + (rank < total % size) for rank in range(size)]
    pieces, surplus = [], []
    for owner, ranges in enumerate(by_owner):
        for start, end in ranges:
            kept = min(end - start, room[owner])
            room[owner] -= kept
            if kept:
                pieces.append(Piece(start, start + kept, owner, owner))
            if start + kept < end:
                surplus.append((start + kept, end, owner))
    spare = [rank for rank in range(size) if room[rank]]
    for start, end, owner in sorted(surplus):
        while start < end:
            taker = spare[0]
            taken = min(end - start, room[taker])
            pieces.append(Piece(start, start + taken, owner, taker))
            room[taker] -= taken
            start += taken
            if not room[taker]:
                spare.pop(0)
    return pieces


def _plan(by_owner: Sequence[Sequence[tuple[int, int]]], chosen: bool | None = None) -> list[Piece] | None:
    """The aggregators' pieces where the layout goes through them (``chosen``, else ``relayed``), else None."""
    shares = [sum(end - start for start, end in ranges) for ranges in by_owner]
    if not (relayed(shares) if chosen is None else chosen and len(shares) > 2):
        return None
    pieces = aggregators(by_owner)
    return pieces if sum(piece.owner != piece.aggregator for piece in pieces) <= p2p.CHUNKS else None


def received(by_owner: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """The elements each rank receives in a reduction to owners of this layout (what the planner prints)."""
    pieces = _plan(by_owner)
    if pieces is None:  # direct: every other rank's copy of each owned element
        return [(len(by_owner) - 1) * sum(end - start for start, end in ranges) for ranges in by_owner]
    counts = [0] * len(by_owner)
    for start, end, owner, aggregator in pieces:
        if owner == aggregator:
            counts[owner] += (len(by_owner) - 1) * (end - start)
        else:  # the aggregator hears from all but the owner and itself; the owner from the aggregator
            counts[aggregator] += (len(by_owner) - 2) * (end - start)
            counts[owner] += end - start
    return counts


def reduction(buffer: Tensor, by_owner: Sequence[Sequence[tuple[int, int]]], group: dist.ProcessGroup) -> Any:
    """A reduction to owners of ``buffer``'s ranges (``by_owner[r]``: rank ``r``'s), started; ``wait()`` ends it."""
    pieces = _plan(by_owner)
    if pieces is None:
        return p2p.ReductionExchange(buffer, by_owner, group)
    return RelayedReduction(buffer, pieces, group)


class RelayedReduction:
    """A reduction to owners through aggregators; started when built, finished by ``wait()`` (once, any thread).
    Each rank sends its contributions to their aggregators at once; on the thread beside the waiter it aggregates
    (sums, in rank order, sent on to the owner), then as an owner adds the partial sums it receives."""

    def __init__(self, buffer: Tensor, pieces: Sequence[Piece], group: dist.ProcessGroup) -> None:
        size, mine = group_size(group), dist.get_rank(group)
        self.group, self.buffer = group, buffer
        self.direct = p2p.ReductionExchange(
            buffer,
            [[(p.start, p.end) for p in pieces if p.owner == p.aggregator == rank] for rank in range(size)],
            group,
        )
        self.to_aggregators, self.to_owners = p2p.reduction_tags(group), p2p.reduction_tags(group)
        relayed = [piece for piece in pieces if piece.owner != piece.aggregator]
        elements = sum(piece.end - piece.start for piece in relayed)
        staged = p2p.STAGING_BYTES // (2 * max(1, size - 2) * buffer.element_size())
        self.chunk = max(1, staged, -(-elements // max(1, p2p.CHUNKS - len(relayed))))  # at most CHUNKS messages
        self.messages = [
            Piece(at, min(at + self.chunk, piece.end), piece.owner, piece.aggregator)
            for piece in relayed
            for at in range(piece.start, piece.end, self.chunk)
        ]
        self.sends = [
            dist.isend(
                buffer[m.start : m.end], dst=self._global(m.aggregator), group=group, tag=self.to_aggregators + i
            )
            for i, m in enumerate(self.messages)
            if mine not in (m.owner, m.aggregator)
        ]
        self.partial_sums: list[Any] = []  # the aggregator's sends to the owners (waited for in ``wait``)
        self.gathered = [(i, m) for i, m in enumerate(self.messages) if m.aggregator == mine]
        self.incoming = [(i, m) for i, m in enumerate(self.messages) if m.owner == mine]
        self.contributors = sorted({p for _, m in self.gathered for p in range(size) if p not in (m.owner, mine)})
        self.staging_bytes = buffer.element_size() * (
            len(self.contributors) * sum(_slots(self.gathered)) + sum(_slots(self.incoming))
        )  # this rank's staging (the direct pieces' apart), counted in the group's budget until the thread is done
        self.relayed: Future[None] | None = None
        if self.gathered or self.incoming:
            p2p.count_staging(group, self.staging_bytes)
            self.relayed = p2p.run_beside(self._relay, group)
        self.done = False

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def _relay(self) -> None:
        try:
            self._aggregate()
            self._collect()
        finally:
            p2p.count_staging(self.group, -self.staging_bytes)

    def _aggregate(self) -> None:
        """As an aggregator: every chunk summed and sent on to its owner."""
        staging = {peer: [receive_buffer(n, self.buffer) for n in _slots(self.gathered)] for peer in self.contributors}

        def send_on(i: int, m: Piece) -> None:
            owner = self._global(m.owner)
            sent = dist.isend(self.buffer[m.start : m.end], dst=owner, group=self.group, tag=self.to_owners + i)
            self.partial_sums.append(sent)

        sources = [[peer for peer in self.contributors if peer != m.owner] for _, m in self.gathered]
        self._add_received(self.gathered, sources, staging.__getitem__, self.to_aggregators, send_on)

    def _collect(self) -> None:
        """As an owner: every partial sum received and added into this rank's own contribution."""
        slots = [receive_buffer(n, self.buffer) for n in _slots(self.incoming)]
        self._add_received(self.incoming, [[m.aggregator] for _, m in self.incoming], lambda _: slots, self.to_owners)

    def _add_received(
        self,
        messages: Sequence[tuple[int, Piece]],
        sources: list[list[int]],
        slots_of: Callable[[int], list[Tensor]],
        tag: int,
        then: Callable[[int, Piece], None] = lambda i, m: None,
    ) -> None:
        """Each message's rows from its ``sources``, in order, added into this rank's own, then ``then(i, m)``; two
        messages in flight, taking turns in a peer's two ``slots_of(peer)``."""

        def post(k: int) -> list[tuple[Any, Tensor]]:
            i, m = messages[k]
            rows = [(peer, slots_of(peer)[k % 2][: m.end - m.start]) for peer in sources[k]]
            return [(dist.irecv(row, src=self._global(peer), group=self.group, tag=tag + i), row) for peer, row in rows]

        posted = [post(k) for k in range(min(2, len(messages)))]
        for k, (i, m) in enumerate(messages):
            for work, _ in posted[k]:
                work.wait()
            p2p.add_rows(self.buffer[m.start : m.end], [row for _, row in posted[k]])
            then(i, m)
            if k + 2 < len(messages):
                posted.append(post(k + 2))

    def wait(self) -> None:
        """The direct pieces, then the thread's part (partial sums sent and received), then this rank's sends."""
        if self.done:
            return
        try:
            self.direct.wait()
            if self.relayed is not None:
                self.relayed.wait()
            for work in [*self.sends, *self.partial_sums]:
                work.wait()
        finally:
            self.done, self.sends, self.partial_sums = True, [], []


def _slots(messages: Sequence[tuple[int, Piece]]) -> list[int]:
    """The elements of each of the (at most two) staging slots that ``messages`` take turns in."""
    return [max(m.end - m.start for _, m in messages[slot::2]) for slot in range(min(2, len(messages)))]


def send_from_owners(
    buffer: Tensor, slices: Sequence[tuple[int, int, int]], group: dist.ProcessGroup, chosen: bool | None = None
) -> list[Any]:
    """Each ``buffer[start:end]`` of group rank ``src`` to every other rank, for every ``(src, start, end)``: direct,
    or where ``relayed`` (or ``chosen`` by the caller) through aggregators. Returns the pending works."""
    size, mine = group_size(group), dist.get_rank(group)
    by_owner: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    for src, start, end in slices:
        if end > start:
            by_owner[src].append((start, end))
    pieces = _plan(by_owner, chosen)
    if pieces is None:
        return p2p.send_from_owners(buffer, slices, group)
    works = p2p.send_from_owners(buffer, [(p.owner, p.start, p.end) for p in pieces if p.owner == p.aggregator], group)
    tag = p2p.sync_tags(group)
    forwards: list[tuple[Any, Piece, int]] = []
    for i, piece in enumerate(p for p in pieces if p.owner != p.aggregator):
        view, peer = buffer[piece.start : piece.end], dist.get_global_rank(group, piece.aggregator)
        if mine == piece.owner:
            works.append(dist.isend(view, dst=peer, group=group, tag=tag + i))
        elif mine == piece.aggregator:
            owner = dist.get_global_rank(group, piece.owner)
            forwards.append((dist.irecv(view, src=owner, group=group, tag=tag + i), piece, tag + i))
        else:
            works.append(dist.irecv(view, src=peer, group=group, tag=tag + i))
    if forwards:
        works.append(_Forwarding(buffer, forwards, group))
    return works


class _Forwarding:
    """An aggregator's part of a relayed sync: each piece, once received from its owner, sent on to every rank."""

    def __init__(self, buffer: Tensor, forwards: list[tuple[Any, Piece, int]], group: dist.ProcessGroup) -> None:
        self.buffer, self.forwards, self.group = buffer, forwards, group
        self.sends: list[Any] = []
        self.done = p2p.run_beside(self._forward, group)

    def _forward(self) -> None:
        size, mine = group_size(self.group), dist.get_rank(self.group)
        for received, piece, tag in self.forwards:
            received.wait()
            view = self.buffer[piece.start : piece.end]
            self.sends += [
                dist.isend(view, dst=dist.get_global_rank(self.group, peer), group=self.group, tag=tag)
                for peer in range(size)
                if peer not in (piece.owner, mine)
            ]

    def wait(self) -> None:
        self.done.wait()
        for work in self.sends:
            work.wait()
        self.sends, self.forwards = [], []
