"""Gradient accumulation under the overlap hooks (``step_from_first_backward=True``), with the deprecated
``reduce_to_owners_hook`` inside (an all-reduce now) or ``allreduce_hook``: every way of accumulating (without
clearing between backwards, clearing to None, in place or through ``.data``; ``no_sync()``; DDP's bucket views,
static graph, unused parameters) trains as DDP + plain SGD. Before the hook was retired, accumulating without
clearing was refused (the owners' leftovers were summed); now ``.grad`` holds DDP's average everywhere."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved, reduce_to_owners_hook
from tests._dist import run_on_ranks

HOOKS = [hook_with_zero_step, hook_with_zero_step_interleaved]
ALLREDUCE = ["allreduce_synced", "allreduce_synced_bucket_view", "allreduce_synced_static_graph"]
HOWS = ["synced", "synced_bucket_view", "synced_static_graph", "synced_find_unused", *ALLREDUCE]
HOWS += ["zero_grad", "zero_grad_static_graph", "zero_grad_find_unused", "in_place", "data_zero"]
HOWS += ["no_sync", "no_sync_bucket_view", "no_sync_find_unused"]
NOT_CLEARED = ("synced", "synced_bucket_view", "synced_static_graph", "synced_find_unused", *ALLREDUCE)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, iteration: int, micro: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1000 * iteration + 10 * micro + rank))


def _clear(how: str, zero: ZeroRedundancyOptimizer, plain: torch.optim.Optimizer, model: nn.Module) -> None:
    if how == "data_zero":  # the old idiom: no _version bump
        for param in model.parameters():
            if param.grad is not None:
                param.grad.data.zero_()
    elif how not in NOT_CLEARED:
        zero.zero_grad(set_to_none=how != "in_place")  # in_place: _version bumped, the same tensor
    if how not in NOT_CLEARED:
        plain.zero_grad()


def _train(rank: int, hook: Any, how: str) -> str:
    """Three iterations of two backwards (the first under ``no_sync()`` where ``how`` says so, the gradients cleared
    before each synced one otherwise) against DDP + SGD stepping after every synced backward; returns "ok"."""
    model, reference = _net(), _net()
    options = {
        "gradient_as_bucket_view": how.endswith("bucket_view"),
        "static_graph": how.endswith("static_graph"),
        "find_unused_parameters": how.endswith("find_unused"),
    }
    ddp = DDP(model, bucket_cap_mb=0.0005, **options)
    reference_ddp = DDP(reference, bucket_cap_mb=0.0005)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1, momentum=0.9)
    inner, state = (allreduce_hook, None) if how.startswith("allreduce") else (reduce_to_owners_hook, zero)
    ddp.register_comm_hook(state, hook(inner, ddp, zero, step_from_first_backward=True))
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for iteration, micro in itertools.product(range(3), range(2)):
        if micro == 0 or not how.startswith("no_sync"):  # before every synced backward, or before no_sync's
            _clear(how, zero, plain, model)
        if how.startswith("no_sync") and micro == 0:
            with ddp.no_sync(), reference_ddp.no_sync():
                ddp(_batch(rank, iteration, micro)).square().mean().backward()
                reference_ddp(_batch(rank, iteration, micro)).square().mean().backward()
            continue
        ddp(_batch(rank, iteration, micro)).square().mean().backward()
        reference_ddp(_batch(rank, iteration, micro)).square().mean().backward()
        plain.step()
        _assert_close(model, reference, f"{how} {iteration}.{micro}")
    return "ok"


def _assert_close(model: nn.Module, reference: nn.Module, what: str) -> None:
    for index, (param, expected) in enumerate(zip(model.parameters(), reference.parameters())):
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6, msg=lambda m, i=index: f"{what}[{i}]: {m}")


def _body(rank: int, world_size: int) -> list[tuple[str, str, str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # reduce_to_owners_hook is deprecated
        return [(hook.__name__, how, _train(rank, hook, how)) for hook in HOOKS for how in HOWS]


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_way_of_accumulating_trains_as_ddp(world_size: int) -> None:
    for results in run_on_ranks(_body, world_size, timeout=300):
        assert len(results) == len(HOOKS) * len(HOWS)
        for hook, how, outcome in results:
            assert outcome == "ok", (hook, how, outcome)


def _explicit_bucket_view_body(rank: int, world_size: int) -> list[str]:
    """Without the overlap hooks, with DDP's bucket views (re-created at its second forward): two synced backwards
    before the very first ``step()`` train as DDP, cleared between them or not."""
    warnings.simplefilter("ignore", FutureWarning)  # reduce_to_owners_hook is deprecated
    outcomes = []
    for clear in (False, True):
        model, reference = _net(), _net()
        ddp, reference_ddp = DDP(model, bucket_cap_mb=0.0005, gradient_as_bucket_view=True), DDP(reference)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        ddp.register_comm_hook(zero, reduce_to_owners_hook)
        plain = torch.optim.SGD(reference.parameters(), lr=0.1)
        for micro in range(2):
            if clear:
                zero.zero_grad()
                plain.zero_grad()
            ddp(_batch(rank, 0, micro)).square().mean().backward()
            reference_ddp(_batch(rank, 0, micro)).square().mean().backward()
        zero.step()
        plain.step()
        _assert_close(model, reference, f"explicit step, cleared={clear}")
        outcomes.append("ok")
    return outcomes


def test_accumulating_with_bucket_views_before_the_first_step_trains_as_ddp() -> None:
    for outcomes in run_on_ranks(_explicit_bucket_view_body, 2, timeout=120):
        assert outcomes == ["ok", "ok"], outcomes
