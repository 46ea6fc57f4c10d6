"""gloo's fastest way to move a step's bytes: each rank sending each owner its share directly, point to point
(``ReductionExchange``, ``send_from_owners``); ``docs/guides/internals.md``."""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from distoptim.comm.groups import attached, attached_everywhere, group_size

__all__ = [
    "CHUNKS",
    "FIRST_REDUCTION_TAG",
    "STAGING_BYTES",
    "ReductionExchange",
    "add_rows",
    "count_staging",
    "future_of",
    "pack_into",
    "reduction_tags",
    "run_beside",
    "send_from_owners",
    "started",
    "sync_tags",
]

STAGING_BYTES = 8 << 20
"""The most an owner's receives of one reduction hold at once (two chunks in flight from each other rank)."""

_SYNC_TAG = 0xD15
"""The parameter sync's messages, posted by the training loop only, in the same order on every rank."""
FIRST_REDUCTION_TAG = 1 << 30
_FIRST_SYNC_TAG = 1 << 29  # the relayed syncs' (``relay.py``): below the reductions', far above _SYNC_TAG
_CHUNK_BITS = 12
CHUNKS = 1 << _CHUNK_BITS
"""The tags one reservation (``reduction_tags``, ``sync_tags``) holds: the most messages it may number."""
_SEQUENCE_BITS = 30 - _CHUNK_BITS
_staged_lock = threading.Lock()  # taken by the training thread (starting) and the waiters (finishing)


def _global(group: dist.ProcessGroup, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def send_from_owners(buffer: Tensor, slices: Sequence[tuple[int, int, int]], group: dist.ProcessGroup) -> list[Any]:
    """Each ``buffer[start:end]`` sent by group rank ``src`` to every other rank and received there in place, for
    every ``(src, start, end)``; the pending works are returned for ``wait``."""
    size, mine = group_size(group), dist.get_rank(group)
    works = []
    for src, start, end in slices:
        if end <= start:
            continue
        piece = buffer[start:end]
        if src == mine:
            works += [
                dist.isend(piece, dst=_global(group, peer), group=group, tag=_SYNC_TAG)
                for peer in range(size)
                if peer != mine
            ]
        else:
            works.append(dist.irecv(piece, src=_global(group, src), group=group, tag=_SYNC_TAG))
    return works


class ReductionExchange:
    """One reduction to owners (``by_owner[r]``: rank ``r``'s ranges of ``buffer``), point to point, in chunks;
    started when built (receiving only if the group's staging allows), finished by ``wait()`` (once, any thread)."""

    def __init__(self, buffer: Tensor, by_owner: Sequence[Sequence[tuple[int, int]]], group: dist.ProcessGroup):
        size, mine = group_size(group), dist.get_rank(group)
        self.state = state = _state(group)
        self.group, self.tag = group, reduction_tags(group)
        self.peers = [rank for rank in range(size) if rank != mine]
        largest = max((sum(end - start for start, end in ranges) for ranges in by_owner), default=0)
        staged_chunk = STAGING_BYTES // (2 * max(1, len(self.peers)) * buffer.element_size())
        self.chunk = max(1, staged_chunk, -(-largest // (1 << _CHUNK_BITS)))  # alike on every rank: same chunks
        self.sends = [
            work
            for owner, ranges in enumerate(by_owner)
            if owner != mine and ranges
            for work in self._send_chunks(_packed(buffer, ranges), owner)
        ]
        self.dtype, self.device = buffer.dtype, buffer.device
        self.targets = [buffer[start:end] for start, end in by_owner[mine]]
        share = sum(target.numel() for target in self.targets) if self.peers else 0  # alone: nothing to receive
        self.bounds = [(at, min(at + self.chunk, share)) for at in range(0, share, self.chunk)]
        self.staging_bytes = min(2, len(self.bounds)) * min(self.chunk, share) * buffer.element_size() * len(self.peers)
        self.staging: dict[int, list[Tensor]] = {}
        self.receives: dict[tuple[int, int], Any] = {}
        self.done = False
        with _staged_lock:  # once one waits its turn, so do the later ones: the waiter finds the earlier ones done
            staged = state.staged
            self.receiving = not state.deferred and (not staged or staged + self.staging_bytes <= 2 * STAGING_BYTES)
            if self.receiving:
                state.staged += self.staging_bytes
            else:
                state.deferred += 1
        if self.receiving:
            self._start_receiving()

    def _send_chunks(self, outgoing: Tensor, owner: int) -> list[Any]:
        return [
            dist.isend(outgoing[at : at + self.chunk], dst=_global(self.group, owner), group=self.group, tag=tag)
            for tag, at in enumerate(range(0, outgoing.numel(), self.chunk), start=self.tag)
        ]

    def _start_receiving(self) -> None:
        staged = min(self.chunk, self.bounds[-1][1]) if self.bounds else 0
        self.staging = {
            peer: [torch.empty(staged, dtype=self.dtype, device=self.device) for _ in self.bounds[:2]]
            for peer in self.peers
        }
        for number in range(min(2, len(self.bounds))):
            for peer in self.peers:
                self._receive(number, peer)

    def _receive(self, number: int, peer: int) -> None:
        start, end = self.bounds[number]
        into = self.staging[peer][number % 2][: end - start]
        self.receives[number, peer] = dist.irecv(
            into, src=_global(self.group, peer), group=self.group, tag=self.tag + number
        )

    def wait(self) -> None:
        """Receive and add every chunk, then wait for this rank's sends."""
        if self.done:
            return
        if not self.receiving:
            with _staged_lock:
                self.state.staged += self.staging_bytes
                self.state.deferred -= 1
            self.receiving = True
        try:
            if not self.staging and self.bounds:  # not started when built
                self._start_receiving()
            for number, (start, end) in enumerate(self.bounds):
                rows = []
                for peer in self.peers:
                    self.receives.pop((number, peer)).wait()
                    rows.append(self.staging[peer][number % 2][: end - start])
                _add_into(self.targets, start, rows)
                if number + 2 < len(self.bounds):
                    for peer in self.peers:
                        self._receive(number + 2, peer)
            for work in self.sends:
                work.wait()
        finally:
            with _staged_lock:
                self.state.staged -= self.staging_bytes
            self.done, self.staging, self.sends, self.targets = True, {}, [], []


def reduction_tags(group: dist.ProcessGroup) -> int:
    """The first of ``CHUNKS`` tags of a reduction's own, the next of ``group``'s (alike on every rank)."""
    state = _state(group)
    state.reductions += 1
    return FIRST_REDUCTION_TAG + (((state.reductions - 1) % (1 << _SEQUENCE_BITS)) << _CHUNK_BITS)


def sync_tags(group: dist.ProcessGroup) -> int:
    """The first of ``CHUNKS`` tags of a relayed sync's own (``reduction_tags``' rule, syncs counted apart)."""
    state = _state(group)
    state.syncs += 1
    return _FIRST_SYNC_TAG + (((state.syncs - 1) % (1 << (_SEQUENCE_BITS - 1))) << _CHUNK_BITS)


def started(group: dist.ProcessGroup) -> tuple[int, int]:
    """The reductions and relayed syncs ``group`` has started: alike on every rank, unless a backward raised after
    launching more reductions on some ranks than on others (its tags no longer pair up: a new group is needed)."""
    state = _state(group)
    return state.reductions, state.syncs


def _packed(buffer: Tensor, ranges: Sequence[tuple[int, int]]) -> Tensor:
    """``buffer``'s ranges one after another: a view when there is one, a copy otherwise."""
    if len(ranges) == 1:
        return buffer[ranges[0][0] : ranges[0][1]]
    packed = buffer.new_empty(sum(end - start for start, end in ranges))
    pack_into(packed, buffer, ranges)
    return packed


def pack_into(target: Tensor, buffer: Tensor, ranges: Sequence[tuple[int, int]]) -> None:
    """``buffer``'s ranges copied one after another into the start of ``target``."""
    at = 0
    for start, end in ranges:
        target[at : at + end - start].copy_(buffer[start:end])
        at += end - start


def _add_into(targets: Sequence[Tensor], start: int, rows: Sequence[Tensor]) -> None:
    """Add ``rows`` (elements ``start`` onwards of the targets laid end to end), in order, into the targets."""
    at = 0
    for target in targets:
        lo, hi = max(start, at), min(start + rows[0].numel(), at + target.numel())
        if lo < hi:
            add_rows(target[lo - at : hi - at], [row[lo - start : hi - start] for row in rows])
        at += target.numel()


def add_rows(into: Tensor, rows: Sequence[Tensor]) -> None:
    """``rows`` added into ``into`` in order; a 16-bit sum taken in fp32 and rounded once, not once a rank."""
    total = into.float() if into.element_size() < 4 and into.is_floating_point() else into
    for row in rows:
        total.add_(row)
    if total is not into:
        into.copy_(total)


def count_staging(group: dist.ProcessGroup, nbytes: int) -> None:
    """``nbytes`` more (fewer, if negative) staging held by ``group``'s transfers besides its reductions."""
    with _staged_lock:
        _state(group).staged += nbytes


def run_beside(job: Callable[[], object], group: dist.ProcessGroup) -> Future[None]:
    """``job`` run on a second thread of ``group``'s, in order: work others' waits depend on (``relay.py``)."""
    return _state(group).beside.submit(job)


def future_of(works: Sequence[Any], group: dist.ProcessGroup) -> Future[None]:
    """A future completed (or failed) once ``works`` have been waited for, on ``group``'s waiter thread, in order."""
    return _state(group).waiter.submit(lambda: [work.wait() for work in works])


class _Waiter:
    """A daemon thread that runs jobs in the order they were submitted and completes a future for each."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future[None]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        weakref.finalize(self, self._jobs.put, None)  # the group is gone: its thread ends

    def submit(self, job: Callable[[], object]) -> Future[None]:
        future: Future[None] = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # first use, or a forked child
                self._thread = threading.Thread(target=_run, args=(self._jobs,), name="distoptim-p2p", daemon=True)
                self._thread.start()
        self._jobs.put((job, future))
        return future

    def finish(self, timeout: float) -> None:
        """Run the jobs handed to it so far, then end the thread (a later ``submit`` starts another)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            thread.join(timeout)


def _run(jobs: queue.SimpleQueue[tuple[Callable[[], object], Future[None]] | None]) -> None:
    while (item := jobs.get()) is not None:
        job, future = item
        try:
            job()
        except BaseException as error:  # handed to whoever waits on the future
            future.set_exception(error)  # type: ignore[arg-type]  # typed as the result in torch
        else:
            future.set_result(None)
        del item, job, future  # the next get() may wait long: hold no bucket meanwhile


class _Group:
    """What this module keeps for a group: reductions and syncs started, staging held, deferred receives, threads."""

    def __init__(self) -> None:
        self.reductions = self.syncs = 0  # the tag reservations made so far
        self.staged = self.deferred = 0
        self.waiter, self.beside = _Waiter(), _Waiter()


def _state(group: dist.ProcessGroup) -> _Group:
    return attached(group, "p2p", _Group)  # a group gone: dropped


EXIT_TIMEOUT_S = 60.0


@atexit.register
def _finish_at_exit() -> None:
    """Let each thread finish its jobs before shutdown (a peer may wait; a daemon killed in a wait aborts in C++)."""
    for state in attached_everywhere("p2p"):
        state.beside.finish(EXIT_TIMEOUT_S)
        state.waiter.finish(EXIT_TIMEOUT_S)
