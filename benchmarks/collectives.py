"""How fast gloo moves one step's gradient to its owners and the parameters back, by each way it can.

A 21M-element fp32 buffer (the benchmark GPT's gradient) in 9 buckets; every way starts all buckets concurrently and
waits for all of them, as a backward's reduction or a step's sync does. Reductions: an all-reduce (DDP's, moving
twice the bytes), a reduce to each owner (``DISTOPTIM_COLLECTIVES=chunked`` off the even regions; the "rooted" style
before point to point), a reduce-scatter (chunked), and point to point (``comm/p2p.py``, the default on gloo). Syncs:
a broadcast from each owner, an all-gather (chunked), and point to point. Prints the median of 7 runs of the slowest
rank, in ms::

    .venv/bin/python benchmarks/collectives.py 2 4
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from distoptim.demo.launch import RankContext, run_ranks

ELEMENTS, BUCKETS, RUNS = 21_000_000, 9, 7


def _ways(rank: int, size: int, buckets: list[torch.Tensor]) -> dict[str, Callable[[], None]]:
    from distoptim.comm import collectives as comm

    group = dist.group.WORLD
    regions = [[b * len(bucket) // size for b in range(size + 1)] for bucket in buckets]
    slices = [[(r, region[r], region[r + 1]) for r in range(size)] for region in regions]

    def wait(works: list) -> None:  # type: ignore[type-arg]
        comm.wait_all(works)

    def reduce_to_owners(style: comm.Collectives) -> Callable[[], None]:
        return lambda: [
            future.wait()
            for future in [comm.reduce_to_owners_async(b, s, group, style) for b, s in zip(buckets, slices)]
        ]

    return {
        "reduce: all-reduce": lambda: wait([dist.all_reduce(b, async_op=True) for b in buckets]),
        "reduce: rooted reduces": lambda: wait(
            [dist.reduce(b[lo:hi], dst=r, async_op=True) for b, s in zip(buckets, slices) for r, lo, hi in s]
        ),
        "reduce: reduce-scatter": reduce_to_owners(comm.Collectives.CHUNKED),
        "reduce: point to point": reduce_to_owners(comm.Collectives.POINT_TO_POINT),
        "sync: rooted broadcasts": lambda: wait(
            [w for b, s in zip(buckets, slices) for w in comm.broadcast_slices(b, s, group, wait=False)]
        ),
        "sync: all-gather": lambda: wait(
            [
                w
                for b, r in zip(buckets, regions)
                for w in comm.gather_from_owners(b, [r], group, comm.Collectives.CHUNKED, False)
            ]
        ),
        "sync: point to point": lambda: wait(
            [
                w
                for b, r in zip(buckets, regions)
                for w in comm.gather_from_owners(b, [r], group, comm.Collectives.POINT_TO_POINT, False)
            ]
        ),
    }


def _rank(ctx: RankContext) -> dict[str, float]:
    torch.set_num_threads(1)
    size = ctx.world_size
    per_bucket = ELEMENTS // BUCKETS // size * size
    buckets = [torch.randn(per_bucket, generator=torch.Generator().manual_seed(b)) for b in range(BUCKETS)]
    results = {}
    for name, way in _ways(ctx.rank, size, buckets).items():
        way()  # warm-up
        times = []
        for _ in range(RUNS):
            dist.barrier()
            begin = time.perf_counter()
            way()
            times.append(time.perf_counter() - begin)
        slowest = torch.tensor([statistics.median(times)])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[name] = slowest.item() * 1e3
    return results


def main() -> None:
    for world_size in [int(arg) for arg in sys.argv[1:]] or [2, 4]:
        for name, ms in run_ranks(_rank, world_size, timeout_s=600)[0].items():
            print(f"N={world_size} {name:<26} {ms:8.1f} ms")


if __name__ == "__main__":
    main()
