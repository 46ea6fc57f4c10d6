"""The planner's bytes sent per step against the collectives the library really calls, counted on gloo ranks as
``benchmarks/comm_bytes.py`` counts them (what one rank receives; floating-point tensors only, so the control
plane's integer agreements are left out), for every mode the planner prints, on a model of several buckets and
regions (a parameter over the bucket cap in a region of its own, a frozen one), both partitions, with and without
bucket views, in both styles of collectives: NCCL's (chunked: every rank alike, exactly the planner's figure) and
gloo's (point to point: the ranks differ by their shards, their mean is the planner's figure, and for ZeRO-1 and
``ShardedDataParallel`` each rank's is the planner's ``gloo_received``, by the path taken: at 3 and 4 ranks the greedy
partition's shares are unequal enough that its buckets go through aggregators)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import distoptim
from benchmarks.comm_bytes import CommCounter
from distoptim import ZeroRedundancyOptimizer
from distoptim.comm import collectives as comm
from distoptim.hooks import allreduce_hook
from distoptim.plan.figures import PlanConfig
from distoptim.plan.inventory import from_factory, load_factory
from distoptim.plan.memory import plan_modes
from distoptim.plan.state import resolve_optimizer
from tests._dist import run_on_ranks
from tests.test_planner import FACTORY, planner_net

CAP_MB = 0.25  # ShardedDataParallel's buckets: PlannerNet's 1.5 MiB ``wide`` alone, the rest in a second one


def _model(config: dict[str, Any], world_size: int) -> tuple[Any, Any]:
    """(what the forward runs, what steps) for ``config``'s mode."""
    model = planner_net().to(config["dtype"])
    mode = config["mode"]
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters())
    if mode == "ddp":
        ddp = DDP(model, bucket_cap_mb=0.004)  # several DDP buckets
        ddp.register_comm_hook(None, allreduce_hook)  # DDP's own all-reduce runs in C++, where nothing counts it
        return ddp, torch.optim.AdamW(model.parameters())
    zero = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        partition=config["partition"],
        parameters_as_bucket_view=config["bucket_view"],
    )
    if mode == "sharded_data_parallel":
        return distoptim.ShardedDataParallel(
            model, zero, bucket_cap_mb=CAP_MB, reduce_dtype=config.get("reduce_dtype")
        ), zero
    ddp = DDP(model, bucket_cap_mb=0.004)
    ddp.register_comm_hook(None, allreduce_hook)
    return ddp, zero


def _sends_body(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[float]:
    """Bytes this rank received in the third iteration (forward, backward, step, the parameter sync landed)."""
    counted = []
    for config in configs:
        os.environ[comm.ENVIRONMENT] = config["style"]
        net, optimizer = _model(config, world_size)
        counter = CommCounter(floating_only=True)
        for iteration in range(3):
            with counter.counting(iteration == 2):
                optimizer.zero_grad()
                batch = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * iteration + rank))
                net(batch.to(config["dtype"])).float().square().mean().backward()
                optimizer.step()
                if isinstance(optimizer, ZeroRedundancyOptimizer):
                    optimizer.sync_finished()
        counted.append(counter.bytes)
    os.environ.pop(comm.ENVIRONMENT)
    return counted


def _planned(config: dict[str, Any], world_size: int) -> tuple[int, int, tuple[int, ...]]:
    """(bytes sent per step, how many collectives the figure adds up: each one's bytes rounded down, and per rank
    the bytes received on gloo by the path taken, where the planner models them)."""
    inventory = from_factory(load_factory(FACTORY), FACTORY).cast(config["dtype"])
    plan_config = PlanConfig(
        world_size=world_size,
        optimizer=resolve_optimizer("adamw"),
        partition=config["partition"],
        bucket_cap_mb=CAP_MB,
        parameters_as_bucket_view=config["bucket_view"],
        reduce_dtype=config.get("reduce_dtype"),
    )
    mode = {mode.key: mode for mode in plan_modes(inventory, plan_config)}[config["mode"]]
    return mode.sends_total, len(mode.sends), mode.gloo_received


F32 = {"dtype": torch.float32, "partition": "even", "bucket_view": False}
CONFIGS = [
    {**F32, "mode": mode, "partition": partition, "bucket_view": bucket_view, "style": style}
    for mode in ("zero1", "sharded_data_parallel")
    for partition in ("even", "greedy")
    for bucket_view in (False, True)
    for style in ("chunked", "p2p")
]
CONFIGS += [
    {**F32, "mode": "ddp", "style": "chunked"},
    {**F32, "mode": "fsdp2", "style": "chunked"},
    *(
        {**F32, "dtype": torch.bfloat16, "reduce_dtype": torch.float32, "mode": "sharded_data_parallel", "style": s}
        for s in ("chunked", "p2p")
    ),
]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_planned_bytes_sent_are_the_counted_collectives_of_every_mode(world_size: int) -> None:
    counted = run_on_ranks(_sends_body, world_size, CONFIGS, timeout=300)
    wrong = []
    for index, config in enumerate(CONFIGS):
        (planned, terms, gloo), by_rank = _planned(config, world_size), [ranks[index] for ranks in counted]
        got = by_rank if config["style"] == "chunked" else [sum(by_rank) / world_size]
        if any(not 0 <= value - planned < terms + 1e-6 for value in got):  # each term rounded down to a byte
            wrong.append(f"{config}: planned {planned}, counted {by_rank}")
        each = config["style"] == "p2p" and config["mode"] in ("zero1", "sharded_data_parallel")  # each rank's own
        if each and any(not 0 <= value - want < terms + 1e-6 for value, want in zip(by_rank, gloo, strict=True)):
            wrong.append(f"{config}: planned on gloo {gloo}, counted {by_rank}")
    assert not wrong, "\n".join(wrong)
