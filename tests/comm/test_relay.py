"""The relay through aggregators (``comm/relay.py``): who aggregates what, sums and syncs right on real gloo ranks
against sums taken here, and the bytes each rank sends and receives against an all-reduce's, where the owners'
shares are unequal (one rank owning most of a buffer, as the greedy partition gives a large embedding's owner)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.comm import collectives as comm
from distoptim.comm import p2p, relay
from tests._dist import run_on_ranks

P2P = comm.Collectives.POINT_TO_POINT


def _layout(world_size: int, total: int = 6000) -> list[tuple[int, int, int]]:
    """(owner, start, end) slices: rank 0 owns 70% (in two ranges), the others share the rest unevenly."""
    big = int(0.7 * total)
    cuts = [0, big // 2]
    rest = total - big
    weights = list(range(1, world_size))
    at = big // 2
    slices = [(0, 0, at)]
    for rank, weight in zip(range(1, world_size), weights):
        size = rest * weight // sum(weights) if rank < world_size - 1 else total - big // 2 - at + cuts[0]
        slices.append((rank, at, at + size))
        at += size
    slices.append((0, at, total))
    return slices


def test_every_rank_aggregates_an_even_share_and_owners_keep_their_own_first() -> None:
    by_owner = [[(0, 10), (40, 100)], [(10, 12)], [(12, 40)], []]
    pieces = relay.aggregators(by_owner)
    covered = sorted((p.start, p.end) for p in pieces)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(covered)), covered  # no overlaps
    assert sum(p.end - p.start for p in pieces) == 100
    for owner, ranges in enumerate(by_owner):
        mine = {i for s, e in ranges for i in range(s, e)}
        assert {i for p in pieces if p.owner == owner for i in range(p.start, p.end)} == mine
    assert [sum(p.end - p.start for p in pieces if p.aggregator == rank) for rank in range(4)] == [25] * 4
    assert next(p for p in pieces if p.owner == 0) == relay.Piece(0, 10, 0, 0)  # its first range, kept
    assert all(p.aggregator == 1 for p in pieces if p.owner == 1)  # short of 25: all its own
    assert sum(p.end - p.start for p in pieces if p.owner == p.aggregator == 2) == 25  # 28: 25 kept, 3 relayed


def test_the_direct_path_is_chosen_where_shares_are_near_equal_and_always_at_two_ranks() -> None:
    assert not relay.relayed([50, 50]) and not relay.relayed([99, 1])  # at 2 ranks the relay is the direct path
    assert not relay.relayed([25, 25, 25, 25]) and not relay.relayed([28, 24, 24, 24])
    assert relay.relayed([58, 14, 14, 14]) and relay.relayed([100, 0, 0])
    assert relay.relayed([41, 30, 29]) and not relay.relayed([40, 30, 30])  # 3 ranks: direct up to 40%
    assert not relay.relayed([100, 0, 0], pieces=p2p.CHUNKS + 1)  # too many messages to tell apart: direct


@contextmanager
def _counting(moved: dict[str, int]) -> Iterator[None]:
    """Bytes this rank hands to ``isend`` and receives through ``irecv`` (any thread)."""
    lock, isend, irecv = threading.Lock(), dist.isend, dist.irecv

    def counted(kind: str, original: Any) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with lock:
                moved[kind] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        return call

    sending = mock.patch.object(dist, "isend", counted("sent", isend))
    with sending, mock.patch.object(dist, "irecv", counted("received", irecv)):
        yield


def _relay_body(rank: int, world_size: int, dtype: torch.dtype, staging: int) -> dict[str, Any]:
    p2p.STAGING_BYTES = staging  # small: many chunks, two in flight
    slices = _layout(world_size)
    total = slices[-1][2]
    moved = {"sent": 0, "received": 0}
    values = [torch.linspace(-1, 1, total, dtype=torch.float64) * (r + 1) + r for r in range(world_size)]
    buffer = values[rank].to(dtype)
    with _counting(moved):
        reduced = comm.reduce_to_owners_async(buffer, slices, dist.group.WORLD, P2P).wait()
    expected = sum(v.to(dtype).double() for v in values)
    errors = [
        (reduced[start:end].double() - expected[start:end]).abs().max().item()
        for owner, start, end in slices
        if owner == rank
    ]
    reduction = dict(moved)
    moved.update(sent=0, received=0)
    params = torch.zeros(total, dtype=dtype)
    for owner, start, end in slices:
        if owner == rank:
            params[start:end] = values[owner][start:end].to(dtype)
    with _counting(moved):
        comm.broadcast_slices(params, slices, dist.group.WORLD, collectives=P2P)
    synced = torch.equal(params, torch.cat([values[o][s:e].to(dtype) for o, s, e in slices]))
    return {"errors": errors, "reduction": reduction, "sync": dict(moved), "synced": synced, "total": total}


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unequal_shares_reduce_and_sync_moving_no_more_than_an_all_reduce_on_any_rank(
    world_size: int, dtype: torch.dtype
) -> None:
    results = run_on_ranks(_relay_body, world_size, dtype, 4096, timeout=120)
    total = results[0]["total"] * torch.empty((), dtype=dtype).element_size()
    all_reduce = 2 * (world_size - 1) / world_size * total
    tolerance = 1e-5 if dtype == torch.float32 else 0.1  # bf16: the partial sum rounded once more, at its aggregator
    for rank, result in enumerate(results):
        assert result["synced"], f"rank {rank}: the sync did not land every owner's values"
        assert max(result["errors"]) <= tolerance, f"rank {rank}: {result['errors']}"
        for kind in ("sent", "received"):
            step = result["reduction"][kind] + result["sync"][kind]
            assert step <= 1.001 * all_reduce, f"rank {rank} {kind} {step} B a step, all-reduce {all_reduce:.0f} B"
            for phase in ("reduction", "sync"):
                assert result[phase][kind] <= all_reduce, f"rank {rank}: {phase} {kind} {result[phase][kind]}"
    # today's direct path would have rank 0 receive (N-1) x 70% of the buffer in the reduction alone
    assert (world_size - 1) * 0.7 * total > 1.05 * all_reduce or world_size == 3


class _Model(nn.Module):
    """A large embedding (the greedy partition's dominant owner), fp32 layers and a bf16 head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())
        self.head = nn.Linear(16, 8).to(torch.bfloat16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens).mean(1)).to(torch.bfloat16)).float()


def _training_body(rank: int, world_size: int) -> dict[str, int]:
    """ShardedDataParallel (greedy, gloo's style) against DDP + plain AdamW, step by step."""
    relayed = {"reductions": 0, "syncs": 0}
    build, tags = relay.RelayedReduction, p2p.sync_tags

    def counted_reduction(*args: Any) -> Any:
        relayed["reductions"] += 1
        return build(*args)

    def counted_sync(group: Any) -> int:
        relayed["syncs"] += 1
        return tags(group)

    reductions = mock.patch.object(relay, "RelayedReduction", counted_reduction)
    with reductions, mock.patch.object(p2p, "sync_tags", counted_sync):
        for mode in ("sharded_data_parallel",):
            model, reference = _Model(), _Model()
            zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition="greedy", lr=0.01)
            net = ShardedDataParallel(model, zero, bucket_cap_mb=0.004)
            ddp = DDP(reference, bucket_cap_mb=0.004)
            plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
            for step in range(3):
                tokens = torch.randint(0, 100, (4, 5), generator=torch.Generator().manual_seed(10 * step + rank))
                for wrapped, optimizer in ((net, zero), (ddp, plain)):
                    optimizer.zero_grad()
                    wrapped(tokens).square().mean().backward()
                    optimizer.step()
                zero.sync_finished()
                for (name, ours), want in zip(model.named_parameters(), reference.parameters()):
                    rtol, atol = (1e-5, 1e-6) if want.dtype == torch.float32 else (1.6e-2, 1e-3)
                    torch.testing.assert_close(ours, want, rtol=rtol, atol=atol, msg=f"{mode} step {step} {name}")
                with torch.no_grad():  # differences in rounding do not compound
                    for ours, want in zip(model.parameters(), reference.parameters()):
                        want.copy_(ours)
    return relayed


@pytest.mark.parametrize("world_size", [3, 4])
def test_training_through_the_relay_equals_ddp_and_the_plain_optimizer(world_size: int) -> None:
    for relayed in run_on_ranks(_training_body, world_size, timeout=240):
        assert relayed["reductions"] > 0 and relayed["syncs"] > 0, relayed  # the relay was taken


def _out_of_order_body(rank: int, world_size: int) -> list[bool]:
    """One relayed reduction per rank owning 90% of its buffer (so each rank aggregates for the others) and three
    relayed syncs, all in flight at once; each rank calls ``wait()`` on the reductions themselves, its own last (a
    cycle: each first waits for a reduction whose owner waits for another first), then on the syncs in reverse: no
    wait depends on another rank's order."""
    total = 1000
    layouts = []
    for big in range(world_size):  # rank ``big`` owns 90%, the others an even part of the rest
        small = [r for r in range(world_size) if r != big]
        cuts = [0] + [int(0.9 * total) + total // 10 * k // len(small) for k in range(len(small))] + [total]
        ranges = [[(cuts[k], cuts[k + 1])] for k in range(world_size)]  # ranks in order: move ``big``'s to it
        layout: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
        for order, r in enumerate([big, *small]):
            layout[r] = ranges[order]
        layouts.append(layout)
    buffers = [torch.full((total,), float(rank + 1 + k)) for k in range(world_size)]
    reductions = [relay.reduction(b, layout, dist.group.WORLD) for b, layout in zip(buffers, layouts)]
    slices = _layout(world_size)
    params = [torch.full((slices[-1][2],), float(rank)) for _ in range(3)]
    syncs = [comm.broadcast_slices(p, slices, dist.group.WORLD, wait=False, collectives=P2P) for p in params]
    for k in range(rank + 1, rank + 1 + world_size):
        reductions[k % world_size].wait()
    for sync in syncs[::-1]:
        comm.wait_all(sync)
    want = sum(range(1, world_size + 1))
    relayed = [isinstance(r, relay.RelayedReduction) for r in reductions]
    reduced = [
        torch.equal(b[s:e], torch.full((e - s,), float(want + world_size * k)))
        for k, b in enumerate(buffers)
        for s, e in layouts[k][rank]
    ]
    synced = [torch.equal(p[s:e], torch.full((e - s,), float(o))) for p in params for o, s, e in slices]
    return relayed + reduced + synced


def test_transfers_in_flight_complete_whatever_order_each_rank_waits_in() -> None:
    for checks in run_on_ranks(_out_of_order_body, 3, timeout=60):
        assert all(checks), checks


def _small_relay_body(rank: int, world_size: int) -> dict[str, Any]:
    """A 1000-element relayed reduction (rank 0 owns 90%): the staging the relay allocates, what it counts in the
    group's budget while its thread has not run (held back by a job queued before it), and after ``wait()``."""
    group, total = dist.group.WORLD, 1000
    layout = [[(0, 900)], [(900, 950)], [(950, total)]]
    allocated: list[int] = []
    made = relay.receive_buffer

    def recorded(numel: int, like: torch.Tensor) -> torch.Tensor:
        allocated.append(numel * like.element_size())
        return made(numel, like)

    buffer = torch.arange(total, dtype=torch.float32) * (rank + 1)
    held = threading.Event()
    queued = p2p.run_beside(held.wait, group)  # the relay's job runs after this one
    with mock.patch.object(relay, "receive_buffer", recorded):
        reduction = relay.reduction(buffer, layout, group)
        counted = p2p._state(group).staged
        held.set()
        queued.wait()
        reduction.wait()
    assert isinstance(reduction, relay.RelayedReduction)
    longest = max(m.end - m.start for m in reduction.messages if m.owner != m.aggregator)
    return {
        "allocated": sum(allocated),
        "relay": reduction.staging_bytes,
        "direct": reduction.direct.staging_bytes,
        "counted": counted,
        "after": p2p._state(group).staged,
        "bound": 2 * (world_size - 1) * longest * buffer.element_size(),
        "reduced": [torch.equal(buffer[s:e], torch.arange(s, e, dtype=torch.float32) * 6) for s, e in layout[rank]],
    }


def test_a_small_relayed_reduction_stages_no_more_than_its_messages_and_counts_it_in_the_budget() -> None:
    for rank, result in enumerate(run_on_ranks(_small_relay_body, 3, timeout=60)):
        assert all(result["reduced"]), (rank, result)
        assert 0 < result["allocated"] == result["relay"] <= result["bound"], (rank, result)  # not 1Mi-element slots
        assert result["counted"] == result["direct"] + result["relay"], (rank, result)
        assert result["after"] == 0, (rank, result)
