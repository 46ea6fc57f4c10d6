"""Sparse gradients (``nn.Embedding(sparse=True)``) under ZeRO-1 on DDP's all-reduce: the greedy partition steps
each parameter whole, its sparse gradient as torch.optim does (as DDP + SGD); the even partition cuts parameters
into pieces, which a sparse gradient cannot be, and refuses it on every rank at the first step or clip (it crashed
in torch's ``copy_()`` on every rank before: the fuzzer, issue 42)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8, sparse=True), nn.Linear(8, 4))


def _backward(model: nn.Module, rank: int, step: int) -> None:
    tokens = torch.tensor([[rank + step, 2 * rank + 1], [3, 4 + step]])
    model(tokens).square().sum().backward()


def _refusals(zero: ZeroRedundancyOptimizer) -> list[str]:
    errors = []
    for call in (lambda: zero.clip_grad_norm_(1.0), zero.step):
        try:
            call()
        except ValueError as error:
            errors.append(str(error))
    return errors


def _body(rank: int, world_size: int) -> None:
    # greedy: trains as DDP + the plain optimizer
    model, reference = _model(), _model()
    ddp, ddp_reference = DDP(model), DDP(reference)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        for wrapper, optimizer in ((ddp, zero), (ddp_reference, plain)):
            optimizer.zero_grad()
            _backward(wrapper, rank, step)
            optimizer.step()
        for got, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # even: refused by clip_grad_norm_ and step(), on every rank, nothing stepped
    model = _model()
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, partition="even")
    before = copy.deepcopy(model.state_dict())
    _backward(ddp, rank, 0)
    errors = _refusals(zero)
    assert len(errors) == 2, errors
    for error in errors:
        assert error.startswith("partition='even' cuts parameters into pieces, and a sparse gradient"), error
        assert "partition='greedy'" in error and "sparse=False" in error, error
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_sparse_gradients_greedy_trains_even_refused() -> None:
    run_on_ranks(_body, 2)
