"""A layer unfrozen since the last placement, whose gradient ``no_sync()`` accumulated (each rank's own), placed
before the backward that reduces it (a checkpoint between micro-batches): the sum must still be averaged. A group
added inside ``no_sync()`` leaves it in force: the backwards left inside still accumulate, as DDP's."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from tests._dist import run_on_ranks


def _x(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * micro + rank))


class _Plain:
    """DDP + torch.optim for a model whose trainable set changes: every gradient averaged by hand, after the last
    micro-batch (DDP built with the layer frozen would never reduce it)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def reduce(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()


def _body(rank: int, world_size: int, between: str) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    base[2].requires_grad_(False)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    zero = ZeroRedundancyOptimizer(list(ours.parameters()), torch.optim.SGD, lr=0.05)
    sdp = ShardedDataParallel(ours, zero)
    plain, reference = _Plain(theirs), torch.optim.SGD(theirs.parameters(), lr=0.05)
    for step in range(3):
        if step == 1:
            ours[2].requires_grad_(True)
            theirs[2].requires_grad_(True)
        for model in (sdp, plain):
            with model.no_sync():
                model(_x(rank, 2 * step)).square().sum().backward()
        if step == 1 and between == "consolidate":
            zero.consolidate_state_dict(0)  # places the unfrozen layer, its .grad this rank's own still
        elif step == 1 and between == "sharded_state_dict":
            zero.sharded_state_dict()
        for model in (sdp, plain):
            model(_x(rank, 2 * step + 1)).square().sum().backward()
        plain.reduce()
        zero.step()
        reference.step()
        zero.zero_grad()
        reference.zero_grad()
    for name, got, want in zip([n for n, _ in ours.named_parameters()], ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{name} differs")


@pytest.mark.parametrize("between", ["nothing", "consolidate", "sharded_state_dict"])
def test_no_sync_gradient_of_a_layer_placed_between_micro_batches_is_averaged(between: str) -> None:
    run_on_ranks(_body, 2, between)


class _Fork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, through_a: bool) -> torch.Tensor:
        return self.b(self.a(x) if through_a else x)


def _untouched_body(rank: int, world_size: int) -> None:
    net = _Fork()
    net.a.requires_grad_(False)
    zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    model = ShardedDataParallel(net, zero)
    net.a.requires_grad_(True)  # trainable since the plan: no bucket holds it
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x, True).square().sum().backward()
    averaged = [p.grad.clone() for p in net.a.parameters()]
    model(x, False).square().sum().backward()  # reaches only b, on every rank
    for before, param in zip(averaged, net.a.parameters()):
        assert torch.equal(param.grad, before), "a backward that reached no rank's .grad averaged it again"


def test_an_unplaced_gradient_no_backward_reached_is_left_as_it_is() -> None:
    """As DDP leaves a gradient unused everywhere (averaging it again would round it anew at 3 ranks)."""
    run_on_ranks(_untouched_body, 3)


def _on_one_rank_body(rank: int, world_size: int) -> str:
    net = _Fork()
    net.a.requires_grad_(False)
    zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    model = ShardedDataParallel(net, zero)
    net.a.requires_grad_(rank == 0)  # a user's slip: DDP would train the layer on rank 0 alone, unreduced
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with pytest.raises(ValueError, match="make the same parameters trainable on every rank") as raised:
        model(x, True).square().sum().backward()
    return str(raised.value)


def test_a_layer_made_trainable_on_some_ranks_only_is_refused_on_every_rank() -> None:
    messages = run_on_ranks(_on_one_rank_body, 3)
    assert all("parameters made trainable since the wrapper planned its buckets" in m for m in messages)


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.norm, self.rest = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.norm(torch.tanh(self.first(x))))


def _added_inside_body(rank: int, world_size: int) -> None:
    model, reference = _Normed(), _Normed()
    ddp = DDP(reference, find_unused_parameters=True)  # built before the freeze: it keeps the layer
    for net in (model, reference):
        net.first.requires_grad_(False)
    zero = ZeroRedundancyOptimizer([*model.norm.parameters(), *model.rest.parameters()], torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, zero)
    plain = torch.optim.SGD([*reference.norm.parameters(), *reference.rest.parameters()], lr=0.1)
    for step in range(3):
        for micro in range(3):
            for wrapped, net, optimizer in ((sdp, model, zero), (ddp, reference, plain)):
                with wrapped.no_sync() if micro < 2 else contextlib.nullcontext():
                    if (step, micro) == (1, 1):  # unfrozen at a micro-batch count, between two no_sync backwards
                        net.first.requires_grad_(True)
                        optimizer.add_param_group({"params": list(net.first.parameters()), "lr": 0.05})
                    wrapped(_x(rank, 10 * step + micro)).square().mean().backward()
        for optimizer in (zero, plain):
            optimizer.step()
            optimizer.zero_grad()
        # still inside no_sync() after the placing: no reduction, and no buffer broadcast before the next forward
        for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"step {step} {name} differs")


def test_a_group_added_inside_no_sync_keeps_accumulating_as_ddp() -> None:
    run_on_ranks(_added_inside_body, 2)
