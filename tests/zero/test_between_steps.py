"""What changes between two steps without ZeRO being told, in every way of reducing and stepping, against DDP + the
plain optimizer:

- gradual unfreezing: a layer (or a bias small enough that placing it moves bucket views within their spare room,
  in the middle of the backward under the interleaved stepping) frozen when ZeRO was built is made trainable (on
  every rank), with bucket views on and off and DDP's hooks firing a layer at a time. Its first step already
  uses the averaged gradient: reduced to owners, its elements (owned by nobody yet) are all-reduced; stepped inside
  the backward, the ranks agree on what they train and place it before the step;
- new storage: every parameter is given a copy of itself (``param.data = ...``, as ``model.to(...)`` does when it
  copies; Accelerate's ``prepare`` does it on the CPU): the fragment views and bucket views are bound again to the
  new storage, keeping the optimizer state, instead of stepping and syncing the old memory."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests.zero._hooks import lockstep, register

ITERATIONS, UNFREEZE_AT, MOVE_AT = 5, 2, 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
    )


def _frozen(net: nn.Module, which: str) -> Any:
    """What is frozen when the optimizers are built: a layer, or a bias small enough that placing it moves the
    bucket views within their spare room (in the middle of a backward, for the interleaved stepping)."""
    return net[2] if which == "layer" else net[6].bias


def _body(rank: int, world_size: int, configs: list[tuple[str, str, str, bool, str]]) -> None:
    for partition, reduction, stepping, bucket_view, frozen in configs:
        what = f"{partition} {reduction} {stepping} bucket_view={bucket_view} frozen={frozen}"
        model, reference = _net(), _net()
        ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=1e-4)  # a bucket a layer: hooks mid-backward
        reference_ddp = DDP(reference, find_unused_parameters=True)
        for net in (model, reference):
            _frozen(net, frozen).requires_grad_(False)
        kwargs: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1}
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            overlap_with_ddp=stepping != "explicit",
            partition=partition,
            parameters_as_bucket_view=bucket_view,
            **kwargs,
        )
        register(ddp, zero, reduction, stepping)
        plain = torch.optim.AdamW(reference.parameters(), **kwargs)
        for iteration in range(ITERATIONS):
            if iteration == UNFREEZE_AT:
                for net in (model, reference):
                    _frozen(net, frozen).requires_grad_(True)
            if iteration == MOVE_AT:
                for param in model.parameters():
                    param.data = param.data.clone()
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * iteration + rank))
            lockstep(ddp, zero, stepping, reference_ddp, plain, x, f"{what} iteration {iteration}")
        unfrozen = _frozen(model, frozen)
        params = list(unfrozen.parameters()) if isinstance(unfrozen, nn.Module) else [unfrozen]
        assert all(zero.fragments_of(p) for p in params), f"{what}: what was unfrozen has no owner"


CONFIGS = list(
    itertools.product(
        ["greedy", "even"],
        ["all_reduce", "to_owners"],
        ["explicit", "hook", "interleaved"],
        [False, True],
        ["layer", "bias"],
    )
)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unfreezing_and_new_storage_between_steps_train_as_with_ddp(world_size: int) -> None:
    run_on_ranks(_body, world_size, CONFIGS, timeout=240)


def _clip_after_unfreezing(rank: int, world_size: int) -> None:
    """Unfreeze, backward, clip, step: the first clip after unfreezing measures and clips the unfrozen layer's
    gradient too (it has no owner until the plan is made again; found by the fuzzer, seeds 106 and 108)."""
    from distoptim import ShardedDataParallel
    from distoptim.hooks import reduce_to_owners_hook

    for way in ("ddp", "to_owners", "sdp"):
        model, reference = _net(), _net()
        for net in (model, reference):
            net[2].requires_grad_(False)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.05)
        plain = torch.optim.SGD(reference.parameters(), lr=0.05)
        if way == "sdp":
            wrapped: nn.Module = ShardedDataParallel(model, zero, bucket_cap_mb=1e-4)
        for net in (model, reference):
            net[2].requires_grad_(True)
        if way != "sdp":
            wrapped = DDP(model, bucket_cap_mb=1e-4)
            if way == "to_owners":
                wrapped.register_comm_hook(zero, reduce_to_owners_hook)
        reference_ddp = DDP(reference, bucket_cap_mb=1e-4)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
        wrapped(x).square().mean().backward()
        reference_ddp(x).square().mean().backward()
        got = zero.clip_grad_norm_(0.05)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        torch.testing.assert_close(got, want, msg=lambda m, way=way: f"{way}: clip norm: {m}")
        zero.step()
        plain.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m, way=way, name=name: f"{way}: {name}: {m}")


def test_clipping_right_after_unfreezing_clips_the_unfrozen_gradient_too() -> None:
    run_on_ranks(_clip_after_unfreezing, 2, timeout=120)


def _clip_then_accumulate(rank: int, world_size: int) -> None:
    """backward, clip, another backward onto the clipped gradient, step (under DDP's all-reduce): the second
    backward adds to every rank's whole gradient and DDP averages them, so every rank must have clipped all of it,
    not only the pieces it owns (found by the fuzzer, seed 7376: the average mixed clipped and unclipped pieces)."""
    model, reference = _net(), _net()
    ddp, reference_ddp = DDP(model, bucket_cap_mb=1e-4), DDP(reference, bucket_cap_mb=1e-4)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.05)
    plain = torch.optim.SGD(reference.parameters(), lr=0.05)
    for micro in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * micro + rank))
        ddp(x).square().mean().backward()
        reference_ddp(x).square().mean().backward()
        if micro == 0:
            got = zero.clip_grad_norm_(0.05, norm_type=1.0)
            want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type=1.0)
            torch.testing.assert_close(got, want)
    zero.step()
    plain.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")


def test_clipping_then_another_backward_before_the_step_trains_as_ddp() -> None:
    run_on_ranks(_clip_then_accumulate, 2, timeout=120)


def _big_int_body(rank: int, world_size: int) -> str:
    params = [torch.ones(3, requires_grad=True)]
    try:  # a group's own key, an int a float cannot hold: 2**60 and 2**60 + 1 are one float
        ZeroRedundancyOptimizer([{"params": params, "seed": 2**60 + rank}], torch.optim.SGD, lr=0.1)
    except ValueError as error:
        return str(error)
    return "no error"


def test_integer_settings_that_differ_beyond_a_floats_precision_are_refused() -> None:
    for message in run_on_ranks(_big_int_body, 2):
        assert "disagree" in message and "'seed'" in message, message
