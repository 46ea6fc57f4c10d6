"""Hostile review of ZeroRedundancyOptimizer on DDP (hooks, hybrid sharding): against DDP + plain AdamW on the same
seeds and data. Run explicitly: pytest tests/_review_zero.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks

KW = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}  # SGD: differences stay proportional


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _join_unused_body(rank: int, world_size: int, hook_name: str, find_unused: Any) -> list[torch.Tensor]:
    from torch.distributed.algorithms.join import Join

    from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved

    hook = {"hook": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}[hook_name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    static = find_unused == "static_graph"
    ddp = DDP(model, bucket_cap_mb=0.0001, find_unused_parameters=find_unused is True, static_graph=static)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.05)
    ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
    with Join([ddp, zero]):
        for step in range(2 + rank):
            zero.zero_grad()
            ddp(_x(rank, step)).square().mean().backward()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("find_unused", [False, True, "static_graph"])
@pytest.mark.parametrize("hook_name", ["hook", "interleaved"])
def test_overlap_hooks_under_join(hook_name: str, find_unused: Any) -> None:
    results = run_on_ranks(_join_unused_body, 2, hook_name, find_unused, timeout=60)
    for a, b in zip(*results):
        assert torch.equal(a, b)
