"""Step time of every mode on one GPU with NCCL (world size 1), and whether the CPU runs ahead of the GPU.

For each mode: the median time of a whole iteration (forward, backward, step) with the GPU drained after it, and the
median time the CPU takes to *queue* one (no drain): a mode that makes the CPU wait for the GPU somewhere in its hot
path shows a queueing time close to the whole iteration's. Run by ``benchmarks/gpu_check.sh`` on a lent GPU::

    python benchmarks/gpu_timing.py [--params-millions 50] [--iterations 20] [--batch 2048]

The batch keeps the GPU busier than the CPU's queueing (the 2026-12-06 run at 64 rows was CPU-bound in every mode).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's tests/ helpers
from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.comm import collectives as comm
from tests.zero._hooks import register


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers).cuda()


def _variant(name: str, width: int, depth: int) -> tuple[Any, Any, str]:
    model = _model(width, depth)
    if name == "ddp-adamw":
        return DDP(model, device_ids=[0]), torch.optim.AdamW(model.parameters(), lr=1e-4), "plain"
    overlap = name.endswith("-interleaved")
    zero = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        partition="even",
        parameters_as_bucket_view=True,
        overlap_with_ddp=overlap,
        lr=1e-4,
    )
    if name.startswith("sdp"):
        return ShardedDataParallel(model, zero, overlap_param_sync=name == "sdp-overlap"), zero, "explicit"
    ddp = DDP(model, device_ids=[0])
    register(ddp, zero, "to_owners" if "zero2" in name else "all_reduce", "interleaved" if overlap else "explicit")
    return ddp, zero, "interleaved" if overlap else "explicit"


def _time(wrapped: Any, optimizer: Any, stepping: str, batch: torch.Tensor, iterations: int) -> tuple[float, float]:
    def iteration() -> None:
        optimizer.zero_grad()
        wrapped(batch).square().mean().backward()
        if stepping != "interleaved":
            optimizer.step()

    for _ in range(3):
        iteration()
    torch.cuda.synchronize()
    whole, queued = [], []
    for _ in range(iterations):
        start = time.perf_counter()
        iteration()
        queued.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        whole.append(time.perf_counter() - start)
    return statistics.median(whole) * 1e3, statistics.median(queued) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-millions", type=float, default=50.0)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument(
        "--batch",
        type=int,
        default=2048,
        help="rows per batch; at 64 every mode, DDP too, is bound by the CPU's queueing",
    )
    args = parser.parse_args()
    width = 2048
    depth = max(1, round(args.params_millions * 1e6 / (width * width + width)))
    store = tempfile.mktemp(prefix="distoptim-gpu-")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    batch = torch.randn(args.batch, width, device="cuda")
    millions = depth * (width * width + width) / 1e6
    print(f"{depth} layers of {width}: {millions:.1f}M parameters, batch {args.batch}, world size 1 (NCCL)")
    print(f"{'variant':<24} {'collectives':<10} {'iteration ms':>13} {'queued ms':>10}")
    for name in ["ddp-adamw", "zero1", "zero2", "zero2-interleaved", "sdp", "sdp-overlap"]:
        for style in [comm.Collectives.CHUNKED] if name != "ddp-adamw" else [None]:  # NCCL refuses p2p
            os.environ[comm.ENVIRONMENT] = style.value if style else "auto"
            wrapped, optimizer, stepping = _variant(name, width, depth)
            whole, queued = _time(wrapped, optimizer, stepping, batch, args.iterations)
            print(f"{name:<24} {style.value if style else '-':<10} {whole:>13.2f} {queued:>10.2f}")
            del wrapped, optimizer
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
