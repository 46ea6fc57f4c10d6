"""One gradient intake for ShardedDataParallel: whatever gradient the program produced since the last clear (a
backward through the wrapper, a closure's, a hand-set ``.grad``) is what ``zero.step()`` uses, and clearing works
through every object a user can call it on (the wrapper, the inner module or a reference to it kept from before
wrapping, ``.grad = None`` by hand, the optimizer; to None or in place). Each case runs against DDP
(find_unused_parameters) + plain AdamW on the same seeds and data, at 2 ranks, in both partitions; a gradient that
cannot be right (``no_sync``'s, never reduced) is refused on every rank, as are sparse gradients at wrapping."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.hooks import allreduce_hook, hook_with_zero_step, reduce_to_owners_hook
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


# -------------------------------------------------- 5. clearing through the inner module, by hand, in place
CLEARS = ["inner_module", "inner_module_in_place", "grad_none_by_hand", "wrapper", "wrapper_in_place", "zero"]
CLEARS += ["zero_in_place", "inner_module_then_zero_in_place"]  # the second clear: no .grad left to zero (810142)


def _clear(how: str, model: nn.Module, sdp: ShardedDataParallel, zero: ZeroRedundancyOptimizer) -> None:
    if how == "inner_module":  # model.module.zero_grad(), or the bare model a script kept from before wrapping
        model.zero_grad()
    elif how == "inner_module_then_zero_in_place":
        model.zero_grad()
        zero.zero_grad(set_to_none=False)
    elif how == "inner_module_in_place":
        sdp.module.zero_grad(set_to_none=False)
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
                reference.zero_grad(set_to_none="in_place" not in how or "_then_" in how)
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


def _hand_set_scaled_body(rank: int, world_size: int, how: str) -> None:
    """A ``.grad`` set by hand (the same on every rank), then clipped or unscaled by a GradScaler: every rank's
    ``.grad`` is scaled, as under DDP, so that a backward adding onto it (no zero_grad) reduces the same sum."""
    for partition in PARTITIONS:
        model, zero, sdp, reference, ddp, plain = _pair(partition)
        for step in range(2):
            for module, wrapped, optimizer in ((model, sdp, zero), (reference, ddp, plain)):
                scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if how == "scaler" else None
                loss = wrapped(_x(rank, step)).square().mean()
                (loss if scaler is None else scaler.scale(loss)).backward()
                if step == 0:
                    module.layers[0].weight.grad = torch.full((6, 6), 10.0)  # type: ignore[union-attr,index]
                if scaler is not None:
                    scaler.step(optimizer)
                    continue
                if optimizer is zero:
                    zero.clip_grad_norm_(1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
                optimizer.step()
            sdp.sync_finished()
            _compare(model, reference, f"{partition} {how} step {step}")


@pytest.mark.parametrize("how", ["clip", "scaler"])
def test_a_hand_set_grad_is_clipped_and_unscaled_on_every_rank(how: str) -> None:
    run_on_ranks(_hand_set_scaled_body, 2, how, timeout=120)


# ---------------------- no_sync's gradient, never reduced, and torch's clip_grad_norm_ are refused on every rank
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
        try:  # it would read no gradient at all: a silent no-op before the markers
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            outcomes.append("clipped")
        except RuntimeError as error:
            outcomes.append(str(error))
    return outcomes


def test_no_syncs_unreduced_gradient_and_torchs_clipping_are_refused_on_every_rank() -> None:
    for outcomes in run_on_ranks(_refusals_body, 2, timeout=60):
        for outcome in outcomes[0::2]:
            assert "no_sync" in outcome and "outside" in outcome, outcome
        for outcome in outcomes[1::2]:
            assert "zero.clip_grad_norm_()" in outcome, outcome


# ------------- the marker in .grad refuses every read of values; module.to() and deepcopy keep it a marker
READS_OF_A_MARKER = {
    "detach().norm()": lambda g: g.detach().norm(),
    ".data.sum()": lambda g: g.data.sum(),
    "pow(2).sum()": lambda g: g.pow(2).sum(),
    "max()": lambda g: g.max(),
    "isinf().any()": lambda g: torch.isinf(g).any(),
    "linalg.norm": lambda g: torch.linalg.norm(g),
    "clone()": lambda g: g.clone(),
    "g * 2": lambda g: g * 2,
    "copy into a buffer": lambda g: torch.zeros(g.shape).copy_(g),
    "float(g[0].sum())": lambda g: float(g[0].sum()),
    "g.data = values": lambda g: setattr(g, "data", torch.zeros(g.shape)),
}


def _marker_body(rank: int, world_size: int) -> dict[str, Any]:
    model, zero, sdp, reference, ddp, plain = _pair("greedy")
    outcomes: dict[str, Any] = {}
    for step in range(2):
        for optimizer, wrapped in ((zero, sdp), (plain, ddp)):
            optimizer.zero_grad()
            wrapped(_x(rank, step)).square().mean().backward()
        grad = model.layers[0].weight.grad
        for name, read in READS_OF_A_MARKER.items():
            try:
                outcomes[name] = f"returned {read(grad)!r}"
            except RuntimeError as error:
                outcomes[name] = str(error)
        outcomes["repr"] = repr(grad)
        copy.deepcopy(model)  # an EMA or best-model copy taken after a backward
        outcomes["deepcopy"] = type(copy.deepcopy(grad)).__name__
        # module.to() converts .grad too: the held gradient must survive it (DDP must be wrapped again after it)
        for module in (model, reference):
            module.to(torch.float64).to(torch.float32)
        ddp = DDP(reference, find_unused_parameters=True)
        zero.step()
        plain.step()
        sdp.sync_finished()
        _compare(model, reference, f"step {step} after module.to()")
    return outcomes


def test_the_marker_refuses_every_read_and_survives_module_to() -> None:
    for outcomes in run_on_ranks(_marker_body, 2, timeout=60):
        for name in READS_OF_A_MARKER:
            assert "zero.clip_grad_norm_()" in outcomes[name], f"{name}: {outcomes[name]}"
        assert "held sharded" in outcomes["repr"], outcomes["repr"]
        assert outcomes["deepcopy"] == "GradientMarker"


def _channels_last_body(rank: int, world_size: int, partition: str, who: str) -> str:
    """``model.to(memory_format=torch.channels_last)`` between the backward and the step: the owned gradient was
    stored in the old memory order, so it cannot survive that (DDP's .grad does); refused like a dtype change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, partition=partition, lr=1.0)
    sdp = ShardedDataParallel(model, zero)
    sdp(torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    if who == "all" or rank == 1:
        model.to(memory_format=torch.channels_last)
    try:
        zero.step()
    except ValueError as error:
        return str(error)
    return "ran"


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("who", ["all", "rank 1"])
def test_a_memory_format_change_between_backward_and_step_is_refused_on_every_rank(partition: str, who: str) -> None:
    for rank, outcome in enumerate(run_on_ranks(_channels_last_body, 2, partition, who, timeout=60)):
        assert "changed memory format (strides) after the ZeroRedundancyOptimizer was built" in outcome, outcome
        assert "Convert the model before building the optimizer" in outcome, outcome
        assert who == "all" or rank == 1 or "on rank 1" in outcome, (rank, outcome)


# ------------- a marker that is not the store's (another parameter's, kept across a clear) is refused; .data clears
def _outcome(action: Any) -> str:
    try:
        action()
        return "ran"
    except (RuntimeError, ValueError) as error:
        return str(error)


def _foreign_marker_body(rank: int, world_size: int) -> dict[str, str]:
    outcomes = {}
    for case in ["another parameter's", "transposed", "kept across zero_grad", "kept across a backward"]:
        model, zero, sdp, *_ = _pair("greedy")
        zero.zero_grad()
        sdp(_x(rank, 0)).square().mean().backward()
        first, second = model.layers[0].weight, model.layers[1].weight
        if case == "another parameter's":
            first.grad = second.grad
        elif case == "transposed":
            outcomes["transposed .T"] = _outcome(lambda p=first: setattr(p, "grad", p.grad.T))
        else:  # torch's step would use the kept gradient; the store put a new marker, not the kept one, back
            kept = [p.grad for p in model.parameters()]
            zero.zero_grad()
            if case == "kept across a backward":
                sdp(_x(rank, 1)).square().mean().backward()
            for param, grad in zip(model.parameters(), kept):
                param.grad = grad
        outcomes[case] = _outcome(zero.step)
    # the old idiom p.grad.data.zero_() zeroes the held gradient, as it zeroes DDP's
    model, zero, sdp, reference, ddp, plain = _pair("even")
    for step in range(3):
        for optimizer, wrapped, module in ((zero, sdp, model), (plain, ddp, reference)):
            wrapped(_x(rank, step)).square().mean().backward()
            if step == 1:
                for param in module.parameters():
                    param.grad.data.zero_()
                wrapped(_x(rank, 10 + step)).square().mean().backward()
            optimizer.step()
        sdp.sync_finished()
        _compare(model, reference, f"step {step}, .grad.data.zero_() between backwards")
    # a layer unfrozen before a backward and added after it: each rank's own gradient, refused
    model = Chain()
    model.side.requires_grad_(False)
    zero = ZeroRedundancyOptimizer([p for p in model.parameters() if p.requires_grad], torch.optim.AdamW, **KW)
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)
    model.side.requires_grad_(True)
    sdp(_x(rank, 0)).square().mean().backward()
    outcomes["added after its backward"] = _outcome(lambda: zero.add_param_group({"params": model.side.parameters()}))
    return outcomes


def test_a_marker_not_the_stores_is_refused_and_data_zero_clears() -> None:
    for outcomes in run_on_ranks(_foreign_marker_body, 2, timeout=90):
        for case in ["another parameter's", "kept across zero_grad", "kept across a backward"]:
            assert "not the one this store put there last" in outcomes[case], f"{case}: {outcomes[case]}"
        assert ".T cannot use" in outcomes["transposed .T"], outcomes["transposed .T"]
        assert "already have a .grad" in outcomes["added after its backward"], outcomes["added after its backward"]


# ------------------------------------------ 9. sparse gradients are refused at wrapping or at the hook's registration
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
        elif where == "overlap":  # the hook steps inside DDP's backward, on dense bucket views
            ddp = DDP(model)
            ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        else:
            ddp = DDP(model)
            ddp.register_comm_hook(zero, reduce_to_owners_hook)
            ddp(torch.tensor([[1, 2, 3]])).sum().backward()
            zero.step()
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize("where", ["sharded", "reduce_to_owners_hook", "overlap"])
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
