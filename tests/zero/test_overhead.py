"""Per-step work fixed by the layout is done once: the parameter sync runs no Python per parameter, the overlap
stepper visits each owned tensor once per backward, whatever the number of DDP buckets; and the results are still
bit for bit those of a single-process optimizer, over many small parameters of every layout."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distoptim import ZeroRedundancyOptimizer
from distoptim._flat import is_dense
from distoptim.comm import collectives as comm
from distoptim.functional import FunctionalOptimizer
from distoptim.hooks import allreduce_hook, hook_with_zero_step_interleaved
from distoptim.zero.buckets import StagedSync
from distoptim.zero.layouts import layouts_from_plan, piece_view
from distoptim.zero.partition import partition_parameters
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, set_gradients


def _small_params(count: int, dense_only: bool, seed: int = 0) -> list[torch.Tensor]:
    """``count`` small parameters cycling through the layouts a sync must keep: contiguous, transposed, channels_last,
    a second dtype, and (unless ``dense_only``) a non-dense slice."""
    generator = torch.Generator().manual_seed(seed)
    kinds: list[Callable[[], torch.Tensor]] = [
        lambda: torch.randn(7, generator=generator),
        lambda: torch.randn(5, 3, generator=generator).t(),
        lambda: torch.randn(2, 3, 2, 2, generator=generator).to(memory_format=torch.channels_last),
        lambda: torch.randn(5, generator=generator).bfloat16(),
    ]
    if not dense_only:
        kinds.append(lambda: torch.randn(4, 6, generator=generator)[:, ::2])
    return [kinds[i % len(kinds)]() for i in range(count)]


def _python_calls(action: Callable[[], None]) -> int:
    """How many Python functions ``action`` calls (generators resumed included)."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        action()
    finally:
        sys.setprofile(None)
    return calls


def _sync_body(rank: int, world_size: int) -> None:
    for partition in ("greedy", "even"):
        calls = []
        for count in (24, 96):
            expected = _small_params(count, dense_only=partition == "even")
            params = [torch.full_like(t, -1.0) for t in expected]
            keys = [(t.device, t.dtype) for t in params]
            plan = partition_parameters(
                [t.numel() for t in params], [True] * count, world_size, mode=partition, keys=keys
            )
            layouts = layouts_from_plan(plan.layouts, plan.fragments, params)
            sync = StagedSync(layouts, dist.group.WORLD, comm.Collectives.POINT_TO_POINT)
            index_of = {id(param): index for index, param in enumerate(params)}
            for step in range(2):  # the first sync works out the copies, the second only runs them
                if partition == "greedy" and step == 1:  # a replaced .data is followed, as torch.optim follows it
                    for param in params:
                        param.data = torch.full_like(param, -1.0)
                for param in params:
                    param.detach().fill_(-1.0)
                for layout in layouts:
                    for piece in layout.pieces:
                        if piece.rank == rank:
                            want = expected[index_of[id(piece.param)]]
                            piece_view(piece).copy_(piece_view(replace(piece, param=want)))
                if step == 0:
                    sync.sync_parameters()
                else:
                    calls.append(_python_calls(sync.sync_parameters))
                for index, (param, want) in enumerate(zip(params, expected)):
                    assert torch.equal(param, want), f"{partition}, {count} parameters, step {step}: parameter {index}"
        assert calls[0] == calls[1], f"{partition}: the sync's Python calls grow with the parameters: {calls}"


@pytest.mark.parametrize("world_size", [1, 3])
def test_staged_sync_runs_no_python_per_parameter(world_size: int) -> None:
    run_on_ranks(_sync_body, world_size)


def _overlap_body(rank: int, world_size: int, hook: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(6, 6) for _ in range(12)))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0002)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.01)
    ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero))
    stepped: list[int] = []
    original = FunctionalOptimizer.step

    def counted(self: FunctionalOptimizer, gradients: list[torch.Tensor | None]) -> None:
        stepped.append(len(gradients))
        original(self, gradients)

    with mock.patch.object(FunctionalOptimizer, "step", counted):
        for iteration in range(3):  # DDP rebuilds its buckets after the first backward
            stepped.clear()
            zero.zero_grad()
            ddp(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank + 10 * iteration))).sum().backward()
    buckets = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", "))
    assert buckets >= 6, f"the test needs many DDP buckets, got {buckets}"
    owned = sum(len(group) for group in zero.local_shard.groups)
    assert sum(stepped) == owned, f"{hook.__name__}: {sum(stepped)} gradients handed over for {owned} owned tensors"


def test_interleaved_overlap_step_visits_each_owned_tensor_once_per_backward() -> None:
    """Stepping bucket by bucket, each bucket's step hands over its own owned tensors only (it used to hand over its
    whole param group, None for the rest: buckets x parameters per backward)."""
    run_on_ranks(_overlap_body, 2, hook_with_zero_step_interleaved)


MODES = [
    (optimizer, bucket_view, partition)
    for optimizer in ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.AdamW, {"lr": 0.01}))
    for bucket_view in (False, True)
    for partition in ("greedy", "even")
]


def _parity_body(rank: int, world_size: int) -> None:
    for (optimizer_class, kwargs), bucket_view, partition in MODES:
        what = f"{optimizer_class.__name__} bucket_view={bucket_view} {partition} world={world_size}"
        dense_only = partition == "even"
        params = [nn.Parameter(t) for t in _small_params(60, dense_only)]
        expected = [nn.Parameter(t) for t in _small_params(60, dense_only)]
        zero = ZeroRedundancyOptimizer(
            params, optimizer_class, parameters_as_bucket_view=bucket_view, partition=partition, **kwargs
        )
        reference = optimizer_class(expected, **kwargs)
        for step in range(3):
            set_gradients(averaged_gradients(params, rank, step), params, expected)
            zero.step()
            reference.step()
            assert_same_tensors(params, expected, f"{what} step {step}")
        dense = [index for index, param in enumerate(expected) if is_dense(param)]
        assert [params[i].stride() for i in dense] == [expected[i].stride() for i in dense], f"{what}: strides kept"


@pytest.mark.parametrize("world_size", [1, 3])
def test_many_small_parameters_match_single_process_optimizer(world_size: int) -> None:
    run_on_ranks(_parity_body, world_size)
