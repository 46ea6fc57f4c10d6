"""Hybrid sharding: ZeRO shards within a group of ranks (a node), DDP averages over all of them, and the shard
groups replicate one another. With ``replicate_group`` every way of reducing and stepping equals DDP + the plain
optimizer on every rank; without it, the overlap hooks, which see DDP's group, refuse a ZeRO over fewer ranks than
DDP's on every rank (the bare deprecated ``reduce_to_owners_hook`` averages over ZeRO's ranks: its documented
contract, as torch's ``allreduce_hook`` averages over the group it is given)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer, checkpoint
from tests._dist import run_on_ranks
from tests.zero._hooks import lockstep, register

WORLD, SHARD = 4, 2  # shard groups {0, 1} and {2, 3}; replicate groups {0, 2} and {1, 3}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def _mesh(rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's shard group and replicate group (every rank creates every group, as dist.new_group needs)."""
    shards = [dist.new_group(list(range(start, start + SHARD))) for start in range(0, WORLD, SHARD)]
    replicas = [dist.new_group(list(range(offset, WORLD, SHARD))) for offset in range(SHARD)]
    return shards[rank // SHARD], replicas[rank % SHARD]


def _parity_body(rank: int, world_size: int) -> None:
    shard, replicate = _mesh(rank)
    configs = itertools.product(["greedy", "even"], ["all_reduce", "to_owners"], ["explicit", "hook", "interleaved"])
    for partition, reduction, stepping in configs:
        what = f"{partition} {reduction} {stepping}"
        model, reference = _net(), _net()
        ddp, reference_ddp = DDP(model), DDP(reference)
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            process_group=shard,
            overlap_with_ddp=stepping != "explicit",
            partition=partition,
            replicate_group=replicate,
            lr=0.02,
        )
        register(ddp, zero, reduction, stepping)
        plain = torch.optim.AdamW(reference.parameters(), lr=0.02)
        for iteration in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * iteration + rank))
            zero.zero_grad()
            ddp(x).square().mean().backward()
            if stepping == "explicit":
                total = zero.clip_grad_norm_(0.1)
                zero.step()
            plain.zero_grad()
            reference_ddp(x).square().mean().backward()
            if stepping == "explicit":
                expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
                torch.testing.assert_close(total, expected, rtol=1e-5, atol=0, msg=what)
            plain.step()
            for index, (param, want) in enumerate(zip(model.parameters(), reference.parameters())):
                label = f"{what} iteration {iteration} parameter {index}"
                torch.testing.assert_close(param, want, rtol=1e-5, atol=1e-6, msg=lambda m, x=label: f"{x}: {m}")


def test_hybrid_sharding_matches_ddp_on_every_rank() -> None:
    run_on_ranks(_parity_body, WORLD, timeout=240)


def _refusal_body(rank: int, world_size: int, stepping: str) -> str:
    shard, _ = _mesh(rank)
    model = _net()
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, process_group=shard, overlap_with_ddp=stepping != "explicit", lr=0.1
    )
    try:
        register(ddp, zero, "to_owners", stepping)
        ddp(torch.ones(2, 6)).sum().backward()
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("stepping", ["hook", "interleaved"])
def test_zero_over_a_subgroup_of_ddp_without_replicas_is_refused(stepping: str) -> None:
    for message in run_on_ranks(_refusal_body, WORLD, stepping):
        assert "DDP averages gradients over ranks [0, 1, 2, 3]" in message, message
        assert "pass replicate_group=" in message, message


def _bad_replicas_body(rank: int, world_size: int) -> str:
    shard, _ = _mesh(rank)
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]  # rank 0 of one shard group with rank 1 of the other
    try:
        ZeroRedundancyOptimizer(
            _net().parameters(), torch.optim.SGD, process_group=shard, replicate_group=crossed[rank in (1, 2)], lr=0.1
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_replicas_at_other_positions_are_refused_on_every_rank() -> None:
    for message in run_on_ranks(_bad_replicas_body, WORLD):
        assert "replicate_group must hold one rank of each shard group" in message, message


def _one_rank_refused_body(rank: int, world_size: int) -> str:
    shard, replicate = _mesh(rank)
    try:  # torch's AdamW refuses lr=-1 on rank 2 alone: the other shard group's ranks must not wait for it
        ZeroRedundancyOptimizer(
            _net().parameters(),
            torch.optim.AdamW,
            process_group=shard,
            replicate_group=replicate,
            lr=-1.0 if rank == 2 else 0.1,
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_construction_refused_in_one_shard_group_raises_in_every_one() -> None:
    """Review r-21c: the construction agreed over the shard group alone, so ranks 0 and 1 waited in the replicas'
    check for ranks 2 and 3 until the process group's timeout."""
    for message in run_on_ranks(_one_rank_refused_body, WORLD, timeout=60):
        assert "Invalid learning rate" in message or "(see its error)" in message, message


def _saved_apart_body(rank: int, world_size: int, root: str) -> str:
    """Ranks 0 and 1 raise in the closure (nothing stepped); ranks 2 and 3 step their shards: a sharded save made
    then holds one shard group's state from before and the other's from after (DCP keeps one replica's groups)."""
    shard, replicate = _mesh(rank)
    params = [torch.linspace(-1, 1, 8).add(i).requires_grad_() for i in range(4)]
    zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, process_group=shard, replicate_group=replicate, lr=0.1)

    def closure() -> float:
        if rank < SHARD:
            raise ValueError("a bad batch on this shard group")
        for p in params:
            p.grad = torch.full_like(p, 1.5)
        return 0.0

    with pytest.raises(ValueError, match="a bad batch"):
        zero.step(closure)
    checkpoint.save({"optim": zero.sharded_state_dict()}, f"{root}/apart")
    template = {"optim": zero.sharded_state_dict()}
    checkpoint.load(template, f"{root}/apart")
    try:
        zero.load_sharded_state_dict(template["optim"])
    except ValueError as error:
        return str(error)
    return "loaded"


def test_a_sharded_save_after_one_shard_group_stepped_alone_is_refused_everywhere(tmp_path: Path) -> None:
    """Review r-22: the mark was gathered over the shard group only, and the clean group's copy was the one kept."""
    for message in run_on_ranks(_saved_apart_body, WORLD, str(tmp_path), timeout=120):
        assert "saved after a zero.step() that raised" in message, message


def _unfreezing_body(rank: int, world_size: int) -> None:
    """A layer unfrozen between steps has no owner at its first backward: its average must reach the other shard
    groups too (the deprecated hook all-reduces over the shard group, then over the replicas)."""
    shard, replicate = _mesh(rank)
    for partition, stepping in itertools.product(["greedy", "even"], ["explicit", "hook"]):
        model, reference = _net(), _net()
        ddp, reference_ddp = (DDP(net, find_unused_parameters=True) for net in (model, reference))
        for net in (model, reference):
            net[0].requires_grad_(False)
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.SGD,
            process_group=shard,
            overlap_with_ddp=stepping != "explicit",
            partition=partition,
            replicate_group=replicate,
            lr=0.05,
            momentum=0.9,
        )
        register(ddp, zero, "to_owners", stepping)
        plain = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        for iteration in range(3):
            if iteration == 1:
                for net in (model, reference):
                    net[0].requires_grad_(True)
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * iteration + rank))
            lockstep(ddp, zero, stepping, reference_ddp, plain, x, f"{partition} {stepping} iteration {iteration}")


def test_a_layer_unfrozen_between_steps_is_averaged_over_every_shard_group() -> None:
    run_on_ranks(_unfreezing_body, WORLD, timeout=240)


class _RankZeroBranch(nn.Module):
    """A layer only rank 0 uses: its shard group uses it, the other shard group has no gradient of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.branch = _net(), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out + self.branch(out) if dist.get_rank() == 0 else out


def _used_on_one_rank_body(rank: int, world_size: int) -> None:
    """Under the overlap hooks the parameters no rank used are skipped, as a plain optimizer skips them: "no rank"
    means none of DDP's ranks, not none of this shard group's (found by the fuzzer at 4 ranks)."""
    shard, replicate = _mesh(rank)
    for stepping in ("hook", "interleaved"):
        torch.manual_seed(0)
        model = _RankZeroBranch()
        torch.manual_seed(0)
        reference = _RankZeroBranch()
        ddp, reference_ddp = (DDP(net, find_unused_parameters=True) for net in (model, reference))
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.SGD,
            process_group=shard,
            overlap_with_ddp=True,
            replicate_group=replicate,
            lr=0.1,
        )
        register(ddp, zero, "all_reduce", stepping)
        plain = torch.optim.SGD(reference.parameters(), lr=0.1)
        for iteration in range(2):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * iteration + rank))
            lockstep(ddp, zero, stepping, reference_ddp, plain, x, f"{stepping} iteration {iteration}")


def test_a_parameter_one_shard_group_alone_used_steps_on_every_replica() -> None:
    run_on_ranks(_used_on_one_rank_body, WORLD, timeout=120)
