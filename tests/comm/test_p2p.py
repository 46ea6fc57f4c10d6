"""gloo's point-to-point transport (``comm/p2p.py``) under the conditions a training loop does not show: ranks that
interleave two groups differently, a peer later than the group's timeout, a share too large for the chunk count,
many reductions in flight, groups destroyed, and ranks that disagree on the staging size."""

from __future__ import annotations

import gc
import time
import weakref
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distoptim import ZeroRedundancyOptimizer
from distoptim.comm import collectives as comm
from distoptim.comm import p2p
from tests._dist import run_on_ranks

P2P = comm.Collectives.POINT_TO_POINT
SLICES = [(0, 0, 3), (1, 3, 8)]


def _two_groups_body(rank: int, world_size: int) -> float:
    """Rank 0 starts a reduction on group A, then one on B, and waits for B's; rank 1 starts A's only after B's is
    done on both. Each group's reductions complete in order, but one group's never wait for another's."""
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    begin = time.monotonic()
    if rank == 0:
        on_a = comm.reduce_to_owners_async(torch.ones(8), SLICES, a, P2P)
        comm.reduce_to_owners_async(torch.ones(8), SLICES, b, P2P).wait()
        took = time.monotonic() - begin
        dist.barrier(group=b)
        assert torch.equal(on_a.wait()[:3], torch.full((3,), 2.0))
    else:
        comm.reduce_to_owners_async(torch.ones(8), SLICES, b, P2P).wait()
        took = time.monotonic() - begin
        dist.barrier(group=b)
        assert torch.equal(comm.reduce_to_owners_async(torch.ones(8), SLICES, a, P2P).wait()[3:], torch.full((5,), 2.0))
    return took


def test_a_reduction_started_late_on_one_group_holds_up_no_other() -> None:
    assert max(run_on_ranks(_two_groups_body, 2, timeout=60)) < 10


def _late_peer_body(rank: int, world_size: int, style: str) -> str:
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=2))
    try:
        buffer = torch.full((8,), float(rank + 1))
        if rank == 1:
            time.sleep(3.5)  # past rank 0's timeout
        try:  # rank 1 finds rank 0 gone (it raised, and left)
            comm.reduce_to_owners_async(buffer, SLICES, dist.group.WORLD, comm.Collectives(style)).wait()
        except RuntimeError as error:
            return f"raised: {error}"
        return f"returned {buffer.tolist()}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("style", [style.value for style in comm.Collectives])
def test_a_peer_later_than_the_timeout_raises_where_the_reduction_is_waited_for(style: str) -> None:
    """Never a partial sum handed on as if reduced: the work's error reaches whoever waits for the future."""
    outcome = run_on_ranks(_late_peer_body, 2, style, timeout=60, backend=None)[0]
    assert outcome.startswith("raised"), outcome


def _large_share_body(rank: int, world_size: int) -> None:
    p2p.STAGING_BYTES = 64  # 8 elements a chunk: the 4096 chunks a reduction's tags allow would hold 32768
    buffer = torch.arange(80_000, dtype=torch.float32) * (rank + 1)
    slices = [(0, 0, 70_000), (1, 70_000, 80_000)]
    comm.reduce_to_owners_async(buffer, slices, dist.group.WORLD, P2P).wait()
    start, end = slices[rank][1:]
    assert torch.equal(buffer[start:end], torch.arange(start, end, dtype=torch.float32) * 3)


def test_a_share_of_more_than_4096_chunks_is_cut_into_larger_chunks() -> None:
    run_on_ranks(_large_share_body, 2, timeout=120)


def _many_in_flight_body(rank: int, world_size: int) -> list[int]:
    """Twelve reductions started before any is waited for (DDP's buckets in a backward) stage at most twice the
    budget at once; those past it start receiving when waited for."""
    p2p.STAGING_BYTES = 256
    buffers = [torch.full((200,), float(rank + 1 + number)) for number in range(12)]
    slices = [(0, 0, 100), (1, 100, 200)]
    staged = []
    futures = []
    for buffer in buffers:
        futures.append(comm.reduce_to_owners_async(buffer, slices, dist.group.WORLD, P2P))
        staged.append(p2p._state(dist.group.WORLD).staged)
    for number, (future, buffer) in enumerate(zip(futures, buffers)):
        future.wait()
        start, end = slices[rank][1:]
        assert torch.equal(buffer[start:end], torch.full((100,), 3.0 + 2 * number))
    assert p2p._state(dist.group.WORLD).staged == 0
    return staged


def test_reductions_in_flight_stage_at_most_twice_the_budget() -> None:
    for staged in run_on_ranks(_many_in_flight_body, 2, timeout=60):
        assert 0 < max(staged) <= 2 * 256, staged


def _destroyed_body(rank: int, world_size: int) -> int:
    refs = []
    for _ in range(3):
        group = dist.new_group([0, 1])
        comm.reduce_to_owners_async(torch.ones(8), SLICES, group, P2P).wait()
        refs.append(weakref.ref(group))
        dist.destroy_process_group(group)
        del group
    deadline = time.monotonic() + 5.0  # the group's waiter thread lets go of its last work asynchronously
    while True:
        gc.collect()
        alive = sum(ref() is not None for ref in refs)
        if alive == 0 or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def test_a_destroyed_group_is_freed() -> None:
    assert run_on_ranks(_destroyed_body, 2, timeout=60) == [0, 0]


def _staging_disagreement_body(rank: int, world_size: int) -> str:
    p2p.STAGING_BYTES = 1 << 20 if rank == 1 else 8 << 20
    with pytest.raises(ValueError, match="STAGING_BYTES") as raised:
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.ones(4))], torch.optim.SGD, lr=0.1)
    return str(raised.value)


def test_ranks_that_cut_messages_differently_are_refused_on_every_rank() -> None:
    run_on_ranks(_staging_disagreement_body, 2, timeout=60)


_EXITING_JOB = """
import os, sys, time
import torch.distributed as dist
from distoptim.comm import p2p
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
def job():
    time.sleep(1.0)
    open(sys.argv[1], "w").write("done")
p2p.run_beside(job, dist.group.WORLD)
"""  # the script ends at once: the job must still run to its end before the interpreter shuts down


def test_jobs_handed_to_the_threads_finish_before_the_process_exits(tmp_path: Any) -> None:
    """A relay job a peer still needs is not abandoned when this rank's script ends, and no daemon thread is left
    inside a collective's wait while the interpreter shuts down (killed in C++ there: std::terminate)."""
    import socket
    import subprocess
    import sys

    marker = tmp_path / "done"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-c", _EXITING_JOB, str(marker), str(port)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert marker.exists(), "the job handed to the thread beside was dropped at exit"
