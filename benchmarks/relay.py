"""Which of gloo's two point-to-point paths is faster where the owners' shares are unequal: direct (``comm/p2p.py``:
each owner receives every rank's copy of its share) or through aggregators of an even share each (``comm/relay.py``).

An 8M-element fp32 buffer in 4 buckets, every bucket cut alike among the ranks: ``even``, ``58%`` (rank 0 owns 58%,
the others equal parts of the rest: the greedy partition's embedding owner) and ``one owner`` (a bucket that is one
large parameter). Every way starts all buckets at once and waits for all, as a backward's reduction or a step's sync
does; the path is forced by ``relay.SLACK`` (``relay.relayed`` chooses by it). Prints the median of 5 runs of the
slowest rank, in ms, and the busiest rank's bytes a step (reduction and sync, sent or received, the larger) over an
all-reduce's::

    .venv/bin/python benchmarks/relay.py 2 4 8
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from distoptim.demo.launch import RankContext, run_ranks

ELEMENTS, BUCKETS, RUNS = 8_000_000, 4, 5
LAYOUTS = {"even": None, "58%": 0.58, "one owner": 1.0}
PATHS = {"direct": float("inf"), "relay": -1.0}  # relay.SLACK: never relayed, relayed wherever N > 2


def _slices(size: int, numel: int, largest: float | None) -> list[tuple[int, int, int]]:
    if size == 1:
        return [(0, 0, numel)]
    first = numel // size if largest is None else int(largest * numel)
    cuts = [0, first] + [first + (numel - first) * r // (size - 1) for r in range(1, size)]
    return [(rank, cuts[rank], cuts[rank + 1]) for rank in range(size)]


def _rank(ctx: RankContext) -> dict[str, float]:
    from distoptim.comm import collectives as comm
    from distoptim.comm import relay

    torch.set_num_threads(1)
    size, group, style = ctx.world_size, dist.group.WORLD, comm.Collectives.POINT_TO_POINT
    numel = ELEMENTS // BUCKETS
    buckets = [torch.randn(numel, generator=torch.Generator().manual_seed(b)) for b in range(BUCKETS)]
    moved = {"sent": 0, "received": 0}
    lock, isend, irecv = threading.Lock(), dist.isend, dist.irecv

    def counted(kind: str, original: Any) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with lock:
                moved[kind] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        return call

    results = {}
    for layout, largest in LAYOUTS.items():
        slices = _slices(size, numel, largest)
        for path, slack in PATHS.items():
            relay.SLACK = slack
            ways = {
                "reduce": lambda s=slices: [
                    f.wait() for f in [comm.reduce_to_owners_async(b, s, group, style) for b in buckets]
                ],
                "sync": lambda s=slices: comm.wait_all(
                    [w for b in buckets for w in comm.broadcast_slices(b, s, group, False, style)]
                ),
            }
            for way, run in ways.items():
                run()  # warm-up
                times = []
                for _ in range(RUNS):
                    dist.barrier()
                    begin = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - begin)
                slowest = torch.tensor([statistics.median(times)])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                results[f"{layout:<9} {path:<6} {way}"] = slowest.item() * 1e3
            moved.update(sent=0, received=0)
            with (
                mock.patch.object(dist, "isend", counted("sent", isend)),
                mock.patch.object(dist, "irecv", counted("received", irecv)),
            ):
                for run in ways.values():
                    run()
            busiest = torch.tensor([float(max(moved.values()))])
            dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
            all_reduce = 2 * (size - 1) / size * ELEMENTS * 4
            results[f"{layout:<9} {path:<6} bytes"] = busiest.item() / all_reduce if size > 1 else 0.0
    return results


def main() -> None:
    for world_size in [int(arg) for arg in sys.argv[1:]] or [2, 4, 8]:
        for name, value in run_ranks(_rank, world_size, timeout_s=900)[0].items():
            unit = "x an all-reduce (busiest rank, a step)" if name.endswith("bytes") else "ms"
            print(f"N={world_size} {name:<24} {value:8.2f} {unit}", flush=True)


if __name__ == "__main__":
    main()
