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

import statistics
import sys
import time

import torch
import torch.distributed as dist

from distoptim.demo.launch import RankContext, run_ranks


def _rank(ctx: RankContext, bucket_view: bool) -> float:
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
    return slowest.item() * 1e3


def main() -> None:
    world_size, bucket_view = int(sys.argv[1]), sys.argv[2] == "bucket"
    print(f"{run_ranks(_rank, world_size, (bucket_view,), timeout_s=600)[0]:.1f}")


if __name__ == "__main__":
    main()
