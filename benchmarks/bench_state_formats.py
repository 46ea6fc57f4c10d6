"""State formats: per-rank live optimizer-state bytes and step time of ZeroRedundancyOptimizer(AdamW) with
``state_format`` fp32 / bf16 / int8, on N local ranks (gloo, one thread each), on GPT-shaped parameters.

State bytes: every tensor the local optimizer's state holds after the steps (codes, scales, step counts). Step
time: ``zero.step()`` (the local step and the parameter sync) with fixed gradients, median over iterations of the
slowest rank, and its ratio to fp32's measured in the same ranks, formats interleaved iteration by iteration.

    python benchmarks/bench_state_formats.py --world-sizes 1 2 --params-millions 8 --iters 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from distoptim import ZeroRedundancyOptimizer
from distoptim.demo.config import config_for_params
from distoptim.demo.launch import run_ranks
from distoptim.demo.model import GPT

FORMATS = ("fp32", "bf16", "int8")


def _state_bytes(zero: ZeroRedundancyOptimizer) -> int:
    return sum(
        value.numel() * value.element_size()
        for entry in zero.local_optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    )


def _rank(context: Any, millions: float, iters: int, partition: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(config_for_params(millions))
    params = {fmt: [p.detach().clone().requires_grad_() for p in model.parameters()] for fmt in FORMATS}
    zeros = {
        fmt: ZeroRedundancyOptimizer(params[fmt], torch.optim.AdamW, partition=partition, state_format=fmt, lr=1e-4)
        for fmt in FORMATS
    }
    for fmt in FORMATS:
        generator = torch.Generator().manual_seed(1)
        for param in params[fmt]:
            param.grad = torch.randn(param.shape, generator=generator) * 1e-3
        zeros[fmt].step()  # the first step makes the state
    times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for _ in range(iters):
        for fmt in FORMATS:
            dist.barrier()
            start = time.perf_counter()
            zeros[fmt].step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[fmt].append(float(elapsed))
    return {
        "numel": sum(p.numel() for p in params["fp32"]),
        "bytes": {fmt: _state_bytes(zeros[fmt]) for fmt in FORMATS},
        "ms": {fmt: 1e3 * statistics.median(times[fmt]) for fmt in FORMATS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--params-millions", type=float, default=8.0)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--partition", choices=("even", "greedy"), default="even")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, the demo's GPT shapes (--params-millions {args.params_millions}), AdamW, "
        f"partition={args.partition}"
    )
    print("world | format | state MiB/rank (max) | x fp32 | step ms (median) | x fp32 | parameters")
    for world_size in args.world_sizes:
        ranks = run_ranks(_rank, world_size, (args.params_millions, args.iters, args.partition), timeout_s=1800.0)
        for fmt in FORMATS:
            most = max(r["bytes"][fmt] for r in ranks)
            fp32 = max(r["bytes"]["fp32"] for r in ranks)
            ms, base = ranks[0]["ms"][fmt], ranks[0]["ms"]["fp32"]
            print(
                f"{world_size:5} | {fmt:6} | {most / 2**20:20.2f} | {most / fp32:6.3f} | {ms:16.1f} | {ms / base:6.2f}"
                f" | {ranks[0]['numel']:,}"
            )


if __name__ == "__main__":
    main()
