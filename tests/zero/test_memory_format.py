"""A parameter's memory order (strides) is fixed when the ZeroRedundancyOptimizer is built, as its dtype and device
are: pieces of the even partition, master copies and optimizer state are ranges in that order. Parameters laid out
channels_last, transposed or non-dense before the optimizer train as the plain optimizer on averaged gradients does
(bucket views included, which may lay a non-dense one out anew); ``model.to(memory_format=...)`` after it is refused
on every rank, saying to convert first."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks

KW = {"lr": 0.5, "momentum": 0.9}  # momentum: state a wrong range would put on other elements
REORDERED = "changed memory format (strides) after the ZeroRedundancyOptimizer was built"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 64, 3), nn.Flatten(), nn.Linear(64, 3))


def _laid_out(partition: str) -> list[nn.Parameter]:
    """A channels_last convolution, a transposed matrix, a vector; under greedy also a non-dense channels_last slice
    (bucket views lay it out row-major: strides the library chose, not a change)."""
    torch.manual_seed(0)
    params = [
        torch.randn(16, 3, 3, 3).contiguous(memory_format=torch.channels_last),
        torch.randn(5, 7).t(),
        torch.randn(9),
    ]
    if partition == "greedy":
        params.append(torch.randn(2, 3, 3, 6).contiguous(memory_format=torch.channels_last)[..., ::2])
    return [nn.Parameter(p) for p in params]


def _averaged(params: list[nn.Parameter], rank: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    for grad in grads:
        dist.all_reduce(grad)
        grad.div_(dist.get_world_size())
    return grads


def _trains_body(rank: int, world_size: int) -> None:
    for partition, bucket_view in ((p, v) for p in ("greedy", "even") for v in (False, True)):
        ours, truth = _laid_out(partition), _laid_out(partition)
        zero = ZeroRedundancyOptimizer(
            ours, torch.optim.SGD, partition=partition, parameters_as_bucket_view=bucket_view, **KW
        )
        plain = torch.optim.SGD(truth, **KW)
        for step in range(3):
            for param, want, grad in zip(ours, truth, _averaged(ours, rank, step)):
                param.grad, want.grad = grad.clone(), grad.clone()
            zero.step()
            plain.step()
            for index, (param, want) in enumerate(zip(ours, truth)):
                label = f"{partition} bucket_view={bucket_view} step {step} parameter {index}"
                torch.testing.assert_close(param, want, rtol=1e-6, atol=1e-6, msg=lambda m, x=label: f"{x}: {m}")


def test_parameters_laid_out_before_the_optimizer_train_as_the_plain_optimizer() -> None:
    run_on_ranks(_trains_body, 2, timeout=120)


def _reformat_body(rank: int, world_size: int, partition: str, who: str, clip: bool = False) -> str:
    """Steps 0 and 1 of SGD with momentum, the model made channels_last between them (on every rank or on one);
    ``clip``: ``zero.clip_grad_norm_`` before each step (collective, outside the step's agreement: it must not raise
    on the changed rank alone, leaving the others in the norm's all-reduce)."""
    model = _model()
    params = list(model.parameters())
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, partition=partition, **KW)
    for step in range(2):
        if step == 1 and (who == "all" or rank == 1):
            model.to(memory_format=torch.channels_last)
        for param, grad in zip(params, _averaged(params, rank, step)):
            param.grad = grad
        try:
            if clip:
                zero.clip_grad_norm_(1.0)
            zero.step()
        except ValueError as error:
            return f"step {step}: {error}"
    return "ran"


@pytest.mark.parametrize("partition", ["greedy", "even"])
@pytest.mark.parametrize(("who", "clip"), [("all", False), ("rank 1", False), ("rank 1", True)])
def test_a_memory_format_change_after_the_optimizer_was_built_is_refused_on_every_rank(
    partition: str, who: str, clip: bool
) -> None:
    """Under the even partition the momentum of each piece would sit on other elements after the change (a silent
    wrong update); greedy is refused alike, one rule: every rank raises at the step after the change (a clip before
    it leaves the refusal to the step's agreement)."""
    for rank, outcome in enumerate(run_on_ranks(_reformat_body, 2, partition, who, clip, timeout=120)):
        assert outcome.startswith("step 1: "), (rank, outcome)
        assert REORDERED in outcome, (rank, outcome)
        assert who == "all" or rank == 1 or "on rank 1" in outcome, (rank, outcome)
        assert "Convert the model before building the optimizer" in outcome, (rank, outcome)


def _unrefused_body(rank: int, world_size: int, partition: str) -> None:
    """A depthwise convolution (its size-1 dimension orders nothing) and a frozen one nobody owns, made channels_last
    after the optimizer: nothing it holds changes order, so it trains on, as the plain optimizer does."""
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(8, 1, 3, 3)), nn.Parameter(torch.randn(8, 4, 3, 3), requires_grad=False)]
    truth = [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in ours]
    zero = ZeroRedundancyOptimizer(ours, torch.optim.SGD, partition=partition, **KW)
    plain = torch.optim.SGD(truth, **KW)
    for step in range(3):
        if step == 1:
            for param in ours:
                param.data = param.data.contiguous(memory_format=torch.channels_last)
        grad = _averaged(ours[:1], rank, step)[0]
        ours[0].grad, truth[0].grad = grad.contiguous(memory_format=torch.channels_last), grad.clone()
        zero.step()
        plain.step()
        torch.testing.assert_close(ours[0], truth[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours[1], truth[1], rtol=0, atol=0)


@pytest.mark.parametrize("partition", ["greedy", "even"])
def test_a_change_of_strides_that_orders_nothing_anew_is_not_refused(partition: str) -> None:
    run_on_ranks(_unrefused_body, 2, partition, timeout=120)


def _reshaped_body(rank: int, world_size: int) -> str:
    param = nn.Parameter(torch.randn(4, 5))
    zero = ZeroRedundancyOptimizer([param], torch.optim.SGD, partition="even", **KW)
    for step in range(2):
        if step == 1:
            param.data = torch.randn(1, 20)
        param.grad = torch.ones_like(param)
        try:
            zero.step()
        except ValueError as error:
            return f"step {step}: {error}"
    return "ran"


def test_a_parameter_given_another_shape_of_the_same_size_is_refused_on_every_rank() -> None:
    """``p.data = t`` of another shape: the pieces and the momentum are ranges of the old one (plain SGD raises)."""
    for rank, outcome in enumerate(run_on_ranks(_reshaped_body, 2, timeout=120)):
        assert outcome.startswith("step 1: ") and "changed shape" in outcome, (rank, outcome)
