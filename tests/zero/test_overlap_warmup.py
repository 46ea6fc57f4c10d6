"""The overlap hooks' warm-up, as torch's ``test_ddp_zero_overlap`` runs it: by default the first two backwards (three
with ``static_graph``) take no step, so a program that prepends dummy inputs, as torch advises, ends where torch's
``ZeroRedundancyOptimizer`` with torch's own hooks ends, and where DDP + plain SGD on the real inputs ends.
A hook registered after plain DDP backwards, or before ``ddp._set_static_graph()``, warms up as torch's hook does: until
DDP's bucket rebuild and one backward more, not a count from registration. ``step_from_first_backward=True`` steps from
the first backward instead."""

from __future__ import annotations

import copy
import itertools
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as torch_zero_hooks
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as torch_allreduce_hook
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved
from tests._dist import run_on_ranks

SGD = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.001}  # torch's test's settings
INPUTS = 5
HOOKS = {"hook": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 40), nn.Tanh(), nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 10))


def _inputs(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(2, 20, generator=generator) for _ in range(INPUTS)]


def _ddp(model: nn.Module, static_graph: bool) -> DDP:
    return DDP(copy.deepcopy(model), bucket_cap_mb=0.004, static_graph=static_graph)  # a few buckets once rebuilt


def _torch_hook(ddp: DDP, zero: TorchZero) -> Any:
    """torch's own ``hook_with_zero_step``, built on gloo (torch refuses gloo up front for fear of a hang; its test
    runs NCCL). The reference of both of distoptim's hooks: torch's interleaved one does hang on gloo (pytorch#62300:
    it broadcasts from a future's callback), and torch's two hooks step alike."""
    with mock.patch.object(torch_zero_hooks.dist, "get_backend", return_value="nccl"):
        return torch_zero_hooks.hook_with_zero_step(torch_allreduce_hook, ddp, zero)


def _warmup_and_train(ddp: DDP, zero: Any, inputs: list[torch.Tensor], warmup: int) -> list[torch.Tensor]:
    """torch's test's loop: ``warmup`` dummy backwards (no zero_grad; ``step()`` called after the first, which torch
    makes a no-op), then one backward per input. Returns ``.grad`` after the first warm-up backward."""
    grads = []
    for index, x in enumerate(inputs[:warmup]):
        ddp(x).sum().backward()
        if index == 0:
            grads = [p.grad.detach().clone() for p in ddp.parameters()]
            zero.step()
    for x in inputs:
        zero.zero_grad()
        ddp(x).sum().backward()
    return grads


def _torch_parity_body(rank: int, world_size: int) -> None:
    for name, static_graph in itertools.product(HOOKS, [False, True]):
        what = f"{name} static_graph={static_graph} world={world_size}"
        model, inputs, warmup = _model(), _inputs(rank), 3 if static_graph else 2
        ours, theirs, local = _ddp(model, static_graph), _ddp(model, static_graph), _ddp(model, static_graph)
        zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, overlap_with_ddp=True, **SGD)
        ours.register_comm_hook(None, HOOKS[name](allreduce_hook, ours, zero))
        torch_zero = TorchZero(theirs.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, **SGD)
        theirs.register_comm_hook(None, _torch_hook(theirs, torch_zero))
        before = [p.detach().clone() for p in model.parameters()]
        for index, x in enumerate(inputs[:warmup]):  # the warm-up alone: nothing changes, no state is made
            ours(x).sum().backward()
            zero.step()
            _assert_equal(ours.parameters(), before, f"{what}: parameters after warm-up backward {index}")
            assert not zero.state, f"{what}: optimizer state after warm-up backward {index}"
        ours = _ddp(model, static_graph)  # fresh, for torch's test's loop
        zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, overlap_with_ddp=True, **SGD)
        ours.register_comm_hook(None, HOOKS[name](allreduce_hook, ours, zero))
        with mock.patch("torch.distributed.optim.zero_redundancy_optimizer.logger"):  # step()'s "should not" warning
            torch_grads = _warmup_and_train(theirs, torch_zero, inputs, warmup)
        our_grads = _warmup_and_train(ours, zero, inputs, warmup)
        _assert_equal(our_grads, torch_grads, f"{what}: .grad after the first warm-up backward (DDP's average)")
        _assert_equal(ours.parameters(), list(theirs.parameters()), f"{what}: against torch's ZeRO and hook")
        plain = torch.optim.SGD(local.parameters(), **SGD)
        for x in inputs:
            plain.zero_grad()
            local(x).sum().backward()
            plain.step()
        _assert_equal(ours.parameters(), list(local.parameters()), f"{what}: against DDP + SGD after the warm-up")
        assert not all(torch.equal(p, b) for p, b in zip(ours.parameters(), before)), f"{what}: never stepped"


def _assert_equal(params: Any, expected: list[torch.Tensor], what: str) -> None:
    for index, (param, want) in enumerate(zip(params, expected, strict=True)):
        torch.testing.assert_close(param, want, rtol=1e-5, atol=1e-6, msg=lambda m, i=index: f"{what} [{i}]: {m}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_warmup_matches_torch_zero_overlap_and_ddp(world_size: int) -> None:
    run_on_ranks(_torch_parity_body, world_size, timeout=240)


def _first_backward_body(rank: int, world_size: int) -> None:
    for name, static_graph in itertools.product(HOOKS, [False, True]):
        what = f"{name} static_graph={static_graph}"
        model, inputs = _model(), _inputs(rank)
        ours, local = _ddp(model, static_graph), _ddp(model, static_graph)
        zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, overlap_with_ddp=True, **SGD)
        ours.register_comm_hook(None, HOOKS[name](allreduce_hook, ours, zero, step_from_first_backward=True))
        plain = torch.optim.SGD(local.parameters(), **SGD)
        for index, x in enumerate(inputs):
            zero.zero_grad()
            ours(x).sum().backward()
            zero.step()
            plain.zero_grad()
            local(x).sum().backward()
            plain.step()
            _assert_equal(ours.parameters(), list(local.parameters()), f"{what}: iteration {index}")


def test_step_from_first_backward_steps_every_backward() -> None:
    run_on_ranks(_first_backward_body, 2, timeout=240)


def _stepped(ddp: DDP, zero: Any, inputs: list[torch.Tensor]) -> list[bool]:
    """Whether each backward changed the parameters."""
    stepped = []
    for x in inputs:
        before = [p.detach().clone() for p in ddp.parameters()]
        zero.zero_grad()
        ddp(x).square().sum().backward()
        stepped.append(any(not torch.equal(p, b) for p, b in zip(ddp.parameters(), before)))
    return stepped


def _late_hook_body(rank: int, world_size: int, name: str, before: int, static: str) -> None:
    """The hook registered after ``before`` plain DDP backwards, or (``static`` "after-hook") before
    ``ddp._set_static_graph()``: torch's warm-up follows DDP's bucket rebuild, not a count from registration."""
    what = f"{name} before={before} static={static}"
    model, inputs = _model(), _inputs(rank)
    ours, theirs = (_ddp(model, static == "static") for _ in range(2))
    for ddp in (ours, theirs):
        for x in inputs[:before]:
            ddp(x).square().sum().backward()
            ddp.zero_grad()
    zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, overlap_with_ddp=True, **SGD)
    ours.register_comm_hook(None, HOOKS[name](allreduce_hook, ours, zero))
    torch_zero = TorchZero(theirs.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, **SGD)
    theirs.register_comm_hook(None, _torch_hook(theirs, torch_zero))
    if static == "after-hook":
        ours._set_static_graph()
        theirs._set_static_graph()
    with mock.patch("torch.distributed.optim.zero_redundancy_optimizer.logger"):
        torch_stepped = _stepped(theirs, torch_zero, inputs)
    our_stepped = _stepped(ours, zero, inputs)
    assert our_stepped == torch_stepped, f"{what}: stepped {our_stepped}, torch's hook {torch_stepped}"
    assert zero.overlap_stepper.warmup_over, f"{what}: warm-up not over"
    _assert_equal(ours.parameters(), list(theirs.parameters()), f"{what}: against torch's ZeRO and hook")


@pytest.mark.parametrize("name", HOOKS)
@pytest.mark.parametrize(("before", "static"), [(1, "no"), (2, "no"), (1, "static"), (0, "after-hook")])
def test_warmup_follows_ddp_rebuild_as_torch(name: str, before: int, static: str) -> None:
    run_on_ranks(_late_hook_body, 2, name, before, static, timeout=240)


def _find_unused_body(rank: int, world_size: int) -> list[bool]:
    """Under ``find_unused_parameters`` DDP never rebuilds its buckets: torch's hooks never step (pinned here, so
    that the documented difference is rechecked when torch changes); distoptim's step from the third backward."""
    model, inputs = _model(), _inputs(rank)
    ours, theirs = (DDP(copy.deepcopy(model), bucket_cap_mb=0.004, find_unused_parameters=True) for _ in range(2))
    zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, overlap_with_ddp=True, **SGD)
    ours.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ours, zero))
    torch_zero = TorchZero(theirs.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, **SGD)
    theirs.register_comm_hook(None, _torch_hook(theirs, torch_zero))
    with mock.patch("torch.distributed.optim.zero_redundancy_optimizer.logger"):
        assert not any(_stepped(theirs, torch_zero, inputs)), "torch's hook now steps under find_unused_parameters"
    return _stepped(ours, zero, inputs)


def test_warmup_under_find_unused_parameters() -> None:
    assert run_on_ranks(_find_unused_body, 2, timeout=240)[0] == [False, False, True, True, True]


def _warmup_over_body(rank: int, world_size: int) -> list[list[bool]]:
    over = []
    for static_graph, first in itertools.product((False, True), (False, True)):
        ddp = _ddp(_model(), static_graph)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero, step_from_first_backward=first))
        over.append([zero.overlap_stepper.warmup_over])
        for x in _inputs(rank)[:4]:
            zero.zero_grad()
            ddp(x).sum().backward()
            over[-1].append(zero.overlap_stepper.warmup_over)
    return over


def test_warmup_over_is_visible() -> None:
    assert run_on_ranks(_warmup_over_body, 2)[0] == [
        [False, False, False, True, True],
        [True] * 5,
        [False, False, False, False, True],
        [True] * 5,
    ]


def _join_body(rank: int, world_size: int, first: int) -> None:
    """Uneven inputs under Join with the default warm-up: the joined rank's shadowed backwards count as warm-up ones
    and step alike, so every rank ends as SGD on the DDP average of the inputs after the warm-up (joined ranks
    contributing zeros). Rank 0 runs ``first`` inputs: with 1, it joins before DDP rebuilds its buckets, which DDP
    then does not note on rank 0 (the ranks agree on it)."""
    for name, static_graph in itertools.product(HOOKS, [False, True]):
        model, warmup, batches = _model(), 3 if static_graph else 2, [first] + [5] * (world_size - 1)
        ddp, reference = _ddp(model, static_graph), copy.deepcopy(model)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, **SGD)
        ddp.register_comm_hook(None, HOOKS[name](allreduce_hook, ddp, zero))
        with Join([ddp, zero]):
            for iteration in range(batches[rank]):
                zero.zero_grad()
                ddp(_inputs(rank)[iteration]).sum().backward()
        plain = torch.optim.SGD(reference.parameters(), **SGD)
        for iteration in range(warmup, max(batches)):
            plain.zero_grad()
            for r in range(world_size):
                if iteration < batches[r]:
                    reference(_inputs(r)[iteration]).sum().backward()
            for param in reference.parameters():
                param.grad = param.grad / world_size
            plain.step()
        _assert_equal(ddp.parameters(), list(reference.parameters()), f"{name} static_graph={static_graph} Join")


@pytest.mark.parametrize("first", [3, 1])
def test_warmup_under_join_with_uneven_inputs(first: int) -> None:
    run_on_ranks(_join_body, 2, first, timeout=240)
