"""Averagers on real ranks: step-for-step parity with PyTorch's, in-place writes, mixed dtypes, validation.

Parity is exact (torch.equal): our collective lays the parameters out in the same flat buffer, divides first and
all-reduces it with the same gloo algorithm, so every element is summed in the same order as PyTorch's.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as torch_hierarchical

from distoptim.averagers import HierarchicalModelAverager, ModelAverager, PeriodicModelAverager
from tests._dist import run_on_ranks

STEPS = 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank sees its own data
    return torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)


def _train_local_sgd(rank: int, averager: Any) -> list[list[torch.Tensor]]:
    """Local SGD with momentum, then ``averager`` after every step; the parameters after each step."""
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        optim.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        averager.average_parameters(model.parameters())
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def _assert_same_history(ours: list[list[torch.Tensor]], theirs: list[list[torch.Tensor]]) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"step {step}: max difference {(x - y).abs().max().item()}"


def _parity_body(rank: int, world_size: int) -> dict[str, Any]:
    # Periodic, with warm-up: the same schedule and the same numbers as torch's, step for step.
    ours_periodic = PeriodicModelAverager(period=3, warmup_steps=2)
    _assert_same_history(
        _train_local_sgd(rank, ours_periodic),
        _train_local_sgd(rank, torch_averagers.PeriodicModelAverager(period=3, warmup_steps=2)),
    )
    # Hierarchical {2: 2, 4: 4} with warm-up; both create their subgroups here, in the same order on every rank.
    ours_hier = HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=3)
    theirs_hier = torch_hierarchical.HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=3)
    ours_history = _train_local_sgd(rank, ours_hier)
    _assert_same_history(ours_history, _train_local_sgd(rank, theirs_hier))
    assert ours_periodic.step == ours_hier.step == STEPS
    # The schedule really averages: after step 8 (4 | 8) all ranks agree; after step 6 only pairs do.
    gathered: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    dist.all_gather_object(gathered, [ours_history[8][0], ours_history[6][0]])
    assert all(torch.equal(g[0], gathered[0][0]) for g in gathered)
    assert torch.equal(gathered[rank][1], gathered[rank ^ 1][1])
    assert not torch.equal(gathered[0][1], gathered[2][1])
    groups = [ours_hier.group_at(s) is None for s in range(8)]
    for averager in (ours_hier, theirs_hier):  # the periods are fixed at construction: one deleted later is missing
        del averager.period_process_group_dict[4]
        averager.step = 8
        with pytest.raises(KeyError):
            averager.average_parameters(_model().parameters())
    return {"groups": groups}


def test_averagers_match_torch_step_for_step() -> None:
    results = run_on_ranks(_parity_body, 4)
    # warm-up 3: steps 0-3 skip except 4 | step; 4 averages globally, 5 skips, 6 averages in pairs, 7 skips.
    assert results[0]["groups"] == [True, True, True, True, False, True, False, True]


def _in_place_body(rank: int, world_size: int) -> None:
    averager = PeriodicModelAverager(period=2)
    base = torch.arange(6, dtype=torch.float64)  # small integers: dividing by 4 and summing are exact
    f32 = nn.Parameter(base.float() * (rank + 1))
    f64 = nn.Parameter(base.reshape(2, 3).t() * (rank + 1))  # non-contiguous parameter
    f16 = nn.Parameter(base.half() * (rank + 1))
    f32_late = nn.Parameter(base[:2].float() * (rank + 1))
    frozen = nn.Parameter(torch.full((3,), float(rank)))  # no gradient: left alone
    params = [f32, f64, f16, f32_late, frozen]
    for p in params[:4]:
        p.grad = torch.zeros_like(p)
    pointers = [p.data_ptr() for p in params]
    before = [p.detach().clone() for p in params]
    mean_factor = sum(r + 1 for r in range(world_size)) / world_size
    # zero-sized parameters first, in the middle and last, of several dtypes: nothing to average
    empties = [nn.Parameter(torch.empty(0)), nn.Parameter(torch.empty(0, 3, dtype=torch.float64))]
    empties.append(nn.Parameter(torch.empty(0, dtype=torch.bfloat16)))
    for empty in empties:
        empty.grad = torch.zeros_like(empty)

    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        averager.average_parameters([empties[0], *params[:2], empties[1], *params[2:], empties[2]])  # step 0: averages
    assert all_reduce.call_count == 1, "one collective per device, mixed dtypes promoted together (as torch)"
    assert [p.data_ptr() for p in params] == pointers, "averaging must write in place"
    for p, old in zip(params[:4], before[:4], strict=True):
        assert p.dtype == old.dtype
        torch.testing.assert_close(p.detach(), old / (rank + 1) * mean_factor, rtol=0, atol=0)
    assert torch.equal(frozen.detach(), before[4])

    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        averager.average_parameters([{"params": params}])  # step 1: not due, param groups accepted
    assert all_reduce.call_count == 0 and averager.step == 2

    with pytest.raises(TypeError, match="plain torch.Tensor"):
        averager.average_parameters([f32, torch.zeros(2)])
    assert averager.step == 2, "a rejected call does not advance the schedule"

    # Hierarchical validation: every rank fails alike before any subgroup is created, so nothing hangs.
    cases: list[tuple[dict[int, int], str]] = [
        ({}, r"^Arg ``period_group_size_dict`` must not be empty\. Map at least one period"),  # torch's text first
        ({0: 2, 4: 4}, r"^The minimum period in arg ``period_group_size_dict`` must be a positive value\."),
        ({4: 2, 2: 4}, "increasing order"),
        ({2: 3, 4: 4}, "divide the group's 4 ranks"),
        ({2: 2, 4: 2}, r"^The last value in arg ``period_group_size_dict`` 2 must be equal to the size of arg "),
        ({2: 2, 4: 3}, r"^The last value in arg ``period_group_size_dict`` 3 must be equal"),
    ]
    for levels, message in cases:
        with pytest.raises(ValueError, match=message):
            HierarchicalModelAverager(levels)
    with pytest.raises(ValueError, match=r"^Arg ``warmup_steps`` must be a non-negative number\."):
        HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=-1)
    with pytest.warns(UserWarning, match=r"^When period is 1, no need to use model averaging because"):
        PeriodicModelAverager(period=1)
    with pytest.warns(UserWarning, match=r"^When the maximum period in arg ``period_group_size_dict`` is 1, no need"):
        HierarchicalModelAverager({1: 4})
    with pytest.raises(TypeError, match="abstract"):
        ModelAverager()  # type: ignore[abstract]
    dist.barrier()


def test_in_place_mixed_dtypes_and_validation() -> None:
    run_on_ranks(_in_place_body, 4)


_MIXED = (torch.bfloat16, torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _mixed_local_sgd(rank: int, averager: Any, wrap: Any = None) -> list[list[torch.Tensor]]:
    """Plain SGD on bf16/f32/f64/f16 parameters that differ per rank, then ``averager`` (or ``wrap(sgd,
    averager)``, a post-local-SGD optimizer) every step; the parameters after each step."""
    gen = torch.Generator().manual_seed(11 + rank)
    params = [nn.Parameter(torch.randn(4, 7, generator=gen).to(dtype)) for dtype in _MIXED]
    sgd = torch.optim.SGD(params, lr=0.1)
    optim = sgd if wrap is None else wrap(sgd, averager)
    history = []
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        optim.step()
        if wrap is None:
            averager.average_parameters(params)
        history.append([p.detach().clone() for p in params])
    return history


def _mixed_body(rank: int, world_size: int) -> None:
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer

    from distoptim import PostLocalSGDOptimizer

    subgroups = [None, dist.new_group([0, 1, 2]), dist.new_group([0, 2])]  # every rank creates each, in order
    for group in subgroups:
        _assert_same_history(
            _mixed_local_sgd(rank, PeriodicModelAverager(period=2, warmup_steps=1, process_group=group)),
            _mixed_local_sgd(rank, torch_averagers.PeriodicModelAverager(2, warmup_steps=1, process_group=group)),
        )
    for levels in ({2: 3}, {1: 1, 3: 3}):
        ours, theirs = HierarchicalModelAverager(levels), torch_hierarchical.HierarchicalModelAverager(levels)
        _assert_same_history(_mixed_local_sgd(rank, ours), _mixed_local_sgd(rank, theirs))
    _assert_same_history(
        _mixed_local_sgd(rank, PeriodicModelAverager(period=2), PostLocalSGDOptimizer),
        _mixed_local_sgd(rank, torch_averagers.PeriodicModelAverager(period=2), TorchPostLocalSGDOptimizer),
    )


def test_mixed_dtypes_average_as_torch_at_three_ranks() -> None:
    """Three ranks (dividing by 3 rounds): torch concatenates mixed dtypes into their promoted dtype, all-reduces
    once and rounds each parameter back once; averaging one dtype at a time differs by up to a bf16 ulp."""
    run_on_ranks(_mixed_body, 3, timeout=180)
