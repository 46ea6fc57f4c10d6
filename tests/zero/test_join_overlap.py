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


BATCHES = [2, 4]  # rank r's number of batches: rank 0 joins early


def _lr(rank: int, step: int) -> float:
    """Rank ``rank``'s lr at ``step`` under StepLR(1, 0.5): it stops halving once the rank has joined."""
    return float(KW["lr"] * 0.5 ** min(step, BATCHES[rank]))


def _scheduled_overlap_body(rank: int, world_size: int, hook_name: str) -> tuple[list[torch.Tensor], list[int]]:
    """Overlap mode under ``Join`` with a StepLR stepped after every step: the joined rank's shard is stepped (by
    DDP's join hook, through the comm hook) with that rank's own lr, its scheduler having stopped with its inputs."""
    from torch.distributed.algorithms.join import Join

    from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved

    model = _net()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, **KW)
    hook = {"hook": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}[hook_name]
    ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
    scheduler = torch.optim.lr_scheduler.StepLR(zero, 1, gamma=0.5)
    with Join([ddp, zero]):
        for step in range(BATCHES[rank]):
            zero.zero_grad()
            ddp(_x(rank, step)).square().mean().backward()
            zero.step()
            scheduler.step()
    owners = [zero.fragments_of(p)[0].rank for p in model.parameters()]  # greedy: whole parameters
    return [p.detach().clone() for p in model.parameters()], owners


def _reference(owners: list[int]) -> list[torch.Tensor]:
    """DDP + plain SGD, one optimizer per owner: each owner steps its parameters with the DDP average (a joined rank
    gives zeros) and its own lr, as torch's ZeroRedundancyOptimizer does once a rank has joined."""
    model = _net()
    params = list(model.parameters())
    optims = [torch.optim.SGD([p for p, owner in zip(params, owners) if owner == r], **KW) for r in range(len(BATCHES))]
    for step in range(max(BATCHES)):
        model.zero_grad()
        for r, count in enumerate(BATCHES):
            if step < count:
                model(_x(r, step)).square().mean().backward()
        for p in params:
            assert p.grad is not None
            p.grad.div_(len(BATCHES))
        for r, optim in enumerate(optims):
            optim.param_groups[0]["lr"] = _lr(r, step)
            optim.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("hook_name", ["hook", "interleaved"])
def test_lr_scheduler_under_join_matches_ddp_and_sgd_per_owner(hook_name: str) -> None:
    """torch's overlap mode refuses gloo: the reference is DDP + plain SGD, one per owner."""
    results = run_on_ranks(_scheduled_overlap_body, 2, hook_name, timeout=60)
    (ours, owners), (theirs, _) = results
    assert sorted(set(owners)) == [0, 1]  # each rank owns some parameter
    for a, b, c in zip(ours, theirs, _reference(owners)):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)


def _overlap_disagree_body(rank: int, world_size: int) -> None:
    """Rank 0 has joined (its lr is its own); rank 1 changes its lr alone: every rank raises, the joined one too."""
    from torch.distributed.algorithms.join import Join

    from distoptim.hooks import allreduce_hook, hook_with_zero_step

    model = _net()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, **KW)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero, step_from_first_backward=True))
    scheduler = torch.optim.lr_scheduler.StepLR(zero, 1, gamma=0.5)
    disagree = r"step: rank (1 and rank 2|2 and rank 1) disagree \(param group 0: 'lr' "
    with pytest.raises(ValueError, match=disagree), Join([ddp, zero]):
        for step in range([1, 4, 4][rank]):
            zero.zero_grad()
            if rank == 1 and step == 2:
                zero.param_groups[0]["lr"] *= 2
            ddp(_x(rank, step)).square().mean().backward()
            zero.step()
            scheduler.step()


def test_training_ranks_still_agree_on_hyperparameters_under_join() -> None:
    run_on_ranks(_overlap_disagree_body, 3, timeout=120)
