"""ZeRO under DDP: every combination of partition x stepping x bucket view equals DDP + the plain optimizer (+ torch's
clip_grad_norm_), on a model with a channels_last convolution and two param groups; the deprecated
``reduce_to_owners_hook`` (an all-reduce now) trains bitwise as DDP, accumulating and clipping included; the
reductions to owners ``ShardedDataParallel`` uses, in every style of collectives."""

from __future__ import annotations

import itertools
import math
import os
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from distoptim.comm import collectives as comm
from distoptim.comm import p2p
from tests._dist import run_on_ranks
from tests.zero._hooks import register

ITERATIONS = 4
PARTITIONS = ["greedy", "even"]
STEPPING = ["explicit", "hook", "interleaved"]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 4))
        self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x.contiguous(memory_format=torch.channels_last))))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [{"params": params[:2], "lr": 0.02}, {"params": params[2:]}]


def _batch(rank: int, iteration: int) -> torch.Tensor:
    return torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(1000 * iteration + rank))


def _ddp(model: nn.Module) -> DDP:
    return DDP(model, bucket_cap_mb=0.002)  # a few buckets once DDP rebuilds them after the first iteration


def _build(config: tuple[str, str, str, bool], optimizer: tuple[type, dict[str, Any]]) -> tuple[DDP, Any]:
    partition, reduction, stepping, bucket_view = config
    optimizer_class, kwargs = optimizer
    model = _Net()
    ddp = _ddp(model)
    zero = ZeroRedundancyOptimizer(
        _groups(model),
        optimizer_class,
        parameters_as_bucket_view=bucket_view,
        overlap_with_ddp=stepping != "explicit",
        partition=partition,
        **kwargs,
    )
    register(ddp, zero, reduction, stepping)
    return ddp, zero


def _matrix_body(rank: int, world_size: int, configs: list[tuple[str, str, str, bool]]) -> None:
    optimizers = [
        (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    ]
    for number, config in enumerate(configs):
        optimizer_class, kwargs = optimizers[number % 2]
        clip = config[2] == "explicit"
        what = f"{config} {optimizer_class.__name__} world={world_size}"
        ddp, zero = _build(config, (optimizer_class, kwargs))
        reference = _Net()
        reference_ddp = _ddp(reference)
        reference_optimizer = optimizer_class(_groups(reference), **kwargs)
        for iteration in range(ITERATIONS):
            zero.zero_grad()
            ddp(_batch(rank, iteration)).square().mean().backward()
            reference_optimizer.zero_grad()
            reference_ddp(_batch(rank, iteration)).square().mean().backward()
            if clip:
                norm_type = [2.0, math.inf, 1.0][iteration % 3]
                total = zero.clip_grad_norm_(0.05, norm_type=norm_type)
                expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type=norm_type)
                torch.testing.assert_close(total, expected, rtol=1e-6, atol=0, msg=f"{what}: norm {norm_type}")
            if config[2] == "explicit":
                zero.step()
            reference_optimizer.step()
            for index, (param, want) in enumerate(zip(ddp.module.parameters(), reference.parameters())):
                label = f"{what} iteration {iteration} parameter {index}"
                torch.testing.assert_close(
                    param, want, rtol=1e-5, atol=1e-6, msg=lambda m, label=label: f"{label}: {m}"
                )
                assert param.stride() == want.stride(), f"{label} lost its layout"


CONFIGS = list(itertools.product(PARTITIONS, ["all_reduce"], STEPPING, [False, True]))


def test_every_combination_at_two_ranks() -> None:
    run_on_ranks(_matrix_body, 2, CONFIGS, timeout=240)


def test_every_combination_at_three_ranks() -> None:
    run_on_ranks(_matrix_body, 3, CONFIGS, timeout=240)


def _clip_errors_body(rank: int, world_size: int) -> None:
    model = _Net()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, partition="even", lr=0.1)
    for param in model.parameters():
        param.grad = torch.full_like(param, math.nan if rank == 1 else 1.0)
    with pytest.raises(RuntimeError, match="non-finite"):
        zero.clip_grad_norm_(1.0, error_if_nonfinite=True)  # only rank 1 has the nan: every rank raises


def test_clip_grad_norm_nonfinite_raises_on_every_rank() -> None:
    run_on_ranks(_clip_errors_body, 2)


def _reduce_to_owners_body(rank: int, world_size: int) -> None:
    """Every way comm.reduce_to_owners_async works, in both styles of collectives: point to point (an owner's ranges
    packed when several, received whole or two chunks of a few elements at a time from each rank; a rank that owns
    nothing receives nothing), rooted reduces in place or packed owner by owner, one reduce_scatter over equal shares
    (the buffer rank by rank, or packed), all-reduced slices (owner EVERY: elements nobody owns yet), and the owned
    sums summed once more across replicas."""
    interleaved = [(2, 0, 3), (0, 3, 5), (1, 5, 9), (0, 9, 10), (2, 10, 11), (1, 11, 12)]
    cases = [
        (interleaved, 4),  # in place
        (interleaved, 0),  # too many slices for in-place reduces: packed
        ([(0, 0, 4), (1, 4, 8), (2, 8, 12)], 4),  # equal shares, rank by rank: the chunked style scatters in place
        ([(1, 0, 2), (comm.EVERY, 2, 4), (2, 4, 6), (0, 6, 8), (1, 8, 10), (2, 10, 12), (0, 12, 14)], 4),  # packed
        ([(1, 0, 5), (0, 5, 7), (1, 7, 9)], 4),  # rank 2 owns nothing
    ]
    styles = [(style, p2p.STAGING_BYTES) for style in comm.Collectives]
    styles.append((comm.Collectives.POINT_TO_POINT, 40))  # received 2-3 elements a chunk, two chunks in flight
    for (collectives, staging), (slices, calls) in itertools.product(styles, cases):
        p2p.STAGING_BYTES, default = staging, p2p.STAGING_BYTES
        size = slices[-1][2]
        buffer = torch.arange(size, dtype=torch.float32) * (rank + 1)
        summed = torch.arange(size, dtype=torch.float32) * sum(r + 1 for r in range(world_size))
        future = comm.reduce_to_owners_async(
            buffer, slices, dist.group.WORLD, collectives, max_rooted_calls_per_rank=calls
        )
        p2p.STAGING_BYTES = default
        assert future.wait() is buffer
        for owner, start, end in slices:
            if owner in (rank, comm.EVERY):
                assert torch.equal(buffer[start:end], summed[start:end]), (collectives, calls, owner, start, end)
    shards = [dist.new_group([r]) for r in range(world_size)]  # every rank a shard group of one, replicated N times
    for collectives in comm.Collectives:
        buffer = torch.ones(6) * (rank + 1)
        comm.reduce_to_owners_async(buffer, [(0, 0, 6)], shards[rank], collectives, replicas=dist.group.WORLD).wait()
        assert torch.equal(buffer, torch.ones(6) * sum(r + 1 for r in range(world_size))), collectives


def test_reduce_to_owners_in_every_style() -> None:
    run_on_ranks(_reduce_to_owners_body, 3)


@pytest.mark.parametrize(
    ("config", "value", "chosen"),  # dist.get_backend_config's answer for backend="gloo", "nccl", ...
    [
        ("cpu:gloo,cuda:gloo", "", comm.Collectives.POINT_TO_POINT),
        ("cpu:gloo", "", comm.Collectives.POINT_TO_POINT),  # init_process_group() without a backend, on a CPU machine
        ("cpu:gloo,cuda:gloo", "chunked", comm.Collectives.CHUNKED),
        ("cuda:nccl", "auto", comm.Collectives.CHUNKED),
        ("cuda:nccl", "p2p", "p2p is gloo's style"),  # NCCL pairs point-to-point messages by order, not by tag
        ("cpu:gloo,cuda:nccl", "", comm.Collectives.CHUNKED),  # the data on the GPU goes over NCCL
        ("cpu:gloo,cuda:nccl", "p2p", "p2p is gloo's style"),
        ("cpu:mpi,cuda:mpi", "", comm.Collectives.CHUNKED),  # p2p only where its pairing by tag is known to hold
        ("cpu:mpi,cuda:mpi", "p2p", "p2p is gloo's style"),
        ("cpu:gloo,cuda:gloo", "rooted", "rooted is gone"),
        ("cpu:gloo,cuda:gloo", "ring", "not a collective style"),
    ],
)
def test_the_style_of_collectives_follows_the_backend(config: str, value: str, chosen: Any) -> None:
    with mock.patch.object(dist, "get_backend_config", return_value=config), mock.patch.dict(os.environ):
        os.environ[comm.ENVIRONMENT] = value
        if isinstance(chosen, comm.Collectives):
            assert comm.choose_collectives(None) is chosen
        else:
            with pytest.raises(ValueError, match=chosen):
                comm.choose_collectives(None)
