"""ShardedDataParallel's gradient contract: the store is the gradient's one home (``.grad`` stays None), a
backward's or a closure's gradient is what ``zero.step()`` uses and consumes, a ``.grad`` the program sets is used
as it is, and ``zero_grad`` through the optimizer or the wrapper clears the store (to None or to zeros); a clear
through another object after the step is covered by the step's consumption. Each case runs against DDP
(find_unused_parameters) + plain AdamW on the same seeds and data, at 2 ranks, in both partitions; a gradient that
cannot be right (``no_sync``'s, never reduced) is refused on every rank, as are sparse gradients at wrapping."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.hooks import allreduce_hook, hook_with_zero_step
from tests._dist import run_on_ranks

KW = {"lr": 0.05, "weight_decay": 0.1}
PARTITIONS = ["greedy", "even"]


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.side = nn.Linear(6, 6)  # used at step 0 only: then its .grad is None or zeros, as the clear left it

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x + self.side(x) if use_side else x


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _pair(partition: str) -> tuple[Chain, ZeroRedundancyOptimizer, ShardedDataParallel, Chain, DDP, Any]:
    model, reference = Chain(), Chain()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition=partition, **KW)
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)
    ddp = DDP(reference, find_unused_parameters=True)
    return model, zero, sdp, reference, ddp, torch.optim.AdamW(reference.parameters(), **KW)


def _compare(ours: nn.Module, ref: nn.Module, label: str) -> None:
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{label} {n}: {m}")


# ---------------------------------------------------------------------------------- 1. zero.step(closure)
def _closure_body(rank: int, world_size: int) -> None:
    for partition in PARTITIONS:
        model, zero, sdp, reference, ddp, plain = _pair(partition)
        for step in range(3):
            loss = zero.step(_closure(zero, sdp, _x(rank, step)))
            want = plain.step(_closure(plain, ddp, _x(rank, step)))
            torch.testing.assert_close(loss, want, msg=f"{partition} step {step}: the closure's loss")
            sdp.sync_finished()
            _compare(model, reference, f"{partition} step {step}")


def _closure(optimizer: Any, model: nn.Module, x: torch.Tensor) -> Any:
    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    return closure


def test_a_closures_backward_is_what_the_step_uses() -> None:
    run_on_ranks(_closure_body, 2, timeout=120)


# ------------------------------------------------------- 5. clearing through the inner module, by hand, in place
# Not here: the inner module's zero_grad(set_to_none=False) after a step whose next backward leaves a parameter
# unused on every rank (DDP steps it with its zeroed .grad; here .grad is None, the clear reaches nothing, and the
# step skips it): the guide's contract says to clear to zeros through the optimizer or the wrapper.
CLEARS = ["inner_module", "grad_none_by_hand", "wrapper", "wrapper_in_place", "zero", "zero_in_place"]


def _clear(how: str, model: nn.Module, sdp: ShardedDataParallel, zero: ZeroRedundancyOptimizer) -> None:
    if how == "inner_module":  # model.module.zero_grad(), or the bare model a script kept from before wrapping
        model.zero_grad()
    elif how == "grad_none_by_hand":
        for p in model.parameters():
            p.grad = None
    elif how.startswith("wrapper"):
        sdp.zero_grad(set_to_none="in_place" not in how)
    else:
        zero.zero_grad(set_to_none="in_place" not in how)


def _clears_body(rank: int, world_size: int) -> None:
    for partition in PARTITIONS:
        for how in CLEARS:
            model, zero, sdp, reference, ddp, plain = _pair(partition)
            for step in range(3):
                _clear(how, model, sdp, zero)
                sdp(_x(rank, step), step == 0).square().mean().backward()
                zero.step()
                reference.zero_grad(set_to_none="in_place" not in how)
                ddp(_x(rank, step), step == 0).square().mean().backward()
                plain.step()
                sdp.sync_finished()
                _compare(model, reference, f"{partition} {how} step {step}")


def test_clearing_through_any_object_clears_the_owned_gradient() -> None:
    run_on_ranks(_clears_body, 2, timeout=180)


# ----------------------------------------------------------- 6. a hand-set .grad, alone or mixed with backward
def _hand_set(model: nn.Module, rank: int, step: int, forward: Any) -> None:
    """``torch.autograd.grad`` through ``forward``, averaged by the user (all_reduce), set by hand."""
    params = list(model.parameters())
    grads = torch.autograd.grad(forward(_x(rank, step)).square().mean(), params)
    for param, grad in zip(params, grads):
        dist.all_reduce(grad)
        param.grad = grad / dist.get_world_size()


def _replace_first(model: nn.Module, step: int) -> None:
    """After a backward, the first layer's gradient replaced by one the user made (the same on every rank)."""
    generator = torch.Generator().manual_seed(step)
    for param in model.layers[0].parameters():  # type: ignore[union-attr]
        param.grad = torch.randn(param.shape, generator=generator)


def _hand_set_body(rank: int, world_size: int) -> None:
    for partition in PARTITIONS:
        for how in ["all_by_hand", "mixed", "by_hand_then_backward"]:
            model, zero, sdp, reference, ddp, plain = _pair(partition)
            for step in range(3):
                zero.zero_grad()
                plain.zero_grad()
                if how != "mixed":
                    _hand_set(model, rank, step, sdp)
                    _hand_set(reference, rank, step, reference)
                if how == "by_hand_then_backward":  # adds onto the hand-set .grad, and the sum is reduced
                    sdp(_x(rank, 50 + step)).square().mean().backward()
                    ddp(_x(rank, 50 + step)).square().mean().backward()
                elif how == "mixed":
                    sdp(_x(rank, step)).square().mean().backward()
                    ddp(_x(rank, step)).square().mean().backward()
                    _replace_first(model, step)
                    _replace_first(reference, step)
                zero.step()
                plain.step()
                sdp.sync_finished()
                _compare(model, reference, f"{partition} {how} step {step}")


def test_a_hand_set_grad_is_used_as_is() -> None:
    run_on_ranks(_hand_set_body, 2, timeout=120)


# ---------------------------------------------- no_sync's gradient, never reduced, is refused on every rank
def _refusals_body(rank: int, world_size: int) -> list[str]:
    outcomes = []
    for partition in PARTITIONS:
        model, zero, sdp, *_ = _pair(partition)
        zero.zero_grad()
        with sdp.no_sync():
            sdp(_x(rank, 0)).square().mean().backward()
        try:
            zero.step()
            outcomes.append("stepped")
        except RuntimeError as error:
            outcomes.append(str(error))
        zero.zero_grad()
        sdp(_x(rank, 0)).square().mean().backward()
        assert all(p.grad is None for p in model.parameters()), "a .grad outlived the backward"
    return outcomes


def test_no_syncs_unreduced_gradient_is_refused_on_every_rank() -> None:
    for outcomes in run_on_ranks(_refusals_body, 2, timeout=60):
        for outcome in outcomes:
            assert "no_sync" in outcome and "outside" in outcome, outcome


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 6, sparse=True)
        self.head = nn.Linear(6, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def _sparse_body(rank: int, world_size: int, where: str) -> str:
    model = Sparse()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=where == "overlap", lr=0.1)
    try:
        if where == "sharded":
            ShardedDataParallel(model, zero)
        else:  # the hook steps inside DDP's backward, on dense bucket views
            ddp = DDP(model)
            ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize("where", ["sharded", "overlap"])
def test_sparse_gradients_are_refused_on_every_rank(where: str) -> None:
    for outcome in run_on_ranks(_sparse_body, 2, where, timeout=60):
        assert "sparse" in outcome and "embed" in outcome, outcome


# ------------------------------------------- a hand-set .grad on a parameter the backward did not reach; reads
def _unreached_body(rank: int, world_size: int) -> None:
    """A hand-set (zero) ``.grad`` on ``side``, then a backward that does not use ``side``: DDP leaves the ``.grad``
    as set and the plain optimizer steps it (weight decay); so must the step here. And in the default mode every
    rank reads the stepped parameters right after ``step()``, without a forward (an EMA of the weights, logging)."""
    for partition in PARTITIONS:
        model, zero, sdp, reference, ddp, plain = _pair(partition)
        for ours, wrapper, optimizer in ((model, sdp, zero), (reference, ddp, plain)):
            ours.side.weight.grad, ours.side.bias.grad = torch.zeros_like(ours.side.weight), torch.zeros(6)
            wrapper(_x(rank, 0), use_side=False).square().mean().backward()
            optimizer.step()
        _compare(model, reference, f"{partition}: a hand-set .grad the backward did not reach")
        gathered = [torch.empty(6) for _ in range(world_size)]
        dist.all_gather(gathered, model.layers[0].bias.detach().clone())
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"{partition}: ranks read different parameters"


def test_a_hand_set_grad_the_backward_did_not_reach_is_stepped_and_reads_after_step_agree() -> None:
    run_on_ranks(_unreached_body, 2, timeout=120)


# ------------------------------------------ the step that places a parameter again consumes the new placement's store
def _replaced_body(rank: int, world_size: int, how: str) -> None:
    """No ``zero_grad()`` at all; after the first step a frozen layer is thawed (``unfreeze``) or a layer given new
    storage (``new_storage``), so the next step places again and its store takes over: that step must consume it too.
    Reference: plain AdamW on gradients averaged by hand, cleared before each backward (the contract)."""
    for partition in PARTITIONS:
        model, reference = Chain(), Chain()
        for m in (model, reference):
            m.side.requires_grad_(how != "unfreeze")
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition=partition, **KW)
        sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)
        plain = torch.optim.AdamW(reference.parameters(), **KW)
        for step in range(3):
            if step == 1:
                for m in (model, reference):
                    m.side.requires_grad_(True) if how == "unfreeze" else m.side.weight.data.copy_(m.side.weight)
                if how == "new_storage":
                    model.side.weight.data = model.side.weight.data.clone()
            sdp(_x(rank, step)).square().mean().backward()
            zero.step()
            plain.zero_grad()
            reference(_x(rank, step)).square().mean().backward()
            for p in reference.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
            plain.step()
            _compare(model, reference, f"{partition} {how} step {step}")


@pytest.mark.parametrize("how", ["unfreeze", "new_storage"])
def test_a_step_that_places_again_consumes_the_gradient(how: str) -> None:
    run_on_ranks(_replaced_body, 2, how, timeout=120)
