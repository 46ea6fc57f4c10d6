"""The backward alone under each way of reducing gradients: DDP's C++ all-reduce, distoptim's Python
``allreduce_hook``, and ``reduce_to_owners_hook`` (ZeRO-2) with each partition; no optimizer step. "no reduction"
(a hook that returns the bucket untouched) is DDP's backward without communication: the difference to it is what
each reduction costs inside the backward.

Each mode runs twice in one set of ranks (the benchmark's 21M-parameter GPT, gloo, one thread per rank), and the
median backward of the slowest rank is printed per mode, in ms::

    .venv/bin/python benchmarks/reduction_backward.py 4
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from distoptim.demo.launch import RankContext, run_ranks

MODES = ["no reduction", "cpp all-reduce", "python allreduce_hook", "to owners, even", "to owners, greedy"]


def _no_reduction(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations on hooks
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _rank(ctx: RankContext) -> dict[str, list[float]]:
    from torch.nn.parallel import DistributedDataParallel

    from distoptim import ZeroRedundancyOptimizer
    from distoptim.demo.config import config_for_params
    from distoptim.demo.model import GPT
    from distoptim.hooks import allreduce_hook, reduce_to_owners_hook

    results: dict[str, list[float]] = {}
    for mode in MODES * 2:
        torch.manual_seed(0)
        model = GPT(config_for_params(20.0, width=512, vocab=8192, context=32, heads=8))
        ddp = DistributedDataParallel(model)
        if mode == "no reduction":
            ddp.register_comm_hook(None, _no_reduction)
        elif mode == "python allreduce_hook":
            ddp.register_comm_hook(None, allreduce_hook)
        elif mode.startswith("to owners"):
            partition = mode.split(", ")[1]
            zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition=partition, lr=1e-4)
            ddp.register_comm_hook(zero, reduce_to_owners_hook)
        tokens = torch.randint(0, 8192, (1, 33), generator=torch.Generator().manual_seed(ctx.rank))
        times = []
        for _ in range(13):
            model.zero_grad()
            loss = ddp(tokens[:, :-1], tokens[:, 1:])
            dist.barrier()
            begin = time.perf_counter()
            loss.backward()
            times.append(time.perf_counter() - begin)
        slowest = torch.tensor([statistics.median(times[3:])])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results.setdefault(mode, []).append(round(slowest.item() * 1e3, 1))
    return results


def main() -> None:
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for mode, times in run_ranks(_rank, world_size, timeout_s=600)[0].items():
        print(f"N={world_size} {mode:<22} backward ms: {', '.join(map(str, times))}")


if __name__ == "__main__":
    main()
