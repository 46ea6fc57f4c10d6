"""ShardedDataParallel reduces a gradient to the very bits DDP's reducer gives, at a world size whose 1/N is
inexact (DDP scales each rank's gradient by 1/N as it copies it into the bucket; dividing by N rounds differently
in about a third of the elements), and keeps reducing under ``backward(create_graph=True)``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from tests._dist import run_on_ranks


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 40), nn.Tanh(), nn.Linear(40, 8)).to(dtype)


def _stepped(
    rank: int, wrap: str, dtype: torch.dtype, reduce_dtype: torch.dtype | None, cap: float, late: bool = False
) -> list:
    """The parameters after one SGD step (lr 1) on a loss only rank 0 has: the sum over ranks is exact, so only
    the scaling by 1/N can tell the two apart. ``late``: the first layer is made trainable after wrapping (no
    bucket holds it: its gradient is all-reduced on its own)."""
    net = _model(dtype)
    net[0].requires_grad_(not late)
    if wrap == "ddp":
        optim: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
        model: nn.Module = DDP(net, bucket_cap_mb=cap)
    else:
        optim = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=1.0)
        model = ShardedDataParallel(net, optim, bucket_cap_mb=cap, reduce_dtype=reduce_dtype)
    net[0].requires_grad_(True)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(rank)).to(dtype)
    (model(x).float().square().sum() * (1.0 if rank == 0 else 0.0)).backward()
    optim.step()
    return [p.detach().clone() for p in net.parameters()]


def _bits_body(rank: int, world_size: int) -> None:
    for dtype, reduce_dtype, cap in [
        (torch.float32, None, 0.002),  # several buckets
        (torch.float32, None, 25.0),  # one bucket
        (torch.float32, None, 1e-6),  # every gradient its own bucket (the gradient becomes the bucket)
        (torch.bfloat16, None, 0.002),
        (torch.bfloat16, torch.float32, 0.002),  # reduced in fp32: copied, then scaled
    ]:
        theirs = _stepped(rank, "ddp", dtype, None, cap)
        ours = _stepped(rank, "sdp", dtype, reduce_dtype, cap, late=False)
        if cap == 0.002 and reduce_dtype is None:  # and with the first layer unplaced: DDP's numbers again
            ours += _stepped(rank, "sdp", dtype, None, cap, late=True)
            theirs += theirs
        if reduce_dtype is not None:
            continue  # another rounding than DDP's by design; it must only run
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            differ = int((a != b).sum())
            assert differ == 0, f"{dtype}, cap {cap}: parameter {index}: {differ} of {a.numel()} elements differ"


def test_reduced_gradient_is_ddps_bit_for_bit_at_three_ranks() -> None:
    run_on_ranks(_bits_body, 3)


def _create_graph_body(rank: int, world_size: int) -> list[torch.Tensor]:
    net = _model(torch.float32)
    zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    model = ShardedDataParallel(net, zero)
    xs = [torch.randn(3, 24, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    model(xs[rank]).square().sum().backward(create_graph=True)
    zero.step()
    reference = _model(torch.float32)  # one process: the mean of every rank's loss, plain SGD
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    (sum(reference(x).square().sum() for x in xs) / world_size).backward()
    plain.step()
    for ours, want in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_backward_with_create_graph_reduces_as_a_plain_backward() -> None:
    first, second = run_on_ranks(_create_graph_body, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
