"""Per-rank memory of a bf16 model trained through fp32 master weights (distoptim, even partition) against the
same model in fp32 under torch's ZeroRedundancyOptimizer, and the step time master weights cost.

Bytes are counted from the real buffers after one backward and one step (parameters, gradients, the local
optimizer's state, the master copies); peak RSS is measured too. One command::

    .venv/bin/python benchmarks/memory_master.py --world-sizes 2 4 8

Each configuration (plus plain AdamW on every rank, the unsharded baseline) runs in freshly spawned ranks
(gloo over 127.0.0.1, one thread each) on the benchmark's GPT-shaped model (``--params-millions``, default 20).
Step time: the median ``step()`` of the slowest rank. ``measure()`` is what benchmarks/report.py calls.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from distoptim.demo.config import GPTConfig, config_for_params
from distoptim.demo.launch import PRELOAD, RankContext, run_ranks

CONFIGS = ["ddp-adamw fp32", "torch-zero fp32", "distoptim fp32", "distoptim bf16 + fp32 master"]
FIELDS = ["params", "grads", "state", "master", "peak_rss", "step_us"]


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _rank(ctx: RankContext, config: str, shape: GPTConfig) -> dict[str, float]:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    from distoptim import ZeroRedundancyOptimizer
    from distoptim.demo.model import GPT

    torch.manual_seed(0)
    model = GPT(shape)
    master = config.endswith("master")
    if master:
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    if config.startswith("ddp"):
        optimizer: Any = torch.optim.AdamW(params, lr=1e-4)
        local, masters = optimizer, []
    elif config.startswith("torch"):
        optimizer = TorchZeRO(params, torch.optim.AdamW, lr=1e-4)
        local, masters = optimizer.optim, []
    else:
        optimizer = ZeroRedundancyOptimizer(
            params, torch.optim.AdamW, partition="even", master_dtype=torch.float32 if master else None, lr=1e-4
        )
        local, masters = optimizer.local_optimizer, [t.tensor for t in optimizer.local_shard.masters]
    generator = torch.Generator().manual_seed(ctx.rank)
    tokens = torch.randint(0, shape.vocab, (1, shape.context + 1), generator=generator)
    times = []
    for _ in range(6):
        optimizer.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).float().backward()
        for param in params:  # the averaged gradient DDP would leave (no DDP here: memory is the point)
            dist.all_reduce(param.grad)
            param.grad.div_(ctx.world_size)
        dist.barrier()
        begin = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - begin)
    figures = torch.tensor(
        [
            _tensor_bytes(params),
            _tensor_bytes(p.grad for p in params),
            _tensor_bytes(v for entry in local.state.values() for v in entry.values()),
            _tensor_bytes(masters),
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            statistics.median(times[2:]) * 1e6,
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the largest rank sets the pace and the memory to provision
    return dict(zip(FIELDS, figures.tolist()))


def measure(world_size: int, config: str, shape: GPTConfig) -> dict[str, float]:
    """One configuration (a name in ``CONFIGS``) on ``world_size`` new ranks: each figure of ``FIELDS``, max over
    ranks (bytes; peak RSS in bytes; median ``step()`` in microseconds)."""
    preload = (*PRELOAD, "torch.distributed.optim")  # what every rank imports; once, in the fork server
    results: list[dict[str, float]] = run_ranks(_rank, world_size, (config, shape), timeout_s=600, preload=preload)
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--params-millions", type=float, default=20.0)
    args = parser.parse_args()
    shape = config_for_params(args.params_millions, width=512, vocab=8192, context=32, heads=8)
    print(f"{'N':>2} {'configuration':<30} {'params':>7} {'grads':>7} {'state':>7} {'master':>7} {'total MB':>8} "
          f"{'RSS MB':>7} {'step ms':>8}")  # fmt: skip
    for world_size in args.world_sizes:
        totals = {}
        for config in CONFIGS:
            row = measure(world_size, config, shape)
            params, grads, state, master = (row[name] for name in FIELDS[:4])
            totals[config] = params + grads + state + master
            print(
                f"{world_size:>2} {config:<30} {params / 1e6:>7.1f} {grads / 1e6:>7.1f} {state / 1e6:>7.1f} "
                f"{master / 1e6:>7.1f} {totals[config] / 1e6:>8.1f} {row['peak_rss'] / 1e6:>7.0f} "
                f"{row['step_us'] / 1e3:>8.1f}",
                flush=True,
            )
        ratio = totals["distoptim bf16 + fp32 master"] / totals["torch-zero fp32"]
        print(f"   bf16 + master / torch's fp32 ZeRO, per-rank bytes: {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
