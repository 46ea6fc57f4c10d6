"""Per-rank memory of a bf16 model trained through fp32 master weights (distoptim, even partition) against the
same model in fp32 under torch's ZeroRedundancyOptimizer, and the step time master weights cost.

Bytes are counted from the real buffers after one backward and one step (parameters, gradients, the local
optimizer's state, the master copies); peak RSS is measured too. One command::

    .venv/bin/python benchmarks/memory_master.py --world-sizes 2 4 8

Each configuration runs in freshly spawned ranks (gloo over 127.0.0.1, one thread each) on the benchmark's
GPT-shaped model (``--params-millions``, default 20). Step time: the median ``step()`` of the slowest rank for
distoptim with master weights on the bf16 model and without them on the fp32 model.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = ["torch-zero fp32", "distoptim fp32", "distoptim bf16 + fp32 master"]


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _rank(rank: int, world_size: int, port: int, config: str, millions: float, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    from distoptim import ZeroRedundancyOptimizer
    from distoptim.demo.config import config_for_params
    from distoptim.demo.model import GPT

    torch.manual_seed(0)
    model = GPT(config_for_params(millions, width=512, vocab=8192, context=32, heads=8))
    master = config.endswith("master")
    if master:
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    if config.startswith("torch"):
        optimizer: Any = TorchZeRO(params, torch.optim.AdamW, lr=1e-4)
        local, masters = optimizer.optim, []
    else:
        optimizer = ZeroRedundancyOptimizer(
            params, torch.optim.AdamW, partition="even", master_dtype=torch.float32 if master else None, lr=1e-4
        )
        local, masters = optimizer.local_optimizer, [t.tensor for t in optimizer.local_shard.masters]
    tokens = torch.randint(0, 8192, (1, 33), generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(6):
        optimizer.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).float().backward()
        for param in params:  # the averaged gradient DDP would leave (no DDP here: memory is the point)
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)
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
    if rank == 0:
        out.put(figures.tolist())
    dist.destroy_process_group()


def _run(world_size: int, config: str, millions: float) -> list[float]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = 29300 + (os.getpid() + world_size + CONFIGS.index(config) * 17) % 600
    ranks = [
        context.Process(target=_rank, args=(r, world_size, port, config, millions, results)) for r in range(world_size)
    ]
    for process in ranks:
        process.start()
    figures: list[float] = results.get()
    for process in ranks:
        process.join()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--params-millions", type=float, default=20.0)
    args = parser.parse_args()
    print(f"{'N':>2} {'configuration':<30} {'params':>7} {'grads':>7} {'state':>7} {'master':>7} {'total MB':>8} "
          f"{'RSS MB':>7} {'step ms':>8}")  # fmt: skip
    for world_size in args.world_sizes:
        totals = {}
        for config in CONFIGS:
            params, grads, state, master, rss, step_us = _run(world_size, config, args.params_millions)
            totals[config] = params + grads + state + master
            print(
                f"{world_size:>2} {config:<30} {params / 1e6:>7.1f} {grads / 1e6:>7.1f} {state / 1e6:>7.1f} "
                f"{master / 1e6:>7.1f} {totals[config] / 1e6:>8.1f} {rss / 1e6:>7.0f} {step_us / 1e3:>8.1f}",
                flush=True,
            )
        ratio = totals["distoptim bf16 + fp32 master"] / totals["torch-zero fp32"]
        print(f"   bf16 + master / torch's fp32 ZeRO, per-rank bytes: {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
