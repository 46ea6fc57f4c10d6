"""The CUDA paths, run where a GPU is (``benchmarks/gpu_check.sh`` on a lent machine); skipped elsewhere.

- NCCL at world size 1 (one GPU): every mode of ZeRO (gradients all-reduced or reduced to owners, stepped explicitly
  or inside DDP's backward, bucket views on and off, both partitions, NCCL's chunked collectives; p2p is refused) and
  ShardedDataParallel (overlapped sync on and off) equal the plain optimizer, and two steady-state iterations run
  under ``torch.cuda.set_sync_debug_mode("error")``: any call that makes the CPU wait for the GPU raises.
- gloo with 2 ranks on one GPU: ZeRO-2 and ShardedDataParallel with CUDA tensors, against DDP + the plain optimizer.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.comm import collectives as comm
from tests._dist import cuda_world_size, run_on_ranks
from tests.zero._hooks import register

pytestmark = pytest.mark.skipif(cuda_world_size() < 1, reason="needs a CUDA device")

KWARGS = {"lr": 0.01, "weight_decay": 0.1}


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)


def _batch(rank: int, step: int, device: torch.device) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank)).to(device)


MODES = [
    *(("ddp", *mode) for mode in itertools.product(["all_reduce", "to_owners"], ["explicit", "hook", "interleaved"])),
    ("sdp", "overlap", "explicit"),
    ("sdp", "no_overlap", "explicit"),
]


def _build(mode: tuple[str, str, str], partition: str, bucket_view: bool, device: torch.device, rank: int) -> Any:
    kind, how, stepping = mode
    model = _model(device)
    zero = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        partition=partition,
        parameters_as_bucket_view=bucket_view,
        overlap_with_ddp=stepping != "explicit",
        **KWARGS,
    )
    if kind == "sdp":
        wrapped: Any = ShardedDataParallel(model, zero, bucket_cap_mb=0.01, overlap_param_sync=how == "overlap")
    else:
        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.01)
        register(wrapped, zero, how, stepping)
    return model, zero, wrapped


def _iteration(wrapped: Any, zero: Any, rank: int, step: int, device: torch.device, stepping: str) -> None:
    zero.zero_grad()
    wrapped(_batch(rank, step, device)).square().mean().backward()
    if stepping == "explicit":
        zero.step()


def _nccl_body(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    os.environ[comm.ENVIRONMENT] = comm.Collectives.POINT_TO_POINT.value  # gloo's: refused on NCCL, by every rank
    with pytest.raises(ValueError, match="p2p is gloo's style"):
        _build(MODES[0], "even", True, device, rank)
    for mode, partition, bucket_view, style in itertools.product(
        MODES, ["greedy", "even"], [False, True], [comm.Collectives.CHUNKED]
    ):
        os.environ[comm.ENVIRONMENT] = style.value
        model, zero, wrapped = _build(mode, partition, bucket_view, device, rank)
        reference = _model(device)
        plain = torch.optim.AdamW(reference.parameters(), **KWARGS)
        for step in range(4):
            if step >= 2:  # the steady state: no call may make the CPU wait for the GPU
                torch.cuda.set_sync_debug_mode("error")
            try:
                _iteration(wrapped, zero, rank, step, device, mode[2])
            finally:
                torch.cuda.set_sync_debug_mode("default")
            plain.zero_grad()
            reference(_batch(rank, step, device)).square().mean().backward()
            plain.step()
        zero.sync_finished()
        for ours, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(
                ours, want, rtol=1e-5, atol=1e-6, msg=f"{mode} {partition} {bucket_view} {style}"
            )
    os.environ.pop(comm.ENVIRONMENT, None)


def test_nccl_every_mode_matches_and_never_waits_for_the_gpu() -> None:
    run_on_ranks(_nccl_body, 1, backend="nccl", timeout=600)


def _gloo_on_one_gpu_body(rank: int, world_size: int) -> None:
    device = torch.device("cuda", 0)
    for mode, partition in itertools.product([MODES[3], MODES[6]], ["greedy", "even"]):
        model, zero, wrapped = _build(mode, partition, True, device, rank)
        reference = _model(device)
        ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KWARGS)
        for step in range(3):
            _iteration(wrapped, zero, rank, step, device, "explicit")
            plain.zero_grad()
            ddp(_batch(rank, step, device)).square().mean().backward()
            plain.step()
        zero.sync_finished()
        for ours, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6, msg=f"{mode} {partition}")


def test_gloo_with_two_ranks_on_one_gpu() -> None:
    run_on_ranks(_gloo_on_one_gpu_body, 2, timeout=300)
