"""What ``ZeroRedundancyOptimizer.step()``'s agreement costs: the one small all-reduce, between the local step and
the parameter sync, through which every rank learns whether the local part succeeded everywhere.

One set of ranks alternates, two steps at a time, between the real ``step()`` and one with the agreement left out
(``agreement.run_step_agreed`` replaced by a plain call), so both see the same machine at the same moments::

    .venv/bin/python benchmarks/step_agreement.py 4

Prints the median over 72 steps of each kind of the slowest rank's ``step()`` (after a barrier), in ms, for the
benchmark's 21M-parameter GPT (AdamW, bucket views) on gloo, one thread per rank. Gradients are fixed; no backward.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from distoptim.demo.launch import RankContext, run_ranks

STEPS = 150  # the first 6 are not counted


def _rank(ctx: RankContext) -> dict[str, float]:
    from distoptim import ZeroRedundancyOptimizer
    from distoptim.demo.config import config_for_params
    from distoptim.demo.model import GPT
    from distoptim.zero import agreement

    torch.manual_seed(0)
    model = GPT(config_for_params(20.0, width=512, vocab=8192, context=32, heads=8))
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, parameters_as_bucket_view=True, lr=1e-4)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    kinds = {"with the agreement": agreement.run_step_agreed, "without": lambda action, *_: action()}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for step in range(STEPS):
        kind = list(kinds)[(step // 2) % 2]
        agreement.run_step_agreed = kinds[kind]  # type: ignore[assignment]
        dist.barrier()
        begin = time.perf_counter()
        zero.step()
        slowest = torch.tensor([time.perf_counter() - begin])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if step >= 6:
            times[kind].append(slowest.item() * 1e3)
    return {kind: statistics.median(values) for kind, values in times.items()}


def main() -> None:
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    medians = run_ranks(_rank, world_size, timeout_s=600)[0]
    print(f"N={world_size} step() ms: " + ", ".join(f"{kind} {ms:.1f}" for kind, ms in medians.items()))


if __name__ == "__main__":
    main()
