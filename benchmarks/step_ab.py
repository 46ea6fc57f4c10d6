"""Time ``ZeroRedundancyOptimizer.step()`` alone (local AdamW on the shard + parameter sync), no DDP, no backward.

Whichever distoptim is importable is timed, so two versions compare by running this under two ``PYTHONPATH``s,
alternating (the backward and DDP, which dominate bench_zero.py's totals and its noise, are left out)::

    git worktree add /tmp/old <commit>
    PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/step_ab.py 4 bucket
    .venv/bin/python benchmarks/step_ab.py 4 bucket

Arguments: world size, then ``staged`` or ``bucket`` (``parameters_as_bucket_view``). Prints the median over 20
steps (after 3 untimed) of the slowest rank, in ms, for the benchmark's 21M-parameter GPT on gloo, one thread per rank.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world_size: int, port: int, bucket_view: bool, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from distoptim import ZeroRedundancyOptimizer
    from distoptim.demo.config import config_for_params
    from distoptim.demo.model import GPT

    torch.manual_seed(0)
    model = GPT(config_for_params(20.0, width=512, vocab=8192, context=32, heads=8))
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, parameters_as_bucket_view=bucket_view, lr=1e-4
    )
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    times = []
    for _ in range(23):
        dist.barrier()
        begin = time.perf_counter()
        zero.step()
        times.append(time.perf_counter() - begin)
    slowest = torch.tensor([statistics.median(times[3:])])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put(slowest.item() * 1e3)
    dist.destroy_process_group()


def main() -> None:
    world_size, bucket_view = int(sys.argv[1]), sys.argv[2] == "bucket"
    context = mp.get_context("spawn")
    results = context.Queue()
    port = 29000 + os.getpid() % 1000
    ranks = [context.Process(target=_rank, args=(r, world_size, port, bucket_view, results)) for r in range(world_size)]
    for process in ranks:
        process.start()
    print(f"{results.get():.1f}")
    for process in ranks:
        process.join()


if __name__ == "__main__":
    main()
