"""ShardedDataParallel and add_param_group of a group in a dtype new to the model: buckets and a gradient store
are made for the new (device, dtype), and it trains as DDP + the plain optimizer; a failure while placing an added
group leaves the optimizer as it was."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests.sharded_data_parallel.test_parity import KWARGS, assert_matches


class _Mixed(torch.nn.Module):
    """An fp32 model with a bf16 layer in front, which a group added later brings into training."""

    def __init__(self, rest: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 6).to(torch.bfloat16)
        self.rest = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6)).to(rest)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(torch.tanh(self.first(x.to(torch.bfloat16))).to(self.rest[0].weight.dtype))


def _refused_add_leaves_it_as_it_was(zero: ZeroRedundancyOptimizer, params: list[torch.Tensor]) -> None:
    """A failure while placing the added group (here injected before ShardedDataParallel rebuilds) puts back the
    groups, the plan and the local optimizer: the retry that follows is not refused as a duplicate."""
    groups, plan, local = len(zero.param_groups), zero.plan, len(zero.local_optimizer.param_groups)

    def fail() -> None:
        raise RuntimeError("injected")

    zero.placer.listeners.insert(0, fail)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            zero.add_param_group({"params": params, "lr": 0.02})
    finally:
        zero.placer.listeners.remove(fail)
    assert (len(zero.param_groups), zero.plan, len(zero.local_optimizer.param_groups)) == (groups, plan, local)


def _new_dtype_body(rank: int, world_size: int, partition: str) -> None:
    """A bf16 group added to a model whose optimizer held only fp32 parameters: SDP makes buckets and a gradient
    store for the new (device, dtype), and trains as DDP + AdamW (the bf16 layer to bf16's precision)."""
    model, reference = _Mixed(), _Mixed()
    ddp = DDP(reference, find_unused_parameters=True)  # built before the freeze: it keeps the layer
    for net in (model, reference):
        net.first.requires_grad_(False)
    zero = ZeroRedundancyOptimizer(model.rest.parameters(), torch.optim.AdamW, partition=partition, **KWARGS)
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)
    assert len(sdp._buckets) == 4, "the cap (26 fp32 elements) gives each of the 4 parameters a bucket of its own"
    plain = torch.optim.AdamW(reference.rest.parameters(), **KWARGS)
    for step in range(4):
        if step == 1:
            for net in (model, reference):
                net.first.requires_grad_(True)
            _refused_add_leaves_it_as_it_was(zero, list(model.first.parameters()))
            zero.add_param_group({"params": list(model.first.parameters()), "lr": 0.02})
            plain.add_param_group({"params": list(reference.first.parameters()), "lr": 0.02})
            assert len(sdp._buckets) == 5, "one bf16 bucket more (42 elements, under the cap of 52)"
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        for optimizer, net in ((zero, sdp), (plain, ddp)):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
        sdp.sync_finished()
        assert_matches(model, reference, f"{partition} step {step}")


@pytest.mark.parametrize("partition", ["greedy", "even"])
def test_a_group_in_a_dtype_new_to_the_model_trains_as_ddp(partition: str) -> None:
    run_on_ranks(_new_dtype_body, 2, partition)


def _wider_than_masters_body(rank: int, world_size: int, partition: str) -> None:
    """``master_dtype=torch.float32`` over bf16 and float64 parameters under ShardedDataParallel: fp32 masters for
    the bf16 layer only, the float64 layers stepped in float64 (never rounded to fp32), as DDP + AdamW does over fp32
    copies of the bf16 parameters and the float64 ones themselves."""
    model, reference = _Mixed(torch.float64), _Mixed(torch.float64)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition=partition, master_dtype=torch.float32, **KWARGS
    )
    sdp, ddp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001), DDP(reference)
    stepped = [p.detach().float().requires_grad_() if p.dtype == torch.bfloat16 else p for p in reference.parameters()]
    plain = torch.optim.AdamW(stepped, **KWARGS)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        zero.zero_grad()
        sdp(x).square().mean().backward()
        zero.step()
        plain.zero_grad()
        reference.zero_grad()
        ddp(x).square().mean().backward()
        for copy, param in zip(stepped, reference.parameters()):
            if copy is not param:
                copy.grad = param.grad.float()
        plain.step()
        with torch.no_grad():
            for copy, param in zip(stepped, reference.parameters()):
                param.copy_(copy)
        sdp.sync_finished()
        for (name, ours), want in zip(model.named_parameters(), reference.parameters()):
            assert ours.dtype == want.dtype, name
            tolerance = {"rtol": 1e-12, "atol": 1e-14} if want.dtype == torch.float64 else {"rtol": 0, "atol": 0}
            torch.testing.assert_close(
                ours, want, **tolerance, msg=lambda m, n=name, s=step: f"{partition} {s} {n}: {m}"
            )


@pytest.mark.parametrize("partition", ["greedy", "even"])
def test_masters_only_for_parameters_narrower_than_master_dtype(partition: str) -> None:
    run_on_ranks(_wider_than_masters_body, 2, partition)
